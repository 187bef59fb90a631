"""GRPO's loss against TRL's own code (GRPOTrainer._compute_loss of TRL 1.16), as test_kto_oracle.py does for KTO.

TRL's trainer is made without its __init__ (`object.__new__` plus the attributes `_compute_loss` reads, set as
GRPOTrainer.__init__ sets them from GRPOConfig) and fed per-token log-probs this test controls: its
`_get_per_token_logps_and_entropies` returns them (the policy's, a leaf for the gradient), with the advantages, the
old log-probs (num_iterations > 1) and the reference's (beta > 0) as `_generate_and_score_completions` hands them on.
One process, no accumulation: TRL's normalizers are then the micro-batch's completions and tokens, which ours take
from the step's counts (`totals`).

Ours runs its training path on the same numbers: `GRPO.loss` (token_logps patched to return the policy's log-probs of
the completion tokens) -> `metrics`. Compared in fp64: the loss, its gradient with respect to every per-token log-prob,
and TRL's kl / clip_ratio metrics.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from finetune.recipe import GRPOSection
from finetune.training import objectives
from finetune.training.objectives.grpo import loss as grpo
from finetune.training.objectives.grpo import objective as grpo_objective
from finetune.training.objectives.grpo import rewards as grpo_rewards
from finetune.training.router_aux import RouterAux

CPU = torch.device("cpu")
ROWS, WIDTH = 6, 9
ENTROPIES = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 4
ACCELERATOR = SimpleNamespace(device=CPU, num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t,
                              reduce=lambda t, reduction: t)  # one process


def scene(seed: int = 3, drift: float = 0.0):
    """Per-token log-probs of ROWS completions of different lengths (one cut at WIDTH), the old policy's (`drift` per
    token away, so ratios leave the clip range), the reference's, and advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 9, 5, 1, 7, 4])
    mask = (torch.arange(WIDTH) < lengths[:, None]).double()
    draw = lambda: -torch.rand(ROWS, WIDTH, generator=generator, dtype=torch.float64) * 3
    policy = draw().requires_grad_()
    old = policy.detach() + drift * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    reference = policy.detach() + 0.3 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    advantages = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    return policy, old, reference, advantages, mask


def ours(config: GRPOSection, policy, old, reference, advantages, mask, monkeypatch, is_ratio=None):
    """(micro-batch loss, logged metrics) as training computes them for one micro-batch that is the whole step.
    `is_ratio`: the vLLM sampler correction (then the old log-probs are kept, as TRL keeps them with vLLM)."""
    def token_logps(model, batch, device, temperature, entropy, router_aux):
        entropy.append((ENTROPIES * mask).sum())  # the policy's per-token entropies, as TRL is handed them
        return policy[mask.bool()]

    monkeypatch.setattr(grpo_objective, "token_logps", token_logps)
    recipe = SimpleNamespace(grpo=config, train=SimpleNamespace(objective="grpo"))
    objective = object.__new__(objectives.GRPO)
    vars(objective).update(config=config, recipe=recipe, rollout_figures={}, position=0, router_aux=RouterAux())
    objective.rollouts = [grpo.Rollout(batch={}, mask=mask, rewards=torch.zeros(ROWS, 1), truncated=torch.zeros(ROWS),
                                       lengths=mask.sum(-1), advantages=advantages,
                                       old_logps=old * mask if config.num_iterations > 1 or is_ratio is not None
                                       else None, ref_logps=reference * mask if config.beta else None,
                                       is_ratio=is_ratio)]
    objective.trained = objective.rollouts  # trained whole (grpo.train_chunk_size unset)
    totals = [float(ROWS), float(mask.sum())]
    to_backward, _, sums = objective.loss(None, {}, totals, CPU)
    return to_backward, objective.metrics(sums.tolist(), totals)


