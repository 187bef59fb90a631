"""The recipe's `train:` section: the objective, the run's length (steps or epochs), the batch, the optimizer and its
schedule, the cadences (logging, eval, checkpoints), resume, and the trackers."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from finetune.recipe.checks import check_one_of_each
from finetune.recipe.objectives import OBJECTIVES, sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused


class TrainSection(_Section):
    objective: Literal[tuple(OBJECTIVES)] = Field(  # the registry's names (recipe/objectives.py)
        "sft", description="sft: next-token loss on the answers. dpo: preference tuning on chosen/rejected pairs "
        "(the `dpo:` section picks the loss: DPO, IPO, hinge, ORPO, SimPO). kto: KTO on single completions labelled "
        "desirable or not (format: unpaired_preference; the `kto:` section). grpo: online RL, completions sampled by "
        "the policy and scored by reward functions (format: prompt; the `grpo:` section; docs/grpo.md). reward: a "
        "reward model (a scalar head + LoRA) on chosen/rejected pairs, TRL's RewardTrainer loss (format: "
        "preference; the `reward:` section; docs/reward.md).")
    max_steps: int = Field(100, gt=0, description="Optimizer steps of the run; or set num_epochs instead (not both).")
    num_epochs: float | None = Field(
        None, gt=0, description="Passes over the training rows instead of max_steps (not both; 1.5: one pass and half "
        "of a reshuffled second). At the run's start max_steps becomes ceil(num_epochs x steps per epoch), at least 1, "
        "steps per epoch = rows // (micro_batch_size x processes x grad_accum), GRPO's x grpo.num_iterations (TRL's): "
        "the resolved recipe.yaml says that max_steps.")
    micro_batch_size: int = Field(4, gt=0, description="Rows per process per forward pass (grpo: completions, as TRL's "
                                  "per_device_train_batch_size: micro_batch_size / grpo.num_generations prompts).")
    grad_accum: int = Field(1, gt=0)
    learning_rate: float = Field(2e-4, gt=0, le=1e30, description="Peak rate; from 3.4e37 AdamW overflows float32.")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="As HF's: warmup over this share of max_steps "
                                       "(rounded up), instead of warmup_steps; the resolved recipe says the steps. "
                                       "Warmup step s of w uses (s+1)/(w+1) of the peak (HF's: s/w, from lr 0).")
    # The warmup_ratio warmup_steps was resolved from (checks.clamped_warmup), for the notes that name the recipe's key
    _warmup_ratio: float | None = PrivateAttr(None)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global gradient norm clip; null (or HF's 0): none.")
    router_aux_loss_coef: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="Mixture-of-experts models: the weight of the router "
        "load-balancing loss (transformers' aux_loss) added to the loss, as TRL's router_aux_loss_coef. null: the "
        "model config's own router_aux_loss_coef (Mixtral-8x7B 0.02); 0: off. Refused on a model whose forward "
        "returns no such loss, and with train.objective reward (docs/recipes.md, Mixture-of-experts).")
    seed: int = Field(42, description="Seeds the shuffle, the eval hold-out, LoRA's init and dropout. 0 to 2**63 - 1: "
                      "torch takes seeds below 2**64, and epochs and ranks are added to it.")
    gradient_checkpointing: bool = True
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0, description="0: evaluate only at the end. With no eval rows (GRPO's, or "
                            "data.eval_fraction giving none) a note at the run's start says nothing evaluates.")
    save_every: int = Field(
        100, ge=0, description="Checkpoint every N steps; one is also written at the last step and on SIGTERM/SIGINT. 0: only those."
    )
    keep_last: int = Field(2, gt=0, description="Checkpoints kept in output.dir/checkpoints (older ones are removed).")
    keep_best: bool = Field(
        False, description="Also keep the checkpoint of the lowest eval loss: keep_last never removes it (at most "
        "keep_last + 1 kept). Needs eval data and an eval at every checkpoint (save_every a multiple of eval_every); "
        "`finetune export RUN OUT --step N` exports it (a DeepSpeed run's: resumed to step N into another folder).")
    resume: str | None = Field(
        None, description="`auto`: continue from the newest good checkpoint in output.dir, if any; or a checkpoint / run folder."
    )
    nan_policy: Literal["stop", "skip"] = Field("stop", description="A NaN/inf loss or gradient: stop the run, or skip the step.")
    threads: int | None = Field(None, gt=0, description="torch CPU threads per process; default: torch's choice.")
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list, description="Experiment trackers fed from rank 0, besides metrics.jsonl (always written)."
    )
    run_name: str | None = Field(None, description="Run name shown by the trackers; default: the name of output.dir.")
    tensorboard_dir: str | None = Field(None, description="TensorBoard log folder, shared by runs: each logs into "
                                        "<tensorboard_dir>/<run_name> (a default run name another run already uses there: <run_name>-<hash of "
                                        "output.dir>); default: output.dir/tensorboard.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (sqlite:///..., http://server, file:...); default: $MLFLOW_TRACKING_URI, "
        "else a SQLite store in output.dir/mlflow.db."
    )
    mlflow_experiment: str = Field("finetune", description="MLflow experiment name.")
    wandb_project: str = Field("finetune", description="Weights & Biases project (offline mode without an API key).")

    @field_validator("objective", mode="before")
    @classmethod
    def _loss_named_as_objective(cls, value: Any) -> Any:
        # `train.objective: orpo` (TRL has an ORPOTrainer): here ORPO, IPO, SimPO ... are losses of an objective
        for name, section in sections().items():
            loss = section.model_fields.get("loss")
            if isinstance(value, str) and value not in OBJECTIVES and loss is not None and value in typing.get_args(
                    loss.annotation):
                raise ValueError(f"`{value}` is a loss of the {name} objective here. Fix: train.objective: {name} and "
                                 f"{name}.loss: {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _null_unsets(cls, values: Any) -> Any:
        # `train.max_steps=null` / `warmup_steps=null` on the command line unset a library recipe's, for num_epochs /
        # warmup_ratio to take their place. max_grad_norm 0 is HF's "no clipping" (null here; it was refused).
        if isinstance(values, dict):
            values = {key: value for key, value in values.items() if key not in ("max_steps", "warmup_steps") or value is not None}
            if values.get("max_grad_norm") in (0, "0"):
                values["max_grad_norm"] = None
        return values

    @model_validator(mode="after")
    def _one_run_length(self) -> TrainSection:
        check_one_of_each(self)  # max_steps or num_epochs, warmup_steps or warmup_ratio
        return self

    @model_validator(mode="after")
    def _seed_a_new_run_takes(self, info: ValidationInfo) -> TrainSection:
        # A seed that finetune before 60aa010 trained with, as torch.manual_seed takes it (-2**63 .. 2**64 - 1), is
        # kept as written in a recipe a run wrote (trains False: read to export or generate) and in a resume, so the
        # numbers are those of then: -1 is torch's 2**64 - 1 but Python random's 1, so no seed of 0 .. 2**63 - 1
        # stands for it (bug bash bb70: a -1 run could be neither resumed nor exported). A new run is refused it.
        new_run = self.resume is None and (info.context or {}).get("trains", True)
        if (0 if new_run else -(2**63)) <= self.seed <= (2**63 - 1 if new_run else 2**64 - 1):
            return self
        raise ValueError(f"train.seed {self.seed} is outside {'0 .. 2**63 - 1' if new_run else '-2**63 .. 2**64 - 1'} (torch "
                         "takes seeds from -2**63 to 2**64 - 1, and epochs and ranks are added to it). Fix: a seed from "
                         "0 to 2**63 - 1." + (" (A run an older finetune trained with a seed below 0 resumes with it: "
                                              "add train.resume=auto.)" if new_run and self.seed < 0 else ""))

    @field_validator("resume")
    @classmethod
    def _resume_target(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be `auto` or the path of a checkpoint or run folder (leave it out to start fresh)")
        return value.strip() if value is not None else None


def lr_factors(t) -> Callable[[int], float]:
    """The factor of the peak learning rate at each step (from 0) of a train section `t` (TrainSection, or a saved
    recipe's train mapping read as attributes): linear warmup, then cosine (or linear / constant) decay to min_lr_ratio
    of the peak.

    Step s of w warmup steps uses (s + 1) / (w + 1) of the peak: no step runs at lr 0. transformers'
    get_*_schedule_with_warmup uses s / w, whose first step has lr 0, and decays to 0: after the warmup the two are the
    same only with train.min_lr_ratio 0 (its default, 0.1, ends cosine and linear at a tenth of the peak)."""

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        if t.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

    return factor
