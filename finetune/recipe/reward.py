"""The recipe's `reward:` section (train.objective: reward): TRL's RewardConfig names and defaults, and the checks of a
reward-model recipe (`check_recipe`, called from recipe/checks.py: check_objective)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RewardSection(BaseModel):
    """A reward model (train.objective: reward): a scalar head (`score`, trained in full) on the last token of each
    response, LoRA on the base, the Bradley-Terry loss of TRL's RewardTrainer on preference pairs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused

    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="TRL's name: adds coefficient x mean((r_chosen + r_rejected)^2) to the loss, which "
        "keeps the rewards centered on 0 (0.01 is the paper's); unset: no term.")

    def check_recipe(self, recipe) -> None:
        check_reward(recipe)


def check_reward(recipe) -> None:  # a finetune.recipe.Recipe (not imported: schema.py imports this)
    """What train.objective: reward needs of the other sections."""
    problems = []
    if recipe.lora.dora:
        problems.append("lora.dora: the reward model's adapter is exported as PEFT's SEQ_CLS adapter with its score "
                        "head; keep the plain LoRA. Fix: lora.dora: false.")
    if recipe.eval.generation_rows:
        problems.append("eval.generation_rows: a reward model generates nothing; its held-out figures are the pairs' "
                        "accuracy and margin. Fix: remove eval.generation_rows.")
    if problems:
        raise ValueError("train.objective reward: " + " ".join(problems))
