"""Every preference loss against TRL's own code: the oracle from another implementation.

TRL (a dev dependency, pinned in constraints/tested.txt) has no standalone loss function: in 1.16 the losses sit inside
the trainers. Each is run here as it ships, on a trainer object made without its __init__ (`object.__new__` plus the
attributes the method reads, set as __init__ sets them from its config), fed per-token log-probs this test controls:
  * sigmoid, sigmoid + length_normalize (TRL: sigmoid_norm), ipo, hinge: `DPOTrainer._compute_loss`, whole (scores,
    loss, rewards and logps metrics), its model forward returning these log-probs as TRL's fused LM head does (0 off
    the completion), the reference log-probs precomputed (`ref_chosen_logps`);
  * sigmoid with label_smoothing (conservative DPO): `CPOTrainer.get_batch_loss_metrics` (loss_type sigmoid, the cDPO
    lines TRL keeps) on the log-ratios, as TRL 1.16's DPOTrainer applies label_smoothing to robust/exo_pair only;
  * orpo: `ORPOTrainer.get_batch_loss_metrics` (odds ratio, NLL minus it, metrics), its concatenated forward returning
    these mean log-probs and our NLL (TRL's NLL also counts the prompt tokens: docs/preference.md);
  * simpo (with label smoothing): `CPOTrainer.get_batch_loss_metrics` (loss_type simpo, cpo_alpha 0).
Ours runs its training path (`micro_batch_terms` -> `combine`) with `sequence_logps` returning the same log-probs, plus
a filler pair (no scored token) that must count for nothing. Compared in fp64 (ORPO: TRL computes in fp32): the loss,
its gradient with respect to every per-token log-prob, and the logged rewards, margins, accuracies and logps.
How `sequence_logps` gets the log-probs from a model is checked in test_preference.py.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from trl import DPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

from finetune.recipe import PreferenceSection
from finetune.training.objectives import preference

CPU = torch.device("cpu")
PAIRS = 4
POSITIONS = 10  # the shifted sequence (labels[:, 1:]): where a response token can be scored
ACCELERATOR = SimpleNamespace(device=CPU, gather=lambda t: t, gather_for_metrics=lambda t: t)  # one process


def scene(seed: int = 3):
    """Per-token log-probs of 2 x PAIRS sequences (chosen rows, then rejected), responses of different lengths and
    places (mask), and the reference's summed log-probs. The policy's are the leaf the gradients are taken against;
    only its masked values are scored (as the models do: TRL's fused head and ours score the response tokens only)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.tensor([2, 1, 4, 0, 1, 3, 2, 5])
    lengths = torch.tensor([3, 6, 2, 7, 5, 2, 4, 1])
    place = torch.arange(POSITIONS)
    mask = (place >= starts[:, None]) & (place < (starts + lengths)[:, None])
    draw = lambda: -torch.rand(2 * PAIRS, POSITIONS, generator=generator, dtype=torch.float64) * 2.5 * mask
    policy, reference = draw().requires_grad_(), draw()
    return policy, reference.sum(dim=1), mask


# ------------------------------------------------------------------------------------------------------------ ours
def ours(config: PreferenceSection, policy, reference_sums, mask, monkeypatch):
    """(step loss, per-pair metric means) of one micro-batch of PAIRS pairs + 1 filler pair, as training computes them."""
    add_filler = lambda values: torch.cat([values[:PAIRS], values.new_zeros(1), values[PAIRS:], values.new_zeros(1)])
    logps, counts = add_filler((policy * mask).sum(dim=1)), add_filler(mask.sum(dim=1))
    monkeypatch.setattr(preference, "sequence_logps", lambda model, batch, device, **_: (logps, counts))
    batch = {"reference_logps": add_filler(reference_sums)}
    reference = preference.Reference(None, SimpleNamespace(dpo=config, model=SimpleNamespace(adapter=None)))
    loss_sum, nll_sum, metric_sums, totals = preference.micro_batch_terms(None, batch, config, reference, CPU)
    assert totals.tolist() == [PAIRS, float(mask[:PAIRS].sum())]  # the filler pair is not counted
    loss = preference.combine(loss_sum, nll_sum, totals.tolist(), config)
    return loss, dict(zip(preference.METRICS, (metric_sums / totals[0]).tolist()))


# ------------------------------------------------------------------------------------------------------------- TRL
def trl_dpo(loss_type: str, config: PreferenceSection, policy, reference_sums, mask):
    """DPOTrainer._compute_loss as it ships; its attributes as DPOTrainer.__init__ sets them from DPOConfig."""
    outputs = SimpleNamespace(log_probs=policy * mask, entropy=torch.zeros_like(policy.detach()),
                              mean_logits=torch.zeros_like(policy.detach()), is_top1=torch.zeros_like(mask))

    class Model:  # TRL's fused LM head: `model(..., labels=, fused_lm_head=True).log_probs`, 0 off the completion
        training = True

        def __call__(self, **kwargs):
            assert kwargs["fused_lm_head"] is True
            return outputs

    trainer = object.__new__(DPOTrainer)
    vars(trainer).update(model=Model(), accelerator=ACCELERATOR, aux_loss_enabled=False, ld_alpha=None,
                         precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                         loss_weights=[1.0], beta=config.beta, label_smoothing=config.label_smoothing,
                         use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    rows = 2 * PAIRS
    inputs = {"input_ids": torch.zeros(rows, POSITIONS + 1, dtype=torch.long),
              "attention_mask": torch.ones(rows, POSITIONS + 1, dtype=torch.long),
              "completion_mask": F.pad(mask, (1, 0)).long(),  # unshifted: the first token is never a completion's
              "ref_chosen_logps": reference_sums[:PAIRS], "ref_rejected_logps": reference_sums[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, trainer.model, inputs, return_outputs=False)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def _no_logits():
    return torch.zeros(PAIRS, POSITIONS, 1, dtype=torch.float64)


def trl_cpo(loss_type: str, config: PreferenceSection, chosen, rejected):
    """CPOTrainer.get_batch_loss_metrics as it ships (cpo_alpha 0: no NLL term, SimPO's setting), its concatenated
    forward returning the given scores."""
    trainer = object.__new__(CPOTrainer)
    vars(trainer).update(accelerator=ACCELERATOR, aux_loss_enabled=False, beta=config.beta, loss_type=loss_type,
                         label_smoothing=config.label_smoothing, cpo_alpha=0.0, alpha=0.0,
                         concatenated_forward=lambda model, batch: (chosen, rejected, _no_logits(), _no_logits(),
                                                                    torch.tensor(0.0)))
    if loss_type == "simpo":
        trainer.simpo_gamma = config.simpo_gamma
    return CPOTrainer.get_batch_loss_metrics(trainer, None, {}, train_eval="train")


def trl_orpo(config: PreferenceSection, chosen, rejected, nll):
    trainer = object.__new__(ORPOTrainer)
    vars(trainer).update(accelerator=ACCELERATOR, aux_loss_enabled=False, beta=config.beta,
                         concatenated_forward=lambda model, batch: (chosen, rejected, _no_logits(), _no_logits(), nll))
    return ORPOTrainer.get_batch_loss_metrics(trainer, None, {}, train_eval="train")


def trl_oracle(config: PreferenceSection, policy, reference_sums, mask):
    """(loss, metrics) of TRL's trainer for this dpo section."""
    sums, counts = (policy * mask).sum(dim=1), mask.sum(dim=1)
    means = sums / counts
    if config.loss == "sigmoid" and config.label_smoothing > 0:
        ratios = sums - reference_sums
        loss, _ = trl_cpo("sigmoid", config, ratios[:PAIRS], ratios[PAIRS:])
        return loss, trl_dpo("sigmoid", config, policy, reference_sums, mask)[1]  # metrics: no loss in them
    if config.loss in preference.WITH_REFERENCE:
        loss_type = "sigmoid_norm" if config.loss == "sigmoid" and config.normalized() else config.loss
        return trl_dpo(loss_type, config, policy, reference_sums, mask)
    if config.loss == "simpo":
        return trl_cpo("simpo", config, means[:PAIRS], means[PAIRS:])
    nll = -policy[:PAIRS][mask[:PAIRS]].mean()  # ours: the chosen responses' tokens (TRL: prompt tokens too)
    return trl_orpo(config, means[:PAIRS], means[PAIRS:], nll)


CASES = {  # beta, label smoothing and SimPO's gamma away from their defaults
    "sigmoid": {"loss": "sigmoid", "beta": 0.3},
    "sigmoid-normalized": {"loss": "sigmoid", "beta": 0.3, "length_normalize": True},
    "sigmoid-smoothed": {"loss": "sigmoid", "beta": 0.3, "label_smoothing": 0.2},
    "ipo": {"loss": "ipo", "beta": 0.3, "label_smoothing": 0.2},  # smoothing set, ignored by both
    "hinge": {"loss": "hinge", "beta": 0.3, "label_smoothing": 0.2},
    "orpo": {"loss": "orpo", "beta": 0.3},
    "simpo": {"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.7, "label_smoothing": 0.2},
}


@pytest.mark.parametrize("case", CASES)
def test_each_loss_equals_trl(case, monkeypatch):
    config = PreferenceSection(**CASES[case])
    policy, reference_sums, mask = scene()
    expected, trl_metrics = trl_oracle(config, policy, reference_sums, mask)
    (expected_grad,) = torch.autograd.grad(expected, policy)
    loss, metrics = ours(config, policy, reference_sums, mask, monkeypatch)
    (grad,) = torch.autograd.grad(loss, policy)
    # TRL's ORPO casts the log-probs to fp32 (odds_ratio_loss); everything else runs in fp64 on both sides.
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if config.loss == "orpo" else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(loss, expected.to(loss.dtype), **tolerance)
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    assert float(grad[mask].abs().sum()) > 0 and bool((grad[~mask] == 0).all())
    assert set(metrics) <= set(trl_metrics)  # the same names as TRL logs
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], rel=tolerance["rtol"], abs=tolerance["atol"]), name
    assert 0 < trl_metrics["rewards/accuracies"] < 1  # the pairs are not all won or all lost: a sign error shows


def test_the_scene_exercises_each_branch():
    """The data is not degenerate: hinge's relu is active for some pairs and not others, margins of both signs."""
    policy, reference_sums, _ = scene()
    sums = policy.detach().sum(dim=1)
    logits = (sums[:PAIRS] - sums[PAIRS:]) - (reference_sums[:PAIRS] - reference_sums[PAIRS:])
    active = 1 - CASES["hinge"]["beta"] * logits > 0
    assert bool(active.any()) and not bool(active.all())
    assert bool((logits > 0).any()) and bool((logits < 0).any())


def test_trl_dpo_sigmoid_ignores_label_smoothing():
    """Why conservative DPO is checked against CPOTrainer's sigmoid: TRL 1.16's DPOTrainer applies label_smoothing to
    robust and exo_pair only (docs/preference.md says so; a TRL upgrade that changes this fails here)."""
    policy, reference_sums, mask = scene()
    plain = trl_dpo("sigmoid", PreferenceSection(loss="sigmoid", beta=0.3), policy, reference_sums, mask)[0]
    smoothed = trl_dpo("sigmoid", PreferenceSection(loss="sigmoid", beta=0.3, label_smoothing=0.2), policy,
                       reference_sums, mask)[0]
    assert float(plain.detach()) == float(smoothed.detach())


def test_orpo_in_fp32_equals_trl_for_responses_the_policy_is_near_certain_of():
    """Regression: training scores in fp32 (sequence_logps), and at mean log-probs near 0 our log1p(-exp(x)) lost 1% of
    the odds-ratio loss (x = -1e-6); TRL's ORPO, in fp32 too, uses a stable log(1 - e^x). At 0 ours stays finite."""
    config = PreferenceSection(loss="orpo", beta=0.3)
    chosen = torch.tensor([-1e-6, -1e-4, -1e-3, -0.2, -2.0], requires_grad=True)
    rejected = torch.tensor([-1e-5, -2e-3, -0.5, -0.01, -1e-6], requires_grad=True)
    expected, _ = trl_orpo(config, chosen, rejected, nll=torch.zeros(()))  # its loss: NLL - mean(beta x logsigmoid)
    expected_grads = torch.autograd.grad(expected, (chosen, rejected))
    loss = preference.pair_losses((chosen, rejected), None, config).mean()
    grads = torch.autograd.grad(loss, (chosen, rejected))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    certain = torch.zeros(2, requires_grad=True)
    at_zero = preference.pair_losses((certain[:1], certain[1:]), None, config).sum()
    assert bool(at_zero.isfinite()) and bool(torch.autograd.grad(at_zero, certain)[0].isfinite().all())
