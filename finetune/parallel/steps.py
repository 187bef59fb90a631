"""One training step through the wrappers: gradient sync per micro-batch, backward, clip + optimizer step, and
generation (evals) through FSDP and ZeRO-3, where every forward is a collective. Each asks the model's engine
(parallel/engines/), where what differs per strategy lives."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from finetune.parallel.engines import engine_of


def gradient_sync(model: nn.Module, *, enabled: bool):
    """Context for one micro-batch: skip the gradient all-reduce / reduce-scatter until the last of the step.

    DeepSpeed ZeRO-2/3 reduce-scatter at every micro-batch (they have no no_sync); they are told where the step ends.
    """
    return engine_of(model).gradient_sync(model, enabled=enabled)


def reshard(model: nn.Module) -> None:
    """Every FSDP unit back to its shard: the parameters are each rank's stored shard again, and the next forward
    gathers what the shards hold then.

    Shard-grad-op (FSDP2 reshard_after_forward false, FSDP1 SHARD_GRAD_OP) keeps a unit gathered after a forward
    until its backward, and after a no-grad forward (the DPO reference pass, an eval) until the next forward, which
    then reuses the gathered values. A caller that writes into the shards between forwards (the reference swap,
    training/preference.py) calls this first, to reach the shards, and after the forward, so the next one gathers the
    values written back. Only units that hold a trained parameter: FSDP2's root unit (embeddings, head) stays gathered
    after its forward even under full shard, and gathering it again costs an all-gather of the embeddings.

    ZeRO-3 likewise keeps a no-grad forward's parameters whole until they are next needed: trained parameters found
    gathered are freed back to their partitions without writing them back (`partition(has_been_updated=False)`).
    Without it KTO's no-grad forwards before a step (the KL rows, then their reference with the starting values
    swapped in) left the starting values gathered, and every later forward of the step used them: rewards 0, loss 0.5
    on deepspeed_zero3.yaml, and the ZeRO-3 DPO curve 4.1e-3 from single-process instead of 3.8e-4. DDP and single
    process: nothing to do.
    """
    engine_of(model).reshard(model)


@contextlib.contextmanager
def generation_model(model: nn.Module):
    """The module to call `.generate()` on, for every rank together (FSDP forwards are collectives).

    DDP: the inner module (no collectives in a forward). FSDP2: generate() calls inner modules, so the root's
    unshard hooks must wrap `generate` too (register_fsdp_forward_method). FSDP1 and ZeRO-3: greedy decoding by full
    forwards of the root, the same number on every rank.
    """
    with engine_of(model).generation_model(model) as module:
        yield module


def backward(model: nn.Module, loss: torch.Tensor) -> None:
    """Backpropagate one micro-batch's (already normalized) loss."""
    engine_of(model).backward(model, loss)


def engine_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    """The torch optimizer an engine was built with (DeepSpeed), so the scheduler can drive its learning rate."""
    return engine_of(model).torch_optimizer(model)


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                   max_norm: float | None, *, allowed: bool) -> tuple[float, bool]:
    """Clip, step and zero the gradients, unless the loss (`allowed`) or the gradient norm is not finite.

    Returns (gradient norm before clipping, whether the parameters were updated). Under DeepSpeed the engine clips and
    steps, and skips the update itself when the norm is NaN/inf.
    """
    return engine_of(model).optimizer_step(model, optimizer, parameters, max_norm, allowed=allowed)


def clip_grad_norm(model: nn.Module, parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip by the global norm over all ranks' shards; returns the norm before clipping."""
    return engine_of(model).clip_grad_norm(model, parameters, max_norm)
