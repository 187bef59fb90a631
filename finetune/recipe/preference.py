"""The recipe's `dpo:` section (train.objective: dpo; KTO reads its reference and dropout): TRL's DPOConfig,
ORPOConfig and CPOConfig names and defaults, and what a DPO recipe needs of the other sections (`check_recipe`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused


class PreferenceSection(_Section):
    """Preference tuning (train.objective: dpo). Names and defaults as TRL's DPOConfig / ORPOConfig / CPOConfig."""

    loss: Literal["sigmoid", "ipo", "hinge", "orpo", "simpo"] = Field(
        "sigmoid", description="sigmoid: DPO. ipo, hinge: against the reference. orpo, simpo: reference-free.")
    beta: float = Field(0.1, gt=0, description="DPO's beta (the strength of the pull to the reference); ORPO's lambda "
                        "(weight of the odds-ratio term, as TRL's ORPOConfig.beta); SimPO's reward scale.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO / robust SimPO: assumed share of "
                                   "flipped preference labels (sigmoid and simpo).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin.")
    length_normalize: bool | None = Field(
        None, description="Score a response by its mean token log-probability instead of the sum. Default: on for "
        "ipo, orpo and simpo (as TRL), off for sigmoid and hinge.")
    reference: Literal["adapter_off", "precomputed"] = Field(
        "adapter_off", description="adapter_off: the reference is the model with the trained adapter's changes off "
        "(the base, or base + model.adapter): one no-grad forward per step, no extra memory. precomputed: the reference "
        "log-probs of every pair computed once before step 1 and kept in the run folder; each step runs the policy only.")
    max_prompt_length: int | None = Field(
        None, gt=0, description="Prompt tokens kept (its end) before the responses are cut to data.max_length. "
        "Default: half of data.max_length.")
    disable_dropout: bool = Field(True, description="Dropout off during preference tuning (as TRL): the policy's "
                                  "log-probs are then those the reference sees at step 1.")

    def check_recipe(self, recipe) -> None:  # a finetune.recipe.Recipe with train.objective: dpo
        if self.max_prompt_length is not None and self.max_prompt_length >= recipe.data.max_length:
            raise ValueError(f"dpo.max_prompt_length ({self.max_prompt_length}) leaves no room for a response within "
                             f"data.max_length ({recipe.data.max_length}). Fix: lower it, or raise data.max_length.")

    def normalized(self) -> bool:
        return self.length_normalize if self.length_normalize is not None else self.loss in ("ipo", "orpo", "simpo")
