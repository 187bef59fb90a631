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
