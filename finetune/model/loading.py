"""Sharded loading for FSDP: build the model without weights, then read, quantize and shard one unit at a time.

Why: with the v1 loader every rank quantized a full copy of the base before FSDP sharded it, so a 70B model needed
~40 GiB per GPU just to start. Here no rank ever holds more of the base than its own shard plus the unit being
built:

  1. skeleton: the model on the meta device (only the small non-persistent buffers, such as rotary frequencies,
     are real), Linear layers replaced by bitsandbytes `Linear4bit` exactly as transformers' own bnb quantizer does,
     k-bit preparation, LoRA attached by PEFT on the meta device (`low_cpu_mem_usage`);
  2. the checkpoint is checked against the skeleton (every tensor present, every shape right) before any weight is
     read: a bad checkpoint fails in a second, naming the tensor and the file;
  3. one unit at a time (a decoder layer; at the end the rest: embeddings, final norm, LM head): each tensor is read
     on its own from the memory-mapped safetensors file, cast and quantized on the rank's device exactly as
     `from_pretrained` does (so the packed bytes and quant state are bitwise the same), LoRA is initialised, and
     the unit is sharded at once (FSDP2: `fully_shard(layer)`; FSDP1: the same per-unit materialisation through
     FSDP's `param_init_fn`), which frees everything but this rank's shard.

LoRA initialisation does not depend on the order in which weights are built: each LoRA module draws its A matrix
from a generator seeded by (train.seed, module name), so every loader and every rank starts from the same adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from finetune import held_signals
from finetune.distributed import print0
from finetune.errors import ModelLoadError
from finetune.model.experts.lora import check_train_router
from finetune.model.experts.split import fused_expert_views
from finetune.model.lora.attach import adapter_start, check_target_modules, lora_config
from finetune.model.lora.init import lora_checksum
from finetune.model.materialize import (  # noqa: F401
    Materializer,
    alive_tensor_bytes,
    checkpoint_name,
    is_lora_name,
    materializer,
    place_buffers,
    tied_groups,
    untie_stored_apart,
)
from finetune.model.quantization import cache as quantized_cache
from finetune.model.quantization import prequantized
from finetune.model.quantization.prequantized import PackedLayout
from finetune.model.skeleton import meta_base_model
from finetune.model.sources.conversions import convert_index
from finetune.model.sources.files import (  # noqa: F401
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointIndex,
    TensorReader,
    checkpoint_folder,
    checkpoint_index,
    convert_to_safetensors,
)
from finetune.model.sources.shard_reads import RankShard
from finetune.model.support import converted_at_load
from finetune.recipe import Recipe


# ------------------------------------------------------------------------------------------------ the skeleton
def build_skeleton(recipe: Recipe, config, *, gradient_checkpointing: bool) -> nn.Module:
    """The PeftModel (4-bit layers and LoRA included) with every parameter on the meta device."""
    from finetune.model import base as model_stage
    from finetune.model.experts.lora import get_peft_model

    # A 4-bit checkpoint's llm_int8_skip_modules stay unquantized, as transformers reloads such a checkpoint.
    base = meta_base_model(config, dtype=model_stage.torch_dtype(recipe.model.dtype),
                           bnb_config=prequantized.skeleton_quantization(recipe, config),
                           attn_implementation=recipe.model.attn_implementation,
                           trust_remote_code=recipe.model.trust_remote_code)
    with held_signals.checks_every_rank_makes():  # a misspelled target: refused before any weight is read
        check_target_modules(recipe, base)
    model_stage.keep_4bit_weights_trainable_on_cpu(base)
    model_stage.prepare_for_kbit_training(base, gradient_checkpointing=gradient_checkpointing)
    peft_model = get_peft_model(base, lora_config(recipe, base), train_router=recipe.lora.train_router,
                                low_cpu_mem_usage=True)
    if recipe.lora.fused:
        from finetune.model.lora.fused import use_fused_lora

        use_fused_lora(peft_model)
    return peft_model


def check_lora_targets(recipe: Recipe, config) -> None:
    """lora.target_modules against the module names of `config`'s model, built on the meta device with its experts
    split as the loaders split them (no weight read): for the loads through `from_pretrained` (layer split, DoRA,
    a checkpoint that is not safetensors), which attach LoRA only after every weight is loaded and quantized. PEFT
    drops a misspelled name beside good ones without a word (fewer LoRAs trained) and fails with a traceback when
    no name matches or a name is a block or a norm. With model.adapter, a list is compared with the adapter's own
    targets (all-linear, the default, means those: nothing to check)."""
    if recipe.lora.target_modules == "all-linear":
        return
    from finetune.model import base as model_stage
    from finetune.model.classes import from_config
    from finetune.model.experts.split import split_experts

    try:
        with torch.device("meta"):
            model = from_config(config, dtype=model_stage.torch_dtype(recipe.model.dtype),
                                trust_remote_code=recipe.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - a model only from_pretrained builds: attach_lora checks it after loading
        return
    split_experts(model, dtype=model_stage.torch_dtype(recipe.model.dtype),
                  quantized=recipe.quantization.method != "none")
    check_target_modules(recipe, model)


def check_checkpoint(model: nn.Module, index: CheckpointIndex, packed: PackedLayout | None = None) -> None:
    """Every base tensor of the skeleton is in the checkpoint with the right shape (before anything is read); a
    pre-quantized checkpoint (`packed`) holds each 4-bit weight as packed bytes + quant state instead."""
    problems = []
    tied = {name for group in tied_groups(model).values() for name in group[1:]}
    for name, tensor in _meta_tensors(model):
        key = checkpoint_name(name)
        if is_lora_name(name) or (name in tied and key not in index.shapes):
            continue
        if packed is not None and type(tensor).__name__ == "Params4bit":
            problems += prequantized.checkpoint_problems(packed, key, tensor, index)
            continue
        # A meta Params4bit still has the (out, in) shape of the weight it will quantize.
        if key not in index.shapes:
            problems.append(f"{key}: missing (the config needs it, shape {list(tensor.shape)})")
        elif index.shapes[key] != tuple(tensor.shape):
            problems.append(f"{key} in {index.files[key].name}: shape {list(index.shapes[key])}, the config needs "
                            f"{list(tensor.shape)}")
        elif index.dtypes.get(key, "").startswith("float8"):  # quantized values; their scales are other tensors
            problems.append(f"{key} in {index.files[key].name}: stored as {index.dtypes[key]}, quantized values that "
                            "are other numbers than the weight without their scales")
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:8])
        if len(problems) > 8:
            shown += f"\n  - ... and {len(problems) - 8} more"
        raise ModelLoadError(f"the checkpoint in {index.folder} does not match the model's config.json:\n{shown}\n"
                             f"{_mismatch_fix(index)}")


# Tensors that only quantized checkpoints hold (GPTQ / AWQ codes and scales, fp8 and compressed-tensors scales).
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale", ".weight_scale_inv",
                      ".weight_zero_point", ".weight_shape")


def _mismatch_fix(index: CheckpointIndex) -> str:
    quantized = sorted(name for name in index.shapes if name.endswith(QUANTIZED_SUFFIXES))
    if quantized:
        return (f"Fix: these weights are stored quantized ({quantized[0]} and {len(quantized) - 1} more such tensors), "
                "in a format finetune does not read (config.json names no quantization it reads). Point "
                "model.name_or_path at the model's 16-bit (bf16) checkpoint, which finetune quantizes to 4 bits "
                "itself, or dequantize these weights to bf16 with the tool that made them.")
    return (quantized_cache.mismatch_fix(index.folder)  # an entry another writer left under this key
            or "Fix: use the config.json that came with these weights (or re-download the model).")


def _meta_tensors(model: nn.Module):
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta:
            yield name, param
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta:
            yield name, buffer


# ------------------------------------------------------------------------------------------------ the loader
@dataclass
class LoadedModel:
    """What the parallel wrap takes: the PeftModel (whole, or a meta skeleton) and how to build one unit of it."""

    model: nn.Module
    materialize: Callable[[nn.Module], None] | None  # None: already loaded (per-rank loader)
    lora_checksum: Callable[[], float]  # of the LoRA start as built on this rank (compare across ranks after wrap)
    builder: Materializer | None = None

    @property
    def bytes_read(self) -> int | None:
        """Checkpoint bytes this rank read (None: loaded by transformers' from_pretrained, not counted)."""
        return self.builder.reader.bytes_read if self.builder is not None else None


def load_model(recipe: Recipe, *, sharded: bool, device: torch.device, device_map: dict | None,
               gradient_checkpointing: bool, trace: bool = False, shard: RankShard | None = None) -> LoadedModel:
    """Sharded loading (FSDP): a skeleton whose units the wrap builds one at a time; with `shard` (FSDP2) each rank
    reads and quantizes only its own chunk of every tensor (shard_reads.py). Otherwise the whole model on this rank
    (single process, DDP, DeepSpeed), built the same way, one unit after another (`_whole_model`), where the
    checkpoint is safetensors; layer split, DoRA and other checkpoints go through transformers' `from_pretrained`.
    A whole model ends with every buffer on `device` too (rotary frequencies, made at init on the CPU: place_buffers);
    under FSDP the wrap moves them with the units."""
    from finetune.model import base as model_stage

    config = model_stage.load_config(recipe)
    # fp8, GPTQ, AWQ, compressed-tensors, bitsandbytes 8-bit: refused before a file is fetched or a weight read.
    prequantized.refuse_unread_quantization(config, f"model.name_or_path `{recipe.model.name_or_path}`")
    folder = checkpoint_folder(recipe) if sharded else _per_tensor_folder(recipe, device_map)
    if folder is not None and converted_at_load(config):
        folder = None  # a layout transformers splits, concatenates or transposes at load: its from_pretrained reads it
    if folder is None:
        with held_signals.checks_every_rank_makes():  # a peer that fails first must not cut rank 0's paragraph short
            prequantized.check_local_checkpoint(recipe)  # transformers would use a 4-bit checkpoint's settings silently
            check_lora_targets(recipe, config)  # from_pretrained reads every weight before LoRA is attached
            check_train_router(recipe, config)  # (lora.train_router on a model with no router: refused here, not after)
        peft_model = model_stage.build_model(recipe, device=device, device_map=device_map,
                                             gradient_checkpointing=gradient_checkpointing)
        if device_map is None:  # one device: its init-time buffers there too, whatever from_pretrained did with them
            for module in peft_model.modules():
                place_buffers(module, device)
        checksum = lora_checksum(peft_model)
        return LoadedModel(peft_model, None, lambda: checksum)
    skeleton = build_skeleton(recipe, config, gradient_checkpointing=gradient_checkpointing)
    with held_signals.checks_every_rank_makes():
        untied = _untie_stored_heads(recipe, skeleton, folder)
    if not untied:  # the cache is written from the tied model (one tensor for both): read the base itself
        folder = quantized_cache.cached_checkpoint(recipe, folder, device=device)  # model.quantized_cache: auto
    with held_signals.checks_every_rank_makes():  # headers only, alike on every rank (see run.py's other checks)
        index = checkpoint_index(folder)
        convert_index(index, skeleton)  # transformers' key renames
        fused_expert_views(index, skeleton)  # per-expert tensors stored fused: each read as its expert's slice
        packed = prequantized.packed_layout(recipe, folder, index)  # a 4-bit checkpoint: its settings are the recipe's
        check_checkpoint(skeleton, index, packed)
    # Range reads (FSDP2): of a bf16 weight a chunk is read and quantized; of a 4-bit checkpoint's weight the chunk's
    # packed bytes are read (its quant state whole).
    builder = materializer(skeleton, index, device=device, load_dtype=model_stage.torch_dtype(recipe.model.dtype),
                           lora_seed=recipe.train.seed, trace=trace, lora_start=adapter_start(recipe, skeleton),
                           shard=shard if sharded else None, packed=packed)
    if not sharded:
        _whole_model(skeleton, builder)
        return LoadedModel(skeleton, None, lambda: builder.lora_checksum, builder)
    return LoadedModel(skeleton, builder.tree, lambda: builder.lora_checksum, builder)


def _untie_stored_heads(recipe: Recipe, skeleton: nn.Module, folder: Path) -> list[tuple[str, str]]:
    """Tied weights that the checkpoint stores apart with other values, untied in the skeleton as from_pretrained
    unties them (materialize.untie_stored_apart), with a note; headers only where the model ties nothing."""
    if all(len(group) == 1 for group in tied_groups(skeleton).values()):
        return []
    index = checkpoint_index(folder)
    convert_index(index, skeleton)  # transformers' key renames
    untied = untie_stored_apart(skeleton, index)
    for name, tied_to in untied:
        print0(f"[finetune] note: config.json ties {name} to {tied_to} (tie_word_embeddings), but the checkpoint stores "
               f"both with other values: {name} is loaded from its own tensor, untied, as transformers loads it (set "
               "tie_word_embeddings: false in config.json to say so)"
               + ("; the quantized cache is not used for this base" if recipe.model.quantized_cache == "auto" else ""))
    return untied


def _per_tensor_folder(recipe: Recipe, device_map: dict | None) -> Path | None:
    """The checkpoint folder when a whole-model load can read it tensor by tensor, else None. transformers' `from_pretrained` holds a copy of the
    whole model in model.dtype in RAM while it quantizes (measured: 4.3 GiB on a DDP rank of a 1.4B model whose 4-bit
    base is 654 MiB); the per-tensor reader holds the 4-bit model and one tensor in model.dtype."""
    if device_map is not None or recipe.lora.dora:
        return None  # layer split places layers on several devices; DoRA's magnitudes come from the full weights
    # a hub model: its config and safetensors files are fetched here; a GGUF file: the transformers folder it was
    # converted into once (bf16 safetensors; the same bytes as from_pretrained's, tests/cli/test_quickstart.py)
    folder = checkpoint_folder(recipe)
    return folder if (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file() else None


def _whole_model(skeleton: nn.Module, builder: Materializer) -> None:
    """Build every unit of the skeleton in turn (each block of every layer list, then the rest), each tensor read,
    cast and quantized on its own; freed memory goes back to the OS between units."""
    for module in list(skeleton.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                builder.tree(block)
    builder.tree(skeleton)

