"""State dicts through the wrappers: the full trainable tensors (a collective under FSDP), wrapper-free key names,
and the parameter bytes a rank holds. What differs per strategy is in each engine (parallel/engines/)."""

from __future__ import annotations

import torch
from torch import nn

from finetune.parallel.engines import engine_of
from finetune.parallel.engines.base import normalize_key


def trainable_state_dict(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the trainable parameters `names` (model names, wrappers stripped), on every rank.

    A collective under FSDP: every rank must call it. `ignore_frozen_params` is a hint only (a single-process
    model still returns its frozen weights), hence the explicit `names`.
    """
    return engine_of(model).trainable_state_dict(model, set(names))


def local_parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank actually holds (its shard under FSDP and ZeRO-3), split frozen / trainable."""
    return engine_of(model).local_parameter_bytes(model)


__all__ = ["local_parameter_bytes", "normalize_key", "trainable_state_dict"]
