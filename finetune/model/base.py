"""Tokenizer, 4-bit base model (bitsandbytes NF4), k-bit preparation, and the model built with LoRA (lora/attach.py).

Dtype rule (what makes FSDP sharding of a 4-bit model possible): every non-trainable tensor of the base, the
packed 4-bit weights included (`bnb_4bit_quant_storage`), is stored in `model.dtype`. FSDP then sees one dtype
for the whole base and its mixed-precision cast of it is a no-op. LoRA weights stay fp32 (PEFT's default) as the
optimizer's master weights under every strategy (FSDP1 keeps them in units of their own, one dtype per flat
parameter; FSDP computes with them in model.dtype, see finetune/parallel/checks.py).
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from finetune.distributed import print0
from finetune.model.attention import resolve_attention
from finetune.model.classes import without_towers
from finetune.model.lora.attach import attach_lora, check_adapter
from finetune.model.settings import quantization_config, torch_dtype
from finetune.model.sources.hub import hub_kwargs, is_local, load_error, offline_guard
from finetune.recipe import Recipe

log = logging.getLogger(__name__)

def import_backends() -> None:
    """Import the modelling libraries now (transformers' model classes, PEFT, bitsandbytes)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def load_config(recipe: Recipe):
    """The model's config only (no weights): used by pre-flight checks and the planner (model.adapter checked too).
    model.attn_implementation: auto is resolved here, on the recipe, for this model (finetune/model/attention.py). An
    architecture finetune cannot train is refused here, before any weight loads (finetune/model/support.py)."""
    from finetune.model.support import check_supported

    config = _config(recipe)
    resolve_attention(recipe, config)
    check_supported(config, recipe)
    return config


def _config(recipe: Recipe):
    from transformers import AutoConfig

    check_adapter(recipe)
    if recipe.model.gguf_file:
        from finetune.model.sources.gguf import cached_config

        return cached_config(recipe.model.name_or_path, recipe.model.gguf_file)
    if not is_local(recipe.model.name_or_path) and not recipe.model.revision:
        # Architecture numbers stored in the repo for the recipe library: pre-flight checks and the planner work
        # offline and without a hub round trip. The weights still come from the hub (or its cache) when training.
        from finetune.model.architectures import stored_config

        stored = stored_config(recipe.model.name_or_path)
        if stored is not None:
            return stored
    offline_guard(recipe.model.name_or_path)
    from huggingface_hub.errors import StrictDataclassError  # a config.json field of the wrong type (transformers 5)

    try:
        return AutoConfig.from_pretrained(recipe.model.name_or_path, **hub_kwargs(recipe))
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        raise load_error("config", recipe.model.name_or_path, exc) from None


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    name = recipe.model.tokenizer or recipe.model.name_or_path
    if recipe.model.gguf_file and not recipe.model.tokenizer:
        from finetune.model.sources.gguf import converted_folder  # the tokenizer rebuilt from the GGUF vocabulary

        name = str(converted_folder(recipe.model.name_or_path, recipe.model.gguf_file))
    offline_guard(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **hub_kwargs(recipe))
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a special token of the wrong type in its config
        raise load_error("tokenizer", name, exc) from None
    if recipe.model.chat_template:  # a base model's missing template, or another than the tokenizer's
        from finetune.chat_templates import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(recipe.model.chat_template)
    if recipe.model.adapter:  # the template the adapter was trained with, where the recipe sets none (lora/kept.py)
        from finetune.model.lora.kept import use_start_template

        use_start_template(recipe, tokenizer)
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels -100, attention mask 0), so eos is a safe pad.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def load_base_model(recipe: Recipe, *, device: torch.device, device_map: dict | None = None) -> nn.Module:
    """The causal LM, quantized to 4 bits while loading (unless `quantization: none`), all base weights frozen."""
    from finetune.model.classes import from_pretrained

    offline_guard(recipe.model.name_or_path)
    if recipe.model.attn_implementation == "flash_attention_2" and device.type != "cuda":
        print0("[finetune] note: model.attn_implementation: flash_attention_2 runs on CUDA only (the run trained on a "
               "GPU); auto here", file=sys.stderr)
        recipe.model.attn_implementation = "auto"
    if recipe.model.attn_implementation == "auto":
        load_config(recipe)  # resolves it for this model
    kwargs = dict(
        dtype=torch_dtype(recipe.model.dtype),
        attn_implementation=recipe.model.attn_implementation,
        quantization_config=quantization_config(recipe),
        **hub_kwargs(recipe),
    )
    name = recipe.model.name_or_path
    if recipe.model.gguf_file:
        from finetune.model.sources.gguf import converted_folder  # dequantized once into a cached transformers folder

        name = str(converted_folder(recipe.model.name_or_path, recipe.model.gguf_file))
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type == "cuda":
        kwargs["device_map"] = {"": device}
    if kwargs["quantization_config"] is not None and not recipe.model.gguf_file:
        from finetune.model.experts.families.gpt_oss import refuse_mxfp4_in_from_pretrained

        refuse_mxfp4_in_from_pretrained(load_config(recipe), name)
    try:
        model = from_pretrained(name, load_config(recipe), **kwargs)
    except (OSError, ValueError) as exc:
        raise load_error("model", name, exc) from None
    from finetune.model.experts.split import quantize_split_experts, split_experts

    # transformers leaves fused MoE experts in model.dtype: one Linear per expert projection, 4-bit like the rest.
    quantized = kwargs["quantization_config"] is not None
    if split_experts(model, dtype=kwargs["dtype"], quantized=quantized) and quantized:
        quantize_split_experts(model, kwargs["quantization_config"], load_dtype=kwargs["dtype"])
    keep_4bit_weights_trainable_on_cpu(model)
    return model


