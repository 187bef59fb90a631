"""The concatenated expert layout (Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-style): `gate_up_proj` experts x
2*inter x hidden (gate rows, then up rows) and `down_proj` experts x hidden x inter, no biases, the default gating.
The per-expert names are read from transformers' converter for the model (Mixtral `w1`/`w3`/`w2`, Qwen-MoE
`gate_proj`/`up_proj`/`down_proj`), not from a table of ours."""

from __future__ import annotations

import re

import torch
from torch import nn

from finetune.model.experts.routed import ExpertMLP, ExpertNames, RoutedExperts

MODELS = "Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-style"
ROUTED = RoutedExperts  # called as transformers' experts: (states, top-k index, top-k weights)
TRANSPOSED = False  # the stored fused tensors are (out, in), as nn.Linear: an expert's part is a block of rows
STORED_IN_OUT = False  # the fused parameters are experts x out x in (what an exported fused-expert LoRA follows)
# Where the checkpoint has no per-expert converter (it ships the fused tensors), the per-expert names transformers 4 used.
DEFAULT_NAMES = (("gate_proj", "up_proj"), ("down_proj",))


def why_not(module: nn.Module) -> str | None:
    """Why this fused experts module cannot be split into per-expert Linears, or None."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed (in x out)"
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        return "its experts have biases"
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return "its gate and up projections are interleaved, or it has no gate"
    if getattr(module, "has_post_expert_norm", False) or getattr(type(module), "_apply_gate", _default_apply_gate) \
            is not _default_apply_gate:
        return "its experts apply their own gating or a norm"
    return None


def expert_names(model: nn.Module, param_name: str, part: str) -> tuple[str, ...]:
    """The per-expert names transformers' converter for `param_name` (…experts.gate_up_proj / down_proj) reads."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    for converter in get_model_conversion_mapping(model):
        if not isinstance(converter, WeightConverter) or not param_name.endswith(converter.target_patterns[0]):
            continue
        operations = [type(op) for op in converter.operations]
        expected = [MergeModulelist, Concatenate] if part == "gate_up" else [MergeModulelist]
        names = tuple(re.search(r"\*\.(\w+)\.weight$", p).group(1) for p in converter.source_patterns
                      if re.search(r"\*\.(\w+)\.weight$", p))
        if operations == expected and len(names) == len(converter.source_patterns):
            return names
    return DEFAULT_NAMES[0] if part == "gate_up" else DEFAULT_NAMES[1]


def names(model: nn.Module, name: str, module: nn.Module) -> ExpertNames:
    return ExpertNames(expert_names(model, f"{name}.gate_up_proj", "gate_up"), expert_names(model, f"{name}.down_proj", "down"))


def fused_config(module: nn.Module):
    """The config transformers' experts module was built from, to rebuild it for export."""
    return getattr(module, "config", None)


def sizes(module: nn.Module, names: ExpertNames) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of one fused experts module."""
    experts, inter_parts, hidden = module.gate_up_proj.shape
    return experts, hidden, inter_parts // len(names.gate_up)


def new_expert(module: nn.Module, names: ExpertNames, hidden: int, inter: int, *, dtype) -> ExpertMLP:
    """One expert: act(gate(x)) * up(x), then down, with the fused module's activation."""
    return ExpertMLP(names, hidden, inter, module.act_fn, dtype=dtype)


def copy_in(split: RoutedExperts, module: nn.Module) -> None:
    """Each expert's weights copied out of the fused tensors (gate and up are row blocks of `gate_up_proj`)."""
    parts = len(split[0].names.gate_up)
    for index, expert in enumerate(split):
        for part, chunk in zip(expert.names.gate_up, module.gate_up_proj[index].chunk(parts, dim=0), strict=True):
            getattr(expert, part).weight.copy_(chunk)
        getattr(expert, expert.names.down[0]).weight.copy_(module.down_proj[index])


def fused_tensors(split: RoutedExperts) -> dict[str, torch.Tensor]:
    """`copy_in` reversed: the stacked `gate_up_proj` and `down_proj` transformers' experts module holds."""
    names = split[0].names
    gate_up = torch.stack([torch.cat([getattr(expert, part).weight for part in names.gate_up]) for expert in split])
    down = torch.stack([getattr(expert, names.down[0]).weight for expert in split])
    return {"gate_up_proj": gate_up, "down_proj": down}
