"""The LoRA start, seeded by (train.seed, tensor name): the same adapter for every loader, rank and device, and the
fingerprint that compares it across ranks."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from finetune.errors import ModelLoadError


def lora_tensor_name(model_name: str) -> str:
    """The module path of a LoRA tensor without PEFT's wrapper levels: the same for every loader and wrapper."""
    return model_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(lora_tensor_name(name).encode())) % (2**63)


def init_lora_tensor(tensor: torch.Tensor, name: str, seed: int, start: dict[str, torch.Tensor] | None = None) -> bool:
    """PEFT's default LoRA init (A: kaiming-uniform with a=sqrt(5), B: zeros), A drawn from a generator seeded by
    (seed, name). Returns False for tensors that are not A/B matrices (DoRA magnitudes keep PEFT's values).

    Why not PEFT's own draw from the global generator: its values depend on the order in which modules are created
    and on the device of the base (PEFT rounds the init through the base's dtype). Seeding by name makes the
    adapter's start the same for the per-rank loader and sharded loading, on every rank and every device.
    `start` (model.adapter's tensors, `adapter_start`): A and B are copied from it instead.
    """
    if start is not None and ".lora_" in name:
        key = lora_tensor_name(name).replace(".default.", ".")
        if key not in start or start[key].shape != tensor.shape:
            found = "missing" if key not in start else f"shape {list(start[key].shape)}, the model's {list(tensor.shape)}"
            raise ModelLoadError(f"model.adapter: tensor {key} is {found}: the adapter was not trained for this base model "
                                 "and LoRA layout. Fix: use the adapter of a run on the same model.name_or_path.")
        tensor.copy_(start[key])
        return True
    if ".lora_A." in name or ".lora_embedding_A." in name:
        generator = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        return True
    if ".lora_B." in name or ".lora_embedding_B." in name:
        nn.init.zeros_(tensor)
        return True
    return False


def lora_fingerprint(tensor: torch.Tensor, name: str) -> float:
    """A float that changes with any LoRA value and with its name (summed over tensors, compared across ranks)."""
    weight = 1.0 + (zlib.crc32(lora_tensor_name(name).encode()) % 997) / 997.0
    return float(tensor.detach().to("cpu", torch.float64).sum()) * weight


def init_lora_weights(model: nn.Module, seed: int, *, start: dict[str, torch.Tensor] | None = None) -> float:
    """Initialise every LoRA A/B tensor of a loaded PeftModel from its seed (or `start`); returns the checksum."""
    checksum = 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" not in name:
                continue
            value = param.detach().to("cpu", copy=True)
            init_lora_tensor(value, name, seed, start)
            param.copy_(value.to(param.device))
            checksum += lora_fingerprint(value, name)
    return checksum


def lora_checksum(model: nn.Module) -> float:
    """The fingerprint of the LoRA tensors as they are now (compare across ranks: all must start the same)."""
    return sum(lora_fingerprint(p, name) for name, p in model.named_parameters() if ".lora_" in name)
