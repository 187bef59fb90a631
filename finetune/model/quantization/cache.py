"""The quantized cache (`model.quantized_cache: auto`): a bf16 base is quantized once into a 4-bit checkpoint that
every later start loads, reading a quarter of the bytes and quantizing nothing.

An entry lives in $FINETUNE_CACHE/quantized/<key> (else $XDG_CACHE_HOME/finetune/quantized, else
~/.cache/finetune/quantized: beside the GGUF conversions and the tokenized data, one rule: gguf.cache_root),
keyed by where the base is (its resolved folder: a hub snapshot folder names its commit) and by everything that
decides the bytes and their names: the quantization settings, model.dtype, the bitsandbytes and transformers versions
(the tensors are written under transformers' renames) and this writer's version (CACHE_VERSION). Its
manifest records the base's identity (size, modification time and a sampled content hash of config.json and of every
weight file: base_identity); an entry whose base changed since is rebuilt, with a printed note. The entry is written as `finetune quantize` writes (a
plain transformers 4-bit folder) and published with one rename; one process builds it while the others of the node
wait on a file lock, then all read it.

Why `off` by default: an entry is a quarter of the base on disk (~37 GB for a 70B model) in the user's cache
folder, which on clusters is often a small home quota, and the first start pays the quantization plus the write.
Turned on, a start whose cache entry cannot be written (no room, a read-only or mistyped FINETUNE_CACHE) falls back to
quantizing at load with a note.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from finetune import distributed
from finetune.files import content_sample, exclusive_lock
from finetune.model.quantization.prequantized import is_prequantized
from finetune.model.sources.files import checkpoint_index
from finetune.recipe import Recipe

# Bump when the written layout or the quantization path changes: it is in the key, so old entries are never read (and
# are named by a note when their replacement is built: nothing removes them, another finetune may still read them).
# 1: the checkpoint's own tensor names, a mixture-of-experts model's experts left in bf16 (before 4e46171).
# 2: the model's names (transformers' renames), experts split one 4-bit weight per expert projection (writer.py).
CACHE_VERSION = 2
_VERSION_SETTINGS = ("cache_version", "bitsandbytes", "transformers")  # an entry that differs only in these is orphaned
MANIFEST = "finetune_quantized.json"


def cache_root() -> Path:
    """$FINETUNE_CACHE/quantized, else $XDG_CACHE_HOME/finetune/quantized, else ~/.cache/finetune/quantized (beside the
    GGUF conversions: gguf.cache_root holds the rule)."""
    from finetune.model.sources.gguf import cache_root as gguf_cache_root

    return gguf_cache_root().parent / "quantized"


def settings(recipe: Recipe) -> dict:
    """What decides the 4-bit bytes besides the base."""
    import bitsandbytes
    import transformers

    quant = recipe.quantization
    return {"method": quant.method, "double_quant": quant.double_quant, "dtype": recipe.model.dtype,
            "quant_storage": quant.quant_storage or recipe.model.dtype, "bitsandbytes": bitsandbytes.__version__,
            "transformers": transformers.__version__, "cache_version": CACHE_VERSION}


def base_identity(folder: Path) -> dict[str, list]:
    """Size, modification time and content sample (content_sample) of config.json and every weight file (resolved: hub
    snapshots are symlinks). Size and mtime alone missed other weights of the same shapes put in place with the old
    mtime (cp -p, rsync -a, a restored backup, a reproducible image): two fine-tunes of one architecture have the same
    sizes, and the run trained on the old base's entry without a word (bb20)."""
    identity = {}
    for path in base_files(folder):
        stat, sample = file_sample(path)
        identity[path.name] = [stat.st_size, stat.st_mtime_ns, sample]
    return identity


def base_files(folder: Path) -> list[Path]:
    """config.json and every weight file of a base folder (ModelLoadError where it holds no safetensors weights)."""
    index = checkpoint_index(folder)
    return sorted({*index.files.values(), Path(folder) / "config.json"})


_SAMPLES: dict[tuple, str] = {}  # content samples of this process, by the file's inode, size, mtime and ctime


def file_sample(path: Path) -> tuple:
    """(stat, content_sample) of `path` (resolved), sampled once per process while the file is unchanged: the run's
    quantized cache, its resume check and every checkpoint it saves (outputs/base_record.py) ask for the same base.
    The key holds the ctime, which every write or copy over the file changes (cp -p and rsync -a set the mtime back,
    not the ctime)."""
    stat = Path(path).resolve().stat()
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _SAMPLES:
        _SAMPLES[key] = content_sample(path)
    return stat, _SAMPLES[key]


def _say_waiting(holder: str, sibling: bool) -> None:
    if sibling:  # the ranks of one launch: one quantizes, the others read what it wrote
        distributed.print0(f"[finetune] model: {holder} is writing the 4-bit cache; this rank reads it once written.",
                           file=sys.stderr)
        return
    distributed.print0(f"[finetune] model: waiting for another run writing the same 4-bit cache entry: {holder}. This "
                       "run goes on once that one has quantized the base; if that process is stopped (Ctrl-Z) or hung, "
                       "resume or end it.", file=sys.stderr)


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
    with contextlib.ExitStack() as held:
        try:  # one process builds; the others wait, then read it
            held.enter_context(exclusive_lock(target.with_name(target.name + ".lock"), _say_waiting))
        except OSError as exc:  # read-only, a file where the folder should be, no permission: as without the cache
            _say_unwritable(target, exc)
            return base
        reason = _stale_reason(target, identity)
        if reason is None:
            return target
        return _build(recipe, base, target, identity, reason, device=device)


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST)


