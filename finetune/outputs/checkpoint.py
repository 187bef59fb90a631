"""Writing what a run produces and reading it back: the output folder guard, training checkpoints, the adapter.

Layout of output.dir:

    .finetune.lock              pid + host of the run that uses the folder (a second run is refused)
    recipe.yaml  metrics.jsonl  ranks/rank{r}.json
    checkpoints/step-00000040/
        trainable/              torch.distributed.checkpoint (DCP) of {"model": LoRA tensors, "optim": optimizer state};
                                under FSDP every rank writes its own shard, and a load reshards to any world size
        deepspeed/              instead of trainable/ under DeepSpeed: its own checkpoint (one ZeRO partition file per
                                rank; loads into the ZeRO stage that wrote it only, at any number of ranks: another
                                number through DeepSpeed's universal checkpoint, finetune/parallel/zero_checkpoint.py)
        rng/rank{r}.pt          torch / numpy / python (and CUDA) RNG states of every rank
        trainer_state.json      step, scheduler, data position, losses so far, world size, strategy
        recipe.yaml  base.json  the resolved recipe that wrote it; the base it trained on (outputs/base_record.py)
        chat_template.json      the chat template trained with (outputs/trained_template.py: export / generate --step)
        manifest.json           written last: every file with its size and sha256, and the finetune that wrote it
    adapter/                    the standard PEFT adapter (the result)

Only trainable state is saved, never the base weights. A checkpoint is written into a hidden temporary folder with its
manifest, flushed and renamed into place, and renamed out of the listing before it is pruned: a step-N folder is whole
while it is seen (a live run's were "damaged" to `finetune checkpoints`, bb29). One without a valid manifest (copied in
part, truncated, tampered) is detected, reported, and skipped in favour of the newest good one.

This module saves the training checkpoints (a resume reads one back: finetune/outputs/checkpoint_load.py; a
checkpoint's LoRA tensors alone, for `--step`:
finetune/outputs/checkpoint_adapter.py read_trainable_tensors); finding them and choosing the one a resume takes is
finetune/outputs/step_folders.py, the output-folder guard finetune/outputs/run_folder.py, the adapter files
finetune/outputs/adapter_files.py, crash-safe writes finetune/files.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
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
from torch.distributed.checkpoint.api import CheckpointException

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.files import (
    _fsync_tree,
    _replace_dir,
    _sha256,
    _write_text_atomic,
    free_mb,
    no_room,
    on_main,
    refused_pickle,
    remove_path,
)
from finetune.outputs.base_record import write_base_record
from finetune.outputs.run_folder import finetune_version
from finetune.outputs.step_folders import (
    CHECKPOINTS,
    MANIFEST,
    STEP_PREFIX,
    TRAINER_STATE,
    best_step,
    dcp_reader,
    list_checkpoints,
    newest_kept,
    retire_checkpoint,
    untrusted_checkpoint,
)
from finetune.outputs.trained_template import write_trained_template
from finetune.parallel import zero_checkpoint
from finetune.parallel.engines import engine_of


# ------------------------------------------------------------------------------------ training state
def trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> dict:
    """{"model": the trainable tensors, "optim": the optimizer state}, keyed by the model's own parameter names.

    Under FSDP the tensors are this rank's shards (DTensor / ShardedTensor), so DCP writes one file per rank and
    reshards on load. `ignore_frozen_params` drops the frozen base weights; the filter by `names` also drops the
    buffers and bitsandbytes quantization state that are not parameters. FSDP1's own state dict would copy the whole
    base shard first, so its LoRA units are asked alone (parallel/state_dict.py).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(ignore_frozen_params=True)
    with _quiet_torch_distributed():
        model_state, optim_state = engine_of(model).checkpoint_state(model, optimizer, options)
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
    """dcp.save / dcp.load on `path`, in this process alone when there is no process group. A load runs no code of
    the checkpoint's: its metadata through `dcp_reader`, its saved values through `_load_planner`."""
    import torch.distributed.checkpoint as dcp

    options = {"planner": _load_planner(path), "storage_reader": dcp_reader(path)} if operation is dcp.load else {}
    with _quiet_torch_distributed():
        operation(state, checkpoint_id=path, no_dist=_single(), **options)


