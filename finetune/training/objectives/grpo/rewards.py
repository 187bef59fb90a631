"""GRPO's reward functions called on a batch of completions: a table of each function's values (None -> NaN, as TRL),
their weighted nansum, and a failing function named with the prompt row it fails on."""

from __future__ import annotations

import math
import numbers

import torch

from finetune.errors import RewardError


def reward_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


def rewards_per_function(functions: list, prompts: list, completions: list, columns: dict[str, list],
                         places: list[str], **extra) -> torch.Tensor:
    """(completions, functions) float64 rewards, NaN where a function returned None. A function that raises, or
    returns the wrong count or a non-number, is a RewardError naming it, the prompt's row (`places`: each
    completion's prompt row, its file and line) and what went wrong."""
    table = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float64)
    for column, function in enumerate(functions):
        name = reward_name(function)
        try:
            values = list(function(prompts=prompts, completions=completions, **columns, **extra))
        except Exception as exc:  # noqa: BLE001  (user code: any exception is named, with its row)
            where = _failing_row(function, prompts, completions, columns, extra, places)
            raise RewardError(
                f"grpo.reward_functions: `{name}` raised {type(exc).__name__}: {exc} (on {where}). The run stopped "
                "before this step's update; the checkpoints it wrote are intact. Fix the function (it receives "
                "prompts, completions and every other column of the rows as keyword lists), then continue with "
                "train.resume=auto (from the newest checkpoint; with none yet, the run starts over).") from None
        if len(values) != len(completions):
            raise RewardError(f"grpo.reward_functions: `{name}` returned {len(values)} values for {len(completions)} "
                              "completions. Fix: return one float (or None) per completion, in order.")
        for row, value in enumerate(values):
            number = _number(value)
            if value is not None and number is None:
                raise RewardError(f"grpo.reward_functions: `{name}` returned {value!r} for the completion of "
                                  f"{places[row]}. Fix: return floats (or None: not scored).")
            table[row, column] = math.nan if value is None else number
    return table


def _number(value) -> float | None:
    """A reward as a float: any real number (Python's, numpy's scalars) or a one-element tensor or array, as TRL takes
    them (it makes a float tensor of the list); None for anything else (a string, a list)."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and tuple(getattr(value, "shape", (0,))) in ((), (1,)):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _failing_row(function, prompts, completions, columns, extra, places) -> str:
    """The first prompt row on which the function raises alone (the batch call raised; which row did it?)."""
    for row in range(len(completions)):
        one = {key: values[row:row + 1] for key, values in {**columns, **extra}.items()}
        try:
            function(prompts=prompts[row:row + 1], completions=completions[row:row + 1], **one)
        except Exception:  # noqa: BLE001
            return places[row]
    return f"the whole batch only (no prompt row raises alone: {'; '.join(dict.fromkeys(places))})"


def weighted_rewards(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """nansum of the weighted rewards per completion; NaN where every function left it unscored (as TRL)."""
    rewards = (table * torch.tensor(weights, dtype=table.dtype)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(table).all(dim=1), math.nan)
