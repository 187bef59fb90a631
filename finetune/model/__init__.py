"""Model: the tokenizer, the 4-bit base (bitsandbytes NF4) with LoRA attached (PEFT), loaded whole or unit by unit.

    base.py          load_config, load_tokenizer, load_base_model, build_model (4-bit + k-bit prep + LoRA), the adapter
    settings.py      the recipe's dtypes, BitsAndBytesConfig and hub arguments; local or hub, the offline guard, load errors
    lora_init.py     the LoRA start seeded by (seed, tensor name), and its fingerprint across ranks
    loading.py       load_model: the sharded loader (a meta skeleton, each FSDP unit read and quantized on its own)
    skeleton.py      the meta-device model with its 4-bit layers (the sharded loader's and `finetune quantize`'s)
    materialize.py   fills a meta skeleton one module at a time (base weights quantized on the device, LoRA from its seed)
    support.py       the architectures the suite's matrix trains; refusals (no sdpa, fused experts) before weights load
    shard_reads.py   FSDP2: each rank reads and quantizes only its own chunk of each tensor (bitwise the whole tensor's)
    checkpoints/     reading the base: safetensors files (headers, the folder, per-tensor reads), transformers' key renames
    quantization/    4-bit checkpoints as input, `finetune quantize`'s writer, the 4-bit cache (model.quantized_cache)
    experts/         mixture-of-experts layers split into one Linear per expert projection, one module per layout family
    gguf.py          models shipped as GGUF files, converted once into an ordinary transformers folder
    lora_fused.py    the fused LoRA forward (dropout, A and B in one autograd function)
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
    lora_config,
)
from finetune.model.loading import LoadedModel, load_model
from finetune.model.lora.init import lora_checksum
from finetune.model.settings import is_local, torch_dtype

__all__ = ["LoadedModel", "build_model", "count_parameters", "import_backends", "is_local", "keep_4bit_weights_trainable_on_cpu", "load_base_model", "load_config", "load_model",
           "load_tokenizer", "lora_checksum", "lora_config", "release_freed_memory", "torch_dtype"]
