"""Writing what a run produces and reading it back: the output folder guard, training checkpoints, the adapter.

Layout of output.dir:

    .finetune.lock              pid + host of the run that uses the folder (a second run is refused)
    recipe.yaml  metrics.jsonl  ranks/rank{r}.json
    checkpoints/step-00000040/
        trainable/              torch.distributed.checkpoint (DCP) of {"model": LoRA tensors, "optim": optimizer state};
                                under FSDP every rank writes its own shard, and a load reshards to any world size
        deepspeed/              instead of trainable/ under DeepSpeed: its own checkpoint (one ZeRO partition file per
                                rank; loads into the same number of ranks and ZeRO stage only)
        rng/rank{r}.pt          torch / numpy / python (and CUDA) RNG states of every rank
        trainer_state.json      step, scheduler, data position, losses so far, world size, strategy
        recipe.yaml             the resolved recipe of the run that wrote it
        manifest.json           written last: every file with its size and sha256
    adapter/                    the standard PEFT adapter (the result)

Only trainable state is saved, never the base weights. Every checkpoint is written into a hidden temporary folder,
flushed, renamed into place, and only then given its manifest: a folder without a valid manifest (killed mid-save,
truncated, tampered) is detected, reported, and skipped in favour of the newest good one.

This module holds the training checkpoints (finding, checking, saving, loading). The other jobs of the run folder
live beside it and are re-exported here for callers: finetune/files.py (crash-safe writes, on_main),
finetune/run_folder.py (the output-folder guard, recipe.yaml, rank stats) and finetune/adapter_files.py (the adapter).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune import distributed, engine_deepspeed
from finetune.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_key_map, save_adapter
from finetune.errors import CheckpointError
from finetune.files import _fsync_tree, _replace_dir, _sha256, _write_text_atomic, atomic_dir, on_main
from finetune.run_folder import (
    LOCK_FILE,
    RunFolder,
    begin_outputs,
    claim_output_dir,
    current_rss_bytes,
    output_dir_problem,
    release_output_dir,
    take_output_dir,
    write_rank_stats,
)

__all__ = [  # the training checkpoints, and the run-folder jobs re-exported for callers (checkpoint.X)
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "CHECKPOINTS", "LOCK_FILE", "MANIFEST", "STEP_PREFIX", "TRAINER_STATE",
    "RunFolder", "adapter_key_map", "atomic_dir", "begin_outputs", "check_compatible", "checkpoint_dir",
    "checkpoint_problem", "claim_output_dir", "current_rss_bytes", "list_checkpoints", "load_checkpoint",
    "newest_good_checkpoint", "on_main", "output_dir_problem", "prune_checkpoints", "release_output_dir",
    "resume_source", "rng_state", "save_adapter", "save_checkpoint", "set_rng_state", "take_output_dir",
    "trainable_state", "verify_readback", "write_rank_stats",
]

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STEP_PREFIX = "step-"
# Recipe keys that fix the shapes and meaning of the saved LoRA tensors: a resume must not change them.
SHAPE_KEYS = (("lora", "r"), ("lora", "target_modules"), ("lora", "dora"), ("lora", "bias"))
# Keys whose change is allowed on resume but makes the run differ from an uninterrupted one: reported.
NOTED_KEYS = (("model", "name_or_path"), ("model", "dtype"), ("quantization", "method"), ("lora", "alpha"),
              ("lora", "rslora"), ("train", "seed"), ("train", "micro_batch_size"), ("train", "grad_accum"),
              ("train", "learning_rate"), ("train", "lr_schedule"), ("data", "datasets"), ("data", "packing"))


# ------------------------------------------------------------------------------------ finding checkpoints
def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every renamed-into-place checkpoint folder, oldest first (good or not)."""
    root = Path(out_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for path in root.iterdir():
            digits = path.name.removeprefix(STEP_PREFIX)
            if path.is_dir() and path.name.startswith(STEP_PREFIX) and digits.isdigit():
                found.append((int(digits), path))
    return sorted(found)


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (None when every file matches its manifest)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest.json (the save did not finish: killed or crashed while writing)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is unreadable ({type(exc).__name__}: {exc})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or changed)"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted or changed)"
    return None


