"""GRPO's loss: group advantages, the clipped policy loss and its aggregations, one rollout (its rewards: rewards.py).

Formulas, names and defaults as TRL's GRPOTrainer (1.16), so a GRPOConfig reads the same here:
  * rewards: each function's values (None -> NaN), weighted and summed with nansum; a completion every function
    left unscored has no reward and advantage 0;
  * advantages: reward - its group's mean (the G completions of one prompt), divided by (std + 1e-4) of the group
    (scale_rewards group), of the step's whole batch (batch), or not (none); std unbiased, NaN-aware;
  * per token: coef = exp(logp - logp_old), loss = -min(coef A, clamp(coef, 1 - epsilon, 1 + epsilon_high) A),
    plus beta (exp(ref - logp) - (ref - logp) - 1) with a reference; logp_old is the detached logp unless
    num_iterations > 1 (then the log-probs at generation);
  * aggregation: grpo, sapo: mean per completion, mean over completions; dr_grpo: sum / (completions x
    max_completion_length); dapo, cispo: sum / completion tokens; bnpo: each micro-batch's token mean, averaged over
    the micro-batches; luspo: sum / completions;
  * per token, cispo: -min(coef, epsilon_high).detach() A logp; sapo: -sigmoid(t (coef - 1)) 4 / t A, t by A's sign.
Over a whole step (every rank and micro-batch), the counts are the global ones: a micro-batch's share is its sum over
the step's completions or tokens, so 1 process x batch 16 and 2 x 8 give the same gradient. test_grpo_oracle.py runs
TRL's own _compute_loss on the same per-token log-probs as the oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from finetune.data import IGNORE_INDEX
from finetune.recipe import GRPOSection


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation over the non-NaN values (TRL's nanstd)."""
    mean = torch.nanmean(values, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(values)).sum(dim=dim) if dim is not None else (~torch.isnan(values)).sum()
    variance = torch.nanmean((values - mean) ** 2, dim=dim) * count / (count - 1)
    return variance.sqrt()


def advantages(rewards: torch.Tensor, generations: int, scale: str,
               batch_std: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage per completion, whether its group's std is zero) from the weighted rewards of whole groups
    (consecutive runs of `generations`). `batch_std`: the std over the step's whole batch (scale batch)."""
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    group_std = nanstd(grouped, dim=1).repeat_interleave(generations)
    std = torch.full_like(rewards, batch_std) if scale == "batch" else group_std
    result = rewards - mean
    if scale != "none":
        result = result / (std + 1e-4)
    return torch.nan_to_num(result, nan=0.0), torch.isclose(std, torch.zeros_like(std))


# ------------------------------------------------------------------------------------------------------- loss
def per_token_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                    advantages: torch.Tensor, config: GRPOSection, mask: torch.Tensor | None = None,
                    is_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss, policy ratio coef, per-token KL or None), each (completions, tokens); the coef is (completions,
    1) at importance_sampling_level sequence (GSPO: exp of the mean log-ratio over the completion's `mask`), and for
    vespo the gamma weight phi(w) per completion.
    `is_ratio`: the sampler correction (`sampler_correction`), weighting the policy term before the KL (TRL)."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if config.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_ratio)
    advantage = advantages.unsqueeze(1)
    if config.loss_type == "vespo":  # a detached gamma weight of the completion's ratio, the correction inside it
        coef = vespo_weights(logps - old, advantage, mask, is_ratio, config)  # (rows, 1): its metric's values
        loss = -coef * advantage * logps
    elif config.loss_type == "cispo":  # the ratio clipped from above and detached: a weight on the log-prob's gradient
        loss = -torch.clamp(coef, max=config.upper_epsilon).detach() * advantage * logps
    elif config.loss_type == "sapo":  # a soft, temperature-controlled gate instead of the hard clip
        t = torch.where(advantage > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
        loss = -torch.sigmoid(t * (coef - 1)) * 4 / t * advantage
    else:
        clipped = torch.clamp(coef, 1 - config.epsilon, 1 + config.upper_epsilon)
        loss = -torch.min(coef * advantage, clipped * advantage)
    if is_ratio is not None and config.loss_type != "vespo":
        loss = loss * is_ratio
    kl = None
    if config.beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = loss + config.beta * kl
    return loss, coef, kl


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None,
                  config: GRPOSection) -> torch.Tensor:
    """VESPO's phi(w) = exp(lambda + k log w - lambda w) per completion (rows, 1), w its sequence ratio (the summed
    token log-ratios, plus the sampler correction's), k and lambda by the advantage's sign: TRL's get_gamma_weights."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    positive = advantage >= 0
    k = torch.where(positive, config.vespo_k_pos, config.vespo_k_neg)
    rate = torch.where(positive, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(rate + k * log_w - rate * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def sampler_correction(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                       config: GRPOSection) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction: the ratio of the trained policy's probability (at generation) to the
    sampler's, per token (rows, tokens) or per completion (rows, 1, the sum of the token log-ratios), then clipped to
    [clip_min, clip_max] (`*_truncate`) or set to 0 outside it (`*_mask`). A token the sampler gave no log-prob (NaN)
    counts as ratio 1."""
    mode = config.vllm_importance_sampling_mode
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return ratio.masked_fill(outside, 0.0)


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, config: GRPOSection, *, completions: float,
              tokens: float, batches: float = 1.0, batch_tokens: float | None = None) -> torch.Tensor:
    """This chunk's share of the step loss, given the step's completions, completion tokens and micro-batches, over
    all ranks (and, for bnpo, the completion tokens of the micro-batch the chunk is part of: `batch_tokens`)."""
    masked = per_token_loss * mask
    if config.loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(completions, 1)
    if config.loss_type == "dr_grpo":
        return masked.sum() / (max(completions, 1) * config.max_completion_length)
    if config.loss_type == "bnpo":  # TRL: the local batch's token mean, averaged over the accumulated batches
        denominator = mask.sum().clamp(min=1.0) if batch_tokens is None else max(batch_tokens, 1.0)
        return masked.sum() / denominator / max(batches, 1)
    if config.loss_type == "luspo":
        return masked.sum() / max(completions, 1)
    return masked.sum() / max(tokens, 1)  # dapo, cispo, vespo


