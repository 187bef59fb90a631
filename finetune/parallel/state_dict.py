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