def trl_grpo(config: GRPOSection, policy, old, reference, advantages, mask, is_ratio=None):
    """GRPOTrainer._compute_loss as it ships; its attributes as GRPOTrainer.__init__ sets them from GRPOConfig.
    `is_ratio`: use_vllm with vllm_importance_sampling_correction, the ratio handed on as TRL's generation does."""
    trainer = object.__new__(GRPOTrainer)
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                           sapo_temperature_pos=config.sapo_temperature_pos,
                           sapo_temperature_neg=config.sapo_temperature_neg, vespo_k_pos=config.vespo_k_pos,
                           vespo_lambda_pos=config.vespo_lambda_pos, vespo_k_neg=config.vespo_k_neg,
                           vespo_lambda_neg=config.vespo_lambda_neg)
    vars(trainer).update(
        model=SimpleNamespace(training=True), accelerator=ACCELERATOR, args=args, beta=config.beta,
        loss_type=config.loss_type, epsilon_low=config.epsilon, epsilon_high=config.upper_epsilon,
        max_completion_length=config.max_completion_length,
        importance_sampling_level=config.importance_sampling_level,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, current_gradient_accumulation_steps=1, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda model, input_ids, attention_mask, logits_to_keep, **kw: (
            policy, ENTROPIES, None))
    inputs = {"prompt_ids": torch.zeros(ROWS, 2, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
              "completion_ids": torch.zeros(ROWS, WIDTH, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": mask.sum()}
    if config.num_iterations > 1 or is_ratio is not None:
        inputs["old_per_token_logps"] = old
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if config.beta:
        inputs["ref_per_token_logps"] = reference
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


CASES = {  # every aggregation; the KL term; clipping both ways (old log-probs from num_iterations > 1)
    "dapo-default": ({}, 0.0),
    "grpo-kl-clipped": ({"loss_type": "grpo", "beta": 0.04, "num_iterations": 2}, 0.3),
    "dr_grpo-asymmetric-clip": ({"loss_type": "dr_grpo", "num_iterations": 3, "epsilon_high": 0.28,
                                 "max_completion_length": 16}, 0.3),
    "dapo-kl-clipped": ({"beta": 0.1, "num_iterations": 2, "epsilon": 0.1}, 0.2),
    # GSPO: one ratio per completion (the mean token log-ratio); the paper's loss_type grpo, and dapo beside it
    "gspo-grpo-kl-clipped": ({"importance_sampling_level": "sequence", "loss_type": "grpo", "beta": 0.04,
                              "num_iterations": 2, "epsilon": 0.05}, 0.3),
    "gspo-dapo-clipped": ({"importance_sampling_level": "sequence", "num_iterations": 2, "epsilon": 0.02,
                           "epsilon_high": 0.03}, 0.3),
    # TRL's other loss types: bnpo (the micro-batch's token mean), cispo (the ratio clipped at an absolute epsilon_high
    # and detached), sapo (a soft gate, two temperatures), luspo (summed per completion; the sequence level it is
    # meant for, and the token level TRL allows with a warning)
    "bnpo-kl-clipped": ({"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2}, 0.3),
    "cispo-clipped": ({"loss_type": "cispo", "num_iterations": 2, "epsilon_high": 1.1}, 0.3),
    "cispo-sequence-kl": ({"loss_type": "cispo", "importance_sampling_level": "sequence", "beta": 0.1,
                           "num_iterations": 2, "epsilon_high": 0.5}, 0.3),
    "sapo-kl": ({"loss_type": "sapo", "beta": 0.04, "num_iterations": 2, "sapo_temperature_pos": 0.8,
                 "sapo_temperature_neg": 1.3}, 0.3),
    "luspo-sequence-clipped": ({"loss_type": "luspo", "importance_sampling_level": "sequence", "num_iterations": 2,
                                "epsilon": 0.05}, 0.3),
    "luspo-token-kl": ({"loss_type": "luspo", "beta": 0.1, "num_iterations": 2}, 0.3),
    # vespo: the gamma weight of each completion's ratio (TRL's defaults, then other shapes), with the KL term
    "vespo": ({"loss_type": "vespo", "num_iterations": 2}, 0.05),
    "vespo-shapes-kl": ({"loss_type": "vespo", "num_iterations": 2, "beta": 0.04, "vespo_k_pos": 1.5,
                         "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.0}, 0.05),
}


@pytest.mark.parametrize("case", CASES)
def test_grpo_loss_equals_trl(case, monkeypatch):
    keys, drift = CASES[case]
    config = GRPOSection(**keys)
    values = scene(drift=drift)
    expected, trl_metrics = trl_grpo(config, *values)
    (expected_grad,) = torch.autograd.grad(expected, values[0])
    loss, metrics = ours(config, *values, monkeypatch)
    (grad,) = torch.autograd.grad(loss, values[0])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    mask = values[-1].bool()
    assert float(grad[mask].abs().sum()) > 0 and bool((grad[~mask] == 0).all())
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], abs=1e-6), name  # ours are logged rounded to 6 decimals
    assert ("kl" in metrics) == bool(config.beta) and metrics["entropy"] > 0
    if config.loss_type == "cispo":  # the scene really clips
        assert trl_metrics["cispo_clip_ratio"] > 0 and "cispo_clip_ratio" in metrics
    elif config.loss_type == "vespo":  # the weights are not all 0 or 1: the gamma function acts
        assert 0 < trl_metrics["vespo/phi_seq_mean"] and "vespo/phi_seq_mean" in metrics
    elif config.loss_type == "sapo":  # no clip: no clip metric, in TRL as here
        assert not any("clip" in name for name in [*metrics, *trl_metrics])
    elif drift and config.importance_sampling_level == "token":  # the scene really clips, on both sides
        assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0
    elif drift:  # one ratio per completion: some completions are clipped
        assert trl_metrics["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                  "vespo-token_truncate"])
def test_the_vllm_sampler_correction_weights_the_loss_as_trls(mode, monkeypatch):
    """grpo.generation vllm: the correction's ratio (trainer over sampler, finetune's sampler_correction) applied by
    our loss as TRL's _compute_loss applies it (before the KL term), with clipping of the policy ratio too; vespo
    takes it into its sequence weight instead (TRL's get_gamma_weights)."""
    loss_type, _, mode = mode.rpartition("-")
    config = GRPOSection(loss_type=loss_type or "grpo", beta=0.04, num_iterations=2, vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_max=1.3, vllm_importance_sampling_clip_min=0.8)
    policy, old, reference, advantages, mask = scene(drift=0.3)
    sampler = old + 0.1 * torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ratio = grpo.sampler_correction(old * mask, sampler * mask, mask, config)
    assert ratio.shape == ((ROWS, 1) if mode.startswith("sequence") else (ROWS, WIDTH))
    expected, _ = trl_grpo(config, policy, old, reference, advantages, mask, is_ratio=ratio)
    (expected_grad,) = torch.autograd.grad(expected, policy)
    loss, _ = ours(config, policy, old, reference, advantages, mask, monkeypatch, is_ratio=ratio)
    (grad,) = torch.autograd.grad(loss, policy)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    plain, _ = ours(config, policy, old, reference, advantages, mask, monkeypatch)
    assert float((plain - loss).abs()) > 1e-6  # the correction changed the loss


def test_advantages_as_trl_computes_them():
    """Group mean and unbiased std, NaN-aware, per group of G (TRL's sum_then_normalize); an unscorable completion
    (every function None) gets advantage 0 and is left out of its group's statistics; batch scaling uses the batch's
    std. Expected values written out per group, independently of grpo.advantages."""
    nan = float("nan")
    table = torch.tensor([[1.0, nan], [0.0, 0.5], [1.0, 1.0], [nan, nan],  # group 1 (one unscorable)
                          [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)  # group 2: all equal
    rewards = grpo_rewards.weighted_rewards(table, [1.0, 2.0])
    assert rewards[:3].tolist() == [1.0, 1.0, 3.0] and torch.isnan(rewards[3])
    mean, std = 5 / 3, (((1 - 5 / 3) ** 2 * 2 + (3 - 5 / 3) ** 2) / 2) ** 0.5
    result, zero_std = grpo.advantages(rewards, 4, "group")
    expected = [(1 - mean) / (std + 1e-4), (1 - mean) / (std + 1e-4), (3 - mean) / (std + 1e-4), 0.0, 0, 0, 0, 0]
    assert result.tolist() == pytest.approx(expected, rel=1e-12)
    assert zero_std.tolist() == [False] * 4 + [True] * 4
    unscaled, _ = grpo.advantages(rewards, 4, "none")
    assert unscaled.tolist() == pytest.approx([1 - mean, 1 - mean, 3 - mean, 0, 0, 0, 0, 0], rel=1e-12)
    batch, _ = grpo.advantages(rewards, 4, "batch", batch_std=2.0)
    assert batch[2].item() == pytest.approx((3 - mean) / 2.0001, rel=1e-12)
