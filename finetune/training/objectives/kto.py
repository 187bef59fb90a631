"""KTO on the preference engine: single completions labelled desirable or not, against the reference of DPO.

A micro-batch of B unpaired rows (data/loader.py) is scored as DPO's sequences are (`sequence_logps`: the summed
log-probs of the completion tokens), the reference as dpo.reference says (preference.Reference: the adapter off, or
the SFT adapter's starting values swapped in). Formulas, metric names and defaults as TRL's KTOTrainer (1.16):
  * kto (TRL's default): desirable 1 - sigmoid(beta (r - z)), undesirable 1 - sigmoid(beta (z - r)), r the row's
    log-ratio policy - reference, z the KL estimate: the mean over mismatched rows (each prompt with another row's
    completion) of their policy - reference log-ratio, clamped at 0, no gradient;
  * apo_zero_unpaired: desirable 1 - sigmoid(beta r), undesirable sigmoid(beta r), no KL term.
The losses are weighted (kto.desirable_weight, kto.undesirable_weight) and averaged over the rows.

Where this is the same for any world size and micro-batch split, and where it differs from TRL: the loss is the mean
over the rows of the global batch, and z is one number per optimizer step, the mean over the step's mismatched rows of
every rank and micro-batch (computed by `kl_terms` before the step's first backward, summed over ranks with the
counts). The mismatched rows are the step's rows, each prompt with the completion of the row before it in the step's
order (data.BatchStream). TRL rotates completions within one device's micro-batch and averages the per-device means
of one micro-batch: the same numbers for one process without accumulation; with several processes or grad_accum,
TRL's z is a per-micro-batch quantity and ours the step's. Evaluation pairs each held-out row with the previous
one's completion over the whole eval set (TRL: within each eval batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from finetune import distributed
from finetune.data import IGNORE_INDEX, Example, eval_batches, kl_sequence
from finetune.recipe import KTOSection, Recipe
from finetune.training.loss import sequence_logps
from finetune.training.objectives.base import Objective
from finetune.training.objectives.preference import Reference, disable_dropout
from finetune.training.router_aux import RouterAux

# Summed per micro-batch, in this order; the logged metrics (`metric_means`) are TRL's KTOTrainer's names.
SUMS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")


def uses_kl(config: KTOSection) -> bool:
    return config.loss == "kto"


def row_losses(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, kl: float | torch.Tensor,
               config: KTOSection) -> torch.Tensor:
    """Per row: the weighted KTO (or APO-zero unpaired) loss from its policy and reference completion log-probs."""
    ratio = policy - reference
    beta = config.beta
    if config.loss == "kto":
        chosen, rejected = 1 - F.sigmoid(beta * (ratio - kl)), 1 - F.sigmoid(beta * (kl - ratio))
    else:
        chosen, rejected = 1 - F.sigmoid(beta * ratio), F.sigmoid(beta * ratio)
    return torch.where(desirable, config.desirable_weight * chosen, config.undesirable_weight * rejected)


def kl_terms(model: nn.Module, batch: dict[str, torch.Tensor], reference: Reference,
             device: torch.device) -> torch.Tensor:
    """[sum over the micro-batch's mismatched rows of policy - reference log-probs, their count]: no gradient. A KL row
    left with no completion token (cut by max_length, a filler) counts for nothing."""
    mismatched = {key[3:]: value for key, value in batch.items() if key.startswith("kl_")}
    with torch.no_grad():
        policy, counts = sequence_logps(model, mismatched, device)
        ref = reference.logps(model, mismatched, device).to(policy.device, policy.dtype)
    valid = (counts > 0).to(policy.dtype)
    return torch.stack([((policy - ref) * valid).sum().double(), valid.sum().double()])


def kl_estimate(kl_sum: float, kl_count: float) -> float:
    """z of the KTO loss: the mean mismatched log-ratio, clamped at 0 (as TRL)."""
    return max(kl_sum / kl_count, 0.0) if kl_count > 0 else 0.0


def micro_batch_terms(model: nn.Module, batch: dict[str, torch.Tensor], config: KTOSection, reference: Reference,
                      kl: float, device: torch.device, *, router_aux: RouterAux | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of the rows' weighted losses, metric sums (`SUMS`), [rows, desirable rows, undesirable rows]) of one
    micro-batch; a row with no completion token (an eval filler) counts for nothing. `router_aux`: the policy's
    forward also gives a mixture-of-experts model's load-balancing loss to it (not the KL rows', as TRL)."""
    logps, counts = sequence_logps(model, batch, device, router_aux=router_aux)
    ref = reference.logps(model, batch, device).to(logps.device, logps.dtype)
    desirable = batch["desirable"].to(logps.device)
    weight = (counts > 0).to(logps.dtype)
    losses = row_losses(logps, ref, desirable, kl, config)
    chosen, rejected = weight * desirable, weight * ~desirable
    rewards, policy = config.beta * (logps.detach() - ref), logps.detach()
    sums = torch.stack([(rewards * chosen).sum(), (policy * chosen).sum(), (rewards * rejected).sum(),
                        (policy * rejected).sum()]).double()
    return (losses * weight).sum(), sums, torch.stack([weight.sum(), chosen.sum(), rejected.sum()]).double()


def metric_means(sums: list[float], rows: list[float], kl: float, config: KTOSection, prefix: str = "") -> dict:
    """TRL's KTO metrics: rewards and logps of each kind over its own rows (left out when the step has none, as TRL),
    rewards/margins when both kinds are there, kl (the estimate the loss used; 0 for apo_zero_unpaired)."""
    _, chosen, rejected = rows
    values = dict(zip(SUMS, sums))
    out = {}
    for name, count in (("chosen", chosen), ("rejected", rejected)):
        if count > 0:
            out[f"rewards/{name}"] = values[f"rewards/{name}"] / count
            out[f"logps/{name}"] = values[f"logps/{name}"] / count
    if chosen > 0 and rejected > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["kl"] = kl
    return {f"{prefix}{name}": round(value, 6) for name, value in out.items()}


# ------------------------------------------------------------------------------------------- the objective
class KTO(Objective):
    """Mean over the rows of the global batch of the weighted KTO loss, with one KL estimate per step (training/py)."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        super().__init__(model, recipe)
        self.config = recipe.kto
        if recipe.dpo.disable_dropout:
            disable_dropout(model)
        self.reference = Reference(model, recipe, compared=True)  # before a resume loads newer LoRA values

    @classmethod
    def uses_kl_rows(cls, recipe: Recipe) -> bool:
        return uses_kl(recipe.kto)

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        """[rows, desirable, undesirable, KL log-ratio sum, KL rows]: the KL part from this rank's mismatched rows."""
        rows = [0, 0, 0]
        for batch in micro_batches:
            trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1) > 0
            desirable = batch["desirable"]
            rows = [rows[0] + int(trained.sum()), rows[1] + int((trained & desirable).sum()),
                    rows[2] + int((trained & ~desirable).sum())]
        kl = torch.zeros(2, dtype=torch.float64, device=device)
        if uses_kl(self.config):
            for batch in micro_batches:
                kl = kl + kl_terms(model, batch, self.reference, device).to(device)
        return [*rows, kl[0], kl[1]]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        loss_sum, metric_sums, _ = micro_batch_terms(model, batch, self.config, self.reference,
                                                     kl_estimate(totals[3], totals[4]), device,
                                                     router_aux=self.router_aux)
        share = loss_sum / max(totals[0], 1)
        return share * distributed.info().world_size, share.detach(), metric_sums

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        if sums is None:
            return {}
        return metric_means(sums, totals[:3], kl_estimate(totals[3], totals[4]), self.config)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """eval_loss (mean over the held-out rows, the KL estimate over the whole eval set) and eval_rewards/...,
        identical for any world size."""
        info = distributed.info()
        batches = lambda rows: eval_batches(rows, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                            world_size=info.world_size, pad_id=pad_id)
        estimate = 0.0
        if uses_kl(self.config):  # each held-out prompt with the previous row's completion
            mismatched = [kl_sequence(examples[i], examples[i - 1], max_length=recipe.data.max_length)
                          for i in range(len(examples))]
            kl = torch.zeros(2, dtype=torch.float64)
            for batch in batches(mismatched):
                kl += kl_terms(model, {f"kl_{k}": v for k, v in batch.items()}, self.reference, info.device).cpu()
            estimate = kl_estimate(*distributed.all_reduce_sum(kl.tolist()))
        sums = torch.zeros(1 + len(SUMS) + 3, dtype=torch.float64)
        for batch in batches(examples):
            loss_sum, metric_sums, rows = micro_batch_terms(model, batch, self.config, self.reference, estimate,
                                                            info.device)
            sums += torch.cat([loss_sum.double().reshape(1), metric_sums, rows]).cpu()
        total = distributed.all_reduce_sum(sums.tolist())
        rows = total[-3:]
        return {"eval_loss": total[0] / max(rows[0], 1),
                **metric_means(total[1:-3], rows, estimate, self.config, prefix="eval_")}
