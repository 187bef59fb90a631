"""The quantized cache (`model.quantized_cache: auto`): a bf16 base is quantized once into a 4-bit checkpoint that
every later start loads, reading a quarter of the bytes and quantizing nothing.

An entry lives in $FINETUNE_CACHE/quantized/<key> (else ~/.cache/finetune/quantized, beside the GGUF conversions),
keyed by where the base is (its resolved folder: a hub snapshot folder names its commit) and by everything that
decides the bytes: the quantization settings, model.dtype, the bitsandbytes version and this writer's version. Its
manifest records the base's identity (size and modification time of config.json and of every weight file); an entry
whose base changed since is rebuilt, with a printed note. The entry is written as `finetune quantize` writes (a
plain transformers 4-bit folder) and published with one rename; one process builds it while the others of the node
wait on a file lock, then all read it.

Why `off` by default: an entry is a quarter of the base on disk (~37 GB for a 70B model) in the user's cache
folder, which on clusters is often a small home quota, and the first start pays the quantization plus the write.
Turned on, a start whose cache entry cannot be written (no room) falls back to quantizing at load with a note.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from finetune import distributed
from finetune.files import exclusive_lock
from finetune.model.quantization.prequantized import is_prequantized
from finetune.model.sources.files import checkpoint_index
from finetune.recipe import Recipe

CACHE_VERSION = 1  # bump when the written layout or the quantization path changes: old entries are then not read
MANIFEST = "finetune_quantized.json"


def cache_root() -> Path:
    """$FINETUNE_CACHE/quantized, else ~/.cache/finetune/quantized (beside the GGUF conversions; XDG_CACHE_HOME honoured)."""
    from finetune.model.sources.gguf import cache_root as gguf_cache_root

    return gguf_cache_root().parent / "quantized"


def settings(recipe: Recipe) -> dict:
    """What decides the 4-bit bytes besides the base."""
    import bitsandbytes

    quant = recipe.quantization
    return {"method": quant.method, "double_quant": quant.double_quant, "dtype": recipe.model.dtype,
            "quant_storage": quant.quant_storage or recipe.model.dtype, "bitsandbytes": bitsandbytes.__version__,
            "cache_version": CACHE_VERSION}


def base_identity(folder: Path) -> dict[str, list[int]]:
    """Size and modification time of config.json and every weight file (resolved: hub snapshots are symlinks)."""
    index = checkpoint_index(folder)
    paths = sorted({*index.files.values(), Path(folder) / "config.json"})
    identity = {}
    for path in paths:
        stat = path.resolve().stat()
        identity[path.name] = [stat.st_size, stat.st_mtime_ns]
    return identity


def entry_folder(recipe: Recipe, base: Path) -> Path:
    text = json.dumps([str(Path(base).resolve()), settings(recipe)], sort_keys=True)
    return cache_root() / hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_checkpoint(recipe: Recipe, base: Path, *, device: torch.device) -> Path:
    """The folder to load: the cache entry for `base` (built first if missing or stale), or `base` itself when the
    cache is off, does not apply (no quantization, an already 4-bit checkpoint), or cannot be written."""
    if recipe.model.quantized_cache == "off" or recipe.quantization.method == "none" or is_prequantized(base):
        return base
    target = entry_folder(recipe, base)
    identity = base_identity(base)
    if _stale_reason(target, identity) is None:
        distributed.print0(f"[finetune] model: the 4-bit cache of {recipe.model.name_or_path} ({target})")
        return target
    with exclusive_lock(target.with_name(target.name + ".lock")):  # one process builds; the others wait, then read it
        reason = _stale_reason(target, identity)
        if reason is None:
            return target
        return _build(recipe, base, target, identity, reason, device=device)


def _build(recipe: Recipe, base: Path, target: Path, identity: dict, reason: str, *, device: torch.device) -> Path:
    from finetune.files import free_mb, no_room
    from finetune.model.quantization.writer import write_quantized
    from finetune.model.settings import quantization_config, torch_dtype

    needed = sum(size for size, _ in identity.values()) // 3  # 4-bit codes + quant state + bf16 norms/embeddings
    free = shutil.disk_usage(_existing_parent(target)).free
    if free < needed:
        print(f"[finetune] note: the quantized cache needs ~{needed / 1e6:,.0f} MB in {target.parent} and "
              f"{free_mb(target.parent)} are free: quantizing at load instead (set FINETUNE_CACHE elsewhere, or "
              "model.quantized_cache: off).", flush=True)
        return base
    print(f"[finetune] note: {reason}: quantizing {recipe.model.name_or_path} once into {target} "
          "(later starts load these 4-bit bytes)", flush=True)
    manifest = {"base": str(Path(base).resolve()), "name_or_path": recipe.model.name_or_path,
                "identity": identity, "settings": settings(recipe)}

    def write_manifest(folder: Path) -> None:  # last, inside the folder before it is published
        manifest["files"] = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))

    try:
        write_quantized(base, target, bnb_config=quantization_config(recipe), dtype=torch_dtype(recipe.model.dtype),
                        device=device, replace=True, finish=write_manifest)
    except OSError as exc:
        if not no_room(exc):
            raise
        print(f"[finetune] note: no room for the quantized cache in {target.parent} ({exc.strerror}): quantizing at "
              "load instead.", flush=True)
        return base
    return target


def _stale_reason(target: Path, identity: dict) -> str | None:
    """None when the entry can be read as it is; otherwise why it is (re)built."""
    manifest_path = target / MANIFEST
    if not manifest_path.is_file():
        return "no quantized cache entry yet"
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError:
        return "the quantized cache entry's manifest is unreadable"
    if manifest.get("identity") != identity:
        old = manifest.get("identity", {})
        changed = sorted(name for name in identity.keys() | old.keys() if identity.get(name) != old.get(name))
        return (f"the base changed since its quantized cache entry was written ({', '.join(changed[:4])}: other size "
                "or modification time), so the entry is rebuilt")
    sizes = manifest.get("files", {})
    damaged = [name for name, size in sizes.items()
               if not (target / name).is_file() or (target / name).stat().st_size != size]
    if not sizes or damaged:
        return f"the quantized cache entry is damaged ({', '.join(damaged[:3]) or 'no file sizes'}), so it is rebuilt"
    return None


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
