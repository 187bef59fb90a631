"""The generation eval under data.reasoning: context asks the prompt serving sends, not one holding the gold reasoning.

Found by a bug bash (bb53 #1): under Qwen3.5's and DeepSeek-R1's templates, whose generation prompt prefills
`<think>\\n`, a turn trained under `data.reasoning: context` starts its trained tokens after the untrained reasoning.
The eval cut its prompt at the first trained token, so the prompt ended `<think>\\nCalm suggests cool, muted tones.`:
the model was handed the held-out row's own reasoning and scored on "answer given the gold reasoning", not on what
serving asks (apply_chat_template(history, add_generation_prompt=True), ending `<think>\\n`).

In-process and fast: the suite's family tokenizers (tests/data/chat_families.py), rows tokenized by the data stage,
apply_chat_template as the oracle.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    # DeepSeek-R1 under finetune's copy of its template, as the suite's other eval tests (tests/training/test_eval_replies.py)
    return family_tokenizer(family, template=resolve_chat_template("deepseek-r1") if family == "deepseek-r1" else None)


def context_example(family: str, tokenizer, turn: int):
    examples = chat_examples(convert_turns(ROWS["reasoning"]["messages"], SPEC, "row 1"), tokenizer, "row 1",
                             reasoning="context")
    return tokenize_segments(examples[turn], tokenizer)


@pytest.mark.parametrize("family", ["qwen3.5", "deepseek-r1"])
def test_under_reasoning_context_the_eval_prompt_is_the_serving_prompt(family):
    """Before: the prompt ended with the turn's own reasoning (`<think>\\nCalm suggests cool, muted tones.`). Now it
    is apply_chat_template(history, add_generation_prompt=True), token for token, and the reference the answer."""
    tokenizer = tokenizer_of(family)
    rows = ROWS["reasoning"]["messages"]
    oracle = tokenizer.apply_chat_template(rows[:1], tokenize=False, add_generation_prompt=True)
    prompt, reference = evals.prompt_and_reference(context_example(family, tokenizer, 0), tokenizer)
    assert tokenizer.decode(prompt) == oracle
    assert prompt == tokenizer(oracle, add_special_tokens=False)["input_ids"]
    assert reference == "Teal."


@pytest.mark.parametrize("family", ["qwen3.5", "deepseek-r1"])
def test_a_later_turn_under_reasoning_context_is_asked_without_its_reasoning(family):
    """Before: the second turn's prompt ended `<think>\\nGrey is neutral and quiet.`. Now it ends with the serving
    prompt's last user turn and generation prompt (`Another one?` then `<think>\\n`), the reference its answer."""
    tokenizer = tokenizer_of(family)
    rows = ROWS["reasoning"]["messages"]
    oracle = tokenizer.apply_chat_template(rows[:3], tokenize=False, add_generation_prompt=True)
    prompt, reference = evals.prompt_and_reference(context_example(family, tokenizer, 1), tokenizer)
    asked = oracle[oracle.rindex("Another one?"):]
    assert tokenizer.decode(prompt).endswith(asked) and asked.endswith("<think>\n")
    assert reference == "Slate grey."
