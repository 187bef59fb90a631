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

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.host_memory import release_freed_memory
from finetune.recipe import Recipe

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# --------------------------------------------------------------------------------------------- the checkpoint
@dataclass
class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives, and its shape (from the file headers only)."""

    folder: Path
    files: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def conversion_command(folder: Path) -> str:
    return (f"python -m finetune.model.loading convert {folder}  (rewrites the pickle shards as model*.safetensors "
            "beside them, reading them with torch's weights-only loader)")


def checkpoint_index(folder: Path) -> CheckpointIndex:
    """Read the safetensors headers of a checkpoint folder (sharded with an index file, or one file)."""
    from safetensors import safe_open

    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc}). Fix: re-download the model.") from None
        names_by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            names_by_file.setdefault(file_name, []).append(name)
    elif (folder / SINGLE_FILE).exists():
        names_by_file = {SINGLE_FILE: []}
    else:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        if pickles:
            raise ModelLoadError(
                f"{folder}: the weights are pickle files ({', '.join(pickles[:3])}), which cannot be read one tensor at a "
                f"time, so sharded loading would need a full copy in RAM on every rank. Fix: convert them once with "
                f"`{conversion_command(folder)}`, or set parallel.sharded_loading: false."
            )
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}. Fix: point model.name_or_path at a saved "
                             "transformers folder with safetensors weights.")
    index = CheckpointIndex(folder=folder)
    for file_name, listed in names_by_file.items():
        path = folder / file_name
        if not path.exists():
            raise ModelLoadError(
                f"{index_path}: names the shard {file_name} (for {listed[0]} and {len(listed) - 1} more tensors) but "
                f"{path} does not exist. Fix: download the missing shard (or the whole model) again."
            )
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                index.files[name] = path
                index.shapes[name] = tuple(handle.get_slice(name).get_shape())
    return index


def checkpoint_folder(recipe: Recipe) -> Path:
    """The local folder holding the base's weights: the recipe's path, the converted GGUF folder, or the hub cache."""
    from finetune.model.base import is_local, offline_guard

    name = recipe.model.name_or_path
    if recipe.model.gguf_file:
        from finetune.model.gguf import converted_folder

        return converted_folder(name, recipe.model.gguf_file)
    if is_local(name):
        return Path(name).expanduser()
    offline_guard(name)
    from huggingface_hub import snapshot_download

    try:  # config, tokenizer and safetensors only: never the pickle or GGUF duplicates a repo may also hold
        return Path(snapshot_download(name, revision=recipe.model.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as exc:  # noqa: BLE001 (hub errors come in many classes; all mean "not available here")
        from finetune.model.base import _load_error

        raise _load_error("model", name, exc) from None


class TensorReader:
    """One tensor at a time from memory-mapped safetensors files (file pages are shared, not process memory)."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.index.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


# ------------------------------------------------------------------------------------------------ the skeleton
def checkpoint_name(model_name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    from finetune.model.base import lora_tensor_name

    return lora_tensor_name(model_name)


def build_skeleton(recipe: Recipe, config, *, gradient_checkpointing: bool) -> nn.Module:
    """The PeftModel (4-bit layers and LoRA included) with every parameter on the meta device."""
    from accelerate import init_empty_weights
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.model import base as model_stage

    dtype = model_stage.torch_dtype(recipe.model.dtype)
    with init_empty_weights(include_buffers=False):  # rotary frequencies etc. are computed, not loaded: keep them
        base = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=recipe.model.attn_implementation,
                                                trust_remote_code=recipe.model.trust_remote_code)
    base.tie_weights()  # from_config skips tying on the meta device; from_pretrained ties after loading
    bnb_config = model_stage.quantization_config(recipe)
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
    model_stage.keep_4bit_weights_trainable_on_cpu(base)
    model_stage.prepare_for_kbit_training(base, gradient_checkpointing=gradient_checkpointing)
    peft_model = get_peft_model(base, model_stage.lora_config(recipe), low_cpu_mem_usage=True)
    if recipe.lora.fused:
        from finetune.model.lora_fused import use_fused_lora

        use_fused_lora(peft_model)
    return peft_model


def check_checkpoint(model: nn.Module, index: CheckpointIndex) -> None:
    """Every base tensor of the skeleton is in the checkpoint with the right shape (before anything is read)."""
    problems = []
    tied = {name for group in tied_groups(model).values() for name in group[1:]}
    for name, tensor in _meta_tensors(model):
        key = checkpoint_name(name)
        if _is_lora(name) or (name in tied and key not in index.shapes):
            continue
        # A meta Params4bit still has the (out, in) shape of the weight it will quantize.
        if key not in index.shapes:
            problems.append(f"{key}: missing (the config needs it, shape {list(tensor.shape)})")
        elif index.shapes[key] != tuple(tensor.shape):
            problems.append(f"{key} in {index.files[key].name}: shape {list(index.shapes[key])}, the config needs "
                            f"{list(tensor.shape)}")
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:8])
        if len(problems) > 8:
            shown += f"\n  - ... and {len(problems) - 8} more"
        raise ModelLoadError(
            f"the checkpoint in {index.folder} does not match the model's config.json:\n{shown}\n"
            "Fix: use the config.json that came with these weights (or re-download the model)."
        )