def _load_planner(path: Path):
    """DCP's default load planner without its fallback to checkpoints of torch < 2.4: where the checkpoint has keys
    this rank's state does not, that fallback flattens the state again the pre-2.4 way (`optim.param_groups` one key),
    which no checkpoint written here has ("Missing key in checkpoint state_dict: optim.param_groups"). Under FSDP1 a
    rank holds no shard of a tensor with fewer rows than ranks (a reward model's score head [1, hidden], lora.r below
    the process count), so its state lacks that key: every such run died at its first checkpoint's read-back. Every
    checkpoint here is written by torch >= 2.4 (the declared floor), so the fallback is never the right reading.
    Its saved values that are not tensors (the optimizer's param_groups: numbers, names, flags) DCP reads with
    torch.load(weights_only=False), which runs a crafted checkpoint's code (bb26): read as plain data here first."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan

    class LoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                plain = torch.load(value, weights_only=True)
            except Exception as exc:  # noqa: BLE001 (pickle's and torch's own errors: all mean "not plain data")
                what = f"trainable/ (the saved {read_item.dest_index.fqn})"
                raise CheckpointError(untrusted_checkpoint(path.parent, what, refused_pickle(exc))) from None
            checked = io.BytesIO()
            torch.save(plain, checked)  # plain data only: DCP's own reading of it runs nothing
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return LoadPlanner()


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
        # This rank's device only: the state of every visible GPU would not restore where fewer GPUs are visible
        # ("invalid device ordinal"), and a rank draws its dropout masks on its own GPU alone.
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # checkpoints of earlier versions: one state per visible GPU
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str],
                    trainer_state: dict, recipe_yaml: str, *, keep_last: int, keep_best: bool = False,
                    verify: bool = False, tokenizer=None) -> Path:
    """Write checkpoints/step-N atomically (collective: every rank writes its shard and its RNG state).

    Order: temp folder <- every rank's files; manifest with checksums; flush; rename into place; prune to keep_last
    (and, with `keep_best`, never the checkpoint of the lowest eval loss so far), each renamed away, then deleted.
    With `verify`, every rank then reads its part back and compares it with what it saved. The chat template trained
    with is kept beside the recipe (`tokenizer`'s; without one, the recipe's: trained_template.py).
    """
    final = checkpoint_dir(out_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    try:
        return _save(out_dir, step, model, optimizer, names, trainer_state, recipe_yaml, final=final, tmp=tmp,
                     keep_last=keep_last, keep_best=keep_best, verify=verify, tokenizer=tokenizer)
    except BaseException as exc:  # a lost peer: nothing is published, and every survivor removes the partial folder
        if distributed.is_communication_failure(exc):  # (rank 0, which would, may be the lost one)
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str],
          trainer_state: dict, recipe_yaml: str, *, final: Path, tmp: Path, keep_last: int, keep_best: bool,
          verify: bool, tokenizer) -> Path:
    started = time.perf_counter()

    def make_tmp() -> None:
        if reason := remove_path(tmp):  # a link there: removed, never written through (bb26)
            raise OSError(f"{tmp} cannot be removed ({reason})")
        (tmp / "rng").mkdir(parents=True)

    on_main(_as_checkpoint_error(make_tmp, f"cannot create {tmp}"))
    engine = engine_of(model)
    deepspeed = engine.own_checkpoint_format
    state = trainable_state(model, optimizer, names) if not deepspeed else None
    tensors = state["model"] if state else engine.trainable_state_dict(model, names)
    if distributed.any_rank(not all(torch.isfinite(_local(v)).all() for v in tensors.values())):
        raise CheckpointError(f"step {step}: the adapter has NaN/inf values; checkpoint not written (older ones kept).")
    failure = _write_parts(model, state, tmp, deepspeed=deepspeed)
    failure = distributed.first_of_ranks(failure)  # a collective: every rank's files are written (or failed) here
    if failure is not None:
        on_main(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise CheckpointError(_not_written(out_dir, step, *failure, tensors=tensors))

    def publish() -> int:
        try:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1), encoding="utf-8")
            (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
            write_trained_template(tmp, recipe_yaml, tokenizer)  # what export / generate --step give the adapter
            write_base_record(tmp, recipe_yaml)  # the base trained on, which a resume compares (base_record.py)
            size = _write_manifest(tmp, step, trainer_state)  # before the rename: step-N appears whole
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
        except OSError as exc:  # no partial folder is left for a resume to look at
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(_not_written(out_dir, step, no_room(exc), _reason(exc), tensors=tensors)) from None
        prune_checkpoints(out_dir, keep_last=keep_last, newest=step,
                          eval_losses=trainer_state.get("eval_losses") if keep_best else None)
        return size

    size = on_main(publish)
    verify = verify and not deepspeed  # DeepSpeed's files are covered by the manifest's checksums only
    if verify:
        verify_readback(final, state)
    distributed.print0(f"[finetune] checkpoint {final} saved ({size / 1e6:.2f} MB, {time.perf_counter() - started:.2f} s"
                       f"{', read back and compared' if verify else ''})")
    return final


def _write_parts(model: torch.nn.Module, state: dict | None, tmp: Path, *, deepspeed: bool) -> tuple[bool, str] | None:
    """This rank's part of the checkpoint into `tmp` (its shard, its RNG state); None when written, else (no room?,
    why). Errors are returned, not raised: a rank that raised alone would leave the others waiting in a collective."""
    import torch.distributed.checkpoint as dcp

    rank = distributed.info().rank
    try:
        if deepspeed:
            zero_checkpoint.save_state(model, tmp / zero_checkpoint.CHECKPOINT_FOLDER)
        else:
            _dcp(dcp.save, state, tmp / "trainable")
        rng_file = tmp / "rng" / f"rank{rank}.pt"
        torch.save(rng_state(), rng_file)
        with open(rng_file, "rb") as handle:
            os.fsync(handle.fileno())
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if distributed.is_communication_failure(exc):
            raise
        return no_room(exc), f"rank {rank}: {_reason(exc)}"
    return None


def _as_checkpoint_error(function: Callable[[], Any], what: str) -> Callable[[], Any]:
    """Turn an OSError (disk full, permissions) into a CheckpointError that on_main can hand to every rank."""
    def wrapped() -> Any:
        try:
            return function()
        except OSError as exc:
            raise CheckpointError(f"{what}: {exc.strerror or exc}. Older checkpoints are kept.") from None
    return wrapped


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}{f' writing {exc.filename}' if exc.filename else ''}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    found = [line for line in lines if "Error" in line and ":" in line]  # DCP: the wrapped error of each rank
    return (found or lines or [type(exc).__name__])[-1][:300]


def _not_written(out_dir: Path, step: int, full: bool, reason: str, *, tensors: dict) -> str:
    """The paragraph for a checkpoint that could not be written: why, what is intact, the space needed, the way back."""
    if not full:
        return (f"step {step}'s checkpoint was not written ({reason}); its partial files were removed and "
                f"{newest_kept(out_dir)} Fix the cause, then run the same command with train.resume=auto added.")
    good = [path for _, path in list_checkpoints(out_dir) if (path / MANIFEST).exists()]
    if good:
        needed = f"{sum(f.stat().st_size for f in good[-1].rglob('*') if f.is_file()) / 1e6:,.2f} MB (as {good[-1].name})"
    else:  # LoRA weights and the two AdamW moments of every rank
        local = sum(_local(v).numel() * _local(v).element_size() for v in tensors.values())
        needed = f"about {3 * local * distributed.info().world_size / 1e6:,.2f} MB (LoRA weights + AdamW state)"
    return (f"step {step}'s checkpoint was not written: no space left on the filesystem of {out_dir} "
            f"({free_mb(out_dir)} free; {reason}). Its partial files were removed and {newest_kept(out_dir)} The next "
            f"checkpoint needs {needed}, on top of the files the run keeps adding (metrics.jsonl, and the adapter at the "
            "end). Free that much there (older runs, other checkpoints), then run the same command with "
            "train.resume=auto added.")


def _write_manifest(folder: Path, step: int, trainer_state: dict) -> int:
    """manifest.json: every file with size and sha256, written last (its presence marks a complete checkpoint)."""
    files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST}
    manifest = {"format": 1, "step": step, "world_size": trainer_state.get("world_size"), "strategy": trainer_state.get(
        "strategy"), "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "finetune": finetune_version(),  # (an upgrade named)
                "torch": torch.__version__, "files": files}  # DCP's metadata loads in that torch or a newer one only
    _write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return sum(entry["bytes"] for entry in files.values())


def prune_checkpoints(out_dir: Path, *, keep_last: int, newest: int,
                      eval_losses: list[tuple[int, float]] | None = None) -> None:
    """Keep the `keep_last` newest checkpoints up to step `newest`; remove older ones, leftovers of interrupted saves,
    and checkpoints of steps after `newest` (a timeline abandoned by resuming from an earlier checkpoint).

    `eval_losses` ((step, eval loss) of the run so far; train.keep_best): the kept checkpoint whose step has the lowest
    eval loss is never removed, so the run keeps at most keep_last + 1 checkpoints."""
    root = Path(out_dir) / CHECKPOINTS
    doomed = list(root.glob(f".{STEP_PREFIX}*"))
    checkpoints = list_checkpoints(out_dir)
    for step, path in checkpoints:
        if step > newest:
            distributed.print0(f"[finetune] removing {path}: it is after the step this run resumed from")
            doomed.append(path)
    kept = [(step, path) for step, path in checkpoints if step <= newest]
    best = best_step(eval_losses or [], {step for step, _ in kept})
    doomed += [path for step, path in kept[:-keep_last] if step != best]
    for path in doomed:  # a symbolic link: the link goes, what it points at stays (bb26: it was kept, silently)
        if reason := retire_checkpoint(path):
            distributed.print0(f"[finetune] warning: could not remove {path} ({reason}); remove it by hand")


def verify_readback(path: Path, saved: dict) -> None:
    """Every rank loads its part of the checkpoint into zeroed copies and compares with what it saved.

    Catches a checkpoint that holds only rank 0's slice, or tensors that do not survive the round trip.
    """
    import torch.distributed.checkpoint as dcp

    template = copy.deepcopy(saved)
    for _, value in _leaves(template):
        if isinstance(_local(value), torch.Tensor):
            _local(value).zero_()
    try:
        _dcp(dcp.load, template, path / "trainable")
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:  # DCP raises a load's failure on every rank
        if distributed.is_communication_failure(exc):
            raise
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} could not be read back ({reason}). It cannot be trusted; this is a "
                              "bug in the parallel setup, please report it with the recipe and the launch command.") from None
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
