"""KTO's loss against TRL's own code (KTOTrainer._compute_loss of TRL 1.16), as test_preference_oracle.py does for DPO.

TRL's trainer is made without its __init__ (`object.__new__` plus the attributes `_compute_loss` reads, set as
KTOTrainer.__init__ sets them from KTOConfig) and fed per-token log-probs this test controls: its model call returns
them as TRL's fused LM head does (0 off the completion), for the rows and, in its no-grad KL call, for the mismatched
rows; the reference log-probs are precomputed (`ref_logps`, `ref_KL_logps`). One process without accumulation: TRL's
KL estimate is then the batch's, as ours is (finetune/training/kto.py says where they differ).

Ours runs its training path on the same numbers: `Objective.counts` (the KL rows' log-ratio sum) -> `loss` ->
`metrics`, `sequence_logps` patched to return the log-probs, plus a filler row (no completion token) that must count
for nothing. Compared in fp64: the loss, its gradient with respect to every per-token log-prob, TRL's metrics.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from trl import KTOTrainer

from finetune.recipe import KTOSection, PreferenceSection
from finetune.training import objectives
from finetune.training.objectives import kto

CPU = torch.device("cpu")
ROWS = 6
POSITIONS = 10
DESIRABLE = torch.tensor([True, False, True, True, False, False])
ACCELERATOR = SimpleNamespace(device=CPU, gather=lambda t: t, gather_for_metrics=lambda t: t)  # one process


def scene(seed: int = 5, kl_shift: float = 0.0):
    """Per-token log-probs of ROWS rows and of their ROWS mismatched (KL) rows, completions of different lengths and
    places; the reference's summed log-probs of both. The policy's row log-probs are the gradient's leaf; the KL rows'
    policy log-probs are shifted by `kl_shift` per token (to make the KL estimate positive or negative)."""
    generator = torch.Generator().manual_seed(seed)
    starts, lengths = torch.tensor([2, 1, 4, 0, 3, 2]), torch.tensor([3, 6, 2, 7, 4, 5])
    place = torch.arange(POSITIONS)
    mask = (place >= starts[:, None]) & (place < (starts + lengths)[:, None])
    kl_mask = mask.roll(1, dims=0)  # a KL row's completion is the previous row's
    draw = lambda m: -torch.rand(ROWS, POSITIONS, generator=generator, dtype=torch.float64) * 2.5 * m
    policy, reference, kl_reference = draw(mask).requires_grad_(), draw(mask), draw(kl_mask)
    kl_policy = (kl_reference + kl_shift) * kl_mask + draw(kl_mask) * 0.1
    return policy, reference.sum(dim=1), mask, kl_policy, kl_reference.sum(dim=1), kl_mask


# ------------------------------------------------------------------------------------------------------------ ours
class _Reference:
    """The reference of the scene: its precomputed sums, for the rows and for the KL rows."""

    def __init__(self, values: dict):
        self.values = values

    def logps(self, model, batch, device):
        return self.values[batch["which"]]


def ours(config: KTOSection, policy, reference, mask, kl_policy, kl_reference, kl_mask, monkeypatch):
    """(step loss, logged metrics) of one micro-batch of ROWS rows + 1 filler row, as training computes them."""
    filler = lambda values: torch.cat([values, values.new_zeros((1, *values.shape[1:]))])
    scores = {"rows": ((policy * mask).sum(dim=1), mask.sum(dim=1)),
              "kl": ((kl_policy * kl_mask).sum(dim=1), kl_mask.sum(dim=1))}
    monkeypatch.setattr(kto, "sequence_logps", lambda model, batch, device, **_: tuple(map(filler, scores[batch["which"]])))
    labels = torch.where(filler(F.pad(mask, (1, 0))), 1, -100)
    batch = {"which": "rows", "labels": labels, "desirable": filler(DESIRABLE), "kl_which": "kl"}
    recipe = SimpleNamespace(kto=config, dpo=PreferenceSection(disable_dropout=False),
                             model=SimpleNamespace(adapter=None),
                             train=SimpleNamespace(objective="kto", router_aux_loss_coef=None))
    objective = objectives.KTO(torch.nn.Module(), recipe)
    objective.reference = _Reference({"rows": filler(reference), "kl": filler(kl_reference)})
    totals = [float(v) for v in objective.counts(None, [batch], CPU)]
    assert totals[:3] == [ROWS, int(DESIRABLE.sum()), ROWS - int(DESIRABLE.sum())]  # the filler is not counted
    to_backward, _, sums = objective.loss(None, batch, totals, CPU)
    return to_backward, objective.metrics(sums.tolist(), totals)


# ------------------------------------------------------------------------------------------------------------- TRL
def trl_kto(config: KTOSection, policy, reference, mask, kl_policy, kl_reference, kl_mask):
    """KTOTrainer._compute_loss as it ships; its attributes as KTOTrainer.__init__ sets them from KTOConfig."""
    rows, kl_rows = SimpleNamespace(), SimpleNamespace()
    for space, values, where in ((rows, policy, mask), (kl_rows, kl_policy, kl_mask)):
        vars(space).update(log_probs=values * where, entropy=torch.zeros_like(values.detach()),
                           mean_logits=torch.zeros_like(values.detach()))

    class Model:  # TRL's fused LM head: `model(..., labels=, fused_lm_head=True).log_probs`, 0 off the completion
        training = True

        def __call__(self, *, input_ids, **kwargs):
            assert kwargs["fused_lm_head"] is True
            return kl_rows if bool((input_ids == 1).all()) else rows

    trainer = object.__new__(KTOTrainer)
    vars(trainer).update(model=Model(), accelerator=ACCELERATOR, aux_loss_enabled=False, precompute_ref_logps=True,
                         calculate_KL=config.loss == "kto", loss_type=config.loss, beta=config.beta,
                         desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight,
                         _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(ROWS, POSITIONS + 1, dtype=torch.long),
              "attention_mask": torch.ones(ROWS, POSITIONS + 1, dtype=torch.long),
              "completion_mask": F.pad(mask, (1, 0)).long(),  # unshifted: the first token is never a completion's
              "label": DESIRABLE.clone(), "ref_logps": reference}
    if trainer.calculate_KL:
        inputs.update(KL_input_ids=torch.ones(ROWS, POSITIONS + 1, dtype=torch.long),
                      KL_attention_mask=torch.ones(ROWS, POSITIONS + 1, dtype=torch.long),
                      KL_completion_mask=F.pad(kl_mask, (1, 0)).long(), ref_KL_logps=kl_reference)
    loss = KTOTrainer._compute_loss(trainer, trainer.model, inputs, return_outputs=False)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


CASES = {  # beta and the weights away from their defaults; the KL estimate positive, and negative (clamped to 0)
    "kto": ({"beta": 0.3, "desirable_weight": 1.3, "undesirable_weight": 0.7}, 0.2),
    "kto-kl-clamped": ({"beta": 0.3, "desirable_weight": 1.3}, -0.2),
    "apo_zero_unpaired": ({"loss": "apo_zero_unpaired", "beta": 0.3, "undesirable_weight": 1.5}, 0.2),
}


@pytest.mark.parametrize("case", CASES)
def test_kto_equals_trl(case, monkeypatch):
    keys, kl_shift = CASES[case]
    config = KTOSection(**keys)
    values = scene(kl_shift=kl_shift)
    expected, trl_metrics = trl_kto(config, *values)
    (expected_grad,) = torch.autograd.grad(expected, values[0])
    loss, metrics = ours(config, *values, monkeypatch)
    (grad,) = torch.autograd.grad(loss, values[0])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    mask = values[2]
    assert float(grad[mask].abs().sum()) > 0 and bool((grad[~mask] == 0).all())
    expected_names = {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"}
    assert set(metrics) == expected_names and expected_names <= set(trl_metrics)  # TRL's names
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], abs=1e-6), name  # ours are logged rounded to 6 decimals
    if config.loss == "kto":  # the scene exercises the KL term: positive, or negative and clamped to 0
        assert (trl_metrics["kl"] > 0.1) == (kl_shift > 0) and trl_metrics["kl"] >= 0


def test_a_step_without_undesirable_rows_logs_as_trl():
    """No undesirable row in the step: rewards/rejected, logps/rejected and the margin are left out (TRL logs none)."""
    logged = kto.metric_means([0.6, -8.0, 0.0, 0.0], [2, 2, 0], 0.25, KTOSection())
    assert logged == {"rewards/chosen": 0.3, "logps/chosen": -4.0, "kl": 0.25}
