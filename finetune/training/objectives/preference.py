"""Preference tuning on the SFT engine: DPO, IPO and hinge against a reference; ORPO and SimPO without one.

A micro-batch of B pairs is one batch of 2B sequences (B chosen, then B rejected: data/loader.py), scored in one
forward by `sequence_logps` (the sum of the response tokens' log-probabilities per sequence, computed inside the
forward from the trained positions only: no full-vocabulary logits, as the SFT loss). The reference needs no second
model (dpo.reference):
  * adapter_off: one no-grad forward with the trained adapter's changes taken away. Started from a fresh adapter
    (B = 0) that is the base: PEFT's adapter switch is flipped on every LoRA layer (a flag, no parameter touched, so
    FSDP1's flat parameters and ZeRO-3's partitions are left alone, where PEFT's `disable_adapter()` changes
    requires_grad). Started from model.adapter (SFT -> DPO), the reference is base + that adapter, never the bare
    base; and when training moves values the switch leaves on (lora.bias, lora.train_router) the reference is the base
    as loaded, not the trained biases or routers: the starting values (a copy of this rank's LoRA shard, kept before training and before a resume
    loads newer ones) are swapped into the trained parameters for the reference pass and swapped back. A resume reads
    them from the copy of model.adapter its run kept when it started (model/lora/kept.py): the same reference as the
    first steps, whatever that folder holds by then.
  * precomputed: the reference log-probs of every train and eval pair, computed once before step 1 with the starting
    weights (= the reference) and written to the run folder (reference_logps.json), which a resume reads back: each
    step then runs the policy only.

The loss of a step is the mean over the pairs of the global batch (ORPO adds the chosen responses' NLL, a mean over
their tokens), so the gradient is the same for any world size and micro-batch split, as the SFT token mean is.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from finetune import distributed, parallel
from finetune.data import IGNORE_INDEX, Example, eval_batches, set_reference_logps
from finetune.errors import CheckpointError
from finetune.recipe import PreferenceSection, Recipe
from finetune.recipe.router_aux import text_config
from finetune.training.loss import sequence_logps
from finetune.training.objectives.base import Objective
from finetune.training.router_aux import RouterAux

WITH_REFERENCE = ("sigmoid", "ipo", "hinge")
# TRL's names (DPOTrainer; ORPOTrainer adds nll_loss, log_odds_ratio, log_odds_chosen). Means over the pairs, but
# nll_loss: over the chosen responses' tokens.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def metric_names(config: PreferenceSection) -> tuple[str, ...]:
    """The per-step metrics of this dpo.loss, in the order `micro_batch_terms` sums them."""
    return METRICS + ORPO_METRICS if config.loss == "orpo" else METRICS
REFERENCE_FILE = "reference_logps.json"


# ----------------------------------------------------------------------------------------------------- the losses
def pair_losses(policy: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor] | None,
                config: PreferenceSection) -> torch.Tensor:
    """Per pair: the loss from the (chosen, rejected) scores of policy and reference.

    Scores are sequence log-probabilities, already length-normalized where the loss asks for it. Formulas as TRL
    (DPOTrainer for sigmoid / ipo / hinge, ORPOTrainer for orpo, CPOTrainer's simpo; label smoothing of sigmoid as
    CPOTrainer's, conservative DPO): tests/training/test_preference_oracle.py runs TRL's code as the oracle.
    """
    chosen, rejected = policy
    beta, smoothing = config.beta, config.label_smoothing
    if config.loss in WITH_REFERENCE:
        ref_chosen, ref_rejected = reference
        logits = (chosen - rejected) - (ref_chosen - ref_rejected)
        if config.loss == "sigmoid":
            losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        elif config.loss == "ipo":
            losses = (logits - 1 / (2 * beta)) ** 2
        else:
            losses = torch.relu(1 - beta * logits)
        return losses
    if config.loss == "simpo":
        logits = (chosen - rejected) - config.simpo_gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
    else:  # orpo: the odds-ratio term (weight beta = ORPO's lambda); the NLL term is added by the caller
        losses = -beta * F.logsigmoid(orpo_log_odds(chosen, rejected))
    return losses


def orpo_log_odds(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio of the chosen over the rejected response, from their mean log-probs."""
    return (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) of a mean log-prob x <= 0, accurate in fp32 near 0 as TRL's ORPO computes it (expm1 above -ln 2,
    log1p below). log1p(-exp(x)) alone lost 1% of the odds-ratio loss at x = -1e-6, a response the policy is near
    certain of. x = 0 is held at -1e-7 (log 0 is -inf); each branch sees only its own side (no nan gradient)."""
    half = -0.6931471805599453
    x = torch.clamp(x, max=-1e-7)
    return torch.where(x < half, torch.log1p(-torch.exp(torch.clamp(x, max=half))),
                       torch.log(-torch.expm1(torch.clamp(x, min=half))))


def _split(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = values.size(0) // 2
    return values[:half], values[half:]


def micro_batch_terms(model: nn.Module, batch: dict[str, torch.Tensor], config: PreferenceSection, reference: Reference,
                      device: torch.device, *, router_aux: RouterAux | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of pair losses, sum of chosen-token NLL, per-metric sums (`metric_names`), [pairs, chosen tokens]) of one
    micro-batch.

    Filler pairs (eval batches topped up for equal shares) have no scored token and count for nothing. logps/* are the
    scores the rewards come from: sums for the losses with a reference (TRL's DPOTrainer), the length-normalized
    scores for orpo and simpo (TRL's ORPOTrainer and CPOTrainer). `router_aux`: the policy's forward (of the chosen
    and rejected sequences together, as TRL's) also gives a mixture-of-experts model's load-balancing loss to it.
    """
    logps, counts = sequence_logps(model, batch, device, router_aux=router_aux)
    valid = (counts[: counts.size(0) // 2] > 0) & (counts[counts.size(0) // 2 :] > 0)
    ref_logps = reference.logps(model, batch, device) if config.loss in WITH_REFERENCE else None
    scale = counts.clamp(min=1).to(logps.dtype) if config.normalized() else torch.ones_like(logps)
    policy = _split(logps / scale)
    ref = _split(ref_logps.to(logps.device, logps.dtype) / scale) if ref_logps is not None else None
    losses = pair_losses(policy, ref, config)
    weight = valid.to(losses.dtype)
    # Logged as TRL logs them: DPOTrainer's rewards (beta x log-ratio) and logps from the summed log-probs, whatever
    # its loss normalizes (ipo and sigmoid_norm divide inside the loss only); ORPOTrainer's and CPOTrainer's from the
    # scores their loss uses (mean log-probs for orpo and simpo).
    if config.loss in WITH_REFERENCE:
        chosen_logps, rejected_logps = (part.detach() for part in _split(logps))
        ref_chosen, ref_rejected = _split(ref_logps.to(logps.device, logps.dtype))
        chosen_rewards, rejected_rewards = (config.beta * (chosen_logps - ref_chosen),
                                            config.beta * (rejected_logps - ref_rejected))
    else:
        chosen_logps, rejected_logps = (part.detach() for part in policy)
        chosen_rewards, rejected_rewards = config.beta * chosen_logps, config.beta * rejected_logps
    nll = -(_split(logps)[0] * weight).sum()
    chosen_tokens = (counts[: counts.size(0) // 2] * valid).sum()
    sums = [(chosen_rewards * weight).sum(), (rejected_rewards * weight).sum(),
            ((chosen_rewards - rejected_rewards) * weight).sum(),
            ((chosen_rewards > rejected_rewards).to(weight.dtype) * weight).sum(),
            (chosen_logps * weight).sum(), (rejected_logps * weight).sum()]
    if config.loss == "orpo":  # as TRL: log_odds_ratio is the mean of log sigmoid(log odds), before beta
        log_odds = orpo_log_odds(*policy).detach()
        sums += [nll.detach(), (F.logsigmoid(log_odds) * weight).sum(), (log_odds * weight).sum()]
    metrics = torch.stack(sums).double()
    return (losses * weight).sum(), nll, metrics, torch.stack([weight.sum().double(), chosen_tokens.double()])


def combine(loss_sum: torch.Tensor, nll_sum: torch.Tensor, totals: list[float], config: PreferenceSection) -> torch.Tensor:
    """This micro-batch's share of the step loss: pair losses over the global pairs (+ ORPO's NLL over the global
    chosen tokens)."""
    share = loss_sum / max(totals[0], 1)
    if config.loss == "orpo":
        share = share + nll_sum / max(totals[1], 1)
    return share


def metric_means(sums: list[float], counts: list[float], config: PreferenceSection, prefix: str = "") -> dict[str, float]:
    """Each metric's sum over the global batch divided by its pairs (`counts[0]`); nll_loss by the chosen tokens."""
    pairs, tokens = counts[0], counts[1]
    return {f"{prefix}{name}": round(value / max(tokens if name == "nll_loss" else pairs, 1), 6)
            for name, value in zip(metric_names(config), sums)}


# --------------------------------------------------------------------------------------------------- reference
class Reference:
    """Where the reference log-probs come from (module docstring): adapter off, the starting adapter swapped in, or
    the values precomputed into the examples (the batch's `reference_logps`)."""

    def __init__(self, model: nn.Module, recipe: Recipe, *, compared: bool | None = None):
        self.mode = recipe.dpo.reference
        # The starting LoRA values, when they are not zero (an SFT adapter) and a loss compares with them (`compared`:
        # default, dpo.loss is one with a reference; KTO's always is): this rank's own storage of each.
        compared = recipe.dpo.loss in WITH_REFERENCE if compared is None else compared
        self.start = None
        if (recipe.model.adapter or moves_the_base(recipe)) and compared:
            parallel.reshard(model)
            self.start = [_local(p).detach().clone() for p in _trained(model)]

    def logps(self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if self.mode == "precomputed":
            raise RuntimeError("dpo.reference is precomputed but the batch carries no reference_logps")
        with torch.no_grad(), self.active(model):
            return sequence_logps(model, batch, device)[0]

    @contextlib.contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        """The model as the reference, for the duration of the block (no-grad use only)."""
        if self.start is None:
            with adapters_off(model):
                yield
            return
        # Shard-grad-op keeps FSDP units gathered between forwards: back to the shards before writing into them, and
        # again after the reference forward, so that the policy's forward gathers the trained values, not these.
        parallel.reshard(model)
        trained = [_local(p) for p in _trained(model)]
        current = [t.detach().clone() for t in trained]
        with torch.no_grad():
            for tensor, start in zip(trained, self.start):
                tensor.copy_(start)
        try:
            yield
        finally:
            parallel.reshard(model)
            with torch.no_grad():
                for tensor, value in zip(trained, current):
                    tensor.copy_(value)


def moves_the_base(recipe: Recipe) -> bool:
    """Whether training changes values that PEFT's adapter switch leaves on: the biases (lora.bias: all | lora_only
    trains the base's own) and the routers trained in full (lora.train_router: a copy beside the frozen one, which the
    switch does not flip). Then the reference is the starting values swapped in, as for model.adapter."""
    lora = getattr(recipe, "lora", None)
    return lora is not None and (lora.bias != "none" or bool(lora.train_router))


def _trained(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for a parameter: a ZeRO-3 partition, an FSDP2 DTensor's shard, else the data
    (DDP's replica, an FSDP1 flat parameter's shard between forwards)."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.data
    if hasattr(param, "to_local"):
        return param.to_local()
    return param.data


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer only (PEFT's own switch, flipped without touching requires_grad)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, value in zip(layers, before):
            layer._disable_adapters = value


def disable_dropout(model: nn.Module) -> int:
    """Dropout off everywhere (dpo.disable_dropout, as TRL): the policy then scores as the reference does at step 1."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, count = 0.0, count + 1
    return count


# ------------------------------------------------------------------------------------------ precomputed reference
def precompute(model: nn.Module, reference: Reference, examples: list[Example], *, micro_batch_size: int,
               pad_id: int) -> list[tuple[float, float]]:
    """The reference (chosen, rejected) log-probs of every pair: each rank scores its share, all ranks get all."""
    info = distributed.info()
    values = [0.0] * (2 * len(examples))
    was_training = model.training
    model.eval()
    position = info.rank
    with torch.no_grad(), reference.active(model):
        for batch in eval_batches(examples, micro_batch_size=micro_batch_size, rank=info.rank,
                                  world_size=info.world_size, pad_id=pad_id):
            logps = sequence_logps(model, batch, info.device)[0].double().cpu().tolist()
            for chosen, rejected in zip(*_split(torch.tensor(logps))):
                if position < len(examples):
                    values[2 * position], values[2 * position + 1] = float(chosen), float(rejected)
                position += info.world_size
    model.train(was_training)
    summed = distributed.all_reduce_sum(values) if values else []
    return [(summed[2 * i], summed[2 * i + 1]) for i in range(len(examples))]


def attach_reference(model: nn.Module, reference: Reference, splits: dict[str, list[Example]], recipe: Recipe, *,
                     pad_id: int, out_dir: Path, resume_from: Path | None) -> None:
    """dpo.reference precomputed: fill every example's reference_logps, computed now (fresh run: the weights are the
    starting ones) or read from the run folder a resume continues (its weights are no longer the reference). The file
    is keyed by each split's pairs, their tokens and labels hashed (data.rows_fingerprint): a count and a total length
    alone let a resume onto pairs with chosen and rejected swapped take the old values (bb63: loss 9.72 for 0.727). A
    resume into another output.dir copies the file there, so that run can be resumed in its turn."""
    if recipe.dpo.reference != "precomputed" or recipe.dpo.loss not in WITH_REFERENCE:
        return
    from finetune.data import rows_fingerprint
    from finetune.files import _write_text_atomic

    fingerprint = {name: [len(examples), sum(len(e.input_ids) + len(e.rejected.input_ids) for e in examples),
                          rows_fingerprint(examples)] for name, examples in splits.items()}
    if resume_from is not None:
        stored, found = _read_stored(resume_from, fingerprint)
        write = found.resolve() != (out_dir / REFERENCE_FILE).resolve()
    else:
        stored = {name: precompute(model, reference, examples, micro_batch_size=recipe.train.micro_batch_size,
                                   pad_id=pad_id) for name, examples in splits.items()}
        write = True
    if write and distributed.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_text_atomic(out_dir / REFERENCE_FILE, json.dumps({**stored, "fingerprint": fingerprint}))
    for name, examples in splits.items():
        set_reference_logps(examples, stored[name])
    distributed.print0(f"[finetune] reference log-probs: {sum(len(v) for v in splits.values())} pairs "
                       f"({'read from the run folder' if resume_from is not None else 'precomputed'})")


def _same_pairs(stored: object, fingerprint: dict) -> bool:
    """Whether a stored fingerprint is these splits': counts, lengths, and the tokens' hash where it holds one (a file
    written before the hash was kept: its counts and lengths)."""
    return isinstance(stored, dict) and stored.keys() == fingerprint.keys() and all(
        isinstance(stored[name], list) and stored[name][:2] == value[:2] and stored[name][2:] in ([], value[2:])
        for name, value in fingerprint.items())


def _unkeyed_and_changed(stored: dict, fingerprint: dict, resume_from: Path) -> bool:
    """Whether a file of an earlier finetune (keyed by counts and lengths alone, before bb63) belongs to other training
    pairs than these, by the checkpoint's own hash of its training rows (trainer_state.json `data.fingerprint`,
    data.rows_fingerprint as this run's): chosen and rejected swapped keep the counts (bug bash bb70: the old values
    taken in silence, every reference margin of the wrong sign). A checkpoint without that hash cannot tell: noted."""
    if stored.get("train", [None])[2:] or "train" not in fingerprint:
        return False  # keyed by the tokens: _same_pairs compared them
    try:
        saved = (json.loads((resume_from / "trainer_state.json").read_text(encoding="utf-8")).get("data") or {}).get(
            "fingerprint")
    except (OSError, ValueError):
        saved = None
    if saved is None:
        distributed.print0(f"[finetune] note: {REFERENCE_FILE} was written by an earlier finetune, keyed by the pairs' "
                           "counts alone, and this checkpoint holds no hash of its rows: its reference log-probs are "
                           "used as stored. If the pairs changed since (chosen and rejected swapped keep the counts), "
                           "they are another run's: start a new run instead.")
        return False
    return saved != fingerprint["train"][2]


def _read_stored(resume_from: Path, fingerprint: dict) -> tuple[dict, Path]:
    changed = "the pairs changed"
    for folder in (resume_from, *resume_from.parents[:3]):
        path = folder / REFERENCE_FILE
        if path.is_file():
            stored = json.loads(path.read_text(encoding="utf-8"))
            if not _same_pairs(stored.get("fingerprint"), fingerprint):
                saved = stored.get("fingerprint") if isinstance(stored.get("fingerprint"), dict) else {}
                splits = [name for name in sorted({*saved, *fingerprint})  # bb69 #6: say which split's pairs
                          if not _same_pairs({name: saved.get(name)}, {name: fingerprint.get(name, [])})]
                changed = f"the {' and '.join(splits)} pairs changed" if splits else changed
                break
            if _unkeyed_and_changed(stored["fingerprint"], fingerprint, resume_from):
                changed = "the train pairs changed since the checkpoint, as its trainer_state.json's hash of them says"
                break
            return stored, path
    raise CheckpointError(
        f"resume from {resume_from}: dpo.reference is precomputed, but no {REFERENCE_FILE} for these pairs is in its run "
        f"folder ({changed}: other rows, or the same rows tokenized otherwise; or the run was started with "
        "adapter_off). The reference cannot be recomputed from trained weights. Fix: resume with the data and dpo "
        "settings of the saving run, or start a new run.")


# ------------------------------------------------------------------------------------------- the objective
class Preference(Objective):
    """Mean over the pairs of the global batch of the dpo.loss (ORPO: plus the chosen responses' token-mean NLL)."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        super().__init__(model, recipe)
        self.config = recipe.dpo
        if recipe.dpo.disable_dropout:
            disable_dropout(model)
        self.reference = Reference(model, recipe)  # before a resume loads newer LoRA values

    def router_aux_by_default(self, model_config) -> bool:
        """TRL 1.16's DPOTrainer adds the load-balancing loss by default; its ORPOTrainer and CPOTrainer (orpo, simpo)
        only when the model config's output_router_logits is true (false in the hub's configs)."""
        return self.recipe.dpo.loss not in ("orpo", "simpo") or bool(getattr(text_config(model_config),
                                                                             "output_router_logits", False))

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, *, pad_id: int,
                out_dir, resume_from) -> None:
        """dpo.reference precomputed: every pair's reference log-probs, computed now or read back on resume."""
        attach_reference(model, self.reference, {"train": train, "eval": evaluation}, recipe, pad_id=pad_id,
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
        loss_sum, nll_sum, metric_sums, _ = micro_batch_terms(model, batch, self.config, self.reference, device,
                                                              router_aux=self.router_aux)
        share = combine(loss_sum, nll_sum, totals, self.config)
        return share * distributed.info().world_size, share.detach(), metric_sums

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        return metric_means(sums, totals, self.config) if sums is not None else {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """eval_loss (mean over the held-out pairs) and eval_rewards/... , identical for any world size."""
        info = distributed.info()
        sums = torch.zeros(len(metric_names(self.config)) + 4, dtype=torch.float64)
        for batch in eval_batches(examples, micro_batch_size=recipe.train.micro_batch_size, rank=info.rank,
                                  world_size=info.world_size, pad_id=pad_id):
            loss_sum, nll_sum, metric_sums, counts = micro_batch_terms(model, batch, self.config,
                                                                       self.reference, info.device)
            sums += torch.cat([torch.stack([loss_sum.double(), nll_sum.double()]), metric_sums, counts]).cpu()
        total = distributed.all_reduce_sum(sums.tolist())
        loss_sum, nll_sum, metric_sums, (pairs, tokens) = total[0], total[1], total[2:-2], total[-2:]
        loss = loss_sum / max(pairs, 1) + (nll_sum / max(tokens, 1) if self.config.loss == "orpo" else 0.0)
        return {"eval_loss": loss, **metric_means(metric_sums, [pairs, tokens], self.config, prefix="eval_")}
