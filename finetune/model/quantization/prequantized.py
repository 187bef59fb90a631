"""Pre-quantized 4-bit checkpoints (bitsandbytes, as transformers' `save_pretrained` writes them): checked against the
recipe before any weight is read, then each 4-bit weight built from its stored bytes and quant state, never dequantized.

Such a folder has `quantization_config` (quant_method: bitsandbytes) in config.json and, for every quantized weight
`W`: the packed 4-bit codes `W` (stored as `bnb_4bit_quant_storage`: uint8 by default, bf16 when the model was
loaded for FSDP), `W.absmax`, `W.quant_map`, with double quantization `W.nested_absmax` and `W.nested_quant_map`, and
`W.quant_state.bitsandbytes__nf4` (or `__fp4`): a small uint8 tensor holding the rest as JSON (blocksize, shape,
dtype, nested offset). The "-bnb-4bit" repositories on the hub are such folders, and so is what `finetune quantize`
and the quantized cache (cache.py) write.

Why reinterpret and never dequantize: the packed codes are bytes; the storage dtype only says how FSDP sees them. The
recipe keeps the dtype rule (every frozen tensor in model.dtype, one dtype per FSDP unit) by viewing the same bytes
as model.dtype, so the model holds exactly the bytes that quantizing the bf16 base at load gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.sources.files import CheckpointIndex, TensorReader
from finetune.model.sources.shard_reads import RankShard, packed_value_range
from finetune.recipe import Recipe

PACKED_STATE = "quant_state.bitsandbytes__"  # + nf4 / fp4: the non-tensor part of a quant state, as JSON bytes
BLOCKSIZE = 64  # what bitsandbytes and transformers quantize with (no recipe key changes it)
NESTED_BLOCKSIZE = 256  # double quantization's blocks of absmax values


@dataclass
class PackedLayout:
    """How a pre-quantized checkpoint stores its 4-bit weights, and how this run will hold them."""

    folder: Path
    quant_type: str  # nf4 / fp4
    double_quant: bool
    stored_dtype: torch.dtype  # the checkpoint's bnb_4bit_quant_storage
    storage_dtype: torch.dtype  # the recipe's (model.dtype): the same bytes, viewed as this
    model_dtype: torch.dtype
    states: dict[str, dict] = field(default_factory=dict)  # weight name -> its unpacked quant-state JSON

    def state_names(self, key: str) -> list[str]:
        parts = ["absmax", "quant_map", *(("nested_absmax", "nested_quant_map") if self.double_quant else ())]
        return [f"{key}.{part}" for part in parts] + [f"{key}.{PACKED_STATE}{self.quant_type}"]


# The quantization_config methods finetune reads: bitsandbytes 4-bit (this module) and MXFP4 (gpt-oss's experts,
# dequantized at load by their family's reader, finetune/model/experts/families/gpt_oss.py).
READ_METHODS = ("bitsandbytes", "mxfp4")
# What each stored format is, and the transformers setting that dequantizes it at load (with its requirement).
_FORMATS = {
    "fp8": ("8-bit floats, each block scaled by a `weight_scale_inv` tensor", "FineGrainedFP8Config(dequantize=True)",
            ""),
    "compressed-tensors": ("values cast or packed by llm-compressor, scaled by `weight_scale` tensors",
                           "CompressedTensorsConfig(dequantize=True)", " (with `pip install compressed-tensors`)"),
}


def quantization_dict(config) -> dict | None:
    """A config's `quantization_config` as a dict (config.json holds a dict; a config object may hold a class)."""
    quantization = getattr(config, "quantization_config", None) if not isinstance(config, dict) else \
        config.get("quantization_config")
    if hasattr(quantization, "to_dict"):
        quantization = quantization.to_dict()
    return quantization if isinstance(quantization, dict) and quantization else None


