"""The concatenated expert layout with a gating of the experts' own (DeepSeek-V4's `DeepseekV4Experts`, GLM-5's
`Glm5NextTextExperts`: SwiGLU with the gate clamped above and the up projection clamped both ways at `swiglu_limit`):
stored as the concatenated family stores
them (`gate_up_proj` experts x 2*inter x hidden, gate rows then up rows; `down_proj` experts x hidden x inter; no
biases), but the class overrides transformers' `_apply_gate`, the function its own forward and transformers' grouped /
batched expert kernels apply to the concatenated gate|up output.

Each expert here computes gate and up with one 4-bit Linear each (a LoRA on each), concatenates them as the fused
matmul lays them out, and calls the class's own `_apply_gate` on that, bound to the fused module's plain attributes
(`swiglu_limit`'s `limit`, the activation): whatever gating the class defines is the one applied, with no copy of it
here, and no reference to the fused module's tensors is kept. The per-expert names are read from transformers'
converter for the model, as for the concatenated family (DeepSeek-V4: `w1`/`w3`/`w2`)."""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import torch
from torch import nn

from finetune.model.experts.families import concatenated
from finetune.model.experts.routed import ExpertMLP, ExpertNames, RoutedExperts

MODELS = "DeepSeek-V4, GLM-5 (experts with their own gating)"
ROUTED = RoutedExperts
TRANSPOSED = False
STORED_IN_OUT = False
names, sizes, copy_in, fused_tensors = concatenated.names, concatenated.sizes, concatenated.copy_in, concatenated.fused_tensors


def why_not(module: nn.Module) -> str | None:
    """None for a concatenated experts module whose class applies its own gating (and nothing else differs)."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate:
        return "its experts use transformers' default gating"
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) \
            or getattr(module, "gate_up_proj_bias", None) is not None or getattr(module, "has_post_expert_norm", False):
        return "its experts are stored transposed, have biases or a norm"
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return "its gate and up projections are interleaved, or it has no gate"
    return None


class GatedExpertMLP(ExpertMLP):
    """One expert: `apply_gate(cat(gate(x), up(x)))`, then down; `apply_gate` is the fused class's own."""

    def __init__(self, names: ExpertNames, hidden: int, inter: int, act_fn, apply_gate, *, dtype=None):
        super().__init__(names, hidden, inter, act_fn, dtype=dtype)
        self.apply_gate = apply_gate  # a bound method of plain attributes: no state, nothing for FSDP to see

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([getattr(self, name)(x) for name in self.names.gate_up], dim=-1)
        return getattr(self, self.names.down[0])(self.apply_gate(gate_up))


def _own_gate(module: nn.Module):
    """The class's `_apply_gate` bound to a copy of the module's plain attributes and submodules (the activation): what
    it reads (`self.limit`, `self.act_fn`) without the fused tensors."""
    attributes = {key: value for key, value in vars(module).items() if not key.startswith("_")}
    attributes.update(module._modules)
    return MethodType(type(module)._apply_gate, SimpleNamespace(**attributes))


def new_expert(module: nn.Module, names: ExpertNames, hidden: int, inter: int, *, dtype) -> GatedExpertMLP:
    # GLM-5's experts keep no activation module: their gate calls F.silu itself.
    return GatedExpertMLP(names, hidden, inter, getattr(module, "act_fn", None), _own_gate(module), dtype=dtype)


def fused_config(module: nn.Module):
    """What rebuilds the fused module: its config where it keeps one; else None, and the model's text config is used
    (DeepseekV4Experts(config) reads num_local_experts, hidden_size, intermediate_size, hidden_act, swiglu_limit)."""
    return getattr(module, "config", None)
