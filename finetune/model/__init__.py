"""Model: the tokenizer, the 4-bit base (bitsandbytes NF4) with LoRA attached (PEFT), loaded whole or unit by unit.

    base.py          load_config, load_tokenizer, load_base_model, build_model (4-bit + k-bit prep + LoRA), the LoRA init
    loading.py       load_model: the sharded loader (a meta skeleton, each FSDP unit read and quantized on its own)
    gguf.py          models shipped as GGUF files, converted once into an ordinary transformers folder
    lora_fused.py    the fused LoRA forward (dropout, A and B in one autograd function)
    architectures/   stored architecture numbers of the library's models (the hub may be unreachable)
"""

from finetune.model.base import (
    build_model,
    count_parameters,
    import_backends,
    is_local,
    keep_4bit_weights_trainable_on_cpu,
    load_base_model,
    load_config,
    load_tokenizer,
    lora_checksum,
    lora_config,
    torch_dtype,
)
from finetune.model.loading import LoadedModel, load_model, release_freed_memory

__all__ = ["LoadedModel", "build_model", "count_parameters", "import_backends", "is_local", "keep_4bit_weights_trainable_on_cpu", "load_base_model", "load_config", "load_model",
           "load_tokenizer", "lora_checksum", "lora_config", "release_freed_memory", "torch_dtype"]
