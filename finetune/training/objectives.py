"""What a step minimizes, side by side: next-token SFT, preference tuning (training/preference.py), KTO
(training/kto.py) and GRPO (training/grpo.py, its completions sampled in training/grpo_rollouts.py).

The loop asks an objective for three things: the counts its normalization needs (summed over ranks once per step;
KTO's include its KL estimate, from no-grad forwards before the step's first backward),
each micro-batch's share of the step loss (what is backpropagated, times the world size, because DDP, FSDP and
DeepSpeed average gradients over ranks), and the evaluation on held-out examples. So the loop is one loop whatever
is trained, and every strategy, checkpoint and tracker works for both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from finetune import distributed
from finetune.data import IGNORE_INDEX, Example, eval_batches, kl_sequence
from finetune.recipe import Recipe
from finetune.training import grpo, kto, preference
from finetune.training.grpo_rollouts import grpo_rollouts
from finetune.training.loss import token_logps, token_loss_and_correct


class Supervised:
    """Token mean of next-token cross-entropy over the trained tokens of the global batch; logs, as TRL's SFTTrainer,
    mean_token_accuracy (trained tokens whose argmax prediction is the label, over the trained tokens)."""

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, **where) -> None:
        """Work before step 1 (none for SFT)."""

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        return [sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        """(tensor to backpropagate, this micro-batch's contribution to the logged sum, metric sums or None)."""
        batch_loss, _, correct = token_loss_and_correct(model, batch, device)
        return (batch_loss * distributed.info().world_size / max(totals[0], 1), batch_loss.detach(),
                correct.reshape(1).double())

    def step_loss(self, summed: float, totals: list[float]) -> float:
        return summed / max(totals[0], 1)

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        return {"mean_token_accuracy": round(sums[0] / max(totals[0], 1), 6)} if sums is not None else {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """{"eval_loss": token-weighted mean loss over the held-out examples, "eval_mean_token_accuracy"}, identical
        for any world size."""
        info = distributed.info()
        total, count, correct = 0.0, 0, 0.0
        for batch in eval_batches(examples, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                  world_size=info.world_size, pad_id=pad_id):
            batch_loss, batch_tokens, batch_correct = token_loss_and_correct(model, batch, info.device)
            total, count, correct = total + float(batch_loss), count + batch_tokens, correct + float(batch_correct)
        total, count, correct = distributed.all_reduce_sum([total, count, correct])
        return {"eval_loss": total / max(count, 1), "eval_mean_token_accuracy": correct / max(count, 1)}


class Preference:
    """Mean over the pairs of the global batch of the dpo.loss (ORPO: plus the chosen responses' token-mean NLL)."""

    def __init__(self, model: nn.Module, recipe: Recipe):
        self.config = recipe.dpo
        if recipe.dpo.disable_dropout:
            preference.disable_dropout(model)
        self.reference = preference.Reference(model, recipe)  # before a resume loads newer LoRA values

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, *, pad_id: int,
                out_dir, resume_from) -> None:
        """dpo.reference precomputed: every pair's reference log-probs, computed now or read back on resume."""
        preference.attach_reference(model, self.reference, {"train": train, "eval": evaluation}, recipe, pad_id=pad_id,
                                    out_dir=out_dir, resume_from=resume_from)

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        pairs, tokens = 0, 0
        for batch in micro_batches:
            trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
            half = trained.size(0) // 2
            valid = (trained[:half] > 0) & (trained[half:] > 0)
            pairs, tokens = pairs + int(valid.sum()), tokens + int((trained[:half] * valid).sum())
        return [pairs, tokens]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        loss_sum, nll_sum, metric_sums, _ = preference.micro_batch_terms(model, batch, self.config, self.reference, device)
        share = preference.combine(loss_sum, nll_sum, totals, self.config)
        return share * distributed.info().world_size, share.detach(), metric_sums

    def step_loss(self, summed: float, totals: list[float]) -> float:
        return summed

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        return preference.metric_means(sums, totals, self.config) if sums is not None else {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """eval_loss (mean over the held-out pairs) and eval_rewards/... , identical for any world size."""
        info = distributed.info()
        sums = torch.zeros(len(preference.metric_names(self.config)) + 4, dtype=torch.float64)
        for batch in eval_batches(examples, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                  world_size=info.world_size, pad_id=pad_id):
            loss_sum, nll_sum, metric_sums, counts = preference.micro_batch_terms(model, batch, self.config,
                                                                                   self.reference, info.device)
            sums += torch.cat([torch.stack([loss_sum.double(), nll_sum.double()]), metric_sums, counts]).cpu()
        total = distributed.all_reduce_sum(sums.tolist())
        loss_sum, nll_sum, metric_sums, (pairs, tokens) = total[0], total[1], total[2:-2], total[-2:]
        loss = loss_sum / max(pairs, 1) + (nll_sum / max(tokens, 1) if self.config.loss == "orpo" else 0.0)
        return {"eval_loss": loss, **preference.metric_means(metric_sums, [pairs, tokens], self.config, prefix="eval_")}


class KTO:
    """Mean over the rows of the global batch of the weighted KTO loss, with one KL estimate per step (training/kto.py)."""

    def __init__(self, model: nn.Module, recipe: Recipe):
        self.config = recipe.kto
        if recipe.dpo.disable_dropout:
            preference.disable_dropout(model)
        self.reference = preference.Reference(model, recipe, compared=True)  # before a resume loads newer LoRA values

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, **where) -> None:
        """Work before step 1 (none: the reference is computed in each step)."""

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        """[rows, desirable, undesirable, KL log-ratio sum, KL rows]: the KL part from this rank's mismatched rows."""
        rows = [0, 0, 0]
        for batch in micro_batches:
            trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1) > 0
            desirable = batch["desirable"]
            rows = [rows[0] + int(trained.sum()), rows[1] + int((trained & desirable).sum()),
                    rows[2] + int((trained & ~desirable).sum())]
        kl = torch.zeros(2, dtype=torch.float64, device=device)
        if kto.uses_kl(self.config):
            for batch in micro_batches:
                kl = kl + kto.kl_terms(model, batch, self.reference, device).to(device)
        return [*rows, kl[0], kl[1]]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        loss_sum, metric_sums, _ = kto.micro_batch_terms(model, batch, self.config, self.reference,
                                                         kto.kl_estimate(totals[3], totals[4]), device)
        share = loss_sum / max(totals[0], 1)
        return share * distributed.info().world_size, share.detach(), metric_sums

    def step_loss(self, summed: float, totals: list[float]) -> float:
        return summed

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        if sums is None:
            return {}
        return kto.metric_means(sums, totals[:3], kto.kl_estimate(totals[3], totals[4]), self.config)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """eval_loss (mean over the held-out rows, the KL estimate over the whole eval set) and eval_rewards/...,
        identical for any world size."""
        info = distributed.info()
        batches = lambda rows: eval_batches(rows, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                            world_size=info.world_size, pad_id=pad_id)
        estimate = 0.0
        if kto.uses_kl(self.config):  # each held-out prompt with the previous row's completion
            mismatched = [kl_sequence(examples[i], examples[i - 1], max_length=recipe.data.max_length)
                          for i in range(len(examples))]
            kl = torch.zeros(2, dtype=torch.float64)
            for batch in batches(mismatched):
                kl += kto.kl_terms(model, {f"kl_{k}": v for k, v in batch.items()}, self.reference, info.device).cpu()
            estimate = kto.kl_estimate(*distributed.all_reduce_sum(kl.tolist()))
        sums = torch.zeros(1 + len(kto.SUMS) + 3, dtype=torch.float64)
        for batch in batches(examples):
            loss_sum, metric_sums, rows = kto.micro_batch_terms(model, batch, self.config, self.reference, estimate,
                                                                info.device)
            sums += torch.cat([loss_sum.double().reshape(1), metric_sums, rows]).cpu()
        total = distributed.all_reduce_sum(sums.tolist())
        rows = total[-3:]
        return {"eval_loss": total[0] / max(rows[0], 1),
                **kto.metric_means(total[1:-3], rows, estimate, self.config, prefix="eval_")}