def newest_good_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest; every damaged newer one is reported."""
    for step, path in reversed(list_checkpoints(out_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        distributed.print0(f"[finetune] warning: checkpoint {path} is damaged and skipped: {problem}")
    return None


def resume_source(recipe) -> Path | None:
    """The checkpoint train.resume points at (`auto`: the newest good one in output.dir, if any). Rank 0."""
    wanted, out_dir = recipe.train.resume, Path(recipe.output.dir)
    if wanted is None:
        return None
    if wanted == "auto":
        found = newest_good_checkpoint(out_dir)
        if found is None and (out_dir / "adapter" / ADAPTER_WEIGHTS).exists() and not recipe.output.overwrite:
            raise CheckpointError(
                f"train.resume=auto: output.dir {out_dir} holds a finished run but no usable checkpoint to continue from. "
                "Nothing was changed. Fix: choose another output.dir, or pass output.overwrite=true to start over."
            )
        if found is None and list_checkpoints(out_dir):
            distributed.print0(f"[finetune] warning: no good checkpoint in {out_dir / CHECKPOINTS}; starting from step 0")
    else:
        found = _explicit_checkpoint(Path(wanted).expanduser())
    if found is not None:
        check_compatible(found, recipe)
    return found


def _explicit_checkpoint(path: Path) -> Path:
    """train.resume=PATH: a checkpoint folder, or a run folder (its newest good checkpoint)."""
    if not path.exists():
        raise CheckpointError(f"train.resume: {path} does not exist. Fix: give a checkpoint folder "
                              f"(…/{CHECKPOINTS}/{STEP_PREFIX}N), a run folder, or `auto`.")
    if (path / CHECKPOINTS).is_dir():
        found = newest_good_checkpoint(path)
        if found is None:
            raise CheckpointError(f"train.resume: {path} has no usable checkpoint in {CHECKPOINTS}/ (all missing or damaged).")
        return found
    if path.is_dir() and (path.name.startswith(STEP_PREFIX) or (path / MANIFEST).exists()):
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"train.resume: checkpoint {path} cannot be used: {problem}. Fix: point train.resume at "
                                  "an older checkpoint, or use `auto` to take the newest good one.")
        return path
    raise CheckpointError(f"train.resume: {path} is not a checkpoint (no {MANIFEST}) nor a run folder "
                          f"(no {CHECKPOINTS}/). Fix: give …/{CHECKPOINTS}/{STEP_PREFIX}N, a run folder, or `auto`.")


def check_compatible(path: Path, recipe) -> None:
    """Refuse a checkpoint whose LoRA shapes differ from the recipe's; report other changed keys."""
    import yaml

    try:
        saved = yaml.safe_load((path / "recipe.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"train.resume: {path}/recipe.yaml is unreadable ({exc}).") from None
    current = recipe.model_dump(mode="json")

    def value(tree: dict, keys: tuple[str, str]) -> Any:
        return (tree.get(keys[0]) or {}).get(keys[1])

    clashes = [f"{'.'.join(k)}: checkpoint {value(saved, k)!r}, recipe {value(current, k)!r}"
               for k in SHAPE_KEYS if value(saved, k) != value(current, k)]
    if clashes:
        raise CheckpointError(f"train.resume: checkpoint {path} was trained with a different LoRA layout "
                              f"({'; '.join(clashes)}). Fix: use the recipe it was made with, or start a new run.")
    for keys in NOTED_KEYS:
        if value(saved, keys) != value(current, keys):
            distributed.print0(f"[finetune] note: resuming with {'.'.join(keys)} changed "
                               f"({value(saved, keys)!r} -> {value(current, keys)!r}): the run will differ from an uninterrupted one")


# ------------------------------------------------------------------------------------ training state
def trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> dict:
    """{"model": the trainable tensors, "optim": the optimizer state}, keyed by the model's own parameter names.

    Under FSDP the tensors are this rank's shards (DTensor / ShardedTensor), so DCP writes one file per rank and
    reshards on load. `ignore_frozen_params` drops the frozen base weights; the filter by `names` also drops the
    buffers and bitsandbytes quantization state that are not parameters.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    with _quiet_torch_distributed():
        model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    model_state = {key: value for key, value in model_state.items() if key in names}
    missing = sorted(set(names) - set(model_state))
    if missing:
        raise RuntimeError(f"trainable state is missing {len(missing)} of {len(names)} tensors (e.g. {missing[0]})")
    return {"model": model_state, "optim": optim_state}


def _single() -> bool:
    """No process group: DCP reads and writes in this process alone."""
    return distributed.info().backend is None


@contextlib.contextmanager
def _quiet_torch_distributed() -> Iterator[None]:
    """Silence torch's deprecation chatter of FSDP1 state dicts (ShardedTensor) and DCP's single-process notice:
    dozens of lines per rank and checkpoint that say nothing about this run."""
    with warnings.catch_warnings():
        for message in ("torch.distributed is disabled", "Please use DTensor instead", ".*_get_pg_default_device",
                        "Multiple backends are registered"):
            warnings.filterwarnings("ignore", message=message)
        yield


def _dcp(operation: Callable, state: dict, path: Path) -> None:
    """dcp.save / dcp.load on `path`, in this process alone when there is no process group."""
    with _quiet_torch_distributed():
        operation(state, checkpoint_id=path, no_dist=_single())


def _local(value: Any) -> Any:
    """This rank's part of a (possibly sharded) tensor."""
    if hasattr(value, "to_local"):  # DTensor (FSDP2, FSDP1 optimizer state)
        return value.to_local()
    if hasattr(value, "local_tensor"):  # ShardedTensor (FSDP1 model state)
        return value.local_tensor() if value.local_shards() else torch.empty(0)
    return value


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), tree


def rng_state() -> dict:
    """Every random generator this process uses, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str],
                    trainer_state: dict, recipe_yaml: str, *, keep_last: int, verify: bool = False) -> Path:
    """Write checkpoints/step-N atomically (collective: every rank writes its shard and its RNG state).

    Order: temp folder <- every rank's files; flush; rename into place; manifest with checksums; prune to keep_last.
    With `verify`, every rank then reads its part back and compares it with what it saved.
    """
    import torch.distributed.checkpoint as dcp

    started, info = time.perf_counter(), distributed.info()
    final = checkpoint_dir(out_dir, step)
    tmp = final.parent / f".{final.name}.tmp"

    def make_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)

    on_main(_as_checkpoint_error(make_tmp, f"cannot create {tmp}"))
    deepspeed = engine_deepspeed.is_engine(model)
    state = trainable_state(model, optimizer, names) if not deepspeed else None
    tensors = state["model"] if state else engine_deepspeed.trainable_state_dict(model, names)
    if distributed.any_rank(not all(torch.isfinite(_local(v)).all() for v in tensors.values())):
        raise CheckpointError(f"step {step}: the adapter has NaN/inf values; checkpoint not written (older ones kept).")
    if deepspeed:
        engine_deepspeed.save_state(model, tmp / engine_deepspeed.CHECKPOINT_FOLDER)
    else:
        _dcp(dcp.save, state, tmp / "trainable")
    rng_file = tmp / "rng" / f"rank{info.rank}.pt"
    torch.save(rng_state(), rng_file)
    with open(rng_file, "rb") as handle:
        os.fsync(handle.fileno())
    distributed.barrier()

    def publish() -> int:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        (tmp / "recipe.yaml").write_text(recipe_yaml)
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
        size = _write_manifest(final, step, trainer_state)
        prune_checkpoints(out_dir, keep_last=keep_last, newest=step)
        return size

    size = on_main(_as_checkpoint_error(publish, f"cannot write checkpoint {final}"))
    verify = verify and not deepspeed  # DeepSpeed's files are covered by the manifest's checksums only
    if verify:
        verify_readback(final, state)
    distributed.print0(f"[finetune] checkpoint {final} saved ({size / 1e6:.2f} MB, {time.perf_counter() - started:.2f} s"
                       f"{', read back and compared' if verify else ''})")
    return final


def _as_checkpoint_error(function: Callable[[], Any], what: str) -> Callable[[], Any]:
    """Turn an OSError (disk full, permissions) into a CheckpointError that on_main can hand to every rank."""
    def wrapped() -> Any:
        try:
            return function()
        except OSError as exc:
            raise CheckpointError(f"{what}: {exc.strerror or exc}. Older checkpoints are kept.") from None
    return wrapped


def _write_manifest(folder: Path, step: int, trainer_state: dict) -> int:
    """manifest.json: every file with size and sha256, written last (its presence marks a complete checkpoint)."""
    files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST}
    manifest = {"format": 1, "step": step, "world_size": trainer_state.get("world_size"),
                "strategy": trainer_state.get("strategy"), "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    _write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return sum(entry["bytes"] for entry in files.values())


def prune_checkpoints(out_dir: Path, *, keep_last: int, newest: int) -> None:
    """Keep the `keep_last` newest checkpoints up to step `newest`; remove older ones, leftovers of interrupted saves,
    and checkpoints of steps after `newest` (a timeline abandoned by resuming from an earlier checkpoint)."""
    root = Path(out_dir) / CHECKPOINTS
    for leftover in root.glob(f".{STEP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    checkpoints = list_checkpoints(out_dir)
    for step, path in checkpoints:
        if step > newest:
            distributed.print0(f"[finetune] removing {path}: it is after the step this run resumed from")
            shutil.rmtree(path, ignore_errors=True)
    kept = [path for step, path in checkpoints if step <= newest]
    for path in kept[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def verify_readback(path: Path, saved: dict) -> None:
    """Every rank loads its part of the checkpoint into zeroed copies and compares with what it saved.

    Catches a checkpoint that holds only rank 0's slice, or tensors that do not survive the round trip.
    """
    import torch.distributed.checkpoint as dcp

    template = copy.deepcopy(saved)
    for _, value in _leaves(template):
        if isinstance(_local(value), torch.Tensor):
            _local(value).zero_()
    _dcp(dcp.load, template, path / "trainable")
    saved_leaves, loaded_leaves = dict(_leaves(saved)), dict(_leaves(template))
    differs = [key for key, value in saved_leaves.items() if not _same(_local(value), _local(loaded_leaves.get(key)))]
    if distributed.any_rank(bool(differs)):
        where = f"rank {distributed.info().rank}: {differs[0]}" if differs else "another rank"
        raise CheckpointError(f"checkpoint {path} read back differs from what was saved ({where}). It cannot be trusted; "
                              "this is a bug in the parallel setup, please report it.")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> dict:
    """Load trainable weights, optimizer state and this rank's RNG state from `path`; return the trainer state.

    DCP reshards to the current world size and strategy. A rank that did not exist in the saving run keeps its seed.
    """
    import logging

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    if engine_deepspeed.is_engine(model):
        engine_deepspeed.load_state(model, path / engine_deepspeed.CHECKPOINT_FOLDER,
                                    saved_world_size=trainer_state["world_size"], saved_strategy=trainer_state["strategy"])
        _load_rng(path)
        return trainer_state
    if not (path / "trainable").is_dir():
        raise CheckpointError(f"train.resume: checkpoint {path} was written by {trainer_state['strategy']} (DeepSpeed's own "
                              "format). Fix: resume it with the same DeepSpeed setup and number of processes, or start a new run.")
    state = trainable_state(model, optimizer, names)
    try:
        _dcp(dcp.load, state, path / "trainable")
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:  # DCP wraps per-rank failures
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"train.resume: checkpoint {path} does not fit this model ({reason}).") from None
    fsdp_log = logging.getLogger("torch.distributed.fsdp._state_dict_utils")
    level = fsdp_log.level
    fsdp_log.setLevel(logging.ERROR)  # FSDP1 warns once per frozen base weight that it is not in a trainable-only state
    try:
        with _quiet_torch_distributed():
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(strict=False, ignore_frozen_params=True))
    finally:
        fsdp_log.setLevel(level)
    _load_rng(path)
    return trainer_state


def _load_rng(path: Path) -> None:
    rng_file = path / "rng" / f"rank{distributed.info().rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