def unread_quantization(quantization: dict | None, where: str) -> str | None:
    """Why finetune cannot train on weights stored with this `quantization_config` (one paragraph with the fix), or
    None where it reads them (none, bitsandbytes 4-bit, gpt-oss's MXFP4). Read as plain weights, quantized values are
    other numbers (an fp8 weight without its scale, GPTQ's packed int32 codes): nothing may load them as weights."""
    if quantization is None:
        return None
    method = str(quantization.get("quant_method", "?")).lower()
    base_fix = ("point model.name_or_path at the model's 16-bit (bf16) checkpoint: finetune quantizes it to 4 bits "
                "itself, as the recipe's quantization section says")
    if method == "bitsandbytes":
        if quantization.get("load_in_8bit") or quantization.get("_load_in_8bit"):
            return (f"{where} is an 8-bit bitsandbytes checkpoint (config.json quantization_config: load_in_8bit), and "
                    "finetune trains on 16-bit or 4-bit bases only: its int8 weights cannot be read as 4-bit ones, and "
                    f"no quantization setting of the recipe changes that. Fix: {base_fix}.")
        if quantization.get("load_in_4bit", quantization.get("_load_in_4bit")):
            return None
        return (f"{where}: config.json's bitsandbytes quantization_config says neither load_in_4bit nor load_in_8bit, "
                f"so how its weights are stored is unknown. Fix: {base_fix}.")
    if method in READ_METHODS:
        return None
    stored, dequantize, needs = _FORMATS.get(method, ("packed low-bit codes with their scales", None, ""))
    fmt = quantization.get("format")
    how = (f"dequantize this one to bf16 once{needs}: `AutoModelForCausalLM.from_pretrained(FOLDER, quantization_config="
           f"{dequantize}, dtype=torch.bfloat16).save_pretrained(NEW_FOLDER)`, copy the tokenizer files beside it and "
           "train from NEW_FOLDER" if dequantize else "dequantize it to bf16 with the tool that made it")
    return (f"{where}: config.json says its weights are stored quantized (quantization_config.quant_method: {method}"
            f"{f', format: {fmt}' if fmt else ''}: {stored}), which finetune does not read: taken as plain weights "
            "they would be other numbers than the model's, so nothing is loaded. finetune trains on 16-bit checkpoints "
            f"and on bitsandbytes 4-bit ones. Fix: {base_fix}; or {how}.")


def refuse_unread_quantization(config, where: str) -> None:
    """ModelLoadError (unread_quantization's paragraph) for a config whose weights finetune cannot read."""
    if problem := unread_quantization(quantization_dict(config), where):
        raise ModelLoadError(problem)


def stored_quantization(folder: Path) -> dict | None:
    """config.json's bitsandbytes 4-bit `quantization_config` of a checkpoint folder, or None for an unquantized one
    (or gpt-oss's MXFP4, read by its experts' reader). Any other quantization (fp8, GPTQ, AWQ, compressed-tensors,
    bitsandbytes 8-bit) is refused here with its fix (unread_quantization): every reader of a base folder asks this
    first, and none may take such weights for 16-bit ones."""
    config_path = Path(folder) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    quantization = quantization_dict(config)
    refuse_unread_quantization(config, f"`{folder}`")
    if quantization is None or quantization.get("quant_method") != "bitsandbytes":
        return None
    return quantization


def skeleton_quantization(recipe: Recipe, config):
    """The BitsAndBytesConfig the skeleton is built with: the recipe's, plus, for a bitsandbytes 4-bit checkpoint, its
    `llm_int8_skip_modules` (modules it stores unquantized, as Unsloth's "dynamic" 4-bit repositories do), which
    transformers' quantizer keeps as plain Linear layers when it reloads such a checkpoint."""
    from finetune.model.settings import quantization_config

    bnb_config = quantization_config(recipe)
    stored = quantization_dict(config) or {}
    if bnb_config is not None and stored.get("quant_method") == "bitsandbytes" and stored.get("llm_int8_skip_modules"):
        bnb_config.llm_int8_skip_modules = list(stored["llm_int8_skip_modules"])
    return bnb_config


def is_prequantized(folder: Path) -> bool:
    return stored_quantization(folder) is not None


