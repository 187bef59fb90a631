"""Crash-safe writes shared by the run folder, checkpoints, the adapter and exports; rank-0 decisions.

Temporary folder + fsync + rename, so a reader sees a whole folder or none; on_main runs a decision on rank 0 and
gives every rank its answer (or its error). Nothing is written through a symbolic link that a folder holds where a file
or folder is replaced: the link itself is replaced or removed, never what it points at (bb26).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from finetune.errors import CheckpointError, FinetuneError


# ------------------------------------------------------------------------------------------------ file helpers
def destination_problem(path: Path) -> str | None:
    """Why a new file or folder cannot be made at `path` (None when it can): a symbolic link there to nothing, a file
    where a folder above it should be, a folder above it this user cannot write in. What already exists at `path` is
    each verb's to judge (refused, or replaced when asked). The reasons are the one-paragraph errors of the verbs;
    the system's own (FileExistsError, NotADirectoryError) were tracebacks. Shared by the verbs that write one (recipes
    copy, quantize, tiny-model, quickstart, export, plot)."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    parent = path.absolute().parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is {'a link to nothing' if parent.is_symlink() else 'a file'}, not a folder, so {path} " \
               "cannot be made under it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable by this user, so {path} cannot be made in it"
    return None


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, waiting: Callable[[str, bool], None] | None = None) -> Iterator[None]:
    """Hold an OS lock (flock) on `lock_path`: of several processes building the same cache entry (the ranks of a
    node, or several runs), one builds while the others wait here, then find it built. The holder writes its pid,
    host, launch and rank into the file (opened without truncating: the pid is the holder's), so that a process that
    waits longer than WAIT_NOTE_S calls `waiting` once with the holder ("PID 123 on host (lock PATH)") and whether it
    is a rank of this same launch: a builder that is stopped (Ctrl-Z, a scheduler's suspend) or slow was a silent hang
    (bb20), and a sibling rank was named "another run" (bb27)."""
    import fcntl
    import socket

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for(handle, lock_path, waiting)
        try:
            handle.truncate(0)
            handle.write(f"{os.getpid()} {socket.gethostname()} {_launch_id()} {os.environ.get('RANK', '-')}\n")
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


WAIT_NOTE_S = 5.0  # a wait on another process's lock longer than this is said, once


def _launch_id() -> str:
    """What the ranks of one launch share and two launches on a machine do not: their rendezvous address and port."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{address}:{port}" if address and port else "-"


def _wait_for(handle, lock_path: Path, waiting: Callable[[str, bool], None] | None) -> None:
    """Take the lock another process holds: polled for WAIT_NOTE_S, then `waiting` told the holder, then waited on."""
    import fcntl
    import time

    deadline = time.monotonic() + WAIT_NOTE_S
    while waiting is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
    if waiting is not None:
        import socket

        try:
            pid, host, launch, rank = (lock_path.read_text(encoding="utf-8", errors="replace").split() + ["?"] * 4)[:4]
        except OSError:
            pid, host, launch, rank = "?", "?", "-", "-"
        sibling = launch not in ("-", "?") and launch == _launch_id() and host == socket.gethostname()
        waiting(f"rank {rank} of this launch (PID {pid})" if sibling else f"PID {pid} on {host} (lock {lock_path})",
                sibling)
    fcntl.flock(handle, fcntl.LOCK_EX)


_NO_ROOM = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded", errno.EFBIG: "File too large"}


def no_room(exc: BaseException) -> bool:
    """The write failed for want of space: a full filesystem, a quota, a file-size limit. Not every writer raises an
    OSError: torch.distributed.checkpoint reports every rank's failure in one CheckpointException and safetensors
    raises its own SafetensorError, both with the system's text."""
    if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
        return True
    return any(text in str(exc) for text in (*_NO_ROOM.values(), "StorageFull", "QuotaExceeded", "FileTooLarge"))


