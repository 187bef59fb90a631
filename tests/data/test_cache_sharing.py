"""The tokenization cache shared by several runs and processes on one machine (finetune/data/cache.py, bug bash bb20):
a tokenizing worker that dies, a Ctrl-C the run ignores, a run waiting on another's build, an unwritable or read-only
cache, leftovers of killed builds, and where the cache folder is."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import addition_rows, write_jsonl
from test_data import make_recipe

import finetune.files
from finetune import data
from finetune.errors import DataError

pytestmark = pytest.mark.usefixtures("private_cache")


class Hung(Exception):
    """Not an OSError (TimeoutError is one): the cache's fallback to a private build must not swallow it."""


@contextmanager
def hang_guard(seconds: int):
    """Before the fix these builds waited forever: fail the test instead (the alarm interrupts the wait)."""

    def hung(number, frame):
        raise Hung(f"the build still waited after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _examples(sequence) -> list[tuple[list[int], list[int]]]:
    return [(e.input_ids, e.labels) for e in sequence]


def _killed_worker(chunk):
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does


def _worker_sent_sigint(chunk):
    os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C of the terminal reaches every process of its group
    return data.cache._tokenize_in_worker(chunk, data.cache._WORKER_CONTEXT)


def _key_of(recipe, tokenizer) -> str:
    spec = recipe.data.datasets[0]
    return data.cache_key(spec, data.open_source(spec), recipe, tokenizer)


@pytest.mark.slow  # its forked tokenizing workers: over the fast tier's 1.5 s of child CPU on a loaded machine
def test_a_killed_tokenizing_worker_stops_the_build_with_an_error_and_frees_the_entry(tmp_path, tokenizer, monkeypatch):
    """Found by a bug bash (bb20 #1): a data.num_proc worker killed during a build (the OOM killer's SIGKILL) was
    replaced by multiprocessing.Pool, the chunk it held never came back, and the run waited forever holding the
    entry's lock (every other run on that data waited on it too), leaving its temporary folder. Now the build stops
    with one paragraph naming data.num_proc, the lock is free, nothing half-written is left, and a rebuild works."""
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(3100)))}, num_proc=2)
    monkeypatch.setattr(data.cache, "_worker", _killed_worker)
    with hang_guard(20), pytest.raises(DataError, match=r"data\.num_proc: a tokenizing process .* died") as caught:
        data.build_examples(recipe, tokenizer)
    assert "lower data.num_proc" in str(caught.value)
    folder, key = data.cache_dir(), _key_of(recipe, tokenizer)
    assert [p.name for p in folder.iterdir()] == [f"{key}.lock"]  # no entry, no .tmp- folder
    with open(folder / f"{key}.lock") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: another run can build it
    monkeypatch.undo()
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    assert len(data.build_examples(recipe, tokenizer)[0]) > 2900