def clip_names(config: GRPOSection) -> tuple[str, ...]:
    """TRL's clipping metrics of the loss type (clip_sums counts them, in this order)."""
    if config.loss_type == "cispo":
        return ("cispo_clip_ratio",)
    if config.loss_type == "sapo":
        return ()
    if config.loss_type == "vespo":
        return ("vespo/phi_seq_mean",)
    return ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def clip_sums(coef: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: GRPOSection) -> list[torch.Tensor]:
    """Counts of TRL's clipping metrics (clip_names): tokens, or completions at the sequence level (divided by the
    step's tokens or completions afterwards, as TRL's masked means)."""
    advantage = advantages.unsqueeze(1)
    if config.loss_type == "vespo":  # coef is phi(w), one per completion: TRL's vespo/phi_seq_mean
        return [coef.sum()]
    if config.loss_type in ("cispo", "sapo"):
        if config.loss_type == "sapo":
            return []
        clipped = (coef > config.upper_epsilon) & (advantage > 0)
        return [clipped.sum()] if config.importance_sampling_level == "sequence" else [(clipped * mask).sum()]
    low = (coef < 1 - config.epsilon) & (advantage < 0)
    high = (coef > 1 + config.upper_epsilon) & (advantage > 0)
    if config.importance_sampling_level == "sequence":
        return [low.sum(), high.sum(), (low | high).sum()]
    return [(low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum()]


# ---------------------------------------------------------------------------------------------------- rollout
@dataclass
class Rollout:
    """One micro-batch's completions, ready for the loss: model inputs of prompt + completion, the completion tokens'
    mask (and labels), each completion's advantage, and the log-probs kept from generation when needed."""

    batch: dict[str, torch.Tensor]  # input_ids, attention_mask, position_ids, labels (completion tokens only)
    mask: torch.Tensor  # (completions, width) 1 on the completion tokens the loss counts
    rewards: torch.Tensor  # (completions, functions), NaN: not scored
    truncated: torch.Tensor  # (completions,) no EOS within max_completion_length
    lengths: torch.Tensor  # (completions,) completion tokens
    advantages: torch.Tensor | None = None
    zero_std: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None  # (completions, width): the sampler's log-probs (grpo.generation vllm)
    is_ratio: torch.Tensor | None = None  # the sampler correction (sampler_correction), when applied
    shown: list[dict] | None = None  # per completion: its prompt row's index, prompt and completion text (the log)
    batch_tokens: float | None = None  # a chunk's: its whole micro-batch's completion tokens (bnpo's denominator)

    def chunks(self, size: int | None) -> list[Rollout]:
        """The rollout as consecutive runs of `size` completions (grpo.train_chunk_size; None: itself whole), each
        trained by its own forward and backward. Every per-completion field is sliced alike; the loss of each is its
        share of the step's sums, so the chunks' losses add up to the whole rollout's."""
        rows = self.mask.size(0)
        if size is None or size >= rows:
            return [self]

        def part(value, start):
            if isinstance(value, float):  # batch_tokens
                return value
            if value is None:
                return None
            if isinstance(value, dict):
                return {key: tensor[start:start + size] for key, tensor in value.items()}
            return value[start:start + size]

        whole = self.batch_tokens if self.batch_tokens is not None else float(self.mask.sum())
        return [Rollout(**{name: part(getattr(self, name), start) for name in self.__dataclass_fields__ if name != "batch_tokens"},
                        batch_tokens=whole) for start in range(0, rows, size)]


def sequences(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, eos_ids: list[int],
              mask_truncated: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(model inputs with completion labels, completion mask, truncated) of prompt rows (left-padded) followed by
    their completions (right-padded)."""
    left = max(len(p) for p in prompts)
    right = max(1, max(len(c) for c in completions))
    rows = len(prompts)
    ids = torch.full((rows, left + right), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, left + right), dtype=torch.long)
    labels = torch.full((rows, left + right), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((rows, right), dtype=torch.float32)
    truncated = torch.tensor([not (c and c[-1] in eos_ids) for c in completions])
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[row, left - len(prompt):left] = torch.tensor(prompt, dtype=torch.long)
        ids[row, left:left + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention[row, left - len(prompt):left + len(completion)] = 1
        if not (mask_truncated and truncated[row]):
            labels[row, left:left + len(completion)] = ids[row, left:left + len(completion)]
            mask[row, :len(completion)] = 1.0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions, "labels": labels}, mask, truncated


def dense(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values given in row-major order of the mask's ones -> (rows, width), zeros elsewhere."""
    rows, columns = mask.nonzero(as_tuple=True)
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.index_put((rows.to(values.device), columns.to(values.device)), values)
