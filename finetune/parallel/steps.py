"""One training step through the wrappers: gradient sync per micro-batch, backward, clip + optimizer step, and
generation (evals) through FSDP and ZeRO-3, where every forward is a collective."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from finetune.parallel import zero
from finetune.parallel.wrapping import unwrap


def gradient_sync(model: nn.Module, *, enabled: bool):
    """Context for one micro-batch: skip the gradient all-reduce / reduce-scatter until the last of the step.

    DeepSpeed ZeRO-2/3 reduce-scatter at every micro-batch (they have no no_sync); they are told where the step ends.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if zero.is_engine(model):
        zero.set_boundary(model, last=enabled)
        return contextlib.nullcontext()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, (nn.parallel.DistributedDataParallel, FSDP)) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


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
    for param in model.parameters():
        status = getattr(param, "ds_status", None)
        if param.requires_grad and status is not None and status.name == "AVAILABLE":
            param.partition(has_been_updated=False)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in model.modules():
        if isinstance(unit, FSDPModule) and any(p.requires_grad for p in _own_parameters(unit, FSDPModule)):
            unit.reshard()
    for module in FSDP.fsdp_modules(model):
        handle = module._handle
        if handle is not None and handle.uses_sharded_strategy and _fsdp1_gathered(handle.flat_param):
            from torch.distributed.fsdp._runtime_utils import _reshard

            _reshard(module, handle, True)


def _own_parameters(unit: nn.Module, unit_class: type) -> Iterator[nn.Parameter]:
    """The parameters a wrapped unit manages: its subtree's, less those of the units nested in it."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield from module.parameters(recurse=False)
        stack.extend(child for child in module.children() if not isinstance(child, unit_class))


def _fsdp1_gathered(flat_param) -> bool:
    """An FSDP1 flat parameter whose gathered copy is allocated: after a no-grad forward under SHARD_GRAD_OP it is,
    while the parameter already shows its shard, and the next forward would use it without gathering again."""
    padded = getattr(flat_param, "_full_param_padded", None)
    return hasattr(flat_param, "_local_shard") and padded is not None and padded.untyped_storage().size() > 0


@contextlib.contextmanager
def generation_model(model: nn.Module):
    """The module to call `.generate()` on, for every rank together (FSDP forwards are collectives).

    DDP: the inner module (no collectives in a forward). FSDP2: generate() calls inner modules, so the root's
    unshard hooks must wrap `generate` too (register_fsdp_forward_method). FSDP1: the full parameters are gathered
    for the duration (summon_full_params): a full 4-bit copy per rank, as in loading.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, "generate")
        yield model
    elif isinstance(model, FSDP):
        yield _GreedyThroughRoot(model)
    elif zero.is_engine(model) and model.zero_optimization_stage() == 3:
        yield _GreedyThroughRoot(zero.generation_module(model))  # forwards gather: same count on every rank
    else:
        yield unwrap(model)


class _GreedyThroughRoot(nn.Module):
    """`generate(input_ids, attention_mask, max_new_tokens, ...)` as plain greedy decoding by full forwards of the
    root module (no KV cache: fine for the short answers of an eval). Every rank runs every step, so the FSDP
    collectives line up whatever each rank's rows are."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.root = root  # a child module: .eval()/.train()/.parameters() reach the real model

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 eos_token_id: int | None = None, pad_token_id: int | None = None, **_ignored) -> torch.Tensor:
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
            logits = self.root(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               use_cache=False).logits
            token = logits[:, -1].argmax(-1)
            if eos_token_id is not None:
                token = torch.where(finished, torch.full_like(token, pad_token_id or eos_token_id), token)
                finished |= token == eos_token_id
            input_ids = torch.cat([input_ids, token[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, (~finished | (token == eos_token_id))[:, None].long()], dim=1)
        return input_ids


def backward(model: nn.Module, loss: torch.Tensor) -> None:
    """Backpropagate one micro-batch's (already normalized) loss."""
    if zero.is_engine(model):
        zero.backward(model, loss)
    else:
        loss.backward()


def engine_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    """The torch optimizer an engine was built with (DeepSpeed), so the scheduler can drive its learning rate."""
    return zero.torch_optimizer(model) if zero.is_engine(model) else None


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                   max_norm: float | None, *, allowed: bool) -> tuple[float, bool]:
    """Clip, step and zero the gradients, unless the loss (`allowed`) or the gradient norm is not finite.

    Returns (gradient norm before clipping, whether the parameters were updated). Under DeepSpeed the engine clips and
    steps, and skips the update itself when the norm is NaN/inf.
    """
    if zero.is_engine(model):
        return zero.optimizer_step(model)
    norm = clip_grad_norm(model, parameters, max_norm)
    stepped = allowed and math.isfinite(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def clip_grad_norm(model: nn.Module, parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip by the global norm over all ranks' shards; returns the norm before clipping."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    limit = max_norm if max_norm is not None else float("inf")
    if isinstance(model, FSDP):
        norm = model.clip_grad_norm_(limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, limit)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    return float(norm)