QUANTIZED_FROM = "quantized_from.json"  # written by writer.py beside config.json: {"quantized_from": folder}


def quantized_from(folder: Path) -> str | None:
    """The 16-bit folder a 4-bit checkpoint was written from by `finetune quantize` (writer.py records it), or None
    (not recorded: quantized elsewhere, or by an older finetune)."""
    try:
        return json.loads((Path(folder) / QUANTIZED_FROM).read_text(encoding="utf-8"))["quantized_from"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def packed_layout(recipe: Recipe, folder: Path, index: CheckpointIndex) -> PackedLayout | None:
    """The layout of a pre-quantized checkpoint, refused in one paragraph where its settings are not the recipe's
    (config.json and the quant states against `quantization.*`); None for an unquantized checkpoint."""
    from finetune.model.settings import torch_dtype

    stored = _stored_for(recipe, folder)  # 8-bit, fp8, GPTQ...: refused here (unread_quantization)
    if stored is None:
        return None
    model_dtype = torch_dtype(recipe.model.dtype)
    quant = recipe.quantization
    config_path = Path(folder) / "config.json"
    problems = []
    stored_type = stored.get("bnb_4bit_quant_type", "fp4")
    stored_double = bool(stored.get("bnb_4bit_use_double_quant", False))
    if quant.method == "none":
        problems.append("the recipe's quantization.method is none, and 4-bit weights are not dequantized at load")
    elif stored_type != quant.method:
        problems.append(f"bnb_4bit_quant_type is {stored_type}, the recipe's quantization.method is {quant.method}")
    if stored_double != quant.double_quant:
        problems.append(f"bnb_4bit_use_double_quant is {str(stored_double).lower()}, the recipe's "
                        f"quantization.double_quant is {str(quant.double_quant).lower()}")
    layout = PackedLayout(Path(folder), stored_type, stored_double,
                          stored_dtype=getattr(torch, str(stored.get("bnb_4bit_quant_storage", "uint8"))),
                          storage_dtype=torch_dtype(quant.quant_storage or recipe.model.dtype), model_dtype=model_dtype)
    if not problems:
        problems += _quant_state_problems(layout, index)
    if problems:
        raise ModelLoadError(
            f"model.name_or_path `{recipe.model.name_or_path}` is a 4-bit checkpoint quantized with other settings than "
            f"the recipe ({config_path}: {'; '.join(problems)}). Its packed bytes would be another model than the recipe "
            "describes. Fix: set the recipe's quantization section to the checkpoint's settings (quantization.method: "
            f"{stored_type}, quantization.double_quant: {str(stored_double).lower()}), or point model.name_or_path at "
            "the bf16 base, which is quantized with the recipe's settings at load (or once, by `finetune quantize`).")
    return layout


def _stored_for(recipe: Recipe, folder: Path) -> dict | None:
    """stored_quantization, its refusal naming model.name_or_path (the recipe's base folder or hub snapshot)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    refuse_unread_quantization(config if isinstance(config, dict) else {},
                               f"model.name_or_path `{recipe.model.name_or_path}`")
    return stored_quantization(folder)


def check_local_checkpoint(recipe: Recipe) -> bool:
    """`finetune validate` and the loads through `from_pretrained`: a local folder's weights are there (no weight file
    at all is refused as the load would refuse it), its quantization is one finetune reads (unread_quantization; of a
    hub id, its cached config.json's), a local safetensors checkpoint's files (every shard its index names is there
    and readable: headers only, ModelLoadError naming the shard as the sharded loader does), and a local 4-bit
    checkpoint's settings against the recipe's (headers and quant-state JSON only). True when model.name_or_path is
    such a checkpoint and they agree; a mismatch raises as at load."""
    from finetune.model.sources.files import INDEX_FILE, SINGLE_FILE, checkpoint_index
    from finetune.model.sources.hub import cached_hub_config, is_local, missing_weights_error

    folder = Path(recipe.model.name_or_path).expanduser()
    if recipe.model.gguf_file:
        return False
    if not is_local(recipe.model.name_or_path):
        refuse_unread_quantization(cached_hub_config(recipe) or {}, f"model.name_or_path `{recipe.model.name_or_path}`")
        return False
    if error := missing_weights_error(recipe.model.name_or_path):
        raise error
    stored = _stored_for(recipe, folder)
    safetensors = (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()
    index = checkpoint_index(folder) if safetensors else None  # pickle weights: from_pretrained reads them
    if stored is None:
        return False
    packed_layout(recipe, folder, index or checkpoint_index(folder))
    return True


def _quant_state_problems(layout: PackedLayout, index: CheckpointIndex) -> list[str]:
    """Read every quant state's JSON part (a few hundred bytes each; no weight): blocksize and type as the recipe's."""
    from bitsandbytes.utils import unpack_tensor_to_dict

    reader = TensorReader(index)
    found: dict[str, set] = {}
    try:
        for name in index.shapes:
            weight, _, kind = name.partition("." + PACKED_STATE)
            if not kind:
                continue
            state = unpack_tensor_to_dict(reader.get(name))
            layout.states[weight] = state
            found.setdefault("quant_type", set()).add(state.get("quant_type", kind))
            found.setdefault("blocksize", set()).add(state.get("blocksize"))
            if layout.double_quant:
                found.setdefault("nested_blocksize", set()).add(state.get("nested_blocksize"))
    finally:
        reader.close()
    problems = []
    if found.get("quant_type", {layout.quant_type}) != {layout.quant_type}:
        problems.append(f"the quant states say {'/'.join(sorted(found['quant_type']))}, config.json {layout.quant_type}")
    expected = {"blocksize": BLOCKSIZE, "nested_blocksize": NESTED_BLOCKSIZE}
    for key, value in expected.items():
        if found.get(key, {value}) != {value}:
            problems.append(f"the quant states' {key} is {'/'.join(str(v) for v in sorted(found[key]))}, finetune "
                            f"quantizes with {value} (bitsandbytes' and transformers' only choice; no recipe key)")
    return problems


def packed_bytes(numel: int, storage: torch.dtype) -> int:
    """Bytes bitsandbytes' quantize_4bit stores for `numel` weights in `storage` ((n + 1) // (2 * itemsize) elements)."""
    itemsize = torch.empty(0, dtype=storage).element_size()
    return (numel + 1) // (2 * itemsize) * itemsize


def checkpoint_problems(layout: PackedLayout, key: str, tensor: torch.Tensor, index: CheckpointIndex) -> list[str]:
    """What is wrong with one 4-bit weight of the checkpoint against the skeleton's (out, in) weight (headers only)."""
    if key not in index.shapes:
        return [f"{key}: missing (the config needs a 4-bit weight of shape {list(tensor.shape)})"]
    problems = [f"{name}: missing (part of {key}'s quant state)" for name in layout.state_names(key)
                if name not in index.shapes]
    stored = index.shapes[key]
    stored_dtype = index.dtypes.get(key, str(layout.stored_dtype).removeprefix("torch."))
    itemsize = index.itemsize(key) or torch.empty(0, dtype=layout.stored_dtype).element_size()
    stored_bytes = int(torch.Size(stored).numel()) * itemsize
    wanted = packed_bytes(tensor.numel(), layout.storage_dtype)
    if tuple(stored) == tuple(tensor.shape) and len(stored) > 1:  # the whole weight, not its packed codes
        unquantized = (f"{key} in {index.files[key].name}: stored unquantized ({list(stored)} {stored_dtype}), "
                       "though config.json's quantization_config does not list it in llm_int8_skip_modules (the "
                       "modules a 4-bit checkpoint keeps unquantized)")
        return [unquantized]
    if stored_bytes != wanted:
        problems.append(f"{key} in {index.files[key].name}: {stored_bytes} packed bytes ({list(stored)} "
                        f"{stored_dtype}), a 4-bit {list(tensor.shape)} weight "
                        f"stored as {str(layout.storage_dtype).removeprefix('torch.')} needs {wanted}")
    state_shape = layout.states.get(key, {}).get("shape")
    if state_shape is not None and tuple(state_shape) != tuple(tensor.shape):
        problems.append(f"{key}: its quant state is for shape {list(state_shape)}, the config needs {list(tensor.shape)}")
    blocks = -(-tensor.numel() // BLOCKSIZE)
    if f"{key}.absmax" in index.shapes and index.shapes[f"{key}.absmax"] != (blocks,):
        problems.append(f"{key}.absmax: shape {list(index.shapes[f'{key}.absmax'])}, {blocks} blocks expected")
    return problems


def packed_parameter(reader: TensorReader, key: str, param: nn.Parameter, *, device: torch.device,
                     layout: PackedLayout, shard: RankShard | None = None) -> nn.Parameter:
    """A Params4bit from the checkpoint's bytes and quant state: bitwise what quantizing the bf16 base at load gives.

    With `shard` (FSDP2) only the packed bytes of this rank's chunk are read (both as the storage dtype and as uint8,
    as shard_reads.py's range, in whole blocks) and copied to the device, into a zero-filled tensor of the full shape
    made there, which `fully_shard` cuts (as shard_reads.py builds a bf16 weight's); the quant state (absmax, codes:
    ~1/64 of the packed bytes) is read and copied whole, as every rank holds it whole."""
    import bitsandbytes as bnb

    if shard is None:
        stored = reader.get(key).reshape(-1)
        # The same bytes viewed as the recipe's storage dtype (uint8 (2n, 1) -> bf16 (n, 1)): no arithmetic, no copy.
        data = stored.view(torch.uint8).view(layout.storage_dtype).reshape(-1, 1)
    else:
        data = _own_packed_bytes(reader, key, param, layout=layout, shard=shard, device=device)
    stats = {name: reader.get(name) for name in layout.state_names(key)}
    new = bnb.nn.Params4bit.from_prequantized(data, stats, requires_grad=False, device=device,
                                              module=getattr(param, "module", None))
    # The dtype dequantization returns: model.dtype, as when the bf16 base is quantized at load (a checkpoint made
    # from an fp16 base says float16; its 4-bit codes and absmax do not depend on it).
    new.quant_state.dtype = layout.model_dtype
    return new


def _own_packed_bytes(reader: TensorReader, key: str, param: nn.Parameter, *, layout: PackedLayout,
                      shard: RankShard, device: torch.device) -> torch.Tensor:
    """The packed weight in the recipe's storage dtype, (bytes / itemsize, 1), on `device`, with only this rank's
    bytes read and copied there."""
    storage_bytes = torch.empty(0, dtype=layout.storage_dtype).element_size()
    stored_bytes = torch.empty(0, dtype=layout.stored_dtype).element_size()
    numel = param.numel()
    # Made on the device, not filled on the host and moved whole: each rank would copy every packed byte of the model
    # to its GPU, where only its chunk is kept (the zeros are the other ranks' chunks, cut off by fully_shard). The
    # copy below is of uint8 views, so no NaN bit pattern of a bf16 view is rewritten on the way (byte_guard.py).
    whole = torch.zeros(packed_bytes(numel, layout.storage_dtype), dtype=torch.uint8, device=device)
    start, stop = packed_value_range(numel, storage_bytes, shard.rank, shard.world_size, BLOCKSIZE)
    byte_first, byte_last = start // 2, -(-stop // 2)  # two 4-bit values per byte
    first, last = byte_first // stored_bytes, min(-(-byte_last // stored_bytes), whole.numel() // stored_bytes)
    if last > first:  # rows of the stored (bytes / itemsize, 1) tensor (whole blocks are whole rows)
        whole[first * stored_bytes : last * stored_bytes] = reader.get_rows(key, first, last).reshape(-1).view(torch.uint8)
    return whole.view(layout.storage_dtype).reshape(-1, 1)