class GRPO:
    """GRPO: each step the policy samples grpo.num_generations completions per prompt (training/rollout.py), the
    reward functions score them, and the step minimizes the clipped policy loss on their advantages
    (training/grpo.py). Completions are reused for grpo.num_iterations steps."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        from finetune.recipe_grpo import import_reward_function

        self.config, self.recipe, self.tokenizer = recipe.grpo, recipe, tokenizer
        self.functions = [import_reward_function(name) for name in self.config.reward_functions]
        self.reference = preference.Reference(model, recipe, compared=True) if self.config.beta else None
        self.rollouts: list[grpo.Rollout] = []
        self.trained: list[grpo.Rollout] = []  # the rollouts as trained: in chunks of grpo.train_chunk_size
        self.prompt_batches: list[dict] = []
        self.position, self.step, self.generated_at, self.rollout_figures = 0, 0, None, {}

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, **where) -> None:
        """Work before step 1 (none)."""

    def take(self, batches, step: int, count: int) -> list[dict]:
        """The step's prompt micro-batches: new ones at the start of a num_iterations cycle (or after a resume), the
        cycle's own otherwise (the prompts are not consumed again)."""
        self.step = step
        mu = self.config.num_iterations
        if self.generated_at is not None and step - self.generated_at < mu and (step - 1) % mu:
            return self.prompt_batches
        self.prompt_batches, self.generated_at = [next(batches) for _ in range(count)], None
        return self.prompt_batches

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        """[completions, completion tokens] of this rank's step: the completions sampled and scored first, at the
        start of a cycle."""
        if self.generated_at is None:
            self.rollouts = grpo_rollouts(model, micro_batches, self, device)
            self.trained = [chunk for rollout in self.rollouts for chunk in rollout.chunks(self.config.train_chunk_size)]
            self.generated_at = self.step
        self.position = 0
        return [sum(r.mask.size(0) for r in self.rollouts), sum(float(r.mask.sum()) for r in self.rollouts)]

    def train_batches(self, micro_batches: list[dict]) -> list[grpo.Rollout]:
        """What the step runs a forward and backward on: the rollouts' chunks (after `counts`)."""
        return self.trained

    def loss(self, model: nn.Module, batch, totals: list[float], device: torch.device):
        rollout = self.trained[self.position]
        self.position += 1
        logps = grpo.dense(token_logps(model, rollout.batch, device, temperature=self.config.temperature),
                           rollout.mask)
        mask = rollout.mask.to(logps.device)
        moved = lambda t: None if t is None else t.to(logps.device)
        per_token, coef, kl = grpo.per_token_terms(logps, moved(rollout.old_logps), moved(rollout.ref_logps),
                                                   rollout.advantages.to(logps.device, logps.dtype), self.config)
        share = grpo.aggregate(per_token, mask, self.config, completions=totals[0], tokens=totals[1])
        kl_sum = (kl.detach() * mask).sum() if kl is not None else torch.zeros((), device=logps.device)
        sums = torch.stack([kl_sum, *grpo.clip_sums(coef.detach(), rollout.advantages.to(logps.device), mask,
                                                    self.config)]).double()
        return share * distributed.info().world_size, share.detach(), sums

    def step_loss(self, summed: float, totals: list[float]) -> float:
        return summed

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        tokens = max(totals[1], 1)
        out = dict(self.rollout_figures)
        if sums is not None:
            if self.config.beta:
                out["kl"] = sums[0] / tokens
            for name, value in zip(("low_mean", "high_mean", "region_mean"), sums[1:4]):
                out[f"clip_ratio/{name}"] = value / tokens
        # NaN (a std of one value, a function that scored nothing) is left out, as trackers refuse it
        return {name: round(value, 6) for name, value in out.items() if math.isfinite(value)}

    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """No held-out loss: each step's rewards are GRPO's measure."""
        return None


