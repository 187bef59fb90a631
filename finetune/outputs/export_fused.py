"""Per-expert LoRA written, exactly, as PEFT's LoRA on transformers 5's fused expert parameters (`target_parameters`,
`lora.ParamWrapper`): the form plain PEFT loads where it does not convert a per-expert adapter itself.

PEFT 0.21 converts per-expert LoRA tensors onto the fused experts for the model types its conversion table names
(Mixtral- and Qwen-MoE-patterned), and then only when no other Linear bears an expert's leaf name (its config rewrite
moves every `gate_proj`/`up_proj`/`down_proj` target onto the experts, a shared expert's or a dense layer's too). For
gpt-oss, Llama 4, Granite-MoE, Qwen3.5-MoE and the models with shared or dense MLPs the per-expert form loses tensors.

A `ParamWrapper` on a 3-D parameter (experts x d0 x d1) holds `lora_A` (experts*R x in) and `lora_B` (out x R*experts)
and computes, per expert e, the rank-R product of A's rows [e*R, (e+1)*R) and B's columns {k*experts + e} (PEFT's
`get_delta_weight`): a LoRA of its own per expert. So a per-expert rank-r LoRA is that with R = r, exactly; the parts
transformers fuses into one parameter (gate and up in `gate_up_proj`) are one rank-(r_gate + r_up) LoRA whose A is the
parts' A stacked and whose B is block-diagonal (PEFT's own Mixtral conversion does the same), with rank_pattern and
alpha_pattern keeping each part's alpha/r. Rows go where the family puts them (concatenated, Llama 4's columns,
gpt-oss's interleaving): the family's own `fused_tensors` places B, as it places the weights it fuses for a merge.
Where a parameter is stored (in, out) and PEFT reads it as (out, in) (Llama 4 has no `is_transposed` flag), the product
is transposed by exchanging the factors. A Linear beside the experts that PEFT's config rewrite would move is targeted
as a parameter too (`<path>.weight`: a 2-D ParamWrapper holds the same A and B as `lora.Linear`).
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch
from torch import nn

FUSED = (("gate_up_proj", "gate_up"), ("down_proj", "down"))


def stock_meta_model(config) -> nn.Module:
    """The base as transformers builds it (fused experts), on the meta device."""
    from finetune.model.classes import from_config

    with torch.device("meta"):
        return from_config(config)


def moved_by_peft(stock: nn.Module, paths: list[str]) -> set[str]:
    """The module paths that PEFT's transformers-5 config rewrite takes out of `target_modules` on this model (onto
    the fused experts' parameters): the paths of its converted per-expert names, wherever they are."""
    from peft import LoraConfig

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # PEFT < 0.19: no rewrite
        return set()
    probe = LoraConfig(target_modules=set(paths))
    convert_peft_config_for_transformers(probe, model=stock, conversions=None)
    return set(paths) - set(probe.target_modules or ())


def _scaling(adapter_config: dict, path: str, rank: int) -> float:
    """The scaling PEFT gave module `path` in training (alpha / r, or alpha / sqrt(r) with rsLoRA)."""
    from peft.utils.other import get_pattern_key

    alphas = adapter_config.get("alpha_pattern") or {}
    alpha = alphas.get(get_pattern_key(alphas.keys(), path), adapter_config["lora_alpha"])
    return alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)


