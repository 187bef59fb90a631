"""`finetune generate` reads a reply as a chat client reads it: the final answer printed, the reasoning and harmony's
channel words apart, and the interactive chat's history holding the reply as a client sends it back.

Found by a bug bash (bb36 #2): the reply was decoded without its special tokens, so under gpt-oss (harmony) the channel
words were glued onto the answer: `finetune generate` printed `analysisCalm suggests cool, muted tones.assistantfinal
Teal.` and the interactive chat sent that text back as the assistant's turn, so the second prompt held a history no
training example had (the reasoning and the channel words inside the final message, where training had `Teal.`).

In-process and fast: the suite's family tokenizers and templates (tests/data/chat_families.py); the model is a
stand-in that writes, for each prompt, the tokens training taught the turn (the trained span of the row's turn), so
the real decoding, parsing and rendering of `finetune generate` run on them. The oracle is the training context of
the row's second turn (the data stage's own tokens).
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
from finetune.cli import generate
from finetune.data import IGNORE_INDEX
from finetune.data.chat import chat_examples
from finetune.data.conversations import convert_turns
from finetune.data.templates import tokenize_segments
from finetune.recipe import DatasetSpec

SPEC = DatasetSpec(path="rows.jsonl", format="chat")
FAMILIES = ["gpt-oss", "qwen3", "qwen3.5", "glm-4.5", "deepseek-r1", "qwen2.5", "llama-3.1"]


def tokenizer_of(family: str):
    # DeepSeek-R1 distills' own template drops the trained turn's reasoning (refused by the data stage): finetune's copy
    return family_tokenizer(family, template=resolve_chat_template("deepseek-r1") if family == "deepseek-r1" else None)


class Writer(nn.Module):
    """A model that writes `replies` in turn (token ids), as greedy generation returns them: prompt + reply."""

    def __init__(self, replies: list[list[int]], eos: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.replies = list(replies)
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos})()
        self.prompts: list[list[int]] = []

    def generate(self, input_ids, attention_mask, **options):
        self.prompts += [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        reply = torch.tensor([self.replies.pop(0)] * len(input_ids))
        return torch.cat([input_ids, reply], dim=1)


def trained_turns(family: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context, trained tokens) of the reasoning row's two assistant turns, as the data stage tokenizes them: the
    context the template gives each turn at inference and what the model is trained to write there (the first run of
    trained tokens of the first example, the last run of the last: a template that renders earlier turns otherwise
    once later ones follow gives each turn its own example)."""
    messages = convert_turns(ROWS["reasoning"]["messages"], SPEC, "row 1")
    examples = [tokenize_segments(segments, tokenizer) for segments in chat_examples(messages, tokenizer, "row 1")]
    turns = []
    for example, pick in ((examples[0], min), (examples[-1], max)):
        labels = example.labels
        start = pick(i for i, label in enumerate(labels) if label != IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX)
        end = next((i for i in range(start, len(labels)) if labels[i] == IGNORE_INDEX), len(labels))
        turns.append((example.input_ids[:start], example.input_ids[start:end]))
    return turns


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chat_prints_the_answer_and_keeps_the_reply_as_a_client_sends_it(family, monkeypatch, capsys):
    """Before (gpt-oss): `model> analysisCalm suggests cool, muted tones.assistantfinalTeal.`, and the second prompt
    held that text as the assistant's final message; now `model> Teal.` and the second prompt is the context training
    gave the second turn, token for token, in every family with reasoning."""
    tokenizer = tokenizer_of(family)
    (context_1, written_1), (context_2, written_2) = trained_turns(family, tokenizer)
    model = Writer([written_1, written_2], tokenizer.eos_token_id)
    lines = iter(["Pick a colour for a calm room.", "Another one?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    style = generate.prompt_style(None, tokenizer)
    generate.chat(model, tokenizer, style=style, max_new_tokens=len(written_1))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model>")]
    assert printed == ["model> Teal.", "model> Slate grey."], printed
    assert model.prompts[0] == context_1
    assert tokenizer.decode(model.prompts[1]) == tokenizer.decode(context_2)
    assert model.prompts[1] == context_2


def test_one_prompt_prints_the_final_answer_under_harmony(monkeypatch, capsys, tmp_path):
    """Before: `analysisCalm suggests cool, muted tones.assistantfinalTeal.` printed as the answer of a gpt-oss run."""
    tokenizer = tokenizer_of("gpt-oss")
    (_, written), _ = trained_turns("gpt-oss", tokenizer)
    assert generate.answer(Writer([written], tokenizer.eos_token_id), tokenizer, [[1]], max_new_tokens=64) == ["Teal."]
    final_only = tokenizer("<|channel|>final<|message|>Teal.<|return|>", add_special_tokens=False)["input_ids"]
    assert generate.answer(Writer([final_only], tokenizer.eos_token_id), tokenizer, [[1]], max_new_tokens=64) == [
        "Teal."]  # before: `finalTeal.`
