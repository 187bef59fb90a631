"""Training errors found by bug bash 38: the NaN stop and a reward failure every rank shares are marked alike (rank 0
prints one paragraph: the launches are in tests/parallel/test_bb38_errors_once.py), a reward failure of one rank
stays that rank's own, and an absurd learning rate is refused by the recipe, not a torch traceback."""

from __future__ import annotations

import math

import pytest

from finetune.errors import RecipeError, RewardError
from finetune.recipe import validate_recipe
from finetune.training import loop
from finetune.training.objectives.grpo import rewards as grpo_rewards


def _recipe(**train) -> object:
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "unused.jsonl"}]},
                            "train": train})


def test_the_nan_stop_is_alike_on_every_rank(tmp_path):
    """Found by a bug bash: the NaN stop at step 2 (nan_policy stop) was printed whole by both ranks, rank 1's first,
    though every rank decides it alike (the loss is all-reduced, the gradient norm global)."""
    with pytest.raises(loop.NumericalFault, match="step 2: loss nan / gradient norm nan is not finite") as caught:
        loop.handle_numerical_fault(2, math.nan, math.nan, _recipe(), tmp_path, metrics=None)
    assert caught.value.alike_on_every_rank is True


def _failure(place: str, function) -> RewardError:
    with pytest.raises(RewardError) as caught:
        grpo_rewards.rewards_per_function([function], ["q", "q"], ["a", "b"], {}, [place, place])
    return caught.value


def boom(prompts, completions, **columns):
    raise ValueError("boom")


def short(prompts, completions, **columns):
    return [1.0]


def test_a_reward_failing_alike_on_every_rank_is_rank_0s_one_paragraph_saying_so():
    """Found by a bug bash: a reward function raising on every rank at step 2 printed two paragraphs naming different
    prompt rows (rank 1's row 8, rank 0's row 1): one problem or two? Now rank 0 alone says it, naming every rank."""
    rank0, rank1 = _failure("prompt row 1 of p.jsonl", boom), _failure("prompt row 8 of p.jsonl", boom)
    seen = [grpo_rewards.without_rows(rank0), grpo_rewards.without_rows(rank1)]
    said = grpo_rewards.stopped_by(rank0, seen)
    assert said.alike_on_every_rank is True
    assert str(said).startswith("on every rank alike (2 processes, each on its own prompt rows; the row named here is "
                                "rank 0's): grpo.reward_functions[0]: `boom` raised ValueError: boom (on prompt row 1 "
                                "of p.jsonl)"), str(said)
    wrong_count = _failure("prompt row 1 of p.jsonl", short)  # the same text on every rank, no row in it
    said = grpo_rewards.stopped_by(wrong_count, [str(wrong_count)] * 2)
    assert said.alike_on_every_rank is True and str(said).startswith("on every rank alike (2 processes): "), str(said)


def test_a_reward_failing_on_one_rank_or_otherwise_on_each_stays_each_ranks_own():
    """What was right stays so: a function raising on rank 1 alone is rank 1's own paragraph, and rank 0 says it
    stopped for another rank's failure; ranks failing differently each say their own."""
    rank1 = _failure("prompt row 8 of p.jsonl", boom)
    seen = [None, grpo_rewards.without_rows(rank1)]
    assert grpo_rewards.stopped_by(rank1, seen) is rank1 and not getattr(rank1, "alike_on_every_rank", False)
    other = grpo_rewards.stopped_by(None, seen)
    assert "failed on another rank" in str(other) and not getattr(other, "alike_on_every_rank", False)
    rank0 = _failure("prompt row 1 of p.jsonl", short)
    assert grpo_rewards.stopped_by(rank0, [grpo_rewards.without_rows(rank0), seen[1]]) is rank0


def test_an_absurd_learning_rate_is_refused_by_the_recipe():
    """Found by a bug bash: train.learning_rate=1e38 ended in `RuntimeError: value cannot be converted to type float
    without overflow` tracebacks from AdamW on both ranks (its step divides the rate by 1 - beta1: past float32's
    largest from 3.4e37). 1e30, which the NaN tests use, still reaches the NaN stop's paragraph."""
    with pytest.raises(RecipeError, match=r"train.learning_rate: Input should be less than or equal to 1e\+30 "
                                          r"\(got 1e\+38\)"):
        _recipe(learning_rate=1e38)
    assert _recipe(learning_rate=1e30).train.learning_rate == 1e30
