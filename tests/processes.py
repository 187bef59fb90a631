"""Training processes the tests start, stop and wait for (checkpoint, resume and preemption tests share them)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from conftest import child_env

# Kill trials land at a random step (and rank): seeded, printed, replayable with FINETUNE_KILL_SEED=<seed>.
KILL_SEED = int(os.environ.get("FINETUNE_KILL_SEED") or time.time_ns() % 100_000)


def kill_plan(trial: str, first: int, last: int, ranks: int = 1) -> tuple[int, int, str]:
    """(step, rank, replay note) for `trial`: a step in [first, last] and a rank below `ranks`, from KILL_SEED."""
    rng = random.Random(f"{KILL_SEED}/{trial}")
    step, rank = rng.randint(first, last), rng.randrange(ranks)
    note = f"kill trial {trial}: step {step}, rank {rank} (replay: FINETUNE_KILL_SEED={KILL_SEED})"
    print(note, flush=True)
    return step, rank, note


def start(args: list[str], log: Path, env: dict[str, str] | None = None, warm: bool = True) -> subprocess.Popen:
    """A run in its own session (a timed-out one is killed with its process group). `warm`: its ranks forked from the
    suite's warm servers (tests/warm.py), which stand in the command's place: kill it, signal it, read its ranks
    (worker_pids) as the command's own process."""
    import warm as warm_launches

    args = warm_launches.command(args) if warm else args
    popen = warm_launches.Popen if warm_launches.is_warm(args) else subprocess.Popen
    with open(log, "w") as handle:  # the child keeps its own copy of the descriptor
        return popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env or child_env(),
                     start_new_session=True)


def finish(process: subprocess.Popen, log: Path, timeout: float = 240) -> tuple[int, str]:
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return code, log.read_text()


def last_logged_step(out_dir: Path) -> int:
    try:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.endswith("}")]
    return max(steps, default=0)


def wait_for_step(process: subprocess.Popen, out_dir: Path, step: int, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while last_logged_step(out_dir) < step:
        assert process.poll() is None, f"run ended before step {step}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached:\n{log.read_text()[-3000:]}"
        time.sleep(0.005)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the workers started by `launcher_pid` (torchrun's children, or a warm launch's ranks)."""
    import warm

    ranks = warm.rank_pids(launcher_pid)
    if ranks is not None:
        return ranks
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [item for item in environ if item.startswith(b"RANK=")]
        if parent == launcher_pid and rank:
            workers[int(rank[0][5:])] = int(entry.name)
    return workers


def outline(text: str, limit: int = 60) -> str:
    """The lines of a run's log that say what each rank did and how it ended (ours and errors), without the
    launcher's long report: what a failed assertion shows, so that a CI log says why."""
    keep = [line for line in text.splitlines() if "finetune" in line or "Error" in line or "error:" in line
            or "Signal" in line or "exitcode" in line]
    return "\n".join(keep[-limit:])


def sigtermed_during(module: str, function: str) -> str:
    """A `python -c` script running run.py's main in which `module.function` (a pre-flight check every rank makes)
    first SIGTERMs its own process, as the launcher does when another rank failed that check a moment earlier."""
    return f"""
import os, signal, sys
from finetune import run
import {module} as checked

check = checked.{function}
def the_peer_failed_first(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher: another rank failed this same check a moment earlier
    return check(*args, **kwargs)
checked.{function} = the_peer_failed_first
sys.exit(run.main(sys.argv[1:]))
"""
