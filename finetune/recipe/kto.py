"""The recipe's `kto:` section (train.objective: kto): TRL's KTOConfig names and defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused


class KTOSection(_Section):
    """KTO (train.objective: kto). Names and defaults as TRL's KTOConfig; the reference is dpo.reference's, dropout
    follows dpo.disable_dropout."""

    loss: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto", description="kto: KTO's loss, with the batch's KL estimate from mismatched prompt/completion pairs. "
        "apo_zero_unpaired: APO-zero's unpaired variant (no KL term).")
    beta: float = Field(0.1, gt=0, description="KTO's beta: the strength of the pull to the reference.")
    desirable_weight: float = Field(1.0, gt=0, description="Weight of the desirable (label: true) completions' losses.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of the undesirable (label: false) completions' "
                                      "losses (unequal counts: docs/preference.md, KTO).")

    def check_recipe(self, recipe) -> None:  # a finetune.recipe.Recipe with train.objective: kto
        if recipe.dpo.reference == "precomputed":
            raise ValueError("dpo.reference: precomputed is not supported with train.objective: kto: KTO's KL term "
                             "scores each prompt with another row's completion, which changes with the shuffle. Fix: "
                             "dpo.reference: adapter_off (the default).")