def free_mb(path: Path) -> str:
    """Free space on the filesystem of `path` (or of its nearest existing parent), in MB, as text."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{shutil.disk_usage(path).free / 1e6:,.2f} MB"
    except OSError:
        return "unknown"


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
    """`path` holds `text` whole or keeps what it held. A symbolic link at `path` is replaced by the file, never written
    through (a run folder's recipe.yaml linked to the user's own recipe was overwritten); the temporary file is made
    anew (`x`: a link planted at its name is not followed either)."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    remove_path(tmp)
    with open(tmp, "x", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _replace_dir(source: Path, target: Path) -> None:
    """Move `source` to `target` in one rename; an existing `target` is moved aside first and removed after. A symbolic
    link at `target` (a run's adapter/ linked to where a server reads it) is replaced by the folder, and said: the
    link's folder keeps what it held. Before, rmtree refused the link without a word, which stayed in the run folder as
    `.adapter.old-<pid>` (bb26). The files written follow the umask (`follow_umask`)."""
    follow_umask(source)
    if os.path.lexists(target):
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        remove_path(old)
        linked = os.readlink(target) if target.is_symlink() else None
        os.replace(target, old)
        os.replace(source, target)
        remove_path(old)
        if linked is not None:
            print(f"[finetune] note: {target} was a symbolic link to {linked}; it is now a folder of its own with the "
                  f"new files, and {linked} keeps what it held (nothing is written through a link)", flush=True)
    else:
        os.replace(source, target)
    _fsync_dir(target.parent)


def remove_path(path: Path) -> str | None:
    """Remove `path`: a symbolic link itself (never what it points at), a folder with all it holds, a file. None when
    it is gone (or was never there), else why not. shutil.rmtree refuses a link, and with ignore_errors did so without a
    word: a linked `.step-N.tmp` was written into, and a linked step-N was never pruned (bb26)."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    return None


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: /proc; elsewhere set and restored at once)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text(encoding="utf-8", errors="replace").splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give every file under `folder` the read and write bits an open() of this process gives (0666 less the umask),
    keeping any other bit. safetensors' save_file creates its file 0600 whatever the umask, so a run's
    adapter_model.safetensors and a merged export's weights were the only files of their folder a group could not read
    (bb26); under umask 077 everything stays 0600."""
    allowed = 0o666 & ~current_umask()
    for path in [folder, *folder.rglob("*")] if folder.is_dir() else [folder]:
        with contextlib.suppress(OSError):
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode) and stat.S_IMODE(mode) | allowed != stat.S_IMODE(mode):
                os.chmod(path, stat.S_IMODE(mode) | allowed)


