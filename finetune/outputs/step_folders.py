"""Finding checkpoints: the step folders of a run folder, each checked against its manifest, the one a resume takes,
the one an export of `--step N` takes, and each one's eval loss (`finetune checkpoints`, train.keep_best).

Below both the training checkpoints (finetune/outputs/checkpoint.py, which write these folders) and the output-folder
guard (finetune/outputs/run_folder.py, which refuses to start over a run that did not finish). Also here: a
checkpoint's DCP metadata read without running code (`dcp_reader`), for every DCP read finetune makes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pickle
from pathlib import Path

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.files import _sha256, remove_path
from finetune.outputs.adapter_files import ADAPTER_WEIGHTS

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STEP_PREFIX = "step-"


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


def retire_checkpoint(path: Path) -> str | None:
    """Remove a checkpoint folder (pruning): renamed first to a hidden `.step-N.removing-PID` that no listing shows (and
    the next prune removes, if this one is cut short), then deleted. Deleted in place, a reader listing the folders of
    a live run met it half gone ("trainer_state.json is missing", bb29). None when it is gone, else why not."""
    if path.name.startswith(STEP_PREFIX):
        hidden = path.with_name(f".{path.name}.removing-{os.getpid()}")
        with contextlib.suppress(OSError):  # (not renamed: deleted where it is)
            os.replace(path, hidden)
            path = hidden
    return remove_path(path)


def best_step(eval_losses: list, steps: set[int]) -> int | None:
    """The step among `steps` with the lowest eval loss (the earliest of equals; a NaN / inf eval is never best: min()
    kept a NaN seen first); None when none of them was evaluated.
    `eval_losses`: (step, eval loss) pairs, as a checkpoint's trainer state holds them."""
    losses = {int(step): float(loss) for step, loss in eval_losses if int(step) in steps and math.isfinite(float(loss))}
    return min(losses, key=lambda step: (losses[step], step)) if losses else None