def test_workers_keep_a_sigint_the_run_ignores(tmp_path, tokenizer, monkeypatch):
    """Found by a bug bash (bb20 #1): a run started in the background of a script ignores SIGINT (POSIX), but its
    tokenizing workers put SIGINT back to its default action, so the Ctrl-C meant for the script killed them and the
    build hung. Now a worker keeps an ignored SIGINT: the build finishes with the tokens of one process."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(2100))
    serial, _, _ = data.build_examples(make_recipe({"path": str(path)}, cache=False, num_proc=1), tokenizer)
    monkeypatch.setattr(data.cache, "_worker", _worker_sent_sigint)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with hang_guard(20):
            pooled, _, _ = data.build_examples(make_recipe({"path": str(path)}, cache=False, num_proc=2), tokenizer)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _examples(pooled) == _examples(serial)


def test_a_run_waiting_on_another_build_says_whom_it_waits_for(tmp_path, tokenizer, monkeypatch, capsys):
    """Found by a bug bash (bb20 #7): a run waiting for another process's build of the same entry (stopped with
    Ctrl-Z, or slow) printed nothing however long it waited. Now it names the holder's PID once, after a few seconds,
    and goes on building once the lock is free."""
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(30)))})
    lock = data.cache_dir() / f"{_key_of(recipe, tokenizer)}.lock"
    lock.parent.mkdir(parents=True)
    monkeypatch.setattr(finetune.files, "WAIT_NOTE_S", 0.2)
    with open(lock, "w") as holder:  # another run's: its own open file, so its flock excludes this process's
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write("424242 otherhost\n")
        holder.flush()
        releaser = threading.Timer(0.6, lambda: fcntl.flock(holder, fcntl.LOCK_UN))
        releaser.start()
        try:
            with hang_guard(30):
                train, _, stats = data.build_examples(recipe, tokenizer)
        finally:
            releaser.cancel()
    err = capsys.readouterr().err
    assert "waiting for another run building the same data cache entry: PID 424242 on otherhost" in err, err
    assert err.count("waiting for another run") == 1 and stats.cached_datasets == 0 and len(train) > 0


def test_a_rank_waiting_on_its_own_launchs_build_is_not_told_of_another_run(tmp_path, tokenizer, monkeypatch, capsys):
    """Found by a bug bash (bb27 #1): on a cold 2-process start, rank 0 waiting while rank 1 of the same launch built
    the entry said "waiting for another run ... if that process is stopped (Ctrl-Z) or hung, resume or end it", naming
    its own sibling. The holder writes its launch (rendezvous address and port) and rank: a sibling is named as one."""
    import socket

    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(30)))})
    lock = data.cache_dir() / f"{_key_of(recipe, tokenizer)}.lock"
    lock.parent.mkdir(parents=True)
    monkeypatch.setattr(finetune.files, "WAIT_NOTE_S", 0.2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with open(lock, "w") as holder:  # rank 1 of this launch holds it
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write(f"424242 {socket.gethostname()} 127.0.0.1:29555 1\n")
        holder.flush()
        releaser = threading.Timer(0.6, lambda: fcntl.flock(holder, fcntl.LOCK_UN))
        releaser.start()
        try:
            with hang_guard(30):
                data.build_examples(recipe, tokenizer)
        finally:
            releaser.cancel()
    err = capsys.readouterr().err
    assert "rank 1 of this launch (PID 424242) is tokenizing the data" in err, err
    assert "another run" not in err


def test_an_unwritable_cache_is_said_and_a_read_only_one_is_read(tmp_path, tokenizer, monkeypatch, capsys):
    """Found by a bug bash (bb20 #5): a read-only cache that already held the entry (filled in advance by an admin)
    was never read: the lock file was opened for writing first, which failed, and the data was tokenized again at
    every start, without a word, as with any unwritable cache. Now a whole entry is read without the lock, and an
    unwritable cache is named in one note before the private build."""
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(30)))})
    fresh, _, _ = data.build_examples(recipe, tokenizer)

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(data.cache, "_entry_lock", read_only, raising=False)
    monkeypatch.setattr(data.cache, "exclusive_lock", read_only, raising=False)  # the lock before the fix
    again, _, stats = data.build_examples(recipe, tokenizer)
    assert stats.cached_datasets == 1 and _examples(again) == _examples(fresh)
    monkeypatch.undo()
    (tmp_path / "afile").write_text("FINETUNE_CACHE points at a file")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "afile"))
    capsys.readouterr()
    private, _, stats = data.build_examples(recipe, tokenizer)
    err = capsys.readouterr().err
    assert stats.cached_datasets == 0 and _examples(private) == _examples(fresh)
    assert f"the tokenization cache {tmp_path / 'afile' / 'data'} cannot be written" in err, err


def test_a_build_removes_the_leftovers_of_killed_builds_of_its_entry(tmp_path, tokenizer):
    """Found by a bug bash (bb20 #6): a build killed by SIGKILL or SIGTERM left its hidden `.<key>.tmp-<pid>` folder,
    as big as the entry, forever. Now the next build of that entry removes those whose process is gone or that are a
    day old, and keeps a live one; the entry says which data it holds (source.json)."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(30))
    recipe = make_recipe({"path": str(path)})
    folder, key = data.cache_dir(), _key_of(recipe, tokenizer)
    dead, old, live = (folder / f".{key}.tmp-{pid}" for pid in (4194304 + 4242, os.getppid(), 1))
    for leftover in (dead, old, live):
        leftover.mkdir(parents=True)
        (leftover / "ids.bin").write_bytes(b"\0" * 64)
    two_days_ago = time.time() - 2 * 24 * 3600
    for stamped in (old / "ids.bin", old):
        os.utime(stamped, (two_days_ago, two_days_ago))
    data.build_examples(recipe, tokenizer)
    assert sorted(p.name for p in folder.iterdir()) == sorted([key, f"{key}.lock", live.name])
    source = json.loads((folder / key / "source.json").read_text())
    assert source["path"] == str(path) and source["rows"] == 30 and source["built"]


def test_every_cache_follows_one_rule_for_its_folder(tmp_path, monkeypatch):
    """Found by a bug bash (bb20 #4): FINETUNE_CACHE='~/x' (a quoted export, a .env file, a systemd unit) put the
    data cache in a folder named `~` under the working folder while the GGUF and quantized caches expanded it, and the
    data cache ignored XDG_CACHE_HOME. Now all three are siblings by one rule."""
    from finetune.model.quantization.cache import cache_root as quantized_root
    from finetune.model.sources.gguf import cache_root as gguf_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FINETUNE_CACHE", "~/ftc")
    expected = tmp_path / "home" / "ftc"
    assert (data.cache_dir(), quantized_root(), gguf_root()) == (expected / "data", expected / "quantized",
                                                                 expected / "gguf")
    monkeypatch.delenv("FINETUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir() == tmp_path / "xdg" / "finetune" / "data"
    assert quantized_root() == tmp_path / "xdg" / "finetune" / "quantized"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # not absolute: ignored, as the XDG spec says
    assert data.cache_dir() == tmp_path / "home" / ".cache" / "finetune" / "data" == Path.home() / ".cache/finetune/data"
