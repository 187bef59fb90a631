"""What a step minimizes, side by side: next-token SFT and preference tuning (training/preference.py).

The loop asks an objective for three things: the counts its normalization needs (summed over ranks once per step),
each micro-batch's share of the step loss (what is backpropagated, times the world size, because DDP, FSDP and
DeepSpeed average gradients over ranks), and the evaluation on held-out examples. So the loop is one loop whatever
is trained, and every strategy, checkpoint and tracker works for both.
"""

from __future__ import annotations

import torch
from torch import nn

from finetune import distributed
from finetune.data import IGNORE_INDEX, Example, eval_batches
from finetune.recipe import Recipe
from finetune.training import preference
from finetune.training.loss import token_loss_and_correct


class Supervised:
    """Token mean of next-token cross-entropy over the trained tokens of the global batch; logs, as TRL's SFTTrainer,
    mean_token_accuracy (trained tokens whose argmax prediction is the label, over the trained tokens)."""

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, **where) -> None:
        """Work before step 1 (none for SFT)."""

    def counts(self, micro_batches: list[dict]) -> list[float]:
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

    def counts(self, micro_batches: list[dict]) -> list[float]:
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


def for_recipe(model: nn.Module, recipe: Recipe) -> Supervised | Preference:
    return Preference(model, recipe) if recipe.train.objective == "dpo" else Supervised()
