"""FSDP2 (`fully_shard` per decoder layer, HSDP on a 2-D mesh): the model is wrapped in place, its parameters are
DTensors, and each unit gathers and reshards itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from finetune.parallel.engines.base import Engine, own_parameters


class FSDP2Engine(Engine):

    def owns(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule)

    def gradient_sync(self, model: nn.Module, *, enabled: bool):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def reshard(self, model: nn.Module) -> None:
        """Units that hold a trained parameter only: the root unit (embeddings, head) stays gathered after its forward
        even under full shard, and gathering it again costs an all-gather of the embeddings."""
        from torch.distributed.fsdp import FSDPModule

        for unit in model.modules():
            if isinstance(unit, FSDPModule) and any(p.requires_grad for p in own_parameters(unit, FSDPModule)):
                unit.reshard()

    @contextlib.contextmanager
    def generation_model(self, model: nn.Module) -> Iterator[nn.Module]:
        """generate() calls inner modules, so the root's unshard hooks must wrap `generate` too."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
        yield model

    @contextlib.contextmanager
    def decoding_model(self, model: nn.Module, *, gather: str) -> Iterator[tuple[nn.Module, bool]]:
        if gather == "per_forward":  # FSDP2's own hooks all-gather every unit at every forward, as in training
            yield model, True
            return
        with _unsharded(model):
            yield model, True


@contextlib.contextmanager
def _unsharded(model: nn.Module) -> Iterator[None]:
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
