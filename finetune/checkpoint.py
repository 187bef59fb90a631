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
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune import distributed, engine_deepspeed
from finetune.errors import CheckpointError, FinetuneError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LOCK_FILE = ".finetune.lock"
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


# ------------------------------------------------------------------------------------------------ file helpers
def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (POSIX: fsync the directory itself)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _replace_dir(source: Path, target: Path) -> None:
    """Move `source` to `target` in one rename; an existing `target` is moved aside first and removed after."""
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, target)
    _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_dir(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `target` in one rename (the old one removed after)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists() and not replace:
            raise CheckpointError(f"{target} already exists; choose another folder or remove it first.")
        _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def on_main(function: Callable[[], Any]) -> Any:
    """Run `function` on rank 0 only and give its result (or its FinetuneError) to every rank.

    A rank-0 check that raised alone would leave the other ranks waiting in the next collective forever.
    """
    outcome: tuple[str, Any] | None = None
    if distributed.is_main():
        try:
            outcome = ("ok", function())
        except FinetuneError as exc:
            outcome = ("error", (type(exc), str(exc)))
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        error_type, message = outcome[1]
        raise error_type(message)
    return outcome[1]


# ------------------------------------------------------------------------------------------- output folder
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def _lock_owner(out_dir: Path) -> dict | None:
    """The live run holding `out_dir` (pid, host), or None when free or the holder is gone."""
    try:
        owner = json.loads((out_dir / LOCK_FILE).read_text())
    except (OSError, json.JSONDecodeError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return owner if isinstance(owner, dict) and owner.get("host") else None  # another host: assume alive
    return owner if _pid_alive(int(owner.get("pid", -1))) else None


def output_dir_problem(out_dir: Path, *, overwrite: bool, resume: str | None) -> str | None:
    """Why this run may not write into `out_dir` (None when it may). Checked on rank 0 before anything loads."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return f"output.dir {out_dir} is a file, not a folder. Fix: choose another output.dir."
    owner = _lock_owner(out_dir)
    if owner:
        return (
            f"output.dir {out_dir} is in use by a running run (pid {owner.get('pid')} on {owner.get('host')}). Wait for it, "
            f"stop it, or choose another output.dir. (If no such run exists, delete {out_dir / LOCK_FILE}.)"
        )
    if overwrite or resume is not None:
        return None
    if (out_dir / "adapter" / ADAPTER_WEIGHTS).exists():
        return (
            f"output.dir {out_dir} already holds a finished run (adapter/). Nothing was changed. Fix: choose another "
            "output.dir, pass output.overwrite=true to replace it, or train.resume=auto to continue it."
        )
    if list_checkpoints(out_dir):
        return (
            f"output.dir {out_dir} holds checkpoints of a run that did not finish. Nothing was changed. Fix: pass "
            "train.resume=auto to continue it, output.overwrite=true to start over, or choose another output.dir."
        )
    return None


def take_output_dir(out_dir: Path) -> bool:
    """Create the lock file exclusively (a second run racing for the folder loses). True if we created `out_dir`."""
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = out_dir / LOCK_FILE
        if lock.exists() and _lock_owner(out_dir) is None:
            lock.unlink()  # left by a killed run
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise CheckpointError(f"output.dir {out_dir} was just taken by another run; choose another output.dir.") from None
    except OSError as exc:
        raise CheckpointError(f"output.dir {out_dir}: cannot write there ({exc.strerror}). Fix: choose a writable folder.") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
    return created


def release_output_dir(out_dir: Path, *, remove_if_empty: bool = False) -> None:
    with contextlib.suppress(FileNotFoundError):
        (out_dir / LOCK_FILE).unlink()
    if remove_if_empty:
        with contextlib.suppress(OSError):
            out_dir.rmdir()  # only succeeds when empty: a run that failed before writing anything leaves no trace


@dataclass
class RunFolder:
    """The claimed output folder and the checkpoint this run resumes from (None: a fresh start)."""

    path: Path
    resume_from: Path | None
    created: bool = False


@contextlib.contextmanager
def claim_output_dir(recipe) -> Iterator[RunFolder]:
    """Check output.dir and the resume source (before any weight loads), lock the folder, release it at the end.

    Collective: rank 0 decides and every rank gets the same answer (or the same error).
    """
    out_dir = Path(recipe.output.dir)

    def decide() -> tuple[str | None, bool]:
        problem = output_dir_problem(out_dir, overwrite=recipe.output.overwrite, resume=recipe.train.resume)
        if problem:
            raise CheckpointError(problem)
        source = resume_source(recipe)
        return (str(source) if source else None), take_output_dir(out_dir)

    source, created = on_main(decide)
    folder = RunFolder(out_dir, Path(source) if source else None, created)
    try:
        yield folder
    finally:
        if distributed.is_main():
            release_output_dir(out_dir, remove_if_empty=folder.created)


def begin_outputs(out_dir: Path, recipe_yaml: str, resume_from: Path | None) -> None:
    """Rank 0, when training is about to start: clear a replaced run's files (fresh start) or trim the metrics past
    the checkpoint (resume); write recipe.yaml.

    Done this late so that a run failing on its inputs (data, model, launcher, checkpoint) changes nothing in output.dir.
    """
    if resume_from is None:
        for name in ("adapter", CHECKPOINTS, "ranks"):
            shutil.rmtree(out_dir / name, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (out_dir / "metrics.jsonl").unlink()
    else:
        resumed_step = json.loads((resume_from / MANIFEST).read_text())["step"]
        _trim_metrics(out_dir / "metrics.jsonl", resumed_step)
    (out_dir / "recipe.yaml").write_text(recipe_yaml)


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop records of steps after the checkpoint (written by the killed run): they are trained again."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
    _write_text_atomic(path, "".join(line + "\n" for line in kept))


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def write_rank_stats(out_dir: Path, stats: dict, trainable_state: dict) -> None:
    """Per-rank facts for tests and the planner's checks: held parameter bytes, peak RSS (and peak GPU memory on
    CUDA), LoRA checksum."""
    import resource

    stats = dict(stats, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 lora_checksum=float(sum(t.double().sum() for t in trainable_state.values())))
    if torch.cuda.is_available():
        stats["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    (out_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (out_dir / "ranks" / f"rank{stats['rank']}.json").write_text(json.dumps(stats))


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


# -------------------------------------------------------------------------------------------------- adapter
def adapter_key_map(peft_model) -> dict[str, str]:
    """Model parameter name -> PEFT's on-disk key, computed by PEFT itself on the unwrapped model.

    Call before the parallel wrap: PEFT finds adapter tensors by walking the module tree, and FSDP1 inserts
    `_fsdp_wrapped_module` levels into it, after which PEFT silently selects nothing (an empty adapter).
    """
    from peft.utils import get_peft_model_state_dict

    trainable = {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
    tagged = {name: torch.tensor([index]) for index, name in enumerate(trainable)}
    on_disk = get_peft_model_state_dict(peft_model, state_dict=tagged)
    names = list(trainable)
    return {names[int(value.item())]: key for key, value in on_disk.items()}


def save_adapter(peft_config, key_map: dict[str, str], trainable_state: dict[str, torch.Tensor], out_dir: Path) -> dict:
    """Write a standard PEFT adapter folder atomically, read it back and compare. Rank 0 only."""
    from safetensors.torch import load_file, save_file

    missing = [name for name in key_map if name not in trainable_state]
    if not key_map or missing:
        raise RuntimeError(
            f"adapter gather is missing {len(missing)} of {len(key_map)} tensors (e.g. {missing[:2]}): refusing to write a partial adapter"
        )
    tensors = {key_map[name]: trainable_state[name].detach().to("cpu").contiguous() for name in key_map}
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the adapter has NaN/inf values ({bad[0]} and {len(bad) - 1} more); not written over {out_dir}.")
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        _verify_adapter_files(tmp, tensors, load_file)
    return tensors


def _verify_adapter_files(folder: Path, tensors: dict[str, torch.Tensor], load_file) -> None:
    written = load_file(str(folder / ADAPTER_WEIGHTS))
    if written.keys() != tensors.keys():
        raise RuntimeError(f"adapter read back with {len(written)} tensors, {len(tensors)} were saved")
    for key, value in tensors.items():
        if not torch.equal(written[key], value):
            raise RuntimeError(f"adapter tensor {key} differs after reading it back")
    if not (folder / ADAPTER_CONFIG).exists():
        raise RuntimeError("adapter_config.json was not written")
