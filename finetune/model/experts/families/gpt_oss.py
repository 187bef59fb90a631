"""The gpt-oss expert layout (gpt-oss-20b and -120b): `gate_up_proj` experts x hidden x 2*inter, stored transposed (in x
out) with gate and up interleaved column by column (`[..., ::2]` gate, `[..., 1::2]` up), `down_proj` experts x inter x
hidden, a bias on each (`gate_up_proj_bias`, `down_proj_bias`) and the clamped SwiGLU of `GptOssExperts._apply_gate`.

Each expert becomes three `nn.Linear` (out x in, with bias): `gate_proj`, `up_proj`, `down_proj` (the names of the
per-expert layout gpt-oss adapters use); the weights are stored in 4 bits, the biases stay in model.dtype (bitsandbytes
quantizes weights only). The hub's checkpoints store the experts' weights as MXFP4 (`*_blocks` 4-bit e2m1 values in
32-element blocks, `*_scales` one e8m0 exponent per block): read one expert at a time and dequantized with
transformers' own `convert_moe_packed_tensors` (a bf16 checkpoint holds the same tensors unpacked), then NF4 like
every other weight."""

from __future__ import annotations

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.experts.routed import ExpertMLP, ExpertNames, RoutedExperts
from finetune.model.sources.files import CheckpointIndex, DerivedView

MODELS = "gpt-oss-20b, gpt-oss-120b"
NAMES = ExpertNames(("gate_proj", "up_proj"), ("down_proj",))
ROUTED = RoutedExperts  # called as transformers' experts: (states, top-k index, top-k weights)
TRANSPOSED = False  # read through `expert_views`, not as blocks of the stored tensors
STORED_IN_OUT = True  # the fused parameters are experts x in x out
MXFP4_BLOCK = 32  # values per e8m0 scale; 16 bytes of two e2m1 values each


def why_not(module: nn.Module) -> str | None:
    """Why this fused experts module is not gpt-oss's layout, or None."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    if not isinstance(module, GptOssExperts):
        return "it is not gpt-oss's expert layout (transposed, interleaved, biased)"
    return None


def names(model: nn.Module, name: str, module: nn.Module) -> ExpertNames:
    return NAMES


def sizes(module: nn.Module, names: ExpertNames) -> tuple[int, int, int]:
    """(experts, hidden, intermediate): gate_up_proj is experts x hidden x 2*inter."""
    experts, hidden, inter_parts = module.gate_up_proj.shape
    return experts, hidden, inter_parts // 2


class ClampedSwiGLUExpert(ExpertMLP):
    """One gpt-oss expert: `GptOssExperts._apply_gate` on separate gate and up projections (biased Linears), the same
    elementwise operations in the same order: gate clamped above at `limit`, up clamped to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate), then down (biased)."""

    def __init__(self, names: ExpertNames, hidden: int, inter: int, *, alpha: float, limit: float, dtype=None):
        nn.Module.__init__(self)
        self.names, self.alpha, self.limit = names, alpha, limit
        for name in names.gate_up:
            self.add_module(name, nn.Linear(hidden, inter, bias=True, dtype=dtype))
        self.add_module(names.down[0], nn.Linear(inter, hidden, bias=True, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (getattr(self, name)(x) for name in self.names.gate_up)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return getattr(self, self.names.down[0])((up + 1) * glu)


def new_expert(module: nn.Module, names: ExpertNames, hidden: int, inter: int, *, dtype) -> ExpertMLP:
    return ClampedSwiGLUExpert(names, hidden, inter, alpha=module.alpha, limit=module.limit, dtype=dtype)


def fused_config(module: nn.Module):
    """The config transformers' experts module was built from, to rebuild it for export."""
    return getattr(module, "config", None)


def copy_in(split: RoutedExperts, module: nn.Module) -> None:
    """Each expert's weights (transposed to out x in) and biases, gate and up de-interleaved."""
    for index, expert in enumerate(split):
        gate_up, gate_up_bias = module.gate_up_proj[index], module.gate_up_proj_bias[index]
        for part, name in enumerate(NAMES.gate_up):
            getattr(expert, name).weight.copy_(gate_up[:, part::2].t())
            getattr(expert, name).bias.copy_(gate_up_bias[part::2])
        expert.down_proj.weight.copy_(module.down_proj[index].t())
        expert.down_proj.bias.copy_(module.down_proj_bias[index])


def fused_tensors(split: RoutedExperts) -> dict[str, torch.Tensor]:
    """`copy_in` reversed: gate and up columns interleaved again, weights transposed back to in x out."""
    def interleaved(expert, attribute):
        gate, up = (getattr(getattr(expert, name), attribute) for name in NAMES.gate_up)
        if attribute == "weight":
            gate, up = gate.t(), up.t()
        return torch.stack([gate, up], dim=-1).flatten(-2)  # ..., inter, 2 -> ..., 2*inter: gate at even columns

    return {"gate_up_proj": torch.stack([interleaved(expert, "weight") for expert in split]),
            "gate_up_proj_bias": torch.stack([interleaved(expert, "bias") for expert in split]),
            "down_proj": torch.stack([expert.down_proj.weight.t() for expert in split]),
            "down_proj_bias": torch.stack([expert.down_proj.bias for expert in split])}