def tied_groups(model: nn.Module) -> dict[int, list[str]]:
    """Names of the meta parameters, grouped by tensor (tied weights, such as lm_head and embeddings, share one)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta:
            groups.setdefault(id(param), []).append(name)
    return groups


def _meta_tensors(model: nn.Module):
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta:
            yield name, param
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta:
            yield name, buffer


def _is_lora(name: str) -> bool:
    return ".lora_" in name


# --------------------------------------------------------------------------------------------- materialising
@dataclass
class Materializer:
    """Fills the meta tensors of one module at a time: base weights from the checkpoint, LoRA from its seed."""

    reader: TensorReader
    device: torch.device
    load_dtype: torch.dtype
    lora_seed: int
    names: dict[int, str]  # id(module) -> its name in the PeftModel, taken before any wrapping
    aliases: dict[str, list[tuple[nn.Module, str]]]  # tied parameters: every (module, attribute) sharing one tensor
    lora_checksum: float = 0.0
    trace: bool = False
    lora_start: dict | None = None  # model.adapter's tensors: LoRA starts from them instead of the seed
    peak_alive_bytes: int = 0  # with trace: the most tensor bytes alive right after any unit was built
    trace_log: list[tuple[str, int]] = field(default_factory=list)

    def module(self, module: nn.Module) -> None:
        """Materialise the parameters and buffers `module` owns directly (FSDP1's `param_init_fn` contract)."""
        prefix = self.names.get(id(module))
        if prefix is None:
            return
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                self._parameter(module, f"{prefix}.{attr}" if prefix else attr, attr, param)
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                name = f"{prefix}.{attr}" if prefix else attr
                module._buffers[attr] = self.reader.get(checkpoint_name(name)).to(self.device, buffer.dtype)

    def tree(self, root: nn.Module) -> None:
        """Materialise everything still on the meta device under `root` (one unit: a decoder layer, or the rest).

        FSDP1 calls it for every module it wraps, most of them already built by their unit: those cost nothing."""
        if not any(t.is_meta for t in root.parameters()) and not any(b.is_meta for b in root.buffers()):
            return
        release_freed_memory()  # the previous unit's full tensors, freed when FSDP sharded it
        for module in root.modules():
            self.module(module)
        if self.trace:
            alive = alive_tensor_bytes()
            self.peak_alive_bytes = max(self.peak_alive_bytes, alive)
            self.trace_log.append((self.names.get(id(root), "?") or "root", alive))
        if self.names.get(id(root)) == "":  # the root unit is built last: the checkpoint files can be closed
            self.reader.close()

    def _parameter(self, module: nn.Module, name: str, attr: str, param: nn.Parameter) -> None:
        owners = self.aliases.get(name, [(module, attr)])
        if not owners:
            return  # a tied alias (lm_head of tied embeddings): built with the tensor the checkpoint stores
        new = self._lora(name, param) if _is_lora(name) else self._base(name, param)
        for owner, owner_attr in owners:
            owner._parameters[owner_attr] = new

    def _base(self, name: str, param: nn.Parameter) -> nn.Parameter:
        key = checkpoint_name(name)
        if type(param).__name__ == "Params4bit":
            import bitsandbytes as bnb

            # As transformers' Bnb4bitQuantize: cast to the load dtype on the device, then quantize there.
            value = self.reader.get(key).to(device=self.device, dtype=self.load_dtype)
            return bnb.nn.Params4bit(value, requires_grad=False, **param.__dict__).to(self.device)
        value = self.reader.get(key).to(device=self.device, dtype=param.dtype)
        return nn.Parameter(value, requires_grad=param.requires_grad)

    def _lora(self, name: str, param: nn.Parameter) -> nn.Parameter:
        from finetune.model.base import init_lora_tensor, lora_fingerprint

        value = torch.empty(param.shape, dtype=param.dtype, device="cpu")
        if not init_lora_tensor(value, name, self.lora_seed, self.lora_start):
            raise ModelLoadError(f"{name}: sharded loading does not know how to initialise this adapter tensor. "
                                 "Fix: set parallel.sharded_loading: false.")
        self.lora_checksum += lora_fingerprint(value, name)
        return nn.Parameter(value.to(self.device), requires_grad=param.requires_grad)


def materializer(model: nn.Module, index: CheckpointIndex, *, device: torch.device, load_dtype: torch.dtype,
                 lora_seed: int, trace: bool = False, lora_start: dict | None = None) -> Materializer:
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    aliases: dict[str, list[tuple[nn.Module, str]]] = {}
    for group in tied_groups(model).values():
        if len(group) == 1:
            continue
        # The checkpoint holds one of the tied names (the embeddings): build under that one, for every owner.
        stored = next((name for name in group if checkpoint_name(name) in index.shapes), group[0])
        owners = []
        for name in group:
            module_name, _, attr = name.rpartition(".")
            owners.append((model.get_submodule(module_name), attr))
            aliases[name] = []
        aliases[stored] = owners
    return Materializer(TensorReader(index), device, load_dtype, lora_seed, names, aliases, trace=trace,
                        lora_start=lora_start)


# ------------------------------------------------------------------------------------------------ the loader
@dataclass
class LoadedModel:
    """What the parallel wrap takes: the PeftModel (whole, or a meta skeleton) and how to build one unit of it."""

    model: nn.Module
    materialize: Callable[[nn.Module], None] | None  # None: already loaded (per-rank loader)
    lora_checksum: Callable[[], float]  # of the LoRA start as built on this rank (compare across ranks after wrap)
    builder: Materializer | None = None


def load_model(recipe: Recipe, *, sharded: bool, device: torch.device, device_map: dict | None,
               gradient_checkpointing: bool, trace: bool = False) -> LoadedModel:
    """Sharded loading (FSDP): a skeleton whose units the wrap builds one at a time. Otherwise the whole model on
    this rank (single process, DDP, DeepSpeed), built the same way, one unit after another (`_whole_model`), where the
    checkpoint is safetensors; layer split, DoRA and other checkpoints go through transformers' `from_pretrained`."""
    from finetune.model import base as model_stage

    folder = checkpoint_folder(recipe) if sharded else _per_tensor_folder(recipe, device_map)
    if folder is None:
        peft_model = model_stage.build_model(recipe, device=device, device_map=device_map,
                                             gradient_checkpointing=gradient_checkpointing)
        checksum = model_stage.lora_checksum(peft_model)
        return LoadedModel(peft_model, None, lambda: checksum)
    skeleton = build_skeleton(recipe, model_stage.load_config(recipe), gradient_checkpointing=gradient_checkpointing)
    index = checkpoint_index(folder)
    check_checkpoint(skeleton, index)
    builder = materializer(skeleton, index, device=device, load_dtype=model_stage.torch_dtype(recipe.model.dtype),
                           lora_seed=recipe.train.seed, trace=trace, lora_start=model_stage.adapter_start(recipe))
    if not sharded:
        _whole_model(skeleton, builder)
        return LoadedModel(skeleton, None, lambda: builder.lora_checksum, builder)
    return LoadedModel(skeleton, builder.tree, lambda: builder.lora_checksum, builder)


def _per_tensor_folder(recipe: Recipe, device_map: dict | None) -> Path | None:
    """The checkpoint folder when a whole-model load can read it tensor by tensor, else None. transformers' `from_pretrained` holds a copy of the
    whole model in model.dtype in RAM while it quantizes (measured: 4.3 GiB on a DDP rank of a 1.4B model whose 4-bit
    base is 654 MiB); the per-tensor reader holds the 4-bit model and one tensor in model.dtype."""
    if device_map is not None or recipe.model.gguf_file or recipe.lora.dora:
        return None  # layer split places layers on several devices; DoRA's magnitudes come from the full weights
    folder = checkpoint_folder(recipe)  # a hub model: its config and safetensors files are fetched here
    return folder if (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file() else None


def _whole_model(skeleton: nn.Module, builder: Materializer) -> None:
    """Build every unit of the skeleton in turn (each block of every layer list, then the rest), each tensor read,
    cast and quantized on its own; freed memory goes back to the OS between units."""
    for module in list(skeleton.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                builder.tree(block)
    builder.tree(skeleton)


def alive_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once; DTensors through their local shard).

    Deterministic accounting for tests and benchmarks: what loading keeps, whatever the allocator does.
    """
    import gc
    import warnings

    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() on some deprecated module-level objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if type(obj) is DTensor or obj.is_meta:
            continue  # a DTensor's local shard is a tensor of its own, counted there
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() in seen or storage.device.type == "meta":
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def convert_to_safetensors(folder: Path) -> list[Path]:
    """Rewrite pickle weight files (`*.bin`) as safetensors beside them, one shard at a time (weights-only load)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    written = []
    shards = sorted(folder.glob("pytorch_model*.bin")) or sorted(folder.glob("*.bin"))
    weight_map = {}
    for shard in shards:
        state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
        target = shard.with_name(shard.name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors")
        tmp = target.with_suffix(".safetensors.tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(target)
        weight_map.update({name: target.name for name in state})
        written.append(target)
    if len(written) > 1:
        tmp = folder / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        tmp.replace(folder / INDEX_FILE)
    return written


if __name__ == "__main__":  # python -m finetune.model.loading convert FOLDER
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "convert":
        print("usage: python -m finetune.model.loading convert FOLDER", file=sys.stderr)
        sys.exit(2)
    for path in convert_to_safetensors(Path(sys.argv[2])):
        print(f"wrote {path}")
