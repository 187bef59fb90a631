"""GRPO as an objective of the loop: sample and score at the start of a num_iterations cycle (rollouts.py), train on
the rollouts' chunks, no held-out loss (each step's rewards are its measure)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from finetune import distributed
from finetune.recipe import Recipe
from finetune.training.loss import token_logps
from finetune.training.objectives.base import Objective
from finetune.training.objectives.grpo import loss
from finetune.training.objectives.grpo.rollouts import grpo_rollouts
from finetune.training.objectives.preference import Reference, disable_dropout


class GRPO(Objective):
    """GRPO: each step the policy samples grpo.num_generations completions per prompt (training/rollout.py), the
    reward functions score them, and the step minimizes the clipped policy loss on their advantages
    (training/grpo.py). Completions are reused for grpo.num_iterations steps."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        from finetune.recipe.grpo import import_reward_function

        super().__init__(model, recipe)
        self.config, self.tokenizer = recipe.grpo, tokenizer
        self.functions = [import_reward_function(name) for name in self.config.reward_functions]
        if self.config.reward_models:  # scored beside the functions, weighted after them (reward_models.py)
            from finetune.model import torch_dtype
            from finetune.training.objectives.grpo.reward_models import RewardModel

            self.functions += [RewardModel(path, dtype=torch_dtype(recipe.model.dtype),
                                           device=distributed.info().device) for path in self.config.reward_models]
        if self.config.disable_dropout:
            disable_dropout(model)
        self.reference = Reference(model, recipe, compared=True) if self.config.beta else None
        self.rollouts: list[loss.Rollout] = []
        self.trained: list[loss.Rollout] = []  # the rollouts as trained: in chunks of grpo.train_chunk_size
        self.prompt_batches: list[dict] = []
        self.position, self.step, self.generated_at, self.rollout_figures = 0, 0, None, {}
        self.completions_log = None  # completions/rank<r>.jsonl in the run folder, once prepared
        self.vllm = None  # grpo.generation vllm: the server that samples (vllm_server.py), once prepared
        self.completion_rows: list[dict] = []  # the last generation's completions (rollouts.completion_rows)

    def prepare(self, model: nn.Module, train, evaluation, recipe: Recipe, *, out_dir=None, **where) -> None:
        """The completions log: every sampled completion with its rewards and advantage, one file per rank
        (completions/rank<r>.jsonl in the run folder, appended: a resumed run's begins at its checkpoint's step, outputs.begin_outputs)."""
        if out_dir is not None:
            folder = Path(out_dir) / "completions"
            folder.mkdir(parents=True, exist_ok=True)
            self.completions_log = folder / f"rank{distributed.info().rank}.jsonl"
        if self.config.generation == "vllm":
            from finetune.training.objectives.grpo.vllm_server import VLLMGeneration

            self.vllm = VLLMGeneration(recipe, Path(out_dir or "."), distributed.info().device.type)

    def take(self, batches, step: int, count: int) -> list[dict]:
        """The step's prompt micro-batches: new ones at the start of a num_iterations cycle (or after a resume), the
        cycle's own otherwise (the prompts are not consumed again)."""
        self.step = step
        mu = self.config.num_iterations
        if self.generated_at is not None and step - self.generated_at < mu and (step - 1) % mu:
            return self.prompt_batches
        self.prompt_batches, self.generated_at = [next(batches) for _ in range(count)], None
        return self.prompt_batches

    def resumable_after(self, step: int) -> bool:
        """At a num_iterations cycle's end: a resume starts a cycle (it samples), so a checkpoint within one would
        train the cycle's remaining steps on new completions (as save_every must be a multiple of num_iterations)."""
        return step % self.config.num_iterations == 0

    def stop_note(self, step: int) -> str:
        mu = self.config.num_iterations
        end = step + (-step) % mu
        steps = f"step {end}" if end == step + 1 else f"steps {step + 1}-{end}"
        return (f"[finetune] finishing the grpo.num_iterations cycle first: {steps} train on the completions already "
                f"sampled (no sampling), then the checkpoint of step {end}, which resumes exactly")

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        """[completions, completion tokens, micro-batches] of this rank's step: the completions sampled and scored
        first, at the start of a cycle."""
        if self.generated_at is None:
            if self.vllm is not None:
                self.vllm.sync(model, self.step)  # the adapter as trained so far, hot-loaded into the server
            self.rollouts = grpo_rollouts(model, micro_batches, self, device)
            self.trained = [chunk for rollout in self.rollouts for chunk in rollout.chunks(self.config.train_chunk_size)]
            self.generated_at = self.step
        self.position = 0
        return [sum(r.mask.size(0) for r in self.rollouts), sum(float(r.mask.sum()) for r in self.rollouts),
                len(self.rollouts)]

    def seen_tokens(self, trained: list[loss.Rollout], pad_id: int) -> int:
        """The sampled sequences' prompt and completion tokens, at the step that samples them (TRL's num_tokens: the
        prompt tokens of each of the G completions and the completion tokens, counted when generated; the other steps
        of a num_iterations cycle train on them again and add none)."""
        if self.generated_at != self.step:
            return 0
        return sum(int(chunk.batch["attention_mask"].sum()) for chunk in trained)

    def train_batches(self, micro_batches: list[dict]) -> list[loss.Rollout]:
        """What the step runs a forward and backward on: the rollouts' chunks (after `counts`)."""
        return self.trained

    def loss(self, model: nn.Module, batch, totals: list[float], device: torch.device):
        rollout = self.trained[self.position]
        self.position += 1
        entropy: list[torch.Tensor] = []
        logps = loss.dense(token_logps(model, rollout.batch, device, temperature=self.config.temperature,
                                       entropy=entropy, router_aux=self.router_aux), rollout.mask)
        mask = rollout.mask.to(logps.device)
        moved = lambda t: None if t is None else t.to(logps.device)
        per_token, coef, kl = loss.per_token_terms(logps, moved(rollout.old_logps), moved(rollout.ref_logps),
                                                   rollout.advantages.to(logps.device, logps.dtype), self.config,
                                                   mask=mask, is_ratio=moved(rollout.is_ratio))
        share = loss.aggregate(per_token, mask, self.config, completions=totals[0], tokens=totals[1],
                               batches=totals[2] if len(totals) > 2 else 1.0, batch_tokens=rollout.batch_tokens)
        kl_sum = (kl.detach() * mask).sum() if kl is not None else torch.zeros((), device=logps.device)
        entropy_sum = sum(entropy, torch.zeros((), device=logps.device))
        sums = torch.stack([kl_sum, entropy_sum.to(logps.device, kl_sum.dtype),
                            *loss.clip_sums(coef.detach(), rollout.advantages.to(logps.device), mask,
                                            self.config)]).double()
        return share * distributed.info().world_size, share.detach(), sums

    def tables(self) -> dict[str, list[dict]]:
        """The completions sampled for this step (at the start of a num_iterations cycle), for the trackers."""
        return {"completions": self.completion_rows} if self.generated_at == self.step else {}

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        tokens = max(totals[1], 1)
        out = dict(self.rollout_figures)
        if sums is not None:
            if self.config.beta:
                out["kl"] = sums[0] / tokens
            out["entropy"] = sums[1] / tokens  # TRL's: the mean entropy of the policy over the completion tokens
            per_completion = self.config.importance_sampling_level == "sequence" or self.config.loss_type == "vespo"
            clipped_per = max(totals[0], 1) if per_completion else tokens
            for name, value in zip(loss.clip_names(self.config), sums[2:]):
                out[name] = value / clipped_per
        # NaN (a std of one value, a function that scored nothing) is left out, as trackers refuse it
        return {name: round(value, 6) for name, value in out.items() if math.isfinite(value)}
