"""Tokenizer, 4-bit base model (bitsandbytes NF4), k-bit preparation and LoRA (PEFT).

Dtype rule (what makes FSDP sharding of a 4-bit model possible): every non-trainable tensor of the base, the
packed 4-bit weights included (`bnb_4bit_quant_storage`), is stored in `model.dtype`. FSDP then sees one dtype
for the whole base and its mixed-precision cast of it is a no-op. LoRA weights stay fp32 (PEFT's default) as the
optimizer's master weights under every strategy (FSDP1 keeps them in units of their own, one dtype per flat
parameter; FSDP computes with them in model.dtype, see finetune/parallel/checks.py).
"""

from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.recipe import Recipe

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def import_backends() -> None:
    """Import the modelling libraries now (transformers' model classes, PEFT, bitsandbytes)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def is_local(name_or_path: str) -> bool:
    return Path(name_or_path).expanduser().exists()


def _hub_kwargs(recipe: Recipe) -> dict:
    kwargs = {"trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.revision:
        kwargs["revision"] = recipe.model.revision
    return kwargs


def _load_error(what: str, name: str, exc: Exception) -> ModelLoadError:
    local = is_local(name)
    if local:
        fix = f"check that {name} is a saved transformers folder (config.json, weights, tokenizer files)."
    else:
        fix = (
            "this looks like a hub id and it is neither in the local cache nor fetchable now (offline, gated or "
            "misspelled). Download it where the hub "
            f"is reachable (`hf download {name} --local-dir DIR`) and set model.name_or_path to DIR, or set "
            "HF_HUB_OFFLINE=1 to use only the local cache."
        )
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what} ({reason}). Fix: {fix}")


def offline_guard(name_or_path: str) -> None:
    """Fail fast (not hang) when a hub id is needed and the hub cannot be reached: use the local cache only."""
    if is_local(name_or_path):
        return
    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()


def load_config(recipe: Recipe):
    """The model's config only (no weights): used by pre-flight checks and the planner (model.adapter checked too).
    An architecture finetune cannot train is refused here, before any weight loads (finetune/model/support.py)."""
    from finetune.model.support import check_supported

    config = _read_config(recipe)
    check_supported(config, recipe)
    return config


def _read_config(recipe: Recipe):
    from transformers import AutoConfig

    check_adapter(recipe)
    if recipe.model.gguf_file:
        from finetune.model.gguf import cached_config

        return cached_config(recipe.model.name_or_path, recipe.model.gguf_file)
    if not is_local(recipe.model.name_or_path) and not recipe.model.revision:
        # Architecture numbers stored in the repo for the recipe library: pre-flight checks and the planner work
        # offline and without a hub round trip. The weights still come from the hub (or its cache) when training.
        from finetune.model.architectures import stored_config

        stored = stored_config(recipe.model.name_or_path)
        if stored is not None:
            return stored
    offline_guard(recipe.model.name_or_path)
    try:
        return AutoConfig.from_pretrained(recipe.model.name_or_path, **_hub_kwargs(recipe))
    except (OSError, ValueError) as exc:
        raise _load_error("config", recipe.model.name_or_path, exc) from None


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    name = recipe.model.tokenizer or recipe.model.name_or_path
    if recipe.model.gguf_file and not recipe.model.tokenizer:
        from finetune.model.gguf import converted_folder  # the tokenizer rebuilt from the GGUF vocabulary

        name = str(converted_folder(recipe.model.name_or_path, recipe.model.gguf_file))
    offline_guard(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **_hub_kwargs(recipe))
    except (OSError, ValueError) as exc:
        raise _load_error("tokenizer", name, exc) from None
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels -100, attention mask 0), so eos is a safe pad.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def quantization_config(recipe: Recipe):
    """BitsAndBytesConfig for the recipe, or None for `quantization: none`."""
    q = recipe.quantization
    if q.method == "none":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.method,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(recipe.compute_dtype),
        bnb_4bit_quant_storage=torch_dtype(q.quant_storage or recipe.model.dtype),
    )


def load_base_model(recipe: Recipe, *, device: torch.device, device_map: dict | None = None) -> nn.Module:
    """The causal LM, quantized to 4 bits while loading (unless `quantization: none`), all base weights frozen."""
    from transformers import AutoModelForCausalLM

    offline_guard(recipe.model.name_or_path)
    kwargs = dict(
        dtype=torch_dtype(recipe.model.dtype),
        attn_implementation=recipe.model.attn_implementation,
        quantization_config=quantization_config(recipe),
        **_hub_kwargs(recipe),
    )
    name = recipe.model.name_or_path
    if recipe.model.gguf_file:
        from finetune.model.gguf import converted_folder  # dequantized once into a cached transformers folder

        name = str(converted_folder(recipe.model.name_or_path, recipe.model.gguf_file))
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type == "cuda":
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise _load_error("model", name, exc) from None
    from finetune.model.experts import quantize_split_experts, split_experts

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


def lora_config(recipe: Recipe):
    """The LoRA layout: the recipe's lora section, or model.adapter's own (r, alpha, targets) with the recipe's dropout."""
    from peft import LoraConfig

    lora = recipe.lora
    if recipe.model.adapter:
        config = LoraConfig.from_pretrained(str(check_adapter(recipe)))
        config.lora_dropout, config.inference_mode = lora.dropout, False
        return config
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        bias=lora.bias,
        task_type="CAUSAL_LM",
    )


