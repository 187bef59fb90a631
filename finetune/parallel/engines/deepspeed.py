"""DeepSpeed ZeRO-2/3 (parallel/zero.py builds the engine): the engine runs backward, clips, steps and checkpoints in
its own format; ZeRO-3 partitions parameters and gathers them per module in every forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from finetune.parallel import zero
from finetune.parallel.engines.base import Engine, GreedyThroughRoot


class ZeroEngine(Engine):
    own_checkpoint_format = True

    def owns(self, model: nn.Module) -> bool:
        return zero.is_engine(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def gradient_sync(self, model: nn.Module, *, enabled: bool):
        """ZeRO-2/3 reduce-scatter at every micro-batch (they have no no_sync): they are told where the step ends."""
        zero.set_boundary(model, last=enabled)
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        zero.backward(model, loss)

    def torch_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        return zero.torch_optimizer(model)

    def optimizer_step(self, model, optimizer, parameters, max_norm, *, allowed: bool) -> tuple[float, bool]:
        """The engine clips and steps, and skips the update itself when the norm is NaN/inf."""
        return zero.optimizer_step(model)

    def reshard(self, model: nn.Module) -> None:
        """Trained parameters left gathered by a no-grad forward are freed back to their partitions, not written back."""
        for param in model.parameters():
            status = getattr(param, "ds_status", None)
            if param.requires_grad and status is not None and status.name == "AVAILABLE":
                param.partition(has_been_updated=False)

    @contextlib.contextmanager
    def generation_model(self, model: nn.Module) -> Iterator[nn.Module]:
        if model.zero_optimization_stage() == 3:
            yield GreedyThroughRoot(zero.generation_module(model))  # forwards gather: same count on every rank
        else:
            yield zero.generation_module(model)

    @contextlib.contextmanager
    def decoding_model(self, model: nn.Module, *, gather: str) -> Iterator[tuple[nn.Module, bool]]:
        """ZeRO-3 `gather="once"`: every parameter gathered once for the call (TRL's ds3_gather_for_generation);
        `per_forward`: DeepSpeed's own hooks gather each module as it runs. ZeRO-2 keeps whole parameters."""
        stage3 = model.zero_optimization_stage() == 3
        if stage3 and gather == "once":
            with _gathered(model):
                yield zero.generation_module(model), False
        else:
            yield zero.generation_module(model), stage3

    def trainable_state_dict(self, model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
        return zero.trainable_state_dict(model, names)

    def checkpoint_state(self, model, optimizer, options) -> tuple[dict, dict]:
        raise TypeError("DeepSpeed checkpoints are written in its own format (parallel/zero_checkpoint.py), not by DCP")

    def load_checkpoint_state(self, model, optimizer, state, options) -> None:
        raise TypeError("DeepSpeed checkpoints are read in its own format (parallel/zero_checkpoint.py), not by DCP")

    def local_parameter_bytes(self, model: nn.Module) -> dict[str, int]:
        return zero.local_parameter_bytes(model)


@contextlib.contextmanager
def _gathered(engine) -> Iterator[None]:
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
