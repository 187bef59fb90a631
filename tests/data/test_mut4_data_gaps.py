"""Mutation testing round 4 (mut4): rules of data/ported_rows.py and data/conversations.py that no test read.

Found by a bug bash: each test below is the one check that a surviving mutant of these modules broke without any
test failing (PT01-PT04: axolotl's per-message flags and LLaMA-Factory's KTO conversations; CV01-CV04: a row's NaN
cell, a system turn after the first user turn, an all-whitespace completion and an answer of invisible characters).
All in-process, on plain dicts: no tokenizer, no model.
"""

from __future__ import annotations

import pytest

from finetune.data.conversations import check_order, field_text, prompt_completion_turns
from finetune.data.ported_rows import refuse_unscored, split_completion, training_flag
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

USER = {"role": "user", "content": "2+2?"}


def _answer(content: str = "4", **flags) -> dict:
    return {"role": "assistant", "content": content, **({"flags": flags} if flags else {})}


@pytest.mark.parametrize("flags", [{"weight": 0.5}, {"weight": 2}, {"weight": -1.0}])
def test_a_weight_other_than_0_or_1_is_no_training_flag(flags):
    """Found by a bug bash (mut4 PT01): only a clear 0/1 weight is a flag; `weight: 0.5` read as true went unnoticed
    when `value in (0, 1)` was dropped from the flag reading (it would train a turn the data weighs otherwise)."""
    assert training_flag(_answer(**flags)) is None


@pytest.mark.parametrize("flags", [{"train": True, "weight": 0}, {"training": False, "train": 1}])
def test_flags_that_disagree_are_no_training_flag(flags):
    """Found by a bug bash (mut4 PT02): flags that disagree leave the turn as it would be without them; with the
    `len(values) == 1` check gone, one of the two (set order) won, and no test noticed."""
    assert training_flag(_answer(**flags)) is None
    assert training_flag(_answer(train=True, weight=1)) is True


def test_a_kto_conversation_of_the_completion_alone_is_refused():
    """Found by a bug bash (mut4 PT03): a LLaMA-Factory KTO conversation needs a prompt turn before the judged
    completion; one holding only the assistant's message was accepted with an empty prompt when the bound was 1."""
    spec = DatasetSpec(path="rows.jsonl", format="unpaired_preference")
    with pytest.raises(DataError, match="at least a user turn"):
        split_completion([_answer()], spec, "messages", "rows.jsonl line 1")
    prompt, completion = split_completion([USER, _answer()], spec, "messages", "rows.jsonl line 1")
    assert (prompt, completion) == ([USER], [_answer()])


def test_a_preference_answer_with_one_turn_flagged_off_is_refused():
    """Found by a bug bash (mut4 PT04): one flagged-off turn in a scored answer is refused, not only an answer whose
    every turn is flagged off (`any` -> `all` survived)."""
    answer = [_answer("Let me see.", train=True), {"role": "user", "content": "and?"}, _answer("4", train=False)]
    with pytest.raises(DataError, match="flagged not to be trained"):
        refuse_unscored(answer, "chosen", "pairs.jsonl line 1")
    refuse_unscored(answer[:2], "chosen", "pairs.jsonl line 1")


def test_a_nan_cell_is_empty_text_not_the_word_nan():
    """Found by a bug bash (mut4 CV01): a CSV's empty cell loads as NaN; without the isnan check the word "nan"
    would be trained as the field's text."""
    assert field_text(float("nan"), "rows.csv line 2 `input`") == ""
    assert field_text(2.5, "rows.csv line 2 `input`") == "2.5"


def test_a_system_turn_after_the_first_user_turn_is_refused():
    """Found by a bug bash (mut4 CV02): system turns are allowed first only; a system message between turns was
    skipped as if leading once the `all(... messages[:number])` check went, and no test said otherwise."""
    check_order([{"role": "system", "content": "be brief"}, USER, _answer()], "rows.jsonl line 1")
    with pytest.raises(DataError, match="message 2 has role `system`"):
        check_order([USER, {"role": "system", "content": "be brief"}, _answer()], "rows.jsonl line 1")


@pytest.mark.parametrize("content", ["   ", "\u200b", "\n\t"])
def test_an_assistant_turn_of_whitespace_or_invisible_characters_is_an_empty_turn(content):
    """Found by a bug bash (mut4 CV04): an answer of spaces or zero-width characters teaches only the end-of-turn
    token; checking `not content` instead of `not visible(content)` let it through."""
    with pytest.raises(DataError, match="empty assistant turn"):
        check_order([USER, _answer(content)], "rows.jsonl line 1")


def test_a_whitespace_completion_is_refused_as_missing_or_empty():
    """Found by a bug bash (mut4 CV03): a prompt-completion row whose completion is only whitespace is refused for
    that reason ("missing or empty"), as its message says; only the exact empty string was checked by the mutant."""
    spec = DatasetSpec(path="rows.jsonl", format="chat")
    with pytest.raises(DataError, match="missing or empty"):
        prompt_completion_turns([USER], "  \n", spec, "rows.jsonl line 1")
