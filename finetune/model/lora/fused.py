"""A fused LoRA path for PEFT's LoRA linears (4-bit bases included): dropout, A and B in one autograd function.

PEFT's LoRA forward on a bf16 model casts the layer input to the LoRA weights' fp32 (a full fp32 copy of every
projection input, kept for backward), keeps the dropout output and its mask, and builds several output-sized
fp32 temporaries (B's output, its scaled copy, the cast back). Here the adapter's contribution is computed in the
input's dtype (bf16 on real runs; fp32 master weights stay with the optimizer, gradients come back in their dtype),
backward keeps only the layer input (which the base layer saves anyway) and the rank-r projection, and the dropout
mask is regenerated from a seed instead of stored (16 random bits per element: drop_mask).

PEFT keeps attaching, naming, saving and merging; only the forward of plain LoRA layers is replaced, and only where
the adapter weights are the module's own tensors at call time: FSDP1 (LoRA leaves wrapped as their own units, which
gather in their forward) and DeepSpeed ZeRO-3 (partitioned parameters, gathered by module hooks) fall back to
PEFT's forward, as do DoRA and other variants, merged or disabled adapters and mixed-adapter batches.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def drop_mask(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Which elements of x dropout zeroes (bool), the same for the same seed: forward and backward regenerate it.

    Each element draws 16 random bits (four per int64 from the seeded generator) and is kept unless the draw falls in
    the lowest round(p * 65536) values (then dropped), so the drop rate is p to within 1/131072. Measured on 2 CPU cores for a
    1936 x 576 input: 1.1 ms, against 5.7-6.0 ms for bernoulli_ (what torch's dropout and PEFT use) and 3.6 ms for
    `rand() < 1 - p`. Dropout's random numbers were most of the LoRA side's time on CPU: the rank-16 matmuls of that
    input take 0.2 ms.
    """
    count = x.numel()
    generator = torch.Generator(device=x.device).manual_seed(seed)
    bits = torch.randint(-(2**63), 2**63 - 1, ((count + 3) // 4,), dtype=torch.int64, device=x.device,
                         generator=generator)
    return bits.view(torch.int16)[:count].view(x.shape) < -32768 + round(p * 65536)


class LoraDelta(torch.autograd.Function):
    """scaling * dropout(x) @ A^T @ B^T, computed in x.dtype; saves x and the rank-r projection only.

    Inverted dropout's 1 / (1 - p) is applied to the rank-r projection (r values per token, not the layer's width),
    which is the same product.
    """

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, scaling: float, dropout_p: float, seed: int | None):
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        dropped = x2.masked_fill(drop_mask(x2, dropout_p, seed), 0) if seed is not None else x2
        projected = dropped @ lora_a.to(dtype).t()  # (tokens, r)
        if seed is not None:
            projected = projected * (1.0 / (1.0 - dropout_p))
        out = (projected * scaling) @ lora_b.to(dtype).t()
        ctx.save_for_backward(x2, projected, lora_a, lora_b)
        ctx.scaling, ctx.dropout_p, ctx.seed, ctx.x_shape = scaling, dropout_p, seed, x.shape
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, projected, lora_a, lora_b = ctx.saved_tensors
        dtype = x2.dtype
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype) * ctx.scaling
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        grad_b = grad.t() @ projected  # (out, r)
        grad_projected = grad @ b  # (tokens, r)
        drop = None
        if ctx.seed is not None:
            grad_projected = grad_projected * (1.0 / (1.0 - ctx.dropout_p))
            drop = drop_mask(x2, ctx.dropout_p, ctx.seed)
        dropped = x2.masked_fill(drop, 0) if drop is not None else x2
        grad_a = grad_projected.t() @ dropped  # (r, in)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_projected @ a
            if drop is not None:
                grad_x = grad_x.masked_fill_(drop, 0)
            grad_x = grad_x.reshape(ctx.x_shape)
        return grad_x, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype), None, None, None


def _fusable_now(layer, adapter: str) -> bool:
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_b.bias is not None:
        return False  # FSDP1 wraps LoRA leaves in their own units; a LoRA bias is PEFT's business
    if hasattr(lora_a.weight, "ds_id") or lora_a.weight.numel() == 0:
        return False  # DeepSpeed ZeRO-3: partitioned, gathered by the leaves' own forward hooks
    dropout = layer.lora_dropout[adapter]
    return isinstance(dropout, (nn.Dropout, nn.Identity)) and adapter not in getattr(layer, "lora_variant", {})


def fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Replacement forward of a PEFT LoRA linear; falls back to PEFT's own where the fused path does not apply."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if (args or kwargs or self.disable_adapters or self.merged or not adapters
            or not all(_fusable_now(self, a) for a in adapters)):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    for adapter in adapters:
        dropout = self.lora_dropout[adapter]
        p = dropout.p if isinstance(dropout, nn.Dropout) and self.training and dropout.p > 0 else 0.0
        # Drawn from torch's generator: seeded runs repeat, and activation checkpointing (which restores the RNG
        # state before recomputing) regenerates the same mask.
        seed = int(torch.randint(0, 2**62, (1,)).item()) if p else None
        delta = LoraDelta.apply(x.to(result.dtype), self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                                float(self.scaling[adapter]), p, seed)
        result = result + delta
    return result


def use_fused_lora(model: nn.Module) -> int:
    """Route every PEFT LoRA linear of `model` through `fused_forward`; returns how many layers it covers."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module, nn.Module) and hasattr(module, "lora_A") \
                and isinstance(module.get_base_layer(), nn.Linear):
            module.forward = types.MethodType(fused_forward, module)
            count += 1
    return count