def _alpha_for(adapter_config: dict, scaling: float, rank: int) -> float:
    """The alpha that gives a rank-`rank` wrapper `scaling`."""
    alpha = scaling * (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
    return int(alpha) if float(alpha).is_integer() else alpha


def _fused_factors(tensors: dict, prefix: str, split, family, fused: str, parts: tuple[str, ...],
                   adapter_config: dict) -> tuple[torch.Tensor, torch.Tensor, int, float] | None:
    """(A: experts x R x in, B: experts x out x R in the fused parameter's row order, R, scaling) of one fused
    parameter, the parts' LoRA stacked (A) and block-diagonal (B); None when no part carries LoRA."""
    def lora(expert, part, half):
        return tensors.get(f"{prefix}.{expert}.{part}.lora_{half}.weight")

    experts = len(split)
    ranks = [max((lora(e, p, "A").shape[0] for e in range(experts) if lora(e, p, "A") is not None), default=0)
             for p in parts]
    if not any(ranks):
        return None
    total = sum(ranks)
    scales = [_scaling(adapter_config, f"{prefix}.0.{p}".removeprefix("base_model.model."), r) if r else 1.0
              for p, r in zip(parts, ranks, strict=True)]
    reference = next(s for s, r in zip(scales, ranks, strict=True) if r)
    a_rows, pseudo = [], []
    for e in range(experts):
        a_blocks, b_parts, offset = [], {}, 0
        for p, rank, scale in zip(parts, ranks, scales, strict=True):
            linear = getattr(split[e], p)
            a, b = lora(e, p, "A"), lora(e, p, "B")
            block_a = torch.zeros(rank, linear.in_features, dtype=_dtype(tensors))
            block_b = torch.zeros(linear.out_features, total, dtype=_dtype(tensors))
            if a is not None:
                block_a[: a.shape[0]] = a
                block_b[:, offset : offset + b.shape[1]] = b if scale == reference else b * (scale / reference)
            a_blocks.append(block_a)
            b_parts[p] = block_b
            offset += rank
        a_rows.append(torch.cat(a_blocks))
        pseudo.append(_pseudo_expert(split[e].names, b_parts, total))
    stored = family.fused_tensors(pseudo)[fused]  # B placed as the family places this parameter's weights
    b = stored.transpose(1, 2) if family.STORED_IN_OUT else stored
    return torch.stack(a_rows), b, total, reference


def _dtype(tensors: dict) -> torch.dtype:
    """The LoRA factors' dtype. Not the first tensor's: safetensors stores integer tensors first, and a router saved
    with the adapter (lora.train_router) can carry one (DeepSeek-V4's `tid2eid`), in which the fused factors would be
    truncated to integers (zeros)."""
    return next(value.dtype for key, value in tensors.items() if ".lora_" in key and value.is_floating_point())


def _pseudo_expert(names, b_parts: dict, total: int):
    """What a family's `fused_tensors` reads of one expert (weights and biases by part name), holding B factors; the
    parts of the other fused parameter get a placeholder row."""
    def part(name):
        weight = b_parts.get(name, torch.zeros(1, total, dtype=next(iter(b_parts.values())).dtype))
        return SimpleNamespace(weight=weight, bias=weight.new_zeros(weight.shape[0]))

    return SimpleNamespace(names=names, **{name: part(name) for name in (*names.gate_up, *names.down)})


def fused_adapter(tensors: dict[str, torch.Tensor], split_model: nn.Module, config, adapter_config: dict
                  ) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(tensors, adapter_config.json updates) of the adapter in PEFT's fused-expert form, from `tensors` in the names
    of `split_model` (the base with its experts split as training split them, on the meta device; per-expert LoRA,
    on-disk keys); None where PEFT loads the per-expert form itself."""
    from finetune.model.experts.families import FAMILIES
    from finetune.model.experts.routed import RoutedExperts
    from finetune.outputs.runtimes import lora_modules

    stock = stock_meta_model(config)
    routed = {name: module for name, module in split_model.named_modules() if isinstance(module, RoutedExperts)}
    paths = lora_modules(list(tensors))
    on_experts = {path for path in paths if path.rpartition(".")[0].rpartition(".")[0] in routed}
    moved = moved_by_peft(stock, paths)
    if not on_experts or moved == on_experts:  # no expert LoRA, or PEFT converts the per-expert form itself
        return None
    side = [path for path in paths if path not in on_experts]
    side_moved = moved_by_peft(stock, side)
    out = {key: value for key, value in tensors.items() if ".lora_" not in key or
           lora_modules([key])[0] not in on_experts}
    rank_pattern, alpha_pattern, targets = {}, {}, []
    for name, split in routed.items():
        family, stock_module = FAMILIES[split.family], stock.get_submodule(name)
        for fused, part in FUSED:
            factors = _fused_factors(tensors, f"base_model.model.{name}", split, family, fused,
                                     getattr(split[0].names, part), adapter_config)
            if factors is None:
                continue
            a, b, rank, scaling = factors
            if family.STORED_IN_OUT != bool(getattr(stock_module, "is_transposed", False)):
                a, b = b.transpose(1, 2), a.transpose(1, 2)  # PEFT reads the parameter the other way round
            targets.append(f"{name}.{fused}")
            rank_pattern[re.escape(targets[-1])] = rank
            alpha_pattern[re.escape(targets[-1])] = _alpha_for(adapter_config, scaling, rank)
            out[f"{name}.{fused}.lora_A"] = a.reshape(-1, a.shape[-1]).contiguous()
            out[f"{name}.{fused}.lora_B"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    update = {"target_modules": sorted(set(side) - side_moved) or None,
              "target_parameters": [*targets, *(f"{path}.weight" for path in sorted(side_moved))],
              "rank_pattern": {**rank_pattern, **(adapter_config.get("rank_pattern") or {})},
              "alpha_pattern": {**alpha_pattern, **(adapter_config.get("alpha_pattern") or {})}}
    return _peft_keys(out, stock, adapter_config, update), update


def _peft_keys(tensors: dict, stock: nn.Module, adapter_config: dict, update: dict) -> dict[str, torch.Tensor]:
    """The fused factors under the keys PEFT gives its (nested) ParamWrappers, read off a PeftModel of the stock base
    built with the written config (the inner wrapper's key runs through `base_layer`)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    fields = set(LoraConfig.__dataclass_fields__)
    written = {**adapter_config, **update, "lora_dropout": 0.0, "inference_mode": True}
    config = LoraConfig(**{key: value for key, value in written.items() if key in fields})
    peft_model = get_peft_model(stock, config, low_cpu_mem_usage=True)
    keys = {}
    for module_name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            path = module_name.removeprefix("base_model.model.").replace(".base_layer", "")
            keys[f"{path}.{module.parameter_name}"] = module_name
    renamed = {}
    for key, value in tensors.items():
        stem, _, half = key.rpartition(".")
        if stem in keys and half in ("lora_A", "lora_B"):
            renamed[_unrenamed(f"{keys[stem]}.{half}.weight", stock)] = value
        else:
            renamed[_unrenamed(key, stock) if ".lora_" in key else key] = value
    return renamed


def _unrenamed(key: str, stock: nn.Module) -> str:
    """`key` as the checkpoint names it where PEFT's loader would rename it again: PEFT applies transformers' key
    renames to an adapter's keys (peft/utils/transformers_weight_conversion.py), and a rename that is not idempotent
    on the model's own name (Mistral Large 4's `.experts.` -> `.mlp.experts.`) would give `.mlp.mlp.experts`. The
    checkpoint's name, renamed by PEFT, is the model's."""
    from transformers.core_model_loading import rename_source_key

    from finetune.model.sources.conversions import _renamings, checkpoint_names

    prefix = "base_model.model."
    name = key.removeprefix(prefix)
    forward = _renamings(stock, reverse=False)
    if rename_source_key(name, forward, [])[0] == name:
        return key
    stored = checkpoint_names(stock, [name])[name]
    return prefix + stored if rename_source_key(stored, forward, [])[0] == name else key