def keep_4bit_weights_trainable_on_cpu(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout.

    bitsandbytes 0.50 repacks a Linear4bit weight in place the first time it runs in eval mode with an input that
    needs no grad (evaluation, generation) on a CPU with AVX512-BF16. That layout has no backward kernel, so every
    later training step silently loses the gradient through all frozen 4-bit weights. Returns the layers touched.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def prepare_for_kbit_training(model: nn.Module, *, gradient_checkpointing: bool) -> None:
    """Freeze the base and set up gradient checkpointing, keeping every base tensor in its loaded dtype.

    PEFT's `prepare_model_for_kbit_training` also upcasts every bf16/fp16 weight (embeddings, lm_head, norms) to
    fp32: that doubles those tensors' memory and breaks FSDP1's one-dtype-per-flat-parameter rule. We keep its
    other effects: frozen base, inputs that require grad (so checkpointed blocks get gradients), and the cache off.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    model.config.use_cache = False
    if gradient_checkpointing:
        # Non-reentrant: the reentrant variant re-runs FSDP's all-gathers and drops grads of inputs that need none.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()


def build_model(recipe: Recipe, *, device: torch.device, device_map: dict | None = None, gradient_checkpointing: bool):
    """4-bit (or plain) base + LoRA, ready for the parallel wrap (a multimodal model transformers maps to no causal LM
    without its towers, as the per-tensor loaders build it: model/classes.py)."""
    base = without_towers(load_base_model(recipe, device=device, device_map=device_map))
    prepare_for_kbit_training(base, gradient_checkpointing=gradient_checkpointing)
    return attach_lora(base, recipe)


def stored_numel(param: torch.Tensor) -> int:
    """Elements as stored after loading: a 4-bit weight not quantized yet (meta skeleton) counts its packed size."""
    if type(param).__name__ == "Params4bit" and not getattr(param, "bnb_quantized", True):
        packed_bytes = (param.numel() + 1) // 2  # two 4-bit values per byte
        return -(-packed_bytes // param.quant_storage.itemsize)
    return param.numel()


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) element counts as stored (a packed 4-bit weight counts its storage elements)."""
    trainable = sum(stored_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(stored_numel(p) for p in model.parameters())
    return trainable, total
