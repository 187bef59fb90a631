"""State dicts through the wrappers: the full trainable tensors (a collective under FSDP), wrapper-free key names,
and the parameter bytes a rank holds."""

from __future__ import annotations

import torch
from torch import nn

from finetune.parallel import zero

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def normalize_key(key: str) -> str:
    """Strip every wrapper component: FSDP1 nests `_fsdp_wrapped_module.` at each unit, activation checkpointing and
    torch.compile add theirs, DDP prefixes `module.`."""
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key.removeprefix("module.")


def trainable_state_dict(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the trainable parameters `names` (model names, wrappers stripped), on every rank.

    A collective under FSDP: every rank must call it. `ignore_frozen_params` is a hint only (a single-process
    model still returns its frozen weights), hence the explicit `names`.
    """
    names = set(names)
    if zero.is_engine(model):
        return zero.trainable_state_dict(model, names)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return _fsdp1_trainable_state_dict(model, names)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    result = {}
    for key, value in state.items():
        if normalize_key(key) not in names:
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        result[normalize_key(key)] = value.detach().to("cpu").clone()
    return result


def _fsdp1_lora_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """FSDP1 units whose own flat parameter is trainable (the LoRA leaves), with their names; the same order on every
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


def is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP)


def fsdp1_sharded_trainable(model: nn.Module) -> dict[str, object]:
    """FSDP1: this rank's shards (ShardedTensor) of the LoRA tensors, keyed by model names, for a DCP checkpoint.

    The model's own sharded state dict unshards every unit, decoder layers included, and chunks a copy of every
    parameter before frozen ones are dropped: the rank's whole base shard copied on the GPU (brought back from the CPU
    under offload) at every save. Each LoRA leaf is its own unit, so asking those units alone touches the LoRA bytes
    only. Every rank visits the same units in the same order (each state dict is a small collective).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    state: dict[str, object] = {}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        for unit_name, unit in _fsdp1_lora_units(model):
            for key, value in unit.state_dict(prefix=f"{unit_name}.").items():
                state[normalize_key(key)] = value
    return state


def fsdp1_load_trainable(model: nn.Module, state: dict[str, object]) -> None:
    """Load `fsdp1_sharded_trainable`'s tensors (filled by DCP) back into the LoRA leaf units, and no other unit.

    The model's own sharded load unshards every unit with write-back, frozen decoder layers included."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        for unit_name, unit in _fsdp1_lora_units(model):
            prefix = normalize_key(f"{unit_name}.")
            own = {key[len(prefix):]: value for key, value in state.items()
                   if key.startswith(prefix) and "." not in key[len(prefix):]}
            missing = [f"{prefix}{name}" for name in unit._flat_param._fqns if name not in own]
            if missing:
                raise KeyError(f"the checkpoint has no {missing[0]}")
            unit.load_state_dict(own, strict=False)


def _fsdp1_trainable_state_dict(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """FSDP1: gather each LoRA leaf's unit alone, never a decoder layer's.

    `get_model_state_dict(full_state_dict=True)` unshards and clones every parameter of every unit on every rank before
    frozen ones are dropped: the whole base on each GPU after training, in exactly the runs that needed sharding.
    Each LoRA leaf is its own FSDP1 unit (parallel/wrapping.py), so summoning those units one at a time (recurse=False)
    holds at most the LoRA tensors plus one leaf's flat parameter. Every rank visits the same units in the same order.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    result: dict[str, torch.Tensor] = {}
    for unit_name, unit in _fsdp1_lora_units(model):
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


def local_parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank actually holds (its shard under FSDP and ZeRO-3), split frozen / trainable."""
    if zero.is_engine(model):
        return zero.local_parameter_bytes(model)
    frozen = trainable = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        size = local.numel() * local.element_size()
        if param.requires_grad:
            trainable += size
        else:
            frozen += size
    return {"frozen_bytes": frozen, "trainable_bytes": trainable}
