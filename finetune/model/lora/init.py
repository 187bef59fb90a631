"""The LoRA start, seeded by (train.seed, tensor name): the same adapter for every loader, rank and device, and the
fingerprint that compares it across ranks."""

from __future__ import annotations

import math
import re
import zlib

import torch
from torch import nn

from finetune.errors import ModelLoadError


def lora_tensor_name(model_name: str) -> str:
    """The module path of a LoRA tensor without PEFT's wrapper levels: the same for every loader and wrapper."""
    return model_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(lora_tensor_name(name).encode())) % (2**63)


def adapter_key(model_name: str) -> str:
    """The key of a PeftModel parameter in a saved adapter (PEFT's `get_peft_model_state_dict` names), as
    `adapter_start` keys the adapter's tensors: without `base_model.model.`, `.base_layer.` and the adapter name;
    a modules_to_save copy under its module's own name (`mlp.gate.modules_to_save.default.weight` -> `mlp.gate.weight`),
    a DoRA magnitude without `.weight` (`q_proj.lora_magnitude_vector.default.weight` -> `q_proj.lora_magnitude_vector`)."""
    key = re.sub(r"\.modules_to_save\.default(?=\.|$)", "", lora_tensor_name(model_name))
    key = re.sub(r"\.default(?=\.|$)", "", key)
    return key.removesuffix(".weight") if key.endswith(".lora_magnitude_vector.weight") else key


def start_value(start: dict[str, torch.Tensor], name: str, shape: torch.Size) -> torch.Tensor:
    """model.adapter's value of the PeftModel parameter `name` (`adapter_key`); ModelLoadError when the adapter holds
    none of that shape."""
    key = adapter_key(name)
    if key in start and start[key].shape == shape:
        return start[key]
    found = "missing" if key not in start else f"shape {list(start[key].shape)}, the model's {list(shape)}"
    raise ModelLoadError(f"model.adapter: tensor {key} is {found}: the adapter was not trained for this base model "
                         "and LoRA layout. Fix: use the adapter of a run on the same model.name_or_path.")


def init_lora_tensor(tensor: torch.Tensor, name: str, seed: int, start: dict[str, torch.Tensor] | None = None) -> bool:
    """PEFT's default LoRA init for each layer kind (`LoraLayer.reset_lora_parameters`, init_lora_weights: true), the
    random side drawn from a generator seeded by (seed, name). Returns False for tensors that are not A/B matrices (DoRA
    magnitudes keep PEFT's values).

    Linear (and convolution, multi-head attention, per-expert) layers: A kaiming-uniform with a=sqrt(5), B zeros.
    Embeddings (`lora_embedding_A/B`): the other way round, A zeros and B normal(0, 1), as microsoft/LoRA's Embedding.
    The side that is zero makes the start the base model either way; which side it is decides how LoRA trains: with an
    embedding's A drawn like a Linear's (std ~ 1/sqrt(vocab)) its update was sqrt(vocab) times smaller than PEFT's
    (22x at vocab 454, 66x at 32k) and, A being dense, every step moved the rows of tokens absent from the data; with
    A zero, only the rows of tokens in a batch get a gradient.

    Why not PEFT's own draw from the global generator: its values depend on the order in which modules are created
    and on the device of the base (PEFT rounds the init through the base's dtype). Seeding by name makes the
    adapter's start the same for the per-rank loader and sharded loading, on every rank and every device.
    `start` (model.adapter's tensors, `adapter_start`): every LoRA tensor (DoRA magnitudes included) is copied from it
    instead.
    """
    if start is not None and ".lora_" in name:
        tensor.copy_(start_value(start, name, tensor.shape))
        return True
    if ".lora_embedding_A." in name or ".lora_B." in name:
        nn.init.zeros_(tensor)
        return True
    if ".lora_A." in name:
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=_generator(seed, name))
        return True
    if ".lora_embedding_B." in name:
        nn.init.normal_(tensor, mean=0.0, std=1.0, generator=_generator(seed, name))
        return True
    return False


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))


def lora_fingerprint(tensor: torch.Tensor, name: str) -> float:
    """A float that changes with any LoRA value and with its name (summed over tensors, compared across ranks)."""
    weight = 1.0 + (zlib.crc32(lora_tensor_name(name).encode()) % 997) / 997.0
    return float(tensor.detach().to("cpu", torch.float64).sum()) * weight


def init_lora_weights(model: nn.Module, seed: int, *, start: dict[str, torch.Tensor] | None = None) -> float:
    """Initialise every LoRA A/B tensor of a loaded PeftModel from its seed, or, with `start` (model.adapter), every
    trainable tensor from the adapter: LoRA, DoRA magnitudes, biases (lora.bias) and modules_to_save copies (the
    routers of lora.train_router), as `PeftModel.from_pretrained` loads them. Returns the LoRA checksum."""
    checksum = 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" not in name:
                if start is not None and param.requires_grad:  # a trained bias or router copy: the adapter's value
                    param.copy_(start_value(start, name, param.shape).to(param.device, param.dtype))
                continue
            value = param.detach().to("cpu", copy=True)
            init_lora_tensor(value, name, seed, start)
            param.copy_(value.to(param.device))
            checksum += lora_fingerprint(value, name)
    return checksum


def lora_checksum(model: nn.Module) -> float:
    """The fingerprint of the LoRA tensors as they are now (compare across ranks: all must start the same)."""
    return sum(lora_fingerprint(p, name) for name, p in model.named_parameters() if ".lora_" in name)
