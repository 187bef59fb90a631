"""What a step minimizes: one module per objective, each a subclass of the contract in base.py.

    base.py        Objective: what the loop asks of an objective, with the defaults most share
    sft.py         Supervised: next-token cross-entropy on the trained tokens
    preference.py  DPO, IPO, hinge, ORPO, SimPO: pair losses, the reference (adapter off, or precomputed), metrics
    kto.py         KTO on unpaired feedback: the weighted loss, its KL estimate from mismatched rows
    reward.py      a reward model: TRL's RewardTrainer loss on pairs, the score head in the LM head's place
    grpo/          GRPO: objective.py (the cycle), loss.py (advantages, clipped loss), rewards.py (reward functions),
                   rollouts.py (one generation batch scored), sampling.py (G completions per prompt, KV cache, seeds)

Adding an objective: a module here with its Objective subclass, its recipe section, and one entry in the registry,
finetune/recipe/objectives.py, which names the class as "module:Class" (docs/architecture.md). The loop never asks
which objective it runs.
"""

from __future__ import annotations

from torch import nn

from finetune.recipe import Recipe
from finetune.recipe.objectives import OBJECTIVES as REGISTRY
from finetune.recipe.objectives import load
from finetune.training.objectives.base import Objective
from finetune.training.objectives.grpo import GRPO
from finetune.training.objectives.kto import KTO
from finetune.training.objectives.preference import Preference
from finetune.training.objectives.reward import Reward
from finetune.training.objectives.sft import Supervised


def objective_class(recipe: Recipe) -> type[Objective]:
    """The Objective subclass the registry names for train.objective."""
    return load(REGISTRY[recipe.train.objective].objective)


def for_recipe(model: nn.Module, recipe: Recipe, tokenizer=None) -> Objective:
    """The recipe's objective for `model` (GRPO decodes its completions with `tokenizer` for the reward functions)."""
    return objective_class(recipe)(model, recipe, tokenizer)


def uses_kl(recipe: Recipe) -> bool:
    """Whether the train batches need KTO's mismatched (KL) rows."""
    return objective_class(recipe).uses_kl_rows(recipe)


def rows_per_micro_batch(recipe: Recipe) -> int:
    """Data rows per rank per micro-batch: train.micro_batch_size, but prompts for GRPO (its micro_batch_size
    counts completions, as TRL's per_device_train_batch_size)."""
    return recipe.rows_per_micro_batch


__all__ = ["GRPO", "KTO", "Objective", "Preference", "Reward", "Supervised", "for_recipe", "objective_class",
           "rows_per_micro_batch", "uses_kl"]
