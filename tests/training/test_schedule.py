"""The learning-rate schedule (finetune/training/loop.py lr_lambda) with a warmup: each step's factor of the peak by
hand arithmetic, and against transformers' get_*_schedule_with_warmup, as lr_lambda's docstring relates the two
(its warmup starts at (s + 1) / (w + 1), not at 0; after the warmup the same decay, to train.min_lr_ratio of the peak).

Found by a bug bash (mutation testing, bb50 S1/S2): the only test that read the logged rates used warmup 0, so
`(step + 1) / warmup_steps` for the warmup, or a decay counted from step 0 instead of from the warmup's end, passed."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from finetune.recipe import validate_recipe
from finetune.training.loop import lr_lambda

WARMUP, STEPS, PEAK = 2, 6, 3e-3
COS_QUARTER = 0.5 * (1 + math.cos(math.pi / 4))  # the cosine shape a quarter of the way down: 0.853553...


def factors(schedule: str, min_lr_ratio: float, warmup: int = WARMUP) -> list[float]:
    recipe = validate_recipe({"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                              "train": {"max_steps": STEPS, "warmup_steps": warmup, "lr_schedule": schedule,
                                        "min_lr_ratio": min_lr_ratio, "learning_rate": PEAK}})
    factor = lr_lambda(recipe)
    return [factor(step) for step in range(STEPS)]


def hf_factors(make, **kwargs) -> list[float]:
    """transformers' schedule's factor at steps 0..STEPS-1 (its LambdaLR's own lambda)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = make(optimizer, num_warmup_steps=WARMUP, **kwargs)
    return [scheduler.lr_lambdas[0](step) for step in range(STEPS)]


# Steps 0..5 of 2 warmup steps and 6 steps: warmup 1/3, 2/3 (no step at lr 0, none at the peak before the warmup
# ends); then the decay over the 4 steps left, progress 0, 1/4, 2/4, 3/4 (the last step never reaches the minimum).
BY_HAND = {
    ("cosine", 0.1): [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * COS_QUARTER, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - COS_QUARTER)],
    ("cosine", 0.0): [1 / 3, 2 / 3, 1.0, COS_QUARTER, 0.5, 1 - COS_QUARTER],
    ("linear", 0.1): [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.25],
    ("linear", 0.0): [1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25],
    ("constant", 0.1): [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0],
}


@pytest.mark.parametrize(("schedule", "min_lr_ratio"), list(BY_HAND))
def test_warmup_then_decay_by_hand(schedule, min_lr_ratio):
    assert factors(schedule, min_lr_ratio) == pytest.approx(BY_HAND[schedule, min_lr_ratio], rel=1e-12)


def test_after_the_warmup_it_is_transformers_schedule_and_the_warmup_never_starts_at_zero():
    hf = {"cosine": hf_factors(get_cosine_schedule_with_warmup, num_training_steps=STEPS),
          "linear": hf_factors(get_linear_schedule_with_warmup, num_training_steps=STEPS),
          "constant": hf_factors(get_constant_schedule_with_warmup)}
    for schedule, theirs in hf.items():
        ours = factors(schedule, 0.0)
        # transformers' warmup is s / w (its step 0 trains at lr 0); ours (s + 1) / (w + 1)
        assert theirs[:WARMUP] == pytest.approx([0.0, 1 / 2]) and ours[:WARMUP] == pytest.approx([1 / 3, 2 / 3])
        assert ours[WARMUP:] == pytest.approx(theirs[WARMUP:], rel=1e-12), schedule  # min_lr_ratio 0: the same decay
    # min_lr_ratio 0.1: transformers' cosine with min_lr_rate 0.1; for linear, its decay lifted to the floor
    with_floor = hf_factors(get_cosine_with_min_lr_schedule_with_warmup, num_training_steps=STEPS, min_lr_rate=0.1)
    assert factors("cosine", 0.1)[WARMUP:] == pytest.approx(with_floor[WARMUP:], rel=1e-12)
    linear = [0.1 + 0.9 * f for f in hf["linear"]]
    assert factors("linear", 0.1)[WARMUP:] == pytest.approx(linear[WARMUP:], rel=1e-12)


def test_the_scheduler_as_the_loop_builds_it_gives_each_step_its_rate():
    """The loop's LambdaLR over lr_lambda, read before each step (the rate the step trains at, as metrics.jsonl logs)."""
    recipe = validate_recipe({"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                              "train": {"max_steps": STEPS, "warmup_steps": WARMUP, "learning_rate": PEAK}})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
    rates = []
    for _ in range(STEPS):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert (recipe.train.lr_schedule, recipe.train.min_lr_ratio) == ("cosine", 0.1)  # the defaults
    assert rates == pytest.approx([PEAK * f for f in BY_HAND["cosine", 0.1]], rel=1e-12)
