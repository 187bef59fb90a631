"""The model's module tree as the wraps see it: the meta-device skeleton, the decoder layer class (the FSDP unit),
where the layers live, and the layer-split placement."""

from __future__ import annotations

import torch
from torch import nn

from finetune.errors import LaunchError


# -------------------------------------------------------------------------------------------- model facts
def meta_model(config, *, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree with no storage (classes and names for wrap and placement plans)."""
    from finetune.model.classes import from_config

    with torch.device("meta"):
        return from_config(config, trust_remote_code=trust_remote_code)


def decoder_layer_class(model: nn.Module, requested: str | None = None) -> type[nn.Module]:
    """The class of the repeated decoder block: `requested`, else the model's `_no_split_modules`."""
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if requested:
        if requested not in classes:
            layer_like = sorted(n for n in classes if "Layer" in n or "Block" in n) or sorted(classes)
            raise LaunchError(
                f"parallel.layer_class (or fsdp_transformer_layer_cls_to_wrap) `{requested}` is not a module class of this "
                f"model. Its layer classes: {', '.join(layer_like)}. Fix: set it to one of those, or remove it to use the default."
            )
        return classes[requested]
    base = getattr(model, "get_base_model", lambda: model)()
    names = getattr(base, "_no_split_modules", None) or []
    # transformers 5 gives a multimodal model's `_no_split_modules` as a set, iterated in a per-process (hash-seeded)
    # order: Gemma 3 12B/27B (SigLIP blocks beside Gemma3DecoderLayer) got a different unit on each rank and the FSDP
    # wrap aborted. The unit is a block of the language model (what the planner counts and sharded loading builds one
    # at a time), chosen alike on every rank.
    names = list(names) if isinstance(names, (list, tuple)) else sorted(names)
    in_language_model = {type(m).__name__ for m in _language_model(base).modules()}
    for name in [n for n in names if n in in_language_model] + names:
        if name in classes:
            return classes[name]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        return type(max(lists, key=len)[0])
    raise LaunchError("cannot find the decoder layer class of this model; set parallel.layer_class.")


def _language_model(base: nn.Module) -> nn.Module:
    """The text decoder of a multimodal model (transformers' `get_decoder`), else the model itself."""
    try:
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    except (AttributeError, NotImplementedError, ValueError):
        decoder = base
    return decoder if isinstance(decoder, nn.Module) else base


def decoder_layers_path(model: nn.Module, layer_cls: type[nn.Module]) -> tuple[str, int]:
    """Dotted name of the ModuleList holding the decoder layers, and its length."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and isinstance(module[0], layer_cls):
            return name, len(module)
    raise LaunchError(f"no list of {layer_cls.__name__} modules found in the model.")


def layer_split_device_map(model: nn.Module, layer_cls: type[nn.Module], devices: list[str]) -> dict[str, str]:
    """Place consecutive decoder layers on `devices` in balanced groups; embeddings first, head last.

    Balance is by layer count (decoder layers are identical); when the split is uneven the extra layers go to the
    first devices, since the last one also holds the final norm, the LM head and the full-vocabulary logits.
    """
    layers_path, num_layers = decoder_layers_path(model, layer_cls)
    n = len(devices)
    if num_layers < n:
        raise LaunchError(f"layer split over {n} devices needs at least {n} decoder layers, the model has {num_layers}.")
    sizes = [num_layers // n] * n
    for i in range(num_layers % n):
        sizes[i] += 1
    plan: dict[str, str] = {}
    index = 0
    for device, size in zip(devices, sizes):
        for _ in range(size):
            plan[f"{layers_path}.{index}"] = device
            index += 1
    # Everything that is not a decoder layer: modules before the layer list go first, the rest last.
    prefix = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    for name, module in model.named_children() if not prefix else model.get_submodule(prefix).named_children():
        full = f"{prefix}.{name}" if prefix else name
        if full == layers_path:
            continue
        plan[full] = devices[0] if "embed" in name or "rotary" in name else devices[-1]
    for name, _ in model.named_children():
        if prefix and name != prefix.split(".")[0]:
            plan[name] = devices[-1]
    return plan
