"""`finetune quantize BASE OUT`: write a bf16 base as a 4-bit checkpoint (transformers' bitsandbytes layout, sharded
with an index), or `--cache` straight into the quantized cache that recipes with `model.quantized_cache: auto` read.

    finetune quantize BASE OUT [--method nf4|fp4] [--no-double-quant] [--dtype bfloat16] [--force]
    finetune quantize --recipe RECIPE [OUT | --cache]     (the recipe's base and quantization settings)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from finetune.errors import FinetuneError


def cli_quantize(args: argparse.Namespace) -> int:
    """Every problem of the command line is refused before a byte of the base is read."""
    from finetune.model.quantization import cache as quantized_cache
    from finetune.model.quantization.writer import base_config, write_quantized
    from finetune.model.settings import quantization_config, torch_dtype
    from finetune.model.sources.files import checkpoint_folder

    recipe = _recipe(args)
    out = Path(args.out).expanduser() if args.out else None
    if (out is None) == (not args.cache):
        raise FinetuneError("finetune quantize: give either OUT (a folder to write) or --cache (the quantized cache "
                            "that recipes with model.quantized_cache: auto read), not both and not neither.")
    if out is not None:
        _check_out(out, Path(recipe.model.name_or_path), force=args.force)
    if recipe.quantization.method == "none":
        raise FinetuneError("finetune quantize: quantization.method is none in the recipe: nothing to quantize. Fix: "
                            "set quantization.method: nf4 (or fp4).")
    device = _device(args.device)
    base = checkpoint_folder(recipe)  # a hub id is fetched (config, tokenizer, safetensors) or found in the cache
    base_config(base)  # a file, an adapter or run folder, a broken config.json: one paragraph, before a byte is read
    started = time.perf_counter()
    if args.cache:
        recipe.model.quantized_cache = "auto"
        out = quantized_cache.cached_checkpoint(recipe, base, device=device)
        if out == base:
            raise FinetuneError(f"finetune quantize: {base} was not written into the quantized cache (see the note "
                                "above). Fix: set FINETUNE_CACHE to a writable folder with room.")
    else:
        count = 0

        def progress(name: str) -> None:
            nonlocal count
            count += 1
            if count % 50 == 0:
                print(f"[finetune] quantized {count} weights ({name})", flush=True)

        write_quantized(base, out, bnb_config=quantization_config(recipe), dtype=torch_dtype(recipe.model.dtype),
                        device=device, max_shard_bytes=_size(args.max_shard_size), replace=args.force,
                        progress=progress)
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"[finetune] wrote {out}: {written / 2**20:,.1f} MiB of 4-bit safetensors ({recipe.quantization.method}, "
          f"double quant {str(recipe.quantization.double_quant).lower()}, storage "
          f"{recipe.quantization.quant_storage or recipe.model.dtype}) in {time.perf_counter() - started:.1f} s")
    return 0


def _check_out(out: Path, base: Path, *, force: bool) -> None:
    """Every reason not to write OUT, before a byte of the base is read: OUT is the base, holds it or is inside it
    (--force replaced the base with its own 4-bit copy); OUT exists (without --force), is a file or a link (--force
    replaces folders only: a file was moved aside, a link replaced and its target kept), or is the current folder;
    a folder above OUT is a file or not writable."""
    from finetune.files import destination_problem
    from finetune.model.quantization.writer import overlap_problem

    if base.expanduser().exists() and (problem := overlap_problem(base, out)):
        raise FinetuneError(f"finetune quantize: {problem}")
    if not os.path.lexists(out):
        if problem := destination_problem(out):
            raise FinetuneError(f"finetune quantize: {problem}; nothing was written. Fix: choose another OUT.")
        return
    if not force:
        raise FinetuneError(f"finetune quantize: {out} already exists and is not replaced. Fix: choose another OUT, or "
                            "add --force to replace it (the new folder takes its place in one rename).")
    if out.is_symlink() or not out.is_dir():
        what = f"a symbolic link (to {os.readlink(out)})" if out.is_symlink() else "a file"
        raise FinetuneError(f"finetune quantize: {out} is {what}; --force replaces a folder, never a file or a link. "
                            "Nothing was written. Fix: choose another OUT (or give the folder itself, not a link).")
    if Path.cwd().resolve().is_relative_to(out.resolve()):
        raise FinetuneError(f"finetune quantize: {out} is the current folder or holds it; replacing it would remove "
                            "the folder this command runs in. Nothing was written. Fix: choose another OUT, or run "
                            "from outside it.")


def _recipe(args: argparse.Namespace):
    from finetune.recipe import load_recipe, validate_recipe

    if args.recipe:
        from finetune.cli.library import resolve_recipe_path

        if args.base and not args.out and not args.cache:  # `--recipe R OUT`: the one folder given is OUT
            args.base, args.out = None, args.base

        overrides = [f"model.name_or_path={args.base}"] if args.base else []
        return load_recipe(resolve_recipe_path(args.recipe), overrides)
    if not args.base:
        raise FinetuneError("finetune quantize: give BASE (a bf16 model folder or hub id) or --recipe RECIPE.")
    # Only the model and quantization sections matter here; the data section is required by the schema.
    return validate_recipe({
        "model": {"name_or_path": args.base, "dtype": args.dtype},
        "quantization": {"method": args.method, "double_quant": not args.no_double_quant},
        "data": {"datasets": [{"path": "unused.jsonl"}]},
    }, source="finetune quantize")


def _device(name: str | None):
    """--device as torch names it, checked: a name torch does not know, or a device this machine lacks, ended in
    torch's traceback (`Torch not compiled with CUDA enabled`, bb56). None: the first GPU, else the CPU."""
    import torch

    if not name:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    fix = "Fix: --device cpu, or cuda / cuda:N on a machine with GPUs (left out: the first GPU, else the CPU)."
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise FinetuneError(f"finetune quantize: --device {name}: not a device torch knows. {fix}") from None
    if device.type == "cpu":
        return device
    try:  # torch.cuda, torch.xpu ...: each with is_available() and device_count()
        backend = getattr(torch, device.type)
        count = backend.device_count() if backend.is_available() else 0
    except (AttributeError, RuntimeError):
        count = 0
    if count == 0:
        raise FinetuneError(f"finetune quantize: --device {name}: this machine has no {device.type} device that torch "
                            f"{torch.__version__} can use. {fix}")
    if device.index is not None and device.index >= count:
        raise FinetuneError(f"finetune quantize: --device {name}: this machine has {count} {device.type} device"
                            f"{'s' if count > 1 else ''}, numbered from 0. {fix}")
    return device


def _size(text: str) -> int:
    from finetune.planner.fit import parse_size

    return int(parse_size(text, "--max-shard-size"))


def add_parser(verbs, verb) -> None:
    """The verb's arguments; `verb` runs it (command.py imports this module only when the verb is called)."""
    p = verbs.add_parser("quantize", help="write a bf16 base as a 4-bit checkpoint (or into the quantized cache)")
    p.add_argument("base", nargs="?", help="bf16 base: a folder or hub id (default: the recipe's model.name_or_path)")
    p.add_argument("out", nargs="?", help="folder to write (must not exist unless --force)")
    p.add_argument("--recipe", help="take the base, model.dtype and the quantization section from this recipe")
    p.add_argument("--cache", action="store_true", help="write into the quantized cache instead of OUT")
    p.add_argument("--method", default="nf4", choices=["nf4", "fp4"])
    p.add_argument("--no-double-quant", action="store_true", help="do not quantize the absmax values again")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="model.dtype: the storage of the packed weights and the dtype of the other tensors")
    p.add_argument("--device", help="where to quantize (default: the first GPU, else the CPU)")
    p.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default 2GiB)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=verb)
