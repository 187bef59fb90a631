"""The model that samples GRPO's completions, for every rank together: how each strategy's parameters are whole
during a generate call (docs/grpo.md, Generation under each strategy).

  * single process, DDP: the inner model; no collective in a forward.
  * FSDP2 (`gather="once"`, the default): every unit is unsharded once for the whole call and resharded after, so a
    call of T decoding steps costs one all-gather of the model instead of T (the units are told not to reshard after
    their forwards for the duration). `gather="per_forward"`: FSDP2's own hooks all-gather every unit at every
    forward, as in training (one full model is never whole at once).
  * FSDP1: per forward (its own hooks). summon_full_params would hold the whole model, but FSDP1 refuses a forward
    inside it.
  * ZeRO-3 (`gather="once"`): every parameter gathered once for the call with DeepSpeed's module hooks taken off,
    then the hooks put back and the parameters partitioned again, as TRL's `unwrap_model_for_generation`
    (`ds3_gather_for_generation`) does; `gather="per_forward"`: DeepSpeed's own hooks gather each module's parameters
    as it runs, at every decoding step. ZeRO-2 keeps whole parameters: the inner model, as DDP.
Sharded strategies run every decoding step on every rank until every rank's rows are done (each forward is a
collective); `sharded` says whether the caller must keep the ranks in step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from torch import nn

from finetune.parallel import zero
from finetune.parallel.wrapping import unwrap

Gather = Literal["once", "per_forward"]


@contextlib.contextmanager
def decoding_model(model: nn.Module, *, gather: Gather = "once") -> Iterator[tuple[nn.Module, bool]]:
    """(the module to call forward on with a KV cache, whether its forwards are collectives) for the block."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDPModule):
        if gather == "per_forward":
            yield model, True
            return
        with _fsdp2_unsharded(model):
            yield model, True
    elif isinstance(model, FSDP):
        yield model, True
    elif zero.is_engine(model):
        stage3 = model.zero_optimization_stage() == 3
        if stage3 and gather == "once":
            with _zero3_gathered(model):
                yield zero.generation_module(model), False
        else:
            yield zero.generation_module(model), stage3
    else:
        yield unwrap(model), False


@contextlib.contextmanager
def _fsdp2_unsharded(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit gathered once and kept whole through the block's forwards, then back to its shard with its
    own reshard_after_forward setting."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for unit in units:  # FSDP2 keeps no public getter of reshard_after_forward: save its state to restore it exactly
        state = unit._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                       [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def _zero3_gathered(engine) -> Iterator[None]:
    """Every ZeRO-3 parameter gathered for the block and DeepSpeed's per-module gather hooks removed (they would gather
    and release each module again at every forward), then the hooks registered again and the parameters partitioned
    on leaving GatheredParameters (nothing written back: generation changes no parameter). TRL's remove_hooks /
    add_hooks, on the DeepSpeed versions finetune supports (0.19)."""
    import deepspeed

    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None) or optimizer
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p for m in offload.module.modules() for _, p in m.named_parameters(recurse=False)]
        params += [p for m in offload.module.modules() if hasattr(m, "ds_external_parameters")
                   for _, p in m.ds_external_parameters()]
        for param in params:
            if hasattr(param, "ds_active_sub_modules"):
                param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = offload.get_param_coordinator() if hasattr(offload, "get_param_coordinator") else None
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # the recorded module order would be stale after the hooks' return
            offload._register_deepspeed_module(offload.module)
