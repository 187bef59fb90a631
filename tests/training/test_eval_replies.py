"""The generation eval asks the prompt serving sends and compares final answers, read as a chat client reads a reply.

Found by a bug bash (bb36 #2 and #4), each reproduced on the code before this file:
- under gpt-oss (harmony) the eval decoded its samples and references without their special tokens, so both were
  `analysisCalm suggests cool, muted tones.assistantfinalTeal.`: exact_match compared the reasoning too (a model with
  the right answer after other reasoning scored 0), and the samples it logged were garbled;
- the eval cut its prompt from the training tokens, while `finetune generate` and every server render it with
  apply_chat_template(add_generation_prompt=True): under DeepSeek-R1's template a turn without reasoning is trained
  after `<｜Assistant｜>`, and serving asks `<｜Assistant｜><think>\\n`. The eval asked a prompt no server sends.
Also fixed here: under data.reasoning: context the reference was the reasoning's opener alone (`<think>\\n`), the
first run of trained tokens, not the turn's answer.

In-process and fast: the suite's family tokenizers and templates (tests/data/chat_families.py), rows tokenized by the
data stage, and a stand-in model that writes given tokens. The oracle of the prompt is apply_chat_template.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
from chat_families import ROWS, family_tokenizer

from finetune.chat_templates import resolve_chat_template
from finetune.data.chat import chat_examples
from finetune.data.conversations import convert_turns
from finetune.data.templates import tokenize_segments
from finetune.recipe import DatasetSpec
from finetune.training import evals

SPEC = DatasetSpec(path="rows.jsonl", format="chat")


def tokenizer_of(family: str):
    return family_tokenizer(family, template=resolve_chat_template("deepseek-r1") if family == "deepseek-r1" else None)


def first_example(family: str, tokenizer, kind: str = "reasoning", reasoning: str = "train"):
    messages = convert_turns(ROWS[kind]["messages"], SPEC, "row 1")
    return tokenize_segments(chat_examples(messages, tokenizer, "row 1", reasoning=reasoning)[0], tokenizer)


class Writer(nn.Module):
    """Greedy generation that writes `reply` (token ids) after every prompt."""

    def __init__(self, reply: list[int], eos: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.reply = reply
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos})()

    def generate(self, input_ids, attention_mask, **options):
        return torch.cat([input_ids, torch.tensor([self.reply] * len(input_ids))], dim=1)


def test_harmony_replies_are_scored_on_their_final_answers():
    """Before: reference and sample `analysisCalm suggests cool, muted tones.assistantfinalTeal.`; a reply with the
    same final answer after other reasoning scored 0. Now both are `Teal.` and that reply scores 1."""
    tokenizer = tokenizer_of("gpt-oss")
    example = first_example("gpt-oss", tokenizer)
    _, reference = evals.prompt_and_reference(example, tokenizer)
    assert reference == "Teal."
    other = ("<|channel|>analysis<|message|>Teal is calm and cool.<|end|><|start|>assistant<|channel|>final"
             "<|message|>Teal.<|return|>")
    model = Writer(tokenizer(other, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
    result = evals.generation_eval(model, tokenizer, [example], max_new_tokens=64)
    assert result["score"] == 1.0
    assert (result["samples"][0]["reference"], result["samples"][0]["generated"]) == ("Teal.", "Teal.")


@pytest.mark.parametrize("family", ["deepseek-r1", "gpt-oss", "qwen3", "qwen3.5", "glm-4.5", "llama-3.1"])
def test_the_eval_asks_the_prompt_serving_sends(family):
    """Before (DeepSeek-R1, a turn without reasoning): the prompt ended `<｜Assistant｜>`, the oracle (serving, and
    `finetune generate`) `<｜Assistant｜><think>\\n`. Now the eval's prompt is the oracle's tokens in every family."""
    tokenizer = tokenizer_of(family)
    messages = ROWS["multi_turn"]["messages"][:1]
    oracle = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    prompt, reference = evals.prompt_and_reference(first_example(family, tokenizer, "multi_turn"), tokenizer)
    assert tokenizer.decode(prompt) == tokenizer.decode(oracle)
    assert prompt == oracle and reference == "Teal."


def test_a_deepseek_reply_after_the_prefilled_think_is_read_as_its_reasoning_and_answer():
    """Serving prefills `<think>\\n`: the model writes its reasoning, `</think>`, then the answer; scored on the answer."""
    tokenizer = tokenizer_of("deepseek-r1")
    example = first_example("deepseek-r1", tokenizer, "multi_turn")
    reply = tokenizer("Short and calm.\n</think>\n\nTeal.<｜end▁of▁sentence｜>", add_special_tokens=False)["input_ids"]
    result = evals.generation_eval(Writer(reply, tokenizer.eos_token_id), tokenizer, [example], max_new_tokens=32)
    assert result["samples"][0]["generated"] == "Teal." and result["score"] == 1.0


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "glm-4.5"])
def test_under_reasoning_context_the_reference_is_the_answer_not_the_opener(family):
    """Before: the reference was the first run of trained tokens, the reasoning's opener (`<think>\\n`, gpt-oss's
    `analysis`), so no answer could match it."""
    tokenizer = tokenizer_of(family)
    _, reference = evals.prompt_and_reference(first_example(family, tokenizer, reasoning="context"), tokenizer)
    assert reference == "Teal."
