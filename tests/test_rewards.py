"""finetune.rewards' GSM8K reward (final_number); the other built-ins are tested with the engine (tests/training/test_grpo.py)."""

from __future__ import annotations

import pytest

from finetune.rewards import final_number


def test_final_number_reads_gsm8k_answers_and_either_completion_form():
    answers = ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "#### 1,000", "#### 5", "#### -3", "none"]
    completions = ["48 + 24 = 72 clips, so the answer is 72.",  # its last number
                   "The total is #### 1000",  # after its own `####`
                   [{"role": "assistant", "content": "5 apples and 6 pears: 11"}],  # TRL's message list; last is 11
                   "It drops to -3.0",
                   "7"]
    assert final_number(None, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, None]


def test_final_number_needs_an_answer_column():
    with pytest.raises(ValueError, match="answer"):
        final_number(None, ["72"])


def test_final_number_reads_boxed_answers_and_compares_exact_values():
    """Found by a bug bash: NuminaMath's `solution` (docs/grpo.md's `columns: {answer: solution}`) ends in `\\boxed{}`:
    a reference `\\boxed{\\frac{1}{2}}` scored a completion `\\boxed{2}` as right (the last number of each), one
    `\\boxed{4}$. Note 5 apples.` scored `4` as wrong, and `.5` was not `0.5`."""
    answers = [r"so $x = \boxed{\frac{1}{2}}$", r"so $x = \boxed{\frac{1}{2}}$", r"\boxed{4}$. Note 5 apples.",
               "#### 0.5", r"\boxed{x^2 + 1}", r"\boxed{1{,}000}", r"\boxed{-\dfrac{3}{4}}"]
    completions = [r"The answer is \boxed{2}.", "It is 0.5", "4", ".5", r"\boxed{x^2+1}", "1,000 in all",
                   r"-0.75, i.e. \boxed{-0.75}"]
    assert final_number(None, completions, answer=answers) == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert final_number(None, [r"\boxed{3}"], answer=[r"\boxed{}"]) == [None]


def test_boxed_lists_units_and_short_fractions_are_read_as_written():
    """Found by a review of the boxed reading: a list `\\boxed{1, 2}` lost its comma (as a thousands separator) and
    scored `\\boxed{12}` right; `\\boxed{\\$5}`, `\\boxed{10\\%}`, `\\boxed{90^\\circ}` and `\\boxed{5 \\text{ cm}}` scored
    the plain number wrong; `\\frac12` was not `\\frac{1}{2}`."""
    answers = [r"\boxed{1, 2}", r"\boxed{\$5}", r"\boxed{10\%}", r"\boxed{90^\circ}", r"\boxed{5 \text{ cm}}",
               r"\boxed{\frac12}", r"\boxed{\text{(A)}}", r"\boxed{1,000}"]
    completions = [r"\boxed{12}", r"\boxed{5}", "10", r"\boxed{90}", "5", r"\boxed{0.5}", r"\boxed{A}", "1000"]
    assert final_number(None, completions, answer=answers) == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert final_number(None, [r"\boxed{1,2}"], answer=[r"\boxed{1, 2}"]) == [1.0]
