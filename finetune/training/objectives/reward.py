"""A reward model (train.objective: reward): the Bradley-Terry loss of TRL's RewardTrainer on preference pairs.

The model is the 4-bit causal LM with LoRA and a scalar head `score` (model/reward_head.py). A sequence's reward is
the head applied to the final hidden state of its last token (the decoder's output), as transformers'
*ForSequenceClassification models read it: the rows are left-padded here so that the last position is every row's
last token, and the forward asks the LM head for that position only (`logits_to_keep=1`), where a hook puts the score
head in the LM head's place. So the head runs inside the model's forward, which every wrapper (DDP, FSDP1/2, ZeRO)
sees, and no vocabulary-wide logits are made. Per pair: -log sigmoid(r_chosen - r_rejected), plus
center_rewards_coefficient x (r_chosen + r_rejected)^2, averaged over the step's pairs on every rank. TRL's metrics:
accuracy, margin, mean_reward, min_reward, max_reward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from finetune import distributed
from finetune.data import IGNORE_INDEX, Example, eval_batches
from finetune.recipe import Recipe
from finetune.training.loss import causal_lm
from finetune.training.objectives.base import Objective

SUM_NAMES = ("accuracy", "margin", "mean_reward")


def _left_padded(batch: dict[str, torch.Tensor], device: torch.device, pad_id: int | None) -> dict[str, torch.Tensor]:
    """The rows right-aligned (left padding), with positions counting real tokens only. A row ends at its last token
    that is not the pad token, as transformers' *ForSequenceClassification picks the token it scores (where the pad
    token is the end-of-sequence token, the EOS closing a response is not the one scored, at inference either)."""
    mask = batch["attention_mask"]
    rows = []
    for ids, keep in zip(batch["input_ids"], mask.bool()):
        real = ids[keep]
        if pad_id is not None:
            kept = (real != pad_id).nonzero()
            real = real[: int(kept[-1]) + 1] if kept.numel() else real[:1]
        rows.append(real)
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=batch["input_ids"].dtype)
    left = torch.zeros((len(rows), width), dtype=mask.dtype)
    for row, real in enumerate(rows):
        ids[row, width - len(real):] = real
        left[row, width - len(real):] = 1
    positions = (left.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.to(device), "attention_mask": left.to(device), "position_ids": positions.to(device)}


def _decoder(lm: nn.Module) -> nn.Module | None:
    """The module whose output transformers' *ForSequenceClassification scores: its base model (`base_model_prefix`,
    as GenericForSequenceClassification calls it), else the causal LM's decoder; None where neither is a child."""
    base = getattr(lm, getattr(lm, "base_model_prefix", "") or "", None)
    if isinstance(base, nn.Module) and base is not lm:
        return base
    decoder = lm.get_decoder() if callable(getattr(lm, "get_decoder", None)) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not lm else None


@contextlib.contextmanager
def _score_in_place_of_the_head(model: nn.Module) -> Iterator[list]:
    """For the block, the LM head's output is the score head applied to the decoder's output (its last hidden state,
    the positions the head is given: the last one under logits_to_keep=1), as a sequence classifier serving the
    exported head scores it; each score is also put in the list the block gets. Not the head's input: a model may
    change the hidden state on its way to the head (MiniCPM3 divides it by logits_scaling, bb68), which the
    classifier does not. Nor the head's output: a model that scales or caps it (Cohere's logit_scale, Gemma's
    softcap: training.loss.head_transform) would do it to the score (bb66's sibling). A model whose decoder is not
    found scores the head's input."""
    lm = causal_lm(model)
    head, score, decoder, taken, decoded = lm.get_output_embeddings(), lm.score, _decoder(lm), [], []

    def keep(module, inputs, output):
        decoded[:] = [getattr(output, "last_hidden_state", None) if not isinstance(output, tuple) else output[0]]

    def hook(module, inputs, output):
        hidden, last = inputs[0], decoded[-1] if decoded else None
        if last is not None and last.dim() == hidden.dim() == 3 and last.shape[-1] == hidden.shape[-1]:
            hidden = last[:, -hidden.shape[1]:]  # sliced as the head's input is
        taken.append(score(hidden))
        return taken[-1]

    handles = [head.register_forward_hook(hook)]
    if decoder is not None:
        handles.append(decoder.register_forward_hook(keep))
    try:
        yield taken
    finally:
        for handle in handles:
            handle.remove()


