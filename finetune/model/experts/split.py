"""Fused experts found, split into `RoutedExperts` (one Linear per expert projection, the layout taken from the
family that claims the module, finetune/model/experts/families/), quantized to 4 bits, and fused back for export."""

from __future__ import annotations

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.experts.families import FAMILIES, covered_models, family_for
from finetune.model.experts.routed import RoutedExperts
from finetune.model.sources.files import CheckpointIndex


def fused_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers 5's fused experts modules (3-D `gate_up_proj` and `down_proj` parameters), by name."""
    found = []
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            found.append((name, module))
    return found


def split_experts(model: nn.Module, *, dtype: torch.dtype, quantized: bool = True) -> int:
    """Replace every fused experts module by `RoutedExperts` of plain `nn.Linear`s, on the fused tensors' device.

    On the meta device (the sharded loader's skeleton) the new weights are empty and transformers' bnb quantizer then
    converts them like every Linear. With real tensors (after `from_pretrained`) each expert's weights are copied
    out of the fused tensors (`quantize_split_experts` quantizes them). Returns the number of modules replaced.
    A layout this cannot split is refused when `quantized` (its experts would stay in model.dtype), else left fused."""
    replaced = 0
    for name, module in fused_expert_modules(model):
        family_name, reasons = family_for(module)
        if family_name is None:
            if not quantized:
                continue
            raise ModelLoadError(
                f"model: the experts of {type(module).__name__} ({name}) cannot be stored in 4 bits by finetune: "
                f"{'; '.join(reasons)}. Fix: set quantization.method: none (experts in model.dtype), or use a model "
                f"whose experts finetune splits ({covered_models()}).")
        family = FAMILIES[family_name]
        names = family.names(model, name, module)
        experts, hidden, inter = family.sizes(module, names)
        device = module.gate_up_proj.device
        with torch.device(device):
            split = family.ROUTED([family.new_expert(module, names, hidden, inter, dtype=dtype)
                                   for _ in range(experts)])
        # Plain attributes (no state, nothing for FSDP to see): what `fuse_experts` needs to give the layout back.
        config = family.fused_config(module) or model.config.get_text_config()  # DeepSeek-V4's experts keep none
        split.family, split.fused_type, split.fused_config = family_name, type(module), config
        if device.type != "meta":
            with torch.no_grad():
                family.copy_in(split, module)
        split.requires_grad_(False)
        model.set_submodule(name, split)
        replaced += 1
    return replaced


def quantize_split_experts(model: nn.Module, bnb_config, *, load_dtype: torch.dtype) -> int:
    """Store every expert Linear of a loaded model in 4 bits, one projection at a time, as transformers' own
    `Bnb4bitQuantize` does for the other Linears (and the sharded loader does for these): the packed bytes and quant
    states are the same whichever loader built the model. Returns the number of weights quantized."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    count = 0
    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        for expert in module:
            linears = {name: child for name, child in expert.named_children() if type(child) is nn.Linear}
            values = {name: child.weight.detach() for name, child in linears.items()}
            biases = {name: child.bias for name, child in linears.items() if child.bias is not None}
            replace_with_bnb_linear(expert, quantization_config=bnb_config)
            for name, value in values.items():
                layer = getattr(expert, name)
                if name in biases:  # gpt-oss: the bias stays in model.dtype (bitsandbytes quantizes the weight only)
                    layer.bias = biases[name]
                value = value.to(dtype=load_dtype)
                layer.weight = bnb.nn.Params4bit(value, requires_grad=False, **layer.weight.__dict__).to(value.device)
                count += 1
    return count


def fuse_experts(model: nn.Module) -> int:
    """Give every `RoutedExperts` of a model without 4-bit or LoRA layers (a merged one) transformers' own fused experts
    back, the per-expert weights stacked as transformers stacks them (`split_experts` reversed): `save_pretrained`
    then writes the checkpoint layout and names transformers, vLLM and llama.cpp read. Returns the modules replaced."""
    replaced = 0
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]:
        with torch.no_grad():
            tensors = FAMILIES[module.family].fused_tensors(module)
        with torch.device("meta"):
            fused = module.fused_type(module.fused_config)
        for key, value in tensors.items():  # gate_up_proj, down_proj (and gpt-oss's biases)
            setattr(fused, key, nn.Parameter(value, requires_grad=False))
        model.set_submodule(name, fused)
        replaced += 1
    return replaced


def fused_expert_views(index: CheckpointIndex, model: nn.Module) -> int:
    """Add to `index` the per-expert weights of `RoutedExperts` missing from the checkpoint but stored fused. Stored
    experts x out x in (the concatenated family), expert e's part i of n is rows i/n of the fused tensor's slice e
    (transformers' `Concatenate(dim=1)` order); stored experts x in x out (Llama 4), it is columns i/n, transposed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    added = 0
    for name, module in base.named_modules():
        if not isinstance(module, RoutedExperts) or not len(module):
            continue
        family = FAMILIES[getattr(module, "family", "concatenated")]
        if hasattr(family, "expert_views"):  # a layout that is no row block of the stored tensor (gpt-oss)
            added += family.expert_views(index, name, module)
            continue
        names, transposed = module[0].names, family.TRANSPOSED
        for fused, parts in ((f"{name}.gate_up_proj", names.gate_up), (f"{name}.down_proj", names.down)):
            if fused not in index.shapes:
                continue
            stored = index.views.get(fused, (fused,))[0]
            shape = index.shapes[fused]
            for expert in range(shape[0]):
                for part, part_name in enumerate(parts):
                    key = f"{name}.{expert}.{part_name}.weight"
                    if key in index.shapes:
                        continue
                    if transposed:
                        index.add_view(key, (stored, expert, part, len(parts)), (shape[2] // len(parts), shape[1]))
                        index.transposed.add(key)
                    else:
                        index.add_view(key, (stored, expert, part, len(parts)), (shape[1] // len(parts), *shape[2:]))
                    added += 1
    return added
