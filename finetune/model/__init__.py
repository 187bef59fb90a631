"""Model: the tokenizer, the 4-bit base (bitsandbytes NF4) with LoRA attached (PEFT), loaded whole or unit by unit.

    base.py          load_config, load_tokenizer, load_base_model, build_model (4-bit + k-bit prep + LoRA), the LoRA init
    loading.py       load_model: the sharded loader (a meta skeleton, each FSDP unit read and quantized on its own)
    checkpoint_files.py  the base's safetensors files: headers, the folder (local, GGUF-converted, hub), per-tensor reads
    materialize.py   fills a meta skeleton one module at a time (base weights quantized on the device, LoRA from its seed)
    support.py       the architectures the suite's matrix trains; refusals (no sdpa, fused experts) before weights load
    experts.py       mixture-of-experts layers split into one Linear per expert projection (4-bit, LoRA on each)
    conversions.py   transformers' checkpoint key renames and expert fusion applied to a checkpoint index
    prequantized.py  4-bit checkpoints (transformers' bitsandbytes layout) as input: settings checked, bytes kept as stored
    quantize.py      writes a bf16 base as such a 4-bit checkpoint, one tensor at a time (`finetune quantize`, the cache)
    quantized_cache.py  model.quantized_cache: auto: a bf16 base quantized once, its 4-bit bytes loaded at later starts
    shard_reads.py   FSDP2: each rank reads and quantizes only its own chunk of each tensor (bitwise the whole tensor's)
    gguf.py          models shipped as GGUF files, converted once into an ordinary transformers folder
    lora_fused.py    the fused LoRA forward (dropout, A and B in one autograd function)
    architectures/   stored architecture numbers of the library's models (the hub may be unreachable)
"""

from finetune.host_memory import release_freed_memory
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
from finetune.model.loading import LoadedModel, load_model

__all__ = ["LoadedModel", "build_model", "count_parameters", "import_backends", "is_local", "keep_4bit_weights_trainable_on_cpu", "load_base_model", "load_config", "load_model",
           "load_tokenizer", "lora_checksum", "lora_config", "release_freed_memory", "torch_dtype"]
