"""FSDP1 (`FullyShardedDataParallel` with the transformer auto-wrap policy): flat parameters, each LoRA leaf a unit
of its own (parallel/wrapping.py), so state dicts ask those units alone and never gather a decoder layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from finetune.parallel.engines.base import Engine, GreedyThroughRoot, normalize_key


class FSDP1Engine(Engine):

    def owns(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return isinstance(model, FSDP)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def gradient_sync(self, model: nn.Module, *, enabled: bool):
        return contextlib.nullcontext() if enabled else model.no_sync()

    def clip_grad_norm(self, model: nn.Module, parameters: list[nn.Parameter], max_norm: float | None) -> float:
        return float(model.clip_grad_norm_(max_norm if max_norm is not None else float("inf")))

    def reshard(self, model: nn.Module) -> None:
        """Units left gathered by a no-grad forward under SHARD_GRAD_OP back to their shard."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._runtime_utils import _reshard

        for module in FSDP.fsdp_modules(model):
            handle = module._handle
            if handle is not None and handle.uses_sharded_strategy and _gathered(handle.flat_param):
                _reshard(module, handle, True)

    @contextlib.contextmanager
    def generation_model(self, model: nn.Module) -> Iterator[nn.Module]:
        """Greedy full forwards through the root: FSDP1 refuses a forward inside summon_full_params."""
        yield GreedyThroughRoot(model)

    @contextlib.contextmanager
    def decoding_model(self, model: nn.Module, *, gather: str) -> Iterator[tuple[nn.Module, bool]]:
        yield model, True  # per forward (its own hooks), whatever `gather` asks

    def trainable_state_dict(self, model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
        """Each LoRA leaf's unit gathered alone, never a decoder layer's.

        `get_model_state_dict(full_state_dict=True)` unshards and clones every parameter of every unit on every rank
        before frozen ones are dropped: the whole base on each GPU after training, in exactly the runs that needed
        sharding. Summoning the LoRA units one at a time (recurse=False) holds at most the LoRA tensors plus one leaf's
        flat parameter. Every rank visits the same units in the same order.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        result: dict[str, torch.Tensor] = {}
        for unit_name, unit in _lora_units(model):
            with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                for param_name, param in unit.module.named_parameters():
                    key = normalize_key(f"{unit_name}.{param_name}" if unit_name else param_name)
                    if key in names:
                        result[key] = param.detach().to("cpu").clone()
        missing = names - set(result)
        if missing:
            raise RuntimeError(f"FSDP1 gather found {len(result)} of {len(names)} trainable tensors (e.g. missing "
                               f"{min(missing)}): a trainable parameter outside a LoRA leaf unit")
        return result

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, options) -> tuple[dict, dict]:
        """This rank's shards (ShardedTensor) of the LoRA tensors, from the LoRA units alone.

        The model's own sharded state dict unshards every unit, decoder layers included, and chunks a copy of every
        parameter before frozen ones are dropped: the rank's whole base shard copied on the GPU (brought back from the
        CPU under offload) at every save. Every rank visits the same units in the same order.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        state: dict[str, object] = {}
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            for unit_name, unit in _lora_units(model):
                for key, value in unit.state_dict(prefix=f"{unit_name}.").items():
                    state[normalize_key(key)] = value
        return state, get_optimizer_state_dict(model, optimizer, options=options)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, options) -> None:
        """The LoRA leaf units loaded alone: the model's own sharded load unshards every unit with write-back."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            for unit_name, unit in _lora_units(model):
                prefix = normalize_key(f"{unit_name}.")
                own = {key[len(prefix):]: value for key, value in state["model"].items()
                       if key.startswith(prefix) and "." not in key[len(prefix):]}
                missing = [f"{prefix}{name}" for name in unit._flat_param._fqns if name not in own]
                if missing:
                    raise KeyError(f"the checkpoint has no {missing[0]}")
                unit.load_state_dict(own, strict=False)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"], options=options)


def _lora_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Units whose own flat parameter is trainable (the LoRA leaves), with their names; the same order on every
    rank. The root is initialized first (as its first forward would): a unit asked alone before that would take
    itself for the root (a resume loads before the first step)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(model, model)
    units = []
    for unit_name, unit in model.named_modules():
        flat = getattr(unit, "_flat_param", None) if isinstance(unit, FSDP) else None  # this unit's own parameters
        if flat is not None and flat.requires_grad:
            units.append((unit_name, unit))
    return units


def _gathered(flat_param) -> bool:
    """A flat parameter whose gathered copy is allocated: after a no-grad forward under SHARD_GRAD_OP it is, while the
    parameter already shows its shard, and the next forward would use it without gathering again."""
    padded = getattr(flat_param, "_full_param_padded", None)
    return hasattr(flat_param, "_local_shard") and padded is not None and padded.untyped_storage().size() > 0
