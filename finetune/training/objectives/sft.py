"""Supervised fine-tuning: next-token cross-entropy on the trained tokens (the row's masks say which)."""

from __future__ import annotations

import torch
from torch import nn

from finetune import distributed
from finetune.data import IGNORE_INDEX, Example, eval_batches
from finetune.recipe import Recipe
from finetune.training.loss import token_loss_and_correct
from finetune.training.objectives.base import Objective


class Supervised(Objective):
    """Token mean of next-token cross-entropy over the trained tokens of the global batch; logs, as TRL's SFTTrainer,
    mean_token_accuracy (trained tokens whose argmax prediction is the label, over the trained tokens)."""

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        return [sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        """(tensor to backpropagate, this micro-batch's contribution to the logged sum, metric sums or None)."""
        batch_loss, _, correct = token_loss_and_correct(model, batch, device, router_aux=self.router_aux)
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