@contextlib.contextmanager
def atomic_dir(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `target` in one rename (the old one removed after)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    remove_path(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.lexists(target) and not replace:
            raise CheckpointError(f"{target} already exists; choose another folder or remove it first.")
        _replace_dir(tmp, target)
    finally:
        remove_path(tmp)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def on_main(function: Callable[[], Any]) -> Any:
    """Run `function` on rank 0 only and give its result (or its FinetuneError) to every rank.

    A rank-0 check that raised alone would leave the other ranks waiting in the next collective forever.
    """
    from finetune import distributed  # here, not above: the CLI imports this module's path helpers before torch

    outcome: tuple[str, Any] | None = None
    if distributed.is_main():
        try:
            outcome = ("ok", function())
        except FinetuneError as exc:
            outcome = ("error", (type(exc), str(exc)))
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        error_type, message = outcome[1]
        error = error_type(message)
        error.alike_on_every_rank = True  # the same error on every rank: rank 0 prints it, once (finetune/run.py main)
        raise error
    return outcome[1]


# A mixture-of-experts run whose experts carry LoRA writes its adapter as trained (experts split) here, beside adapter/,
# which then holds the form plain PEFT loads (finetune/outputs/run_adapter.py); finetune's own readers (export,
# generate, model.adapter) take this one.
AS_TRAINED = "adapter-as-trained"


def as_trained(folder: Path) -> Path:
    """The folder finetune reads a run's adapter from: AS_TRAINED/ beside (or in) `folder` when the run wrote one, else
    `folder`."""
    for candidate in (folder / AS_TRAINED, folder.parent / AS_TRAINED if folder.name == "adapter" else None):
        if candidate is not None and (candidate / "adapter_config.json").is_file():
            return candidate
    return folder


def same_place(before: Any, now: Any) -> bool:
    """A relative path a run wrote (recipes kept relative paths before a4f6ddb; a stream's position names its datasets'
    paths) and the absolute path it names from here: the same file, no change."""
    return (isinstance(before, str) and isinstance(now, str) and not Path(before).is_absolute()
            and Path(now).is_absolute() and Path(before).expanduser().resolve() == Path(now).resolve())


_SAMPLE_BYTES = 4096  # of each tensor's start and end
_WHOLE_BELOW = 1 << 20  # config.json, a tiny shard: hashed whole
_MAX_HEADER = 100_000_000  # safetensors refuses a longer header (its MAX_HEADER_SIZE)


def content_sample(path: Path) -> str:
    """A hash of a safetensors file's header and of the first and last 4 KiB of every tensor in it (a small file:
    all of it). Any fine-tune or merge rewrites whole tensors, so one of them differs; new rows of an embedding are at
    its end. Cost: two page reads per tensor (a 70B base: ~1,500), not the whole file. Measured on a 1.07 GB shard of
    256 bf16 tensors (2-core test machine, 2026): hashing it whole took 1.7 s (sha256; blake2b 2.6 s) from the page
    cache and 2.7-5.3 s from disk (caches dropped), minutes per start for a 70B base; this sample took 0.003-0.012 s
    from the page cache and 0.07 s from disk."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size <= _WHOLE_BELOW:
            digest.update(handle.read())
            return digest.hexdigest()
        for start, stop in _sampled_ranges(handle, size):
            handle.seek(start)
            digest.update(handle.read(stop - start))
    return digest.hexdigest()


def _sampled_ranges(handle, size: int) -> list[tuple[int, int]]:
    """The header and each tensor's first and last bytes, in file order; a file that is not safetensors: its first and
    last MiB."""
    fallback = [(0, _WHOLE_BELOW), (size - _WHOLE_BELOW, size)]
    header_size = int.from_bytes(handle.read(8), "little")
    # safetensors' own bound on its header (100 MB), and its JSON's `{`: a GGUF file's first 8 bytes read as a 14 GB
    # header, which was read whole (a MemoryError, or 14 GB read at every start, for GGUF files over 14 GB: bb63)
    if not 0 < header_size <= min(size - 8, _MAX_HEADER) or handle.read(1) != b"{":
        return fallback
    handle.seek(8)
    try:
        header = json.loads(handle.read(header_size))
    except ValueError:
        return fallback
    data, ranges = 8 + header_size, {(0, 8 + header_size)}
    for entry in header.values() if isinstance(header, dict) else []:
        if isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2:
            begin, end = (data + offset for offset in entry["data_offsets"])
            ranges |= {(begin, min(end, begin + _SAMPLE_BYTES)), (max(begin, end - _SAMPLE_BYTES), end)}
    return sorted(ranges)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def refused_pickle(exc: BaseException) -> str:
    """What a refused `torch.load(weights_only=True)` met, in a few words for a one-paragraph error: `it asks for the
    global eval (Python code, not tensors)` from torch's WeightsUnpickler line; another error's first sentence. torch's
    whole text is a page of advice with terminal escapes (to load it anyway), which was cut mid-word into the
    paragraph (bb26)."""
    text = _ANSI.sub("", str(exc))
    if found := re.search(r"Unsupported global: GLOBAL (\S+) was not an allowed global", text):
        return f"it asks for the global {found.group(1)} (Python code, not tensors)"
    line = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    first = (line.group(1) if line else next((part.strip() for part in text.splitlines() if part.strip()), ""))
    sentence = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
    if len(sentence) > 200:
        sentence = sentence[:200].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {sentence}" if sentence else type(exc).__name__
