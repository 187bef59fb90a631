"""The output.dir lock is an OS lock (flock) that goes with its process: a live run excludes another, a dead one
(killed, not yet reaped), a recycled pid and a lock file written on another host block nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.errors import CheckpointError
from finetune.outputs import LOCK_FILE, output_dir_problem
from finetune.outputs.run_folder import release_output_dir, take_output_dir

HOLDER = """
import fcntl, json, os, socket, sys, time
lock = sys.argv[1]
fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
print("locked", flush=True)
time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen:
    """A process holding the folder's lock as a running run does (its own process, its own descriptor)."""
    folder.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_live_run_is_refused_and_a_killed_one_frees_the_folder_before_it_is_reaped(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        problem = output_dir_problem(out, overwrite=False, resume="auto")
        assert problem and f"in use by a running run (pid {holder.pid} on {socket.gethostname()}" in problem
        with pytest.raises(CheckpointError, match="just taken by another run"):
            take_output_dir(out)
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{holder.pid}/stat").read_text().split(") ")[1][0] != "Z":  # dead, not reaped: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert output_dir_problem(out, overwrite=False, resume="auto") is None  # the zombie holds no lock
        take_output_dir(out)
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        release_output_dir(out)
        assert not (out / LOCK_FILE).exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("owner", [
    {"pid": 1, "host": "node-17.cluster"},  # a preempted job's lock, written on another node
    {"pid": os.getpid(), "host": socket.gethostname()},  # a live pid of this host that holds no lock (pid recycled)
])
def test_a_lock_file_nobody_holds_blocks_nothing(tmp_path, owner):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps(owner))
    assert output_dir_problem(out, overwrite=False, resume="auto") is None
    take_output_dir(out)
    try:
        holder = subprocess.run([sys.executable, "-c", HOLDER.replace("fcntl.LOCK_EX)", "fcntl.LOCK_EX | fcntl.LOCK_NB)"),
                                 str(out / LOCK_FILE)], capture_output=True, text=True, timeout=60, check=False)
        assert holder.returncode != 0 and "BlockingIOError" in holder.stderr  # and now this run excludes others
    finally:
        release_output_dir(out)


@pytest.mark.slow
def test_two_live_two_rank_runs_on_one_folder(tmp_path, tiny_llama):
    """A 2-rank run holds the folder; a second 2-rank run on it is refused at once, naming the holder."""
    from conftest import addition_rows, recipe_dict, torchrun, write_jsonl, write_recipe

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows())
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "out", train={"max_steps": 400}))
    from processes import start, wait_for_step

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
            str(Path(__file__).resolve().parents[2] / "finetune" / "run.py"), str(recipe), "train.save_every=0"]
    first = start(args, tmp_path / "first.log")
    try:
        wait_for_step(first, tmp_path / "out", 1, tmp_path / "first.log")
        second = torchrun(recipe, "train.resume=auto")
        output = second.stdout + second.stderr
        assert second.returncode != 0 and "is in use by a running run (pid" in output, output[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def _port() -> int:
    from conftest import free_port

    return free_port()