def rewards(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
            pad_id: int | None = None) -> torch.Tensor:
    """One reward per row of `batch`: the score of its last token (not counting trailing pad tokens), in fp32, with
    the graph: the score head's own output, joined with weight 0 to the model's (for the wrappers' backward hooks)
    where the model changed it."""
    with _score_in_place_of_the_head(model) as taken:
        out = model(**_left_padded(batch, device, pad_id), logits_to_keep=1, use_cache=False)
    scores = taken[-1][:, -1, 0].float()
    return scores if out.logits is taken[-1] else scores + out.logits.float().sum() * 0.0


def scored_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per pair of the micro-batch (chosen rows first, rejected after): whether both sides have a scored token (eval
    batches are topped up with filler pairs that have none)."""
    trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    chosen, rejected = trained.chunk(2)
    return (chosen > 0) & (rejected > 0)


def pair_terms(model: nn.Module, batch: dict[str, torch.Tensor], config, device: torch.device, pad_id: int | None):
    """(sum of pair losses, [accuracy, margin, mean reward] sums, the rewards (detached), valid pairs) of a micro-batch
    (chosen rows first, rejected after; filler pairs without a scored token count for nothing)."""
    values = rewards(model, batch, device, pad_id)
    valid = scored_pairs(batch).to(values.device, values.dtype)
    chosen, rejected = values.chunk(2)
    losses = -F.logsigmoid(chosen - rejected)
    if config.center_rewards_coefficient is not None:
        losses = losses + config.center_rewards_coefficient * (chosen + rejected) ** 2
    c, r = chosen.detach(), rejected.detach()
    sums = torch.stack([((c > r).to(valid.dtype) * valid).sum(), ((c - r) * valid).sum(),
                        ((c + r) / 2 * valid).sum()]).double()
    kept = torch.cat([c[valid.bool()], r[valid.bool()]])
    return (losses * valid).sum(), sums, kept, valid.sum()


class Reward(Objective):
    """TRL's RewardTrainer loss, averaged over the step's pairs."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        super().__init__(model, recipe)
        self.config = recipe.reward
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None else None
        self.extremes: list[float] = [float("inf"), float("-inf")]

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        self.extremes = [float("inf"), float("-inf")]
        return [sum(int(scored_pairs(batch).sum()) for batch in micro_batches)]

    def loss(self, model: nn.Module, batch: dict, totals: list[float], device: torch.device):
        loss_sum, sums, kept, _ = pair_terms(model, batch, self.config, device, self.pad_id)
        if kept.numel():
            self.extremes = [min(self.extremes[0], float(kept.min())), max(self.extremes[1], float(kept.max()))]
        share = loss_sum / max(totals[0], 1)
        return share * distributed.info().world_size, share.detach(), sums

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        if sums is None:
            return {}
        pairs = max(totals[0], 1)
        out = {name: value / pairs for name, value in zip(SUM_NAMES, sums)}
        low, high = distributed.all_reduce_max([-self.extremes[0], self.extremes[1]])
        out.update(min_reward=-low, max_reward=high)
        return {name: round(value, 6) for name, value in out.items() if abs(value) != float("inf")}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """eval_loss, eval_accuracy, eval_margin, eval_mean_reward over the held-out pairs, for any world size."""
        info = distributed.info()
        sums = torch.zeros(len(SUM_NAMES) + 2, dtype=torch.float64)
        for batch in eval_batches(examples, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                  world_size=info.world_size, pad_id=pad_id):
            loss_sum, metric_sums, _, pairs = pair_terms(model, batch, self.config, info.device, pad_id)
            sums += torch.cat([torch.stack([loss_sum.double(), pairs.double()]), metric_sums]).cpu()
        total = distributed.all_reduce_sum(sums.tolist())
        pairs = max(total[1], 1)
        return {"eval_loss": total[0] / pairs,
                **{f"eval_{name}": value / pairs for name, value in zip(SUM_NAMES, total[2:])}}