# ------------------------------------------------------------------------------------------------ checkpoint reads
def expert_views(index: CheckpointIndex, name: str, split: RoutedExperts) -> int:
    """Add to `index` each expert's weights and biases, read out of the checkpoint's fused tensors: bf16
    (`gate_up_proj`, experts x in x out) or MXFP4 (`gate_up_proj_blocks` experts x out x in/32 x 16, `_scales`
    experts x out x in/32: one expert's slab read and dequantized). Returns the number of views added."""
    added = 0
    for fused, parts in (("gate_up_proj", NAMES.gate_up), ("down_proj", NAMES.down)):
        stored = f"{name}.{fused}"
        if stored in index.shapes:
            experts, width, out_parts = index.shapes[stored]
            weight = _unpacked_weight
            sources = (stored,)
        elif f"{stored}_blocks" in index.shapes and f"{stored}_scales" in index.shapes:
            experts, out_parts, groups, group_bytes = index.shapes[f"{stored}_blocks"]
            width = groups * group_bytes * 2
            weight = _mxfp4_weight
            sources = (f"{stored}_blocks", f"{stored}_scales")
        else:
            continue
        bias = f"{stored}_bias"
        for expert in range(experts):
            # gate and up: one read of the expert's slab (and bias row) for both parts, not one per part
            slab, bias_row = _SharedSlab(len(parts), _columns), _SharedSlab(len(parts), _entries)
            for part, part_name in enumerate(parts):
                key, shape = f"{name}.{expert}.{part_name}", (out_parts // len(parts), width)
                if f"{key}.weight" not in index.shapes:
                    index.add_view(f"{key}.weight", DerivedView(sources, slab.part(weight(sources, expert), part)), shape)
                    added += 1
                if f"{key}.bias" not in index.shapes and bias in index.shapes:
                    index.add_view(f"{key}.bias", DerivedView((bias,), bias_row.part(_bias(bias, expert), part)),
                                   shape[:1])
                    added += 1
    return added


class _SharedSlab:
    """One expert's slab of a fused tensor (in x out, dequantized; or its bias row), read once for all its parts: gate
    and up are interleaved columns of the same stored rows (and MXFP4 blocks), so a read per part would read it twice.
    Held from the first part's read until every part has taken its share (`pick`); a part read again reads it again."""

    def __init__(self, parts: int, pick):
        self.parts, self.pick, self.value, self.pending = parts, pick, None, set()

    def part(self, read_slab, part: int):
        def read(get):
            if self.value is None or part not in self.pending:
                self.value, self.pending = read_slab(get), set(range(self.parts))
            self.pending.discard(part)
            value = self.value
            if not self.pending:
                self.value = None
            return self.pick(value, part, self.parts)
        return read


def _columns(slab: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """Part `part` of an in x out slab whose parts are interleaved columns, as an (out, in) weight."""
    return slab[:, part::parts].t().contiguous()


def _entries(row: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    return row[part::parts].contiguous()


def refuse_mxfp4_in_from_pretrained(config, name: str) -> None:
    """An MXFP4 checkpoint (config.json `quantization_config.quant_method: mxfp4`, as openai/gpt-oss-* ship) is read by
    finetune's per-tensor loader only: transformers' `from_pretrained` takes one quantizer, so it cannot dequantize
    MXFP4 and store NF4 in one load. Refused, with the fix, where a run would go through it."""
    method = (getattr(config, "quantization_config", None) or {})
    method = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    if str(method).lower().endswith("mxfp4"):
        raise ModelLoadError(
            f"model.name_or_path `{name}`: its experts are stored in MXFP4 (config.json "
            "quantization_config.quant_method: mxfp4). finetune dequantizes them to bf16 and stores NF4 in its "
            "tensor-by-tensor loader, which this run does not use (a layer split over several devices, lora.dora, or "
            "a checkpoint without safetensors goes through transformers' from_pretrained, which cannot combine MXFP4 "
            "with bitsandbytes). Fix: use a bf16 "
            "checkpoint of the model (e.g. unsloth/gpt-oss-20b-BF16), or train with FSDP, DDP or on one device "
            "without lora.dora (the tensor-by-tensor loader reads this checkpoint).")


def _unpacked_weight(sources, expert):
    def read(get):  # expert x in x out: this expert's slab
        return get(sources[0], (expert,))
    return read


def _mxfp4_weight(sources, expert):
    def read(get):  # this expert's blocks and scales (out x ...), dequantized as transformers dequantizes them
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = get(sources[0], (slice(expert, expert + 1),)), get(sources[1], (slice(expert, expert + 1),))
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)[0]  # in x out
    return read


def _bias(stored, expert):
    def read(get):
        return get(stored, (expert,))
    return read


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weight` (experts x in x out, the fused layout) as the hub's gpt-oss checkpoints store them:
    experts x out x in/32 x 16 bytes (two e2m1 values a byte, the even element in the low nibble) and experts x out x
    in/32 e8m0 exponents (biased by 127), each block's scale the power of two that brings its largest magnitude within
    e2m1's 6.0. (transformers' own quantizer needs triton; this follows the OCP MX spec, and is what tests write.)"""
    from transformers.integrations.mxfp4 import FP4_VALUES

    values = weight.float().transpose(1, 2)  # experts x out x in
    blocks = values.reshape(*values.shape[:-1], -1, MXFP4_BLOCK)
    largest = blocks.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = (torch.floor(torch.log2(largest)) - 2).clamp(-127, 127)  # e2m1's largest power of two is 4 = 2**2
    scaled = blocks / torch.exp2(exponent)[..., None]
    grid = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - grid).abs().argmin(dim=-1).to(torch.uint8)  # nearest e2m1 value (ties: first)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)
