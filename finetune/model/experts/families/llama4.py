"""Llama 4's expert layout (Scout, Maverick: `Llama4TextExperts`): the fused tensors are stored (in, out), the
transpose of `nn.Linear`'s (out, in), because transformers multiplies them with `bmm(x, W)`: `gate_up_proj` experts x
hidden x 2*inter (gate columns, then up columns) and `down_proj` experts x inter x hidden. The hub checkpoints store
them so (`feed_forward.experts.gate_up_proj` / `down_proj`, no per-expert converter in transformers), and transformers
loads them as they are; a per-expert checkpoint (`experts.{e}.gate_proj.weight`, as quantized uploads store them, and
vLLM reads) maps one to one onto the split experts. The per-expert names are those: `gate_proj`/`up_proj`/`down_proj`.

The call differs from the other families: Llama 4's MoE block scales every token by its (sigmoid) router score for
every expert, zero where not routed, and calls the experts once with experts x tokens rows (`Llama4RoutedExperts`).
The router is an `nn.Linear` subclass (it returns scores and logits): never quantized (transformers' bnb converts
plain `nn.Linear` only) and kept out of LoRA's all-linear (finetune/model/experts/lora.py), frozen or trained in full.
The shared expert is an ordinary MLP of three Linears: 4-bit with a LoRA each, like attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from finetune.model.experts.routed import ExpertMLP, ExpertNames, RoutedExperts

MODELS = "Llama 4 (Scout, Maverick)"
NAMES = ExpertNames(("gate_proj", "up_proj"), ("down_proj",))


class Llama4RoutedExperts(RoutedExperts):
    """Llama 4's experts, one module each, called as transformers calls `Llama4TextExperts`: rows of expert e are
    rows [e*T, (e+1)*T) of the input, every token already scaled by its score for e (exactly zero where not routed to
    e, sigmoid(-inf)). transformers runs every expert on every token (one batched matmul); here each expert runs on its
    nonzero rows only (top-1 of 16 on Scout: 1/16 of the compute and activations). That is exact: an expert has no
    bias, so a zero row gives a zero output (its LoRA's too, dropout or not), and no gradient reaches the router
    through a row not routed (the -inf it was filled with is a constant).

    As `RoutedExperts`, every expert runs on every step (on no rows, possibly), so each rank uses every parameter in
    the same order (FSDP1, DDP), and the host waits once per layer, for the row counts (`routed_rows`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.shape[-1]
        per_expert = hidden_states.view(len(self), -1, hidden)
        rows, counts = routed_rows(per_expert)
        final = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self):
            chosen = rows[index, : counts[index]]  # a view: no sync, possibly empty
            routed = expert(per_expert[index].index_select(0, chosen))
            final.index_add_(0, chosen + index * per_expert.shape[1], routed.to(final.dtype))
        return final


def routed_rows(per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Per expert, its nonzero rows first (in token order: a stable sort) and how many there are, as Python ints:
    one device-to-host copy for the layer."""
    routed = per_expert.ne(0).any(-1)  # experts x tokens
    rows = torch.sort((~routed).to(torch.uint8), dim=-1, stable=True).indices
    return rows, routed.sum(-1).tolist()  # the layer's one host sync


ROUTED = Llama4RoutedExperts
# The loader reads an expert's part of a stored fused tensor as a column block of its slice, transposed (files.py).
TRANSPOSED = True
STORED_IN_OUT = True  # the fused parameters are experts x in x out


def why_not(module: nn.Module) -> str | None:
    """None for transformers' `Llama4TextExperts` (its layout is known here by its class, as nothing in it says it)."""
    if type(module).__name__ != "Llama4TextExperts":
        return "it is not Llama 4's Llama4TextExperts"
    return None


def names(model: nn.Module, name: str, module: nn.Module) -> ExpertNames:
    return NAMES


def sizes(module: nn.Module, names: ExpertNames) -> tuple[int, int, int]:
    """(experts, hidden, intermediate): `gate_up_proj` is experts x hidden x 2*inter."""
    experts, hidden, inter_parts = module.gate_up_proj.shape
    return experts, hidden, inter_parts // len(names.gate_up)


def fused_config(module: nn.Module):
    """What `Llama4TextExperts(config)` reads, to rebuild it for export (the module keeps no config of its own)."""
    experts, hidden, inter_parts = module.gate_up_proj.shape
    return SimpleNamespace(num_local_experts=experts, hidden_size=hidden, intermediate_size=inter_parts // 2,
                           hidden_act=_activation_name(module.act_fn))


def _activation_name(act_fn) -> str:
    from transformers.activations import ACT2CLS

    return next(name for name, cls in ACT2CLS.items() if type(act_fn) is (cls[0] if isinstance(cls, tuple) else cls))


def copy_in(split: RoutedExperts, module: nn.Module) -> None:
    """Each expert's weights, transposed to (out, in), out of the fused tensors (gate and up: column blocks)."""
    parts = len(split[0].names.gate_up)
    for index, expert in enumerate(split):
        for part, chunk in zip(expert.names.gate_up, module.gate_up_proj[index].chunk(parts, dim=-1), strict=True):
            getattr(expert, part).weight.copy_(chunk.t())
        getattr(expert, expert.names.down[0]).weight.copy_(module.down_proj[index].t())


def new_expert(module: nn.Module, names: ExpertNames, hidden: int, inter: int, *, dtype) -> ExpertMLP:
    return ExpertMLP(names, hidden, inter, module.act_fn, dtype=dtype)


def fused_tensors(split: RoutedExperts) -> dict[str, torch.Tensor]:
    """`copy_in` reversed: the stacked (in, out) `gate_up_proj` and `down_proj` of `Llama4TextExperts`."""
    names = split[0].names
    gate_up = torch.stack([torch.cat([getattr(expert, part).weight.t() for part in names.gate_up], dim=-1)
                           for expert in split])
    down = torch.stack([getattr(expert, names.down[0]).weight.t() for expert in split])
    return {"gate_up_proj": gate_up.contiguous(), "down_proj": down.contiguous()}

