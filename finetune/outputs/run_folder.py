"""The output-folder guard: one run per output.dir (a lock), what a fresh start clears, per-rank facts; which finetune
wrote a run's files, and a run's recipe.yaml read back by a later finetune.

claim_output_dir checks output.dir and the resume source before any weight loads; the files of a replaced run are
cleared only when training is about to start (begin_outputs), so a run failing on its inputs changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.files import _write_text_atomic, on_main, remove_path
from finetune.model.lora.kept import keep_start, use_kept
from finetune.outputs.adapter_files import ADAPTER_WEIGHTS, AS_TRAINED
from finetune.outputs.resume_checks import finetune_version  # noqa: F401 (re-exported for checkpoint.py)
from finetune.outputs.step_folders import CHECKPOINTS, MANIFEST, checkpoint_problem, list_checkpoints, resume_source
from finetune.recipe.checks import output_in_data_problem

LOCK_FILE = ".finetune.lock"


# ------------------------------------------------------------------------------------ what wrote a run folder
def saved_recipe(path: Path):
    """A recipe.yaml a run wrote (a run folder's, a checkpoint's), read by this finetune. Keys a later finetune removed
    (recipe/text.py REMOVED_KEYS) are dropped with a one-line note: the recipe was valid for the finetune that wrote
    it. Anything else invalid is RecipeError, every problem listed, as for any recipe."""
    from finetune.recipe import validate_recipe
    from finetune.recipe.text import absolute_local_paths, drop_removed_keys, read_yaml

    raw = read_yaml(path)
    if dropped := drop_removed_keys(raw):
        print(f"[finetune] note: {path} was written by an older finetune; read without {'; '.join(dropped)}",
              flush=True)
    absolute_local_paths(raw)  # as load_recipe does: its local paths named from here
    _kept_template(raw, Path(path))
    recipe = validate_recipe(raw, source=str(path), trains=False)
    use_kept(recipe, *Path(path).resolve().parents[:3])  # the start adapter its run kept (beside, or a checkpoint's run's)
    if recipe.model.trust_remote_code:  # export and generate inherit it: said before any of that code runs (bb26)
        print(f"[finetune] note: {path} sets model.trust_remote_code: true, so loading its base "
              f"{recipe.model.name_or_path} runs the Python files of that model folder or hub repo here, as the run "
              "did (use a run folder from elsewhere only as you would run its code; set model.trust_remote_code: "
              f"false in {path} to load the base without them)", flush=True)
    return recipe


def _kept_template(raw: dict, path: Path) -> None:
    """A model.chat_template file gone since the run (moved, deleted): the template the run trained with, which its
    checkpoints keep (trained_template.py), is read instead, with a note. Before, `export --step` and `generate --step`
    were refused with a fix (edit the checkpoint's recipe.yaml) that damaged the checkpoint, and `generate RUN` read no
    recipe and rendered an alpaca run's prompts through the chat template (bug bash)."""
    from finetune.outputs.trained_template import trained_template

    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    named = model.get("chat_template")
    if not isinstance(named, str) or not named.endswith(".jinja") or "{" in named or Path(named).expanduser().exists():
        return
    folder = path.resolve().parent
    kept = [folder, *sorted((folder / "checkpoints").glob("step-*"), reverse=True)]  # a checkpoint's; a run's newest
    for checkpoint in kept:
        found, template = trained_template(checkpoint)
        if found and isinstance(template, str):
            model["chat_template"] = template
            print(f"[finetune] note: {path}: model.chat_template {named} is gone; the template the run was trained "
                  f"with, kept in {checkpoint}, is used", flush=True)
            return


# ------------------------------------------------------------------------------------------- output folder
# The lock is an OS lock (flock) on output.dir/.finetune.lock, held by rank 0 for the whole run through an open file
# descriptor: the kernel drops it the moment the process dies, however it dies (SIGKILL, OOM, a node lost), before the
# process is reaped, so a resume started at once is never refused by a dead run, and a pid recycled by another process
# or a lock file written on another host (a preempted job restarted elsewhere) blocks nothing. Two live runs on one
# folder still exclude each other. The file's JSON (pid, host, start time) only words the refusal. Shared filesystems:
# NFS (v3 with lockd, v4) maps flock to byte-range locks the server holds across hosts, released when the holder dies
# (NFSv4: when its lease expires, ~90 s); Lustre honours it when mounted with -o flock and refuses it otherwise, and
# then (as on any filesystem without flock) the pid check below is used instead (docs/checkpoints.md).
_HELD: dict[Path, int] = {}  # output.dir -> the descriptor holding its lock, for this process


def _read_owner(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def _try_lock(fd: int) -> bool | None:
    """flock(fd) without waiting: True taken, False held by a live process, None when the filesystem has no flock."""
    import errno
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return None
        raise
    return True


def _lock_owner(out_dir: Path) -> dict | None:
    """The live run holding `out_dir` (pid, host), or None when free or the holder is gone."""
    lock = out_dir / LOCK_FILE
    if out_dir in _HELD or not lock.exists():
        return None
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)  # NFS maps flock to a write lock: a writable descriptor
    except OSError:
        return None
    try:
        taken = _try_lock(fd)
    finally:
        os.close(fd)  # closing drops a probe lock at once
    owner = _read_owner(lock)
    if taken is None:  # no flock here: the pid check of the file (same host only; another host's run is not seen)
        same_host = owner.get("host") == socket.gethostname()
        return owner if same_host and _pid_alive(int(owner.get("pid", -1))) else None
    return None if taken else (owner or {"pid": "?", "host": "?"})


def running_owner(out_dir: Path) -> str | None:
    """`PID 123 on host` of the run in progress that holds `out_dir`'s lock; None when no run holds it."""
    owner = _lock_owner(out_dir)
    return None if owner is None else f"PID {owner.get('pid', '?')} on {owner.get('host', '?')}"


def output_dir_problem(out_dir: Path, *, overwrite: bool, resume: str | None) -> str | None:
    """Why this run may not write into `out_dir` (None when it may). Checked on rank 0 before anything loads."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return f"output.dir {out_dir} is a file, not a folder. Fix: choose another output.dir."
    if (out_dir / LOCK_FILE).is_symlink():
        return _linked_lock(out_dir)
    owner = _lock_owner(out_dir)
    if owner:
        return (
            f"output.dir {out_dir} is in use by a running run (pid {owner.get('pid')} on {owner.get('host')}, which holds "
            f"the OS lock on {out_dir / LOCK_FILE}). Wait for it, stop it, or choose another output.dir. (The lock goes "
            "with its process: a killed run never blocks its resume.)"
        )
    elsewhere = _resumes_elsewhere(out_dir, resume)
    finished = (out_dir / "adapter" / ADAPTER_WEIGHTS).exists()
    # A resume path that does not exist is resume_source's paragraph (it continues nothing: nothing would be removed)
    given = resume not in (None, "auto") and Path(resume).expanduser().exists()
    if not overwrite and given and not elsewhere and finished:
        return (f"output.dir {out_dir} holds a finished run (adapter/), and train.resume={resume} would continue it in "
                "place from that checkpoint: the finished adapter and every later checkpoint would be removed. Nothing "
                "was changed. Fix: keep this run and write the continued one elsewhere (the same train.resume with "
                "another output.dir), or pass output.overwrite=true to replace it in place.")
    if not overwrite and (resume is None or elsewhere):
        # A new run, or one resumed from another folder's checkpoint: either would write over what this folder holds.
        started = (f"train.resume starts from another folder's checkpoint ({resume}), and its steps would be written "
                   "over this folder's. ") if elsewhere else ""
        if finished:
            return (f"output.dir {out_dir} already holds a finished run (adapter/). {started}Nothing was changed. Fix: "
                    "choose another output.dir, pass output.overwrite=true to replace it, or train.resume=auto to "
                    "continue it.")
        if list_checkpoints(out_dir):
            return (f"output.dir {out_dir} holds checkpoints of a run that did not finish. {started}Nothing was "
                    "changed. Fix: pass train.resume=auto to continue it, output.overwrite=true to start over, or "
                    "choose another output.dir.")
    in_place = resume is not None and not elsewhere and bool(list_checkpoints(out_dir))  # nothing of it is cleared
    return _not_a_run_folder(out_dir, clearing=not in_place)


def _linked_lock(out_dir: Path) -> str:
    """A symbolic link where the run's lock file goes (a run folder from a tarball): refused, not followed. The run
    writes its pid into its lock: through the link it overwrote the file linked to (bb26)."""
    lock = out_dir / LOCK_FILE
    return (f"output.dir {out_dir}: {LOCK_FILE} is a symbolic link (to {os.readlink(lock)}), where a run keeps its lock "
            "file, which it writes its pid into; finetune writes no file through a link, so nothing was changed. No run "
            f"makes such a link. Fix: remove it (`rm {lock}`), then run the same command again.")


def _not_a_run_folder(out_dir: Path, *, clearing: bool) -> str | None:
    """Why a run may not write the names a run writes in `out_dir`: one of them is there as a file where a run writes a
    folder; or, for a run that clears them first (`clearing`: not a resume in place), they are there and no finetune run
    wrote them (the folder's recipe.yaml is no run's resolved recipe: a project folder's own `tensorboard/` or
    `adapter/`, the recipe being run itself)."""
    names = [name for name in (*RUN_FOLDERS, *RUN_FILES, "recipe.yaml") if (out_dir / name).exists()]
    files = [name for name in RUN_FOLDERS if (out_dir / name).exists() and not (out_dir / name).is_dir()]
    if files:
        return (f"output.dir {out_dir} holds {', '.join(files)} as a file, where a run writes a folder of that name "
                "(it would fail at its first checkpoint). Nothing was changed. Fix: move the file away, or choose "
                "another output.dir.")
    if not clearing or not names or _written_by_a_run(out_dir):
        return None
    shown = ", ".join(f"{name}/" if (out_dir / name).is_dir() else name for name in names)
    why = ("its recipe.yaml is not the resolved recipe a run writes" if "recipe.yaml" in names else
           "it has no recipe.yaml, which a run writes first")
    return (f"output.dir {out_dir} holds {shown}, which no finetune run wrote there ({why}), and a run clears and "
            "writes entries of these names. Nothing was changed. Fix: choose another output.dir (a new folder, or one "
            "that only this run writes).")


def _written_by_a_run(out_dir: Path) -> bool:
    """recipe.yaml is a resolved recipe a run wrote: every section dumped, output.overwrite included, which a recipe a
    user writes rarely spells out. Where output.dir named it is not asked: a run folder copied or moved (another mount
    of the same disk) is still a run's."""
    import yaml

    try:
        saved = yaml.safe_load((out_dir / "recipe.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    output = saved.get("output") if isinstance(saved, dict) else None
    return (isinstance(output, dict) and {"dir", "overwrite"} <= output.keys()
            and {"model", "quantization", "lora", "data", "train"} <= saved.keys())


def _resumes_elsewhere(out_dir: Path, resume: str | None) -> bool:
    """train.resume names a checkpoint or run folder that exists outside `out_dir` (one that does not exist is
    resume_source's error)."""
    if resume in (None, "auto"):
        return False
    path = Path(resume).expanduser().resolve()
    return path.exists() and not path.is_relative_to(out_dir.expanduser().resolve())


def take_output_dir(out_dir: Path) -> bool:
    """Take the folder's OS lock (a second live run loses); True if we created `out_dir`. Held until release."""
    created = not out_dir.exists()
    lock = out_dir / LOCK_FILE
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)  # never through a link (bb26)
            taken = _try_lock(fd)
            if taken is False:
                os.close(fd)
                owner = _read_owner(lock)
                raise CheckpointError(f"output.dir {out_dir} was just taken by another run (pid {owner.get('pid', '?')} "
                                      f"on {owner.get('host', '?')}); choose another output.dir.")
            if taken is None and _lock_owner(out_dir) is not None:
                os.close(fd)
                raise CheckpointError(f"output.dir {out_dir} was just taken by another run; choose another output.dir.")
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(lock).st_ino:  # not unlinked by a run releasing it meanwhile
                    break
            os.close(fd)
    except OSError as exc:
        if lock.is_symlink():  # made after output_dir_problem looked (O_NOFOLLOW: ELOOP)
            raise CheckpointError(_linked_lock(out_dir)) from None
        raise CheckpointError(f"output.dir {out_dir}: cannot write there ({exc.strerror}). Fix: choose a writable folder.") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
    _HELD[out_dir] = fd
    return created


def release_output_dir(out_dir: Path, *, remove_if_empty: bool = False) -> None:
    with contextlib.suppress(FileNotFoundError):
        (out_dir / LOCK_FILE).unlink()  # while still holding the lock: a run waiting on it retries on the new file
    fd = _HELD.pop(out_dir, None)
    if fd is not None:
        os.close(fd)
    if remove_if_empty:
        with contextlib.suppress(OSError):
            out_dir.rmdir()  # only succeeds when empty: a run that failed before writing anything leaves no trace


def edited_recipe_problem(out_dir: Path) -> str | None:
    """train.resume=auto: the paragraph for a checkpoint newer than the newest intact one whose files all match its
    manifest but recipe.yaml (edited since: an older finetune's refusal told to). Skipped as damaged, it had the run
    start over from step 0 and write its checkpoints over the folder's (bug bash bb70)."""
    from finetune.files import _sha256

    for _, path in reversed(list_checkpoints(out_dir)):
        if (problem := checkpoint_problem(path)) is None:
            return None
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"] if problem.startswith(
            "recipe.yaml ") else {}
        if files and all((path / name).is_file() and _sha256(path / name) == entry["sha256"]
                         for name, entry in files.items() if name != "recipe.yaml"):
            run = out_dir / "recipe.yaml"  # the run's own: the checkpoint's as written, unless the recipe changed since
            back = (f"put it back (`cp {run} {path / 'recipe.yaml'}`: the run's recipe.yaml is the one the manifest "
                    "checks)" if run.is_file() and _sha256(run) == files["recipe.yaml"]["sha256"] else "undo that edit")
            return (f"train.resume=auto: checkpoint {path} matches its manifest in every file but recipe.yaml "
                    f"({problem}), so the recipe it was written with was changed since; starting over from step 0 "
                    "would write over this run's checkpoints. Nothing was loaded or written. Fix: "
                    f"{back}, then run the same command again; or start a new run (another output.dir).")
    return None


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
        problem = (output_dir_problem(out_dir, overwrite=recipe.output.overwrite, resume=recipe.train.resume)
                   or output_in_data_problem(recipe) or (recipe.train.resume == "auto" and not recipe.output.overwrite
                                                         and edited_recipe_problem(out_dir)))
        if problem:
            raise CheckpointError(problem)
        source = resume_source(recipe)
        if source is None and recipe.train.resume == "auto" and not list_checkpoints(out_dir):
            distributed.print0(f"[finetune] train.resume=auto: no checkpoint in {out_dir} yet; starting at step 1")
        return (str(source) if source else None), take_output_dir(out_dir)

    source, created = on_main(decide)
    folder = RunFolder(out_dir, Path(source) if source else None, created)
    try:
        yield folder
    finally:
        if distributed.is_main():
            release_output_dir(out_dir, remove_if_empty=folder.created)


# What a run writes in output.dir besides recipe.yaml: a replaced run's are removed, so nothing of it mixes with the new
# run's (GRPO's sampled completions, vLLM's per-step adapters and log, the plot, TensorBoard's events, and the tracker
# run ids a resume continues: without them the new run starts its own MLflow / W&B run). An MLflow store in the folder
# (mlflow.db) may hold other runs: kept.
RUN_FOLDERS = ("adapter", AS_TRAINED, CHECKPOINTS, "ranks", "completions", "vllm", "tensorboard")
RUN_FILES = ("metrics.jsonl", "plot.png", "trackers.json")


def begin_outputs(out_dir: Path, recipe_yaml: str, resume_from: Path | None) -> None:
    """Rank 0, when training is about to start: clear a replaced run's files (a fresh start, or one from another
    folder's checkpoint) or trim the metrics past the checkpoint (this folder's run resumed); write recipe.yaml.

    Done this late so that a run failing on its inputs (data, model, launcher, checkpoint) changes nothing in output.dir.
    """
    own = resume_from is not None and resume_from.resolve().is_relative_to(out_dir.resolve())
    if not own:  # a fresh start, or a start from another folder's checkpoint (output.overwrite replaces this one's)
        for name in RUN_FOLDERS:
            if (out_dir / name).is_symlink():  # a link to scratch space: kept; the replaced run's checkpoints go
                for step in list_checkpoints(out_dir) if name == CHECKPOINTS else ():
                    remove_path(step[1])  # a linked step: the link alone
                continue
            shutil.rmtree(out_dir / name, ignore_errors=True)
        for name in RUN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (out_dir / name).unlink()
        _unlink_links(out_dir, ("recipe.yaml",))
        keep_start(out_dir, recipe_yaml)  # model.adapter's files, kept for this run's resume, export and generate
    else:  # the records of steps after the checkpoint go: those steps run again
        _unlink_links(out_dir, (*RUN_FILES, "recipe.yaml"))
        resumed_step = json.loads((resume_from / MANIFEST).read_text(encoding="utf-8"))["step"]
        for log in [out_dir / "metrics.jsonl", *sorted((out_dir / "completions").glob("rank*.jsonl"))]:
            _trim_metrics(log, resumed_step)
    _write_text_atomic(out_dir / "recipe.yaml", recipe_yaml)  # a link there is replaced, not written through (bb26)


def _unlink_links(out_dir: Path, names: tuple[str, ...]) -> None:
    """Each of the run's files `names` that is a symbolic link becomes a file of its own, with a copy of what the link
    led to when that is a file and the run reads it on (metrics.jsonl, trackers.json of a run resumed in place), and
    says so. The run writes recipe.yaml, appends to metrics.jsonl and saves plot.png: through a link they overwrote a
    file outside the folder (bb26)."""
    for name in names:
        path = out_dir / name
        if not path.is_symlink():
            continue
        target = os.readlink(path)
        kept = path.read_bytes() if name not in ("plot.png", "recipe.yaml") and path.is_file() else None  # anew
        path.unlink()
        if kept is not None:
            path.write_bytes(kept)
        print(f"[finetune] note: {path} was a symbolic link to {target}; it is now a file of this run's own "
              f"({'a copy of what the link led to' if kept is not None else 'written anew'}; {target} is left as it "
              "is)", flush=True)


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop records of steps after the checkpoint (written by the killed run; metrics.jsonl, GRPO's completions):
    they are trained again. The generation eval "after" training goes too: the resumed run ends with its own (an
    extended run would otherwise hold one per launch)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            record = json.loads(line)
            if record.get("step", 0) <= last_step and record.get("phase") != "after":
                kept.append(line)
    _write_text_atomic(path, "".join(line + "\n" for line in kept))


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text(encoding="utf-8").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gpu_memory_peaks() -> dict:
    """Peak allocated and reserved bytes on every GPU this process used (layer split spreads over several), summed
    and per device; empty without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    used = [i for i in range(torch.cuda.device_count()) if torch.cuda.max_memory_reserved(i) > 0]
    allocated = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in used}
    reserved = {f"cuda:{i}": torch.cuda.max_memory_reserved(i) for i in used}
    return {"peak_gpu_bytes": sum(allocated.values()), "peak_gpu_reserved_bytes": sum(reserved.values()),
            "peak_gpu_bytes_by_device": allocated, "peak_gpu_reserved_bytes_by_device": reserved}


def write_rank_stats(out_dir: Path, stats: dict, trainable_state: dict) -> None:
    """Per-rank facts for tests and the planner's checks: held parameter bytes, peak RSS (and peak GPU memory,
    allocated and reserved, over every GPU the rank used), LoRA checksum."""
    import resource

    stats = dict(stats, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 lora_checksum=float(sum(t.double().sum() for t in trainable_state.values())))
    stats.update(gpu_memory_peaks())
    (out_dir / "ranks").mkdir(parents=True, exist_ok=True)
    _write_text_atomic(out_dir / "ranks" / f"rank{stats['rank']}.json", json.dumps(stats))