def _say_unwritable(target: Path, exc: OSError) -> None:
    distributed.print0(f"[finetune] note: the quantized cache folder {target.parent} cannot be written "
                       f"({exc.strerror or exc}): quantizing at load instead (set FINETUNE_CACHE to a writable folder, "
                       "or model.quantized_cache: off).")


def _build(recipe: Recipe, base: Path, target: Path, identity: dict, reason: str, *, device: torch.device) -> Path:
    from finetune.files import free_mb, no_room
    from finetune.model.quantization.writer import write_quantized
    from finetune.model.settings import quantization_config, torch_dtype

    needed = sum(size for size, *_ in identity.values()) // 3  # 4-bit codes + quant state + bf16 norms/embeddings
    free = shutil.disk_usage(_existing_parent(target)).free
    if free < needed:
        print(f"[finetune] note: the quantized cache needs ~{needed / 1e6:,.0f} MB in {target.parent} and "
              f"{free_mb(target.parent)} are free: quantizing at load instead (set FINETUNE_CACHE elsewhere, or "
              "model.quantized_cache: off).", flush=True)
        return base
    print(f"[finetune] note: {reason}: quantizing {recipe.model.name_or_path} once into {target} "
          "(later starts load these 4-bit bytes)", flush=True)
    if orphans := orphaned_entries(recipe, base):  # nothing removes them: say where they are
        size = sum(path.stat().st_size for entry in orphans for path in entry.rglob("*") if path.is_file())
        print(f"[finetune] note: older quantized cache entries of this base, written by another finetune, bitsandbytes "
              f"or transformers version, are no longer read: {', '.join(map(str, orphans))} ({size / 1e6:,.0f} MB). "
              "Delete them to free the space (unless another finetune install still uses this cache).", flush=True)
    manifest = {"base": str(Path(base).resolve()), "name_or_path": recipe.model.name_or_path,
                "identity": identity, "settings": settings(recipe)}

    def write_manifest(folder: Path) -> None:  # last, inside the folder before it is published (fsync, rename)
        from finetune.model.file_sums import folder_sums

        manifest["files"] = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        manifest["sums"] = folder_sums(folder, list(manifest["files"]))  # compared at every start: _stale_reason
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")

    try:
        write_quantized(base, target, bnb_config=quantization_config(recipe), dtype=torch_dtype(recipe.model.dtype),
                        device=device, replace=True, finish=write_manifest)
    except OSError as exc:
        if exc.errno in _UNWRITABLE and str(exc.filename or target).startswith(str(target.parent)):
            _say_unwritable(target, exc)
            return base
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
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        return "the quantized cache entry's manifest is unreadable"
    if manifest.get("identity") != identity:
        old = manifest.get("identity", {})
        if old and all(len(value) == 2 for value in old.values()):
            return ("the quantized cache entry was written by a finetune that did not record the base's contents, so "
                    "it is rebuilt")
        changed = sorted(name for name in identity.keys() | old.keys() if identity.get(name) != old.get(name))
        return (f"the base changed since its quantized cache entry was written ({', '.join(changed[:4])}: other size, "
                "modification time or contents), so the entry is rebuilt")
    sizes = manifest.get("files", {})
    damaged = [name for name, size in sizes.items()
               if not (target / name).is_file() or (target / name).stat().st_size != size]
    if not sizes or damaged:
        return f"the quantized cache entry is damaged ({', '.join(damaged[:3]) or 'no file sizes'}), so it is rebuilt"
    return _changed_reason(target, manifest.get("sums"))


def _changed_reason(target: Path, sums) -> str | None:
    """Why an entry whose files have their sizes is rebuilt anyway: bytes that differ from its manifest's sampled
    checksums (model/file_sums.py: zeroed by a power cut after the build, a partial copy; a few MB read per file, not
    the GBs). An entry written before they were recorded has none: its sizes are all there is to compare."""
    from finetune.model.file_sums import changed_files

    if sums is None:
        return None
    changed = changed_files(target, sums) if isinstance(sums, dict) else [MANIFEST]
    if not changed:
        return None
    return (f"the quantized cache entry is damaged ({', '.join(changed[:3])}: the bytes differ from what was "
            "written, e.g. zeroed by a power cut or a partial copy), so it is rebuilt")


def orphaned_entries(recipe: Recipe, base: Path) -> list[Path]:
    """Entries of `base` with this recipe's settings but another writer or library version: this finetune never reads
    them again (the key differs). Entries of other settings (another dtype, double quant...) are not orphans."""
    current, base_path = settings(recipe), str(Path(base).resolve())
    orphans = []
    for manifest_path in sorted(cache_root().glob(f"*/{MANIFEST}")):
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        written = manifest.get("settings") or {}
        if manifest.get("base") != base_path or manifest_path.parent == entry_folder(recipe, base) or any(
                written.get(key) != value for key, value in current.items() if key not in _VERSION_SETTINGS):
            continue
        orphans.append(manifest_path.parent)
    return orphans


def mismatch_fix(folder: Path) -> str | None:
    """The fix to name when a checkpoint `folder` that is a quantized cache entry does not match the model (an entry
    another writer wrote under the same key): the base and its config.json are fine, the entry is not."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file() or folder.resolve().parent != cache_root().resolve():
        return None
    return (f"Fix: delete the quantized cache entry {folder} (the next start rebuilds it from the base), or set "
            "model.quantized_cache: off.")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