def checkpoint_facts(path: Path) -> dict:
    """What a checkpoint says of itself (trainer_state.json): step, eval loss at that step (None when the run did not
    evaluate there), train loss of that step, strategy; empty when unreadable."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    evals = {int(s): float(loss) for s, loss in state.get("eval_losses") or []}
    losses = state.get("losses") or []
    return {"step": step, "eval_loss": evals.get(step), "loss": float(losses[-1]) if losses else None,
            "strategy": state.get("strategy"), "world_size": state.get("world_size")}


def describe_kept(out_dir: Path) -> str:
    """The kept checkpoints of a run folder in a few words each (`step 40 (eval loss 1.2345, best)`), for messages."""
    facts = [checkpoint_facts(path) | {"step": step} for step, path in list_checkpoints(out_dir)]
    if not facts:
        return "none"
    best = best_step([(f["step"], f["eval_loss"]) for f in facts if f.get("eval_loss") is not None],
                     {f["step"] for f in facts})

    def one(fact: dict) -> str:
        loss = fact.get("eval_loss")
        detail = f"eval loss {loss:.4f}{', best' if fact['step'] == best else ''}" if loss is not None else "no eval"
        return f"step {fact['step']} ({detail})"

    return ", ".join(one(fact) for fact in facts)


def report_best_eval(out_dir: Path, eval_losses: list) -> int | None:
    """The step of the run's lowest eval loss; with two evaluations or more, also a line for the end of the run saying
    whether its checkpoint is kept and how to export it (rank 0 prints)."""
    step = best_step(eval_losses, {int(s) for s, _ in eval_losses})
    if step is None or len(eval_losses) < 2:
        return step
    loss = {int(s): float(value) for s, value in eval_losses}[step]
    kept = dict(list_checkpoints(out_dir)).get(step)
    where = (f"its checkpoint {kept} is kept: {_export_hint(out_dir, kept, step)}" if kept else
             "its checkpoint is not kept (train.keep_best: true keeps it; a checkpoint is written every "
             "train.save_every steps)")
    distributed.print0(f"[finetune] best eval loss {loss:.4f} at step {step} of {len(eval_losses)} evaluations; {where}")
    return step


def checkpoints_table(run_dir: Path, *, running: str | None = None) -> str:
    """`finetune checkpoints RUN`: one line per kept checkpoint (step, eval loss, train loss, intact or why not, size),
    the lowest eval loss marked `best`, and how to export one. `running`: the run in progress that holds the folder's
    lock (`PID 123 on host`), whose checkpoints are never called damaged: one it is writing or pruning meanwhile is
    said so (a run of this finetune shows none: it renames whole folders in and out), one gone meanwhile is left out."""
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: not found. Pass a run folder (output.dir of a run).")
    kept = list_checkpoints(run_dir)
    if not kept:
        raise CheckpointError(f"{run_dir}: no checkpoints kept (no {CHECKPOINTS}/step-N folder). A run writes one every "
                              "train.save_every steps and at its last step; pass the run's output.dir.")
    facts = {step: checkpoint_facts(path) for step, path in kept}
    best = best_step([(step, f["eval_loss"]) for step, f in facts.items() if f.get("eval_loss") is not None], set(facts))

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    rows = [("step", "eval loss", "train loss", "state", "MB", "folder")]
    for step, path in kept:
        problem, size = checkpoint_problem(path), _folder_mb(path)
        if size is None:  # pruned while listed
            continue
        state = "intact" if problem is None else f"damaged: {problem}"
        if problem is None and (written := newer_torch(path)):
            state = f"intact; written by torch {written}: readable with that torch or newer only"
        if problem is not None and running:
            state = f"not whole now ({problem}): the run in progress ({running}) may be writing or removing it"
        rows.append((f"{step}{' best' if step == best else ''}", number(facts[step].get("eval_loss")),
                     number(facts[step].get("loss")), state, f"{size:.2f}", str(path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    example = best if best is not None else kept[-1][0]
    return (f"{table}\n`best`: the lowest eval loss among the kept checkpoints (- : no eval at that step). Export one: "
            f"{_export_hint(run_dir, dict(kept)[example], example)}")


def _folder_mb(path: Path) -> float | None:
    """The MB a checkpoint folder holds; None when it is gone (a live run pruned it while it was listed)."""
    total = 0
    for item in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # (a file removed meanwhile)
            total += item.stat().st_size if item.is_file() else 0
    return total / 1e6 if path.is_dir() else None


def _export_hint(run_dir: Path, folder: Path, step: int) -> str:
    """How to get step `step`'s adapter out of its checkpoint `folder`: `finetune export --step` reads DCP checkpoints
    (trainable/); a DeepSpeed one (its own format) is resumed to that step into another folder instead."""
    if (folder / "trainable").is_dir() or not (folder / "deepspeed").is_dir():
        return f"`finetune export {run_dir} OUT --step {step}` exports it"
    return (f"written by DeepSpeed (its own format, which `finetune export --step` cannot read), so resume the run "
            f"from it into another folder (train.resume={folder} train.max_steps={step} output.dir=NEW) and export "
            "NEW's adapter")


def step_checkpoint(run_dir: Path, step: int) -> Path:
    """The kept, intact checkpoint of step `step` in run folder `run_dir` (export and generate `--step`); otherwise
    CheckpointError listing the kept steps."""
    found = dict(list_checkpoints(run_dir))
    if step not in found:
        kept = describe_kept(run_dir)
        raise CheckpointError(
            f"{run_dir}: no checkpoint of step {step} is kept (kept: {kept}). Checkpoints are written every "
            "train.save_every steps and at the last step; train.keep_last rotates the older ones away, and "
            "train.keep_best: true also keeps the one of the lowest eval loss. Fix: pass one of the kept steps to "
            f"--step (`finetune checkpoints {run_dir}` lists them with their eval losses).")
    return checked_checkpoint(found[step])


def checked_checkpoint(path: Path) -> Path:
    """`path` when its files match its manifest; otherwise CheckpointError naming the problem."""
    problem = checkpoint_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} cannot be used: {problem}. Nothing was written. Fix: choose another "
                              f"kept step (`finetune checkpoints {path.parent.parent}` lists them).")
    return path


def is_checkpoint(path: Path) -> bool:
    """A checkpoint folder (checkpoints/step-N), as opposed to a run folder or an adapter folder."""
    return path.is_dir() and (path / TRAINER_STATE).is_file() and (
        path.name.startswith(STEP_PREFIX) or (path / MANIFEST).exists())


def newest_kept(out_dir: Path) -> str:
    """A sentence on where a stopped run stands on disk: its newest checkpoint that matches its manifest, if any."""
    good = [(step, path) for step, path in list_checkpoints(out_dir) if checkpoint_problem(path) is None]
    if not good:
        return "no checkpoint was written yet (a resume starts again from step 1)."
    step, path = good[-1]
    return f"the newest checkpoint, {path} (step {step}), is intact and a resume continues from it."


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (None when every file matches its manifest)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return ("no manifest.json (not a whole save: finetune writes it before the folder takes its name, so the "
                "folder was copied in part, or left by an older finetune killed while writing)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is unreadable ({type(exc).__name__}: {exc})"
    if wrong := _mistyped(manifest):
        return f"manifest.json is unreadable ({wrong})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or changed)"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted or changed)"
    return None


def _mistyped(manifest: dict) -> str | None:
    """The first field of a parsed manifest that is not of the type finetune writes (`_write_manifest`), said; None
    when all are. A hand-edited `"files": "x"` was an AttributeError in every verb, `"step": "6"` passed and crashed a
    resume later, and `"bytes": "690"` read "has 690 bytes, the manifest says 690" (bb30)."""
    def number(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not number(manifest["step"]):
        return f"step is {json.dumps(manifest['step'])}, not a whole number"
    if not isinstance(manifest["files"], dict):
        return f"files is {json.dumps(manifest['files'])[:60]}, not a table of files"
    for name, entry in manifest["files"].items():
        if not isinstance(entry, dict):
            return f"the entry of {name} is {json.dumps(entry)[:60]}, not its bytes and sha256"
        if not number(entry.get("bytes")):
            return f"{name}'s bytes is {json.dumps(entry.get('bytes'))[:60]}, not a whole number"
        if not isinstance(entry.get("sha256"), str):
            return f"{name}'s sha256 is {json.dumps(entry.get('sha256'))[:60]}, not text"
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
    return found  # whether it fits this run: resume_checks.check_resume, once the plan and the data are known


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



# ------------------------------------------------------------------------------------ reading DCP metadata
# torch's FileSystemReader unpickles trainable/.metadata with plain pickle.load: a checkpoint changed by someone else
# (and its manifest's checksums recomputed) ran its code on `export --step`, `generate --step` and every resume (bb26).
# What DCP writes there, checked on 800 checkpoints of this suite (single, DDP, FSDP1/2, layer split): these classes of
# torch.distributed.checkpoint, torch.Size, dtypes and layouts (by name), the checkpoint's path. Nothing else is let in.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.strided and the like, looked up by their name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # Python 3.13
    "builtins": {"set", "frozenset"},
    "collections": {"OrderedDict"},
}
UNTRUSTED = "holds code"  # in every refusal: a DCP error that wraps one is recognised by it


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        plain = module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        if plain or name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for the global {module}.{name}")


def untrusted_checkpoint(path: Path, file: str, why: str) -> str:
    """The paragraph for a checkpoint file that would run code when read."""
    return (f"checkpoint {path}: {file} {UNTRUSTED} ({why}), where a checkpoint holds only tensors and facts about "
            "them. finetune never writes that: the file was made or changed elsewhere (its manifest's checksums say "
            "nothing of who computed them). finetune reads a checkpoint without running anything in it, so nothing was "
            "loaded from it. Fix: use a checkpoint of a run you made (one from elsewhere is as safe as running its "
            "code), or the run's finished adapter/ (safetensors: tensors only).")


def read_dcp_metadata(folder: Path, name: str = ".metadata"):
    """DCP's metadata of `folder` (a checkpoint's trainable/), unpickled through `_MetadataUnpickler`: CheckpointError
    when it asks for anything else, or when this torch cannot build it (`unreadable_metadata`)."""
    with open(folder / name, "rb") as handle:
        try:
            return _MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(untrusted_checkpoint(folder.parent, f"{folder.name}/{name}", str(exc))) from None
        except (ValueError, TypeError, AttributeError, EOFError, IndexError) as exc:
            raise CheckpointError(unreadable_metadata(folder.parent, f"{folder.name}/{name}", exc)) from None


def writer_torch(path: Path) -> str | None:
    """The torch version that wrote checkpoint `path` (its manifest.json; None before finetune recorded it)."""
    try:
        written = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("torch")
    except (OSError, ValueError, AttributeError):
        return None
    return written if isinstance(written, str) else None


def newer_torch(path: Path) -> str | None:
    """The torch version that wrote checkpoint `path` when it is newer than this one (its DCP metadata may then be
    unreadable here: torch 2.15's does not unpickle in 2.11-2.13, bb48), else None."""
    import torch
    from packaging.version import InvalidVersion, Version

    written = writer_torch(path)
    try:
        return written if written and Version(written).release > Version(torch.__version__).release else None
    except InvalidVersion:
        return None


def unreadable_metadata(path: Path, name: str, exc: BaseException) -> str:
    """Checkpoint `path`'s DCP metadata that this torch cannot build: a newer torch's format (DCP checkpoints load in
    the torch that wrote them or a newer one) or a damaged file. Said instead of a traceback (export, generate) or of
    "does not fit this model" (a resume, which blamed the base and the LoRA settings)."""
    import torch

    here = torch.__version__
    reason = f"{type(exc).__name__}: {exc}"
    if written := newer_torch(path):
        release = written.split("+")[0]
        return (f"checkpoint {path}: {name} was written by torch {written}, and this is torch {here}, which cannot read "
                f"its format ({reason}): DCP checkpoints load in the torch that wrote them or a newer one. Fix: use "
                f"torch {release} or newer here (pip install 'torch>={release}'), or read it where it was written.")
    written = writer_torch(path)
    by = (f"written by torch {written}" if written else "its manifest names no torch version (finetune recorded it "
          "from 2026-12 on)")
    return (f"checkpoint {path}: {name} cannot be read by torch {here} ({reason}; {by}). A checkpoint written by a "
            "newer torch loads only in that torch or a newer one; one written by this torch or an older one is "
            "damaged. Fix: read it with the torch that wrote it (or newer), or resume from an earlier checkpoint.")


@functools.cache
def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        """FileSystemReader whose metadata (global, or a rank's own) is read by `read_dcp_metadata`."""

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(Path(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return CheckedReader


def dcp_reader(folder: Path):
    """A DCP storage reader of `folder` that runs no code from its metadata; the metadata is read once here first, so
    that a refusal is its own paragraph (inside dcp.load DCP wraps every error into its CheckpointException)."""
    if (folder / ".metadata").is_file():
        read_dcp_metadata(folder)
    return _reader_class()(str(folder))