def check_adapter(recipe: Recipe) -> Path | None:
    """model.adapter's folder, checked before any weight loads (a PEFT adapter: config + safetensors)."""
    if not recipe.model.adapter:
        return None
    folder = Path(recipe.model.adapter).expanduser()
    missing = [name for name in ("adapter_config.json", "adapter_model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"model.adapter ({folder}): {', '.join(missing)} not found, so it is not a PEFT adapter folder. Fix: point it "
            "at the adapter/ folder of a finished run (e.g. runs/sft/adapter), or at an adapter exported by PEFT.")
    return folder


def adapter_start(recipe: Recipe, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """model.adapter's tensors, keyed as `lora_tensor_name` keys a model's LoRA parameters without the adapter name.
    On a mixture-of-experts `model`, keys named as the checkpoint names them (an adapter from `finetune export`) are
    renamed to the model's names (transformers' renames, finetune/model/conversions.py)."""
    folder = check_adapter(recipe)
    if folder is None:
        return None
    from safetensors.torch import load_file

    from finetune.model.experts import has_routed_experts

    tensors = {key.removeprefix("base_model.model."): value
               for key, value in load_file(str(folder / "adapter_model.safetensors")).items()}
    if model is None or not has_routed_experts(model):
        return tensors
    from finetune.model.conversions import model_names

    names = model_names(model, list(tensors))
    return {names[key]: value for key, value in tensors.items()}


def attach_lora(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Wrap the base in a PeftModel; only LoRA parameters require grad afterwards. LoRA starts from `init_lora_weights`
    (or from model.adapter's values)."""
    from finetune.model.experts import get_peft_model

    peft_model = get_peft_model(model, lora_config(recipe), train_router=recipe.lora.train_router)
    init_lora_weights(peft_model, recipe.train.seed, start=adapter_start(recipe, model))
    if recipe.lora.fused:
        from finetune.model.lora_fused import use_fused_lora

        use_fused_lora(peft_model)  # falls back to PEFT's forward per call where it does not apply (lora_fused.py)
    return peft_model


def build_model(recipe: Recipe, *, device: torch.device, device_map: dict | None = None, gradient_checkpointing: bool):
    """4-bit (or plain) base + LoRA, ready for the parallel wrap."""
    base = load_base_model(recipe, device=device, device_map=device_map)
    prepare_for_kbit_training(base, gradient_checkpointing=gradient_checkpointing)
    return attach_lora(base, recipe)


# ------------------------------------------------------------------------------------------- LoRA init, seeded
def lora_tensor_name(model_name: str) -> str:
    """The module path of a LoRA tensor without PEFT's wrapper levels: the same for every loader and wrapper."""
    return model_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(lora_tensor_name(name).encode())) % (2**63)


def init_lora_tensor(tensor: torch.Tensor, name: str, seed: int, start: dict[str, torch.Tensor] | None = None) -> bool:
    """PEFT's default LoRA init (A: kaiming-uniform with a=sqrt(5), B: zeros), A drawn from a generator seeded by
    (seed, name). Returns False for tensors that are not A/B matrices (DoRA magnitudes keep PEFT's values).

    Why not PEFT's own draw from the global generator: its values depend on the order in which modules are created
    and on the device of the base (PEFT rounds the init through the base's dtype). Seeding by name makes the
    adapter's start the same for the per-rank loader and sharded loading, on every rank and every device.
    `start` (model.adapter's tensors, `adapter_start`): A and B are copied from it instead.
    """
    if start is not None and ".lora_" in name:
        key = lora_tensor_name(name).replace(".default.", ".")
        if key not in start or start[key].shape != tensor.shape:
            found = "missing" if key not in start else f"shape {list(start[key].shape)}, the model's {list(tensor.shape)}"
            raise ModelLoadError(f"model.adapter: tensor {key} is {found}: the adapter was not trained for this base model "
                                 "and LoRA layout. Fix: use the adapter of a run on the same model.name_or_path.")
        tensor.copy_(start[key])
        return True
    if ".lora_A." in name or ".lora_embedding_A." in name:
        generator = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        return True
    if ".lora_B." in name or ".lora_embedding_B." in name:
        nn.init.zeros_(tensor)
        return True
    return False


def lora_fingerprint(tensor: torch.Tensor, name: str) -> float:
    """A float that changes with any LoRA value and with its name (summed over tensors, compared across ranks)."""
    weight = 1.0 + (zlib.crc32(lora_tensor_name(name).encode()) % 997) / 997.0
    return float(tensor.detach().to("cpu", torch.float64).sum()) * weight


def init_lora_weights(model: nn.Module, seed: int, *, start: dict[str, torch.Tensor] | None = None) -> float:
    """Initialise every LoRA A/B tensor of a loaded PeftModel from its seed (or `start`); returns the checksum."""
    checksum = 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" not in name:
                continue
            value = param.detach().to("cpu", copy=True)
            init_lora_tensor(value, name, seed, start)
            param.copy_(value.to(param.device))
            checksum += lora_fingerprint(value, name)
    return checksum


def lora_checksum(model: nn.Module) -> float:
    """The fingerprint of the LoRA tensors as they are now (compare across ranks: all must start the same)."""
    return sum(lora_fingerprint(p, name) for name, p in model.named_parameters() if ".lora_" in name)


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
