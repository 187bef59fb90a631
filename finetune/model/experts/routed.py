"""The per-expert module that replaces transformers 5's fused experts: one `nn.Linear` per expert projection
(`ExpertMLP`), a layer's experts called as transformers calls its own (`RoutedExperts`), and the token grouping."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertNames:
    """Per-expert projection names: the parts of `gate_up_proj` in the order transformers concatenates them, and
    `down_proj`'s (from the model's conversion mapping: `.experts.*.w1.weight` -> `w1`)."""

    gate_up: tuple[str, ...]
    down: tuple[str, ...]


# ------------------------------------------------------------------------------------------------ the module
class ExpertMLP(nn.Module):
    """One expert: act(gate(x)) * up(x), then down; each projection an `nn.Linear` (a `Linear4bit` once quantized)."""

    def __init__(self, names: ExpertNames, hidden: int, inter: int, act_fn, *, dtype=None):
        super().__init__()
        self.names = names
        for name in names.gate_up:
            self.add_module(name, nn.Linear(hidden, inter, bias=False, dtype=dtype))
        self.add_module(names.down[0], nn.Linear(inter, hidden, bias=False, dtype=dtype))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(getattr(self, self.names.gate_up[0]), "weight", None)
        if weight is not None and weight.is_floating_point() and x.dtype != weight.dtype:
            # Llama 4 scales the experts' input by the router's scores: a trained router (lora.train_router, kept in
            # fp32) made it fp32 for bf16 experts (quantization none: "expected m1 and m2 to have the same dtype")
            x = x.to(weight.dtype)
        gate, up = (getattr(self, name)(x) for name in self.names.gate_up)
        return getattr(self, self.names.down[0])(self.act_fn(gate) * up)


class RoutedExperts(nn.ModuleList):
    """A layer's experts, one module each; same call as transformers' experts (states, top-k index, top-k weights).
    `family` / `fused_type` / `fused_config`: its layout family (families/), transformers' experts class it replaced and
    its config, so that `fuse_experts` can give a merged model back its stock layout (plain Python attributes: no
    state, nothing for FSDP to see).

    Every expert runs on every step, on the tokens routed to it (possibly none): each rank then uses every parameter
    and joins every collective in the same order whatever its tokens chose. Skipping unrouted experts, as transformers'
    eager loop does, deadlocks FSDP1 (each expert's LoRA is a unit of its own, all-gathered when its forward runs)
    and breaks DDP's gradient reduction (a parameter unused on one rank only).

    One host sync per layer, not one per expert: the (token, slot) pairs are grouped by expert with one stable sort,
    and the host reads only where each expert's group starts (`expert_groups`); each expert then slices its group with
    Python ints. A `torch.where(top_k_index == e)` per expert waits for the GPU every time (its output size is read
    back): 128 experts x 48 layers = 6k stalls per forward on Qwen3-30B-A3B, a step bound by the CPU's launches."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        token_idx, weights, bounds = expert_groups(top_k_index, top_k_weights, len(self))
        for index, expert in enumerate(self):
            rows = token_idx[bounds[index] : bounds[index + 1]]  # a view: no sync, possibly empty
            routed = expert(hidden_states[rows]) * weights[bounds[index] : bounds[index + 1], None]
            final.index_add_(0, rows, routed.to(final.dtype))
        return final


def expert_groups(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tokens and routing weights of every (token, top-k slot) pair grouped by expert, and the group bounds as
    Python ints (expert e's pairs are [bounds[e], bounds[e + 1])): one sort, one search, one device-to-host copy.

    The sort is stable, so within an expert the pairs keep their flat (token, slot) order, which is the order
    `torch.where(top_k_index == e)` gave: the same rows gathered and added in the same order, bitwise the same output.
    The bounds come from `searchsorted` on the sorted expert ids, not `bincount`: CUDA's bincount reads the input's
    min and max back to the host to size its output (two more syncs) and has no deterministic kernel."""
    slots = top_k_index.size(-1)
    flat = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_experts, torch.arange(experts + 1, device=flat.device, dtype=flat.dtype))
    bounds = starts.tolist()  # the layer's one host sync
    return order // slots, top_k_weights.reshape(-1)[order], bounds


def has_routed_experts(model: nn.Module) -> bool:
    return any(isinstance(module, RoutedExperts) for module in model.modules())
