"""The causal LM on the meta device with its 4-bit layers in place: what the sharded loader fills and what
`finetune quantize` reads the quantized weights' settings from (below both, so neither imports the other)."""

from __future__ import annotations

import torch
from torch import nn

from finetune.model.attention import supported_attention


def meta_base_model(config, *, dtype: torch.dtype, bnb_config, attn_implementation: str = "auto",
                    trust_remote_code: bool = False) -> nn.Module:
    """The causal LM on the meta device, its Linear layers turned into `Linear4bit` as `from_pretrained` would
    (attention `auto`: what the model's class supports, finetune/model/attention.py)."""
    from accelerate import init_empty_weights

    from finetune.model.classes import from_config

    if attn_implementation == "auto":
        attn_implementation = supported_attention(config)[0]
    with init_empty_weights(include_buffers=False):  # rotary frequencies etc. are computed, not loaded: keep them
        base = from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                           trust_remote_code=trust_remote_code)
    base.tie_weights()  # from_config skips tying on the meta device; from_pretrained ties after loading
    from finetune.model.experts.split import split_experts

    # Fused MoE experts -> one Linear per expert projection (quantized below); refused here if they cannot be.
    split_experts(base, dtype=dtype, quantized=bnb_config is not None)
    if bnb_config is not None:
        from transformers.quantizers import AutoHfQuantizer

        # transformers' own bnb quantizer picks the modules to convert (not lm_head, not tied weights) and builds the
        # Linear4bit layers: the same skeleton `from_pretrained(quantization_config=...)` fills in.
        quantizer = AutoHfQuantizer.from_config(bnb_config, pre_quantized=False)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # as in from_pretrained: the new layers' biases are created in model.dtype
        try:
            quantizer.preprocess_model(model=base, device_map=None, dtype=dtype)
        finally:
            torch.set_default_dtype(previous)
        base.hf_quantizer = quantizer
        quantizer.postprocess_model(base)
    return base
