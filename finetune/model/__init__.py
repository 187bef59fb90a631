"""Model: the tokenizer, the 4-bit base (bitsandbytes NF4) with LoRA attached (PEFT), loaded whole or unit by unit.

    base.py          load_config, load_tokenizer, load_base_model, build_model (4-bit + k-bit prep + LoRA)
    settings.py      the recipe's dtypes and BitsAndBytesConfig
    loading.py       load_model: the sharded loader (a meta skeleton, each FSDP unit read and quantized on its own)
    skeleton.py      the meta-device model with its 4-bit layers (the sharded loader's and `finetune quantize`'s)
    materialize.py   fills a meta skeleton one module at a time (base weights quantized on the device, LoRA from its seed)
    support.py       the architectures the suite's matrix trains; refusals (no sdpa, fused experts) before weights load
    quantization/    4-bit checkpoints as input, `finetune quantize`'s writer, the 4-bit cache (model.quantized_cache)
    experts/         mixture-of-experts layers split into one Linear per expert projection, one module per layout family
    sources/         where the base comes from: a folder or the hub (the offline guard, load errors), safetensors files
                     (headers, per-tensor reads), transformers' key renames, each rank's own chunk of each tensor, GGUF
    lora/            LoRA attached (the config, model.adapter's start and the run's kept copy of it: kept.py; a saved
                     adapter's files checked: saved_adapter.py), initialized by (seed, tensor name), fused
    file_sums.py     sampled checksums of cache files (data and 4-bit caches): a zeroed or garbled file is rebuilt
    reward_head.py   a reward model's scalar head (`score`, trained in full), saved as PEFT's SEQ_CLS adapter
    architectures/   stored architecture numbers of the library's models (the hub may be unreachable)
"""

from finetune.host_memory import release_freed_memory
from finetune.model.base import (
    build_model,
    count_parameters,
    import_backends,
    keep_4bit_weights_trainable_on_cpu,
    load_base_model,
    load_config,
    load_tokenizer,
)
from finetune.model.loading import LoadedModel, load_model
from finetune.model.lora.attach import lora_config
from finetune.model.lora.init import lora_checksum
from finetune.model.reward_head import attach_score_head
from finetune.recipe.objectives import spec_of


def with_score_head(peft_model, recipe, device):
    """`peft_model`, with a reward model's scalar head attached when the objective has one (train.objective: reward;
    reward_head.py)."""
    if spec_of(recipe.train.objective).head == "score":
        attach_score_head(peft_model, seed=recipe.train.seed, device=device)
    return peft_model

from finetune.model.settings import torch_dtype
from finetune.model.sources.hub import is_local


def adapter_config(peft_model, recipe):
    """The PEFT config the run's adapter is saved with: a reward model's as SEQ_CLS with its score head."""
    from finetune.model.reward_head import sequence_classification_config

    config = peft_model.peft_config["default"]
    return sequence_classification_config(config) if spec_of(recipe.train.objective).head == "score" else config


__all__ = ["LoadedModel", "adapter_config", "attach_score_head", "build_model", "count_parameters", "import_backends",
           "is_local", "keep_4bit_weights_trainable_on_cpu", "load_base_model", "load_config", "load_model",
           "load_tokenizer", "lora_checksum", "lora_config", "release_freed_memory", "torch_dtype",
           "with_score_head"]