def uses_kl(recipe: Recipe) -> bool:
    """Whether the train batches need KTO's mismatched (KL) rows."""
    return recipe.train.objective == "kto" and kto.uses_kl(recipe.kto)


OBJECTIVES = {"sft": lambda model, recipe: Supervised(), "dpo": Preference, "kto": KTO, "grpo": GRPO}


def for_recipe(model: nn.Module, recipe: Recipe, tokenizer=None) -> Supervised | Preference | KTO | GRPO:
    if recipe.train.objective == "grpo":
        return GRPO(model, recipe, tokenizer)  # it decodes its completions for the reward functions
    return OBJECTIVES[recipe.train.objective](model, recipe)


def take_micro_batches(objective, batches, step: int, count: int) -> list[dict]:
    """The step's micro-batches from the stream (GRPO reuses a cycle's prompts for grpo.num_iterations steps)."""
    if isinstance(objective, GRPO):
        return objective.take(batches, step, count)
    return [next(batches) for _ in range(count)]


def train_batches(objective, micro_batches: list[dict]) -> list:
    """What the step's forwards and backwards run on, one each: the micro-batches, or GRPO's rollout chunks."""
    return objective.train_batches(micro_batches) if isinstance(objective, GRPO) else micro_batches


def rows_per_micro_batch(recipe: Recipe) -> int:
    """Data rows per rank per micro-batch: train.micro_batch_size, but prompts for GRPO (its micro_batch_size
    counts completions, as TRL's per_device_train_batch_size)."""
    return recipe.rows_per_micro_batch

