"""Writing a 4-bit checkpoint from a bf16 base, one tensor at a time: what `finetune quantize` and the quantized cache
write, and what transformers' `from_pretrained` (or finetune's loader) reads back as a pre-quantized model.

The layout is transformers' own (`save_pretrained` of a bitsandbytes-quantized model): config.json with
`quantization_config`, sharded safetensors `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`,
every quantized weight as its packed codes plus the quant-state tensors that `Linear4bit._save_to_state_dict` writes,
under the model's tensor names (transformers' renames applied). A mixture-of-experts model's experts are written one
4-bit weight per expert projection, as finetune splits them (finetune/model/experts/): finetune's loader reads such a
folder, transformers' `from_pretrained` does not (it keeps experts fused, and bitsandbytes quantizes no 3-D tensor).
Each weight is quantized exactly as loading the bf16 base does (`Params4bit(value in model.dtype, **skeleton's
settings).to(device)`), so the bytes written are the bytes a run would otherwise compute at every start.

No full copy of the base is ever held: one tensor is read (memory-mapped), cast and quantized, and the packed result
joins the shard being collected, which is written once it reaches `max_shard_bytes`. The folder appears whole or not
at all (a temporary folder renamed at the end; an existing one is replaced only when asked).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from finetune.errors import ModelLoadError
from finetune.model.quantization.prequantized import QUANTIZED_FROM, stored_quantization
from finetune.model.sources.files import INDEX_FILE, CheckpointIndex, TensorReader, checkpoint_index

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
DEFAULT_SHARD_BYTES = 2 * 2**30


def _settings(model) -> dict[str, dict]:
    return {name: {k: v for k, v in param.__dict__.items() if k != "module"}
            for name, param in model.named_parameters() if type(param).__name__ == "Params4bit"}


def model_tensors(base: Path, config, bnb_config, dtype: torch.dtype) -> tuple[CheckpointIndex, list[str], dict]:
    """(the base's index, read as the loader reads it, the model tensor names to write in file order, the Params4bit
    settings by name). Names are the model's, after transformers' renames and with mixture-of-experts experts split
    one Linear per expert projection (finetune/model/experts/): Mixtral's `block_sparse_moe.experts.3.w1` is written
    as `mlp.experts.3.w1`, each expert of a fused 3-D tensor (Qwen3-MoE saved fused, gpt-oss, Llama 4) as its own
    4-bit weight. The checkpoint's own names would leave every expert in bf16, or fused where bitsandbytes cannot go,
    in a folder whose config.json says 4-bit."""
    from finetune.model.experts.split import fused_expert_views
    from finetune.model.materialize import untie_stored_apart
    from finetune.model.skeleton import meta_base_model
    from finetune.model.sources.conversions import convert_index

    skeleton = meta_base_model(config, dtype=dtype, bnb_config=bnb_config)
    index = checkpoint_index(base)
    convert_index(index, skeleton)  # transformers' key renames, as the loader applies them
    fused_expert_views(index, skeleton)  # per-expert views of experts stored fused
    untie_stored_apart(skeleton, index)  # a tied config with its own stored head: written apart, as it loads (bb21)
    names, missing = [], []
    for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]:
        if tensor.is_meta:
            (names if name in index.shapes else missing).append(name)
    if missing:
        raise ModelLoadError(f"{base}: the checkpoint has no tensor for {len(missing)} weight(s) of its config.json "
                             f"(e.g. {missing[0]}). Fix: use the config.json that came with these weights.")
    names.sort(key=lambda n: (str(index.files[n]), n))  # file by file: the reads stay sequential on disk
    return index, names, _settings(skeleton)


def _quantized_tensors(name: str, value: torch.Tensor, settings: dict, *, dtype: torch.dtype,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """The packed weight and its quant state as `Linear4bit._save_to_state_dict` names them (`W.absmax`, ...)."""
    import bitsandbytes as bnb

    # As the loader (materialize.py) and transformers' Bnb4bitQuantize: cast on the device, then quantize there.
    param = bnb.nn.Params4bit(value.to(device=device, dtype=dtype), requires_grad=False, **settings).to(device)
    tensors = {name: param.data.detach().cpu()}
    for key, state in param.quant_state.as_dict(packed=True).items():
        tensors[f"{name}.{key}"] = state.detach().cpu()
    return tensors


def _dequantized_tensors(name: str, value: torch.Tensor, settings: dict, *, dtype: torch.dtype,
                         device: torch.device) -> dict[str, torch.Tensor]:
    """The weight as a 4-bit run computes with it: quantized as the loader quantizes it, then dequantized (what
    bitsandbytes' 4-bit matmul multiplies by), in `dtype`."""
    import bitsandbytes as bnb

    param = bnb.nn.Params4bit(value.to(device=device, dtype=dtype), requires_grad=False, **settings).to(device)
    return {name: bnb.functional.dequantize_4bit(param.data, param.quant_state).to(dtype).detach().cpu()}


def overlap_problem(base: Path, out: Path) -> str | None:
    """Why `out` may not be written for `base` (None when it may): it is the base folder itself, a folder holding it
    (replacing it would delete the base), or a folder inside it. Symbolic links are followed on both sides."""
    base_real, out_real = Path(base).expanduser().resolve(), Path(out).expanduser().resolve()
    if out_real == base_real:
        where = "is the base folder itself" + (f" ({out_real})" if Path(out).is_symlink() else "")
    elif base_real.is_relative_to(out_real):
        where = f"holds the base ({base_real}): replacing it would delete the base"
    elif out_real.is_relative_to(base_real):
        where = "is inside the base folder: the 4-bit files would be mixed into the base model's"
    else:
        return None
    return (f"{out} {where}. The bf16 base is what the 4-bit folder is made from (and what a merge reads back, through "
            f"{QUANTIZED_FROM}). Nothing was read or written. Fix: choose OUT outside {base}, e.g. "
            f"{base_real.parent / (base_real.name + '-nf4')}.")


def base_config(base: Path):
    """The bf16 base's config (AutoConfig), or a ModelLoadError in one paragraph when `base` is no model folder: a
    file, a LoRA adapter or a run folder (no config.json of a model), a config.json that does not parse or names no
    model_type. transformers' own OSError and ValueError ended `finetune quantize` in a traceback (bb56)."""
    from transformers import AutoConfig

    from finetune.model.sources.hub import ADAPTER_CONFIG, damaged_json

    base = Path(base)
    fix = "Fix: give the folder of a bf16 model as transformers saves it (config.json, safetensors weights, tokenizer)."
    if base.is_file():
        raise ModelLoadError(f"{base} is a file, not a model folder. {fix}")
    adapter = next((folder for folder in (base, base / "adapter") if (folder / ADAPTER_CONFIG).is_file()), None)
    if adapter is not None and not (base / "config.json").is_file():
        try:
            named = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            named = None
        what = "a LoRA adapter" if adapter == base else f"a run folder (its LoRA adapter: {adapter})"
        raise ModelLoadError(f"{base} is {what}, not a base model: it holds no base weights to quantize. Fix: quantize "
                             f"the base it was trained on ({named or 'base_model_name_or_path in ' + ADAPTER_CONFIG}).")
    try:
        return AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as exc:
        damaged = damaged_json(base, ("config.json",))
        reason = f"config.json {damaged[1]}" if damaged else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        again = " Or, as config.json is cut short, copy or download it again." if damaged else ""
        raise ModelLoadError(f"{base}: cannot read the model's config ({reason[:200]}). {fix}{again}") from None


def _check_base(base: Path, out: Path) -> None:
    """ModelLoadError when `out` overlaps `base` (overlap_problem) or `base` is already 4-bit: before a byte is read."""
    if problem := overlap_problem(base, out):
        raise ModelLoadError(problem)
    if stored_quantization(base) is not None:
        raise ModelLoadError(f"{base}: already a 4-bit checkpoint (quantization_config in config.json); it is used as "
                             "it is. Fix: point at the bf16 base to quantize it.")


def write_quantized(base: Path, out: Path, *, bnb_config, dtype: torch.dtype, device: torch.device,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, replace: bool = False,
                    finish: Callable[[Path], None] | None = None, progress: Callable[[str], None] | None = None,
                    dequantize: bool = False) -> Path:
    """Quantize the safetensors base in `base` into `out` (atomic); `finish(folder)` runs last, before the rename.

    `dequantize`: write each 4-bit weight back in `dtype` as the run sees it (quantized, then dequantized), a plain
    checkpoint with no quantization_config: the base a vLLM server samples with (grpo.generation vllm), so that its
    log-probs are the 4-bit trainer's, not the original base's."""
    from safetensors.torch import save_file

    from finetune.files import atomic_dir

    base, out = Path(base), Path(out)
    _check_base(base, out)
    index, names, settings = model_tensors(base, base_config(base), bnb_config, dtype)
    reader = TensorReader(index)
    weight_map, shard, shard_bytes, total, files = {}, {}, 0, 0, []
    with atomic_dir(out, replace=replace) as tmp:

        def flush() -> None:
            nonlocal shard, shard_bytes
            if shard:
                name = f"shard-{len(files):05d}.tmp"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                files.append((name, list(shard)))
                shard, shard_bytes = {}, 0

        for name in names:
            value = reader.get(name)
            if name in settings:
                write = _dequantized_tensors if dequantize else _quantized_tensors
                tensors = write(name, value, settings[name], dtype=dtype, device=device)
            else:  # norms, embeddings, LM head: in model.dtype, as the loader holds them
                tensors = {name: value.to(dtype) if value.is_floating_point() else value}
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            if shard_bytes and shard_bytes + size > max_shard_bytes:
                flush()
            shard.update(tensors)
            shard_bytes += size
            total += size
            if progress and name in settings:
                progress(name)
        flush()
        reader.close()
        for number, (temporary, names) in enumerate(files, start=1):
            final = f"model-{number:05d}-of-{len(files):05d}.safetensors"
            (tmp / temporary).rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True), encoding="utf-8")
        _copy_side_files(base, tmp, None if dequantize else bnb_config, dtype)
        if not dequantize:  # where the 16-bit weights are: what a merge of an adapter trained on this folder needs
            (tmp / QUANTIZED_FROM).write_text(json.dumps({"quantized_from": str(base.resolve())}, indent=2) + "\n",
                                              encoding="utf-8")
        if finish is not None:
            finish(tmp)
    return out


def _copy_side_files(base: Path, target: Path, bnb_config, dtype: torch.dtype) -> None:
    """config.json with the quantization_config added (None: none); tokenizer, generation config and the rest copied as they are."""
    for path in base.iterdir():
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(WEIGHT_SUFFIXES) \
                and "index.json" not in path.name and path.name not in ("config.json", QUANTIZED_FROM):
            shutil.copy2(path, target / path.name)
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    if bnb_config is not None:
        config["quantization_config"] = bnb_config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
