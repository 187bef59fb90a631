"""Warm launches for the suite: ranks forked from servers that imported the libraries once (tests/warm_server.py).

`command(argv)` turns a command a test would run cold (`python finetune/run.py ...`, `python -m finetune ...`,
`python -c ...`, torchrun, `accelerate launch`) into the same command through tests/warm_launch.py, which stands in
its place (pid, streams, exit code, signals) and forks its ranks from this pytest process's servers, started on the
first warm launch (SERVERS of them: rank i comes from server i mod SERVERS) and stopped at the session's end.

The tests whose subject is a launcher itself (`accelerate launch` with each shipped config, torchrun's and DeepSpeed's
launchers, `finetune train --accelerate-config`, the wheel, what a user's terminal shows) run their commands as they
are. FINETUNE_WARM=0 runs every launch cold (the servers are never started): the suite as it was, to compare.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVERS = 2
HERE = Path(__file__).resolve().parent
WARM_LAUNCH = HERE / "warm_launch.py"
WARM_SERVER = HERE / "warm_server.py"
READY_TIMEOUT_S = 300  # the servers' imports: ~6 s each on 2 idle cores; minutes on a loaded one


class _Servers:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="finetune-warm-"))
        self.sockets = [str(self.folder / f"server-{index}.sock") for index in range(SERVERS)]
        os.environ["FINETUNE_WARM_SOCKETS"] = os.pathsep.join(self.sockets)
        os.environ["FINETUNE_WARM_DIR"] = str(self.folder)
        from conftest import child_env  # the environment of every launch, which the servers must share

        env = child_env()
        self.processes = []
        for index, path in enumerate(self.sockets):
            log = open(self.folder / f"server-{index}.log", "w")  # noqa: SIM115 (the server keeps it)
            self.processes.append(subprocess.Popen([sys.executable, str(WARM_SERVER), path], stdout=log,
                                                   stderr=subprocess.STDOUT, env=env, start_new_session=True))
            log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, process in enumerate(self.processes):
            log = self.folder / f"server-{index}.log"
            while not log.read_text().startswith("ready"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"warm server {index} did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        import shutil

        for process in self.processes:
            process.kill()
            process.wait()
        os.environ.pop("FINETUNE_WARM_SOCKETS", None)
        shutil.rmtree(self.folder, ignore_errors=True)

    def cold_launches(self) -> list[dict]:
        path = self.folder / "cold.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


_servers: _Servers | None = None


def enabled() -> bool:
    return os.environ.get("FINETUNE_WARM", "1").strip() != "0"


def command(argv: list) -> list[str]:
    """`argv` run by the warm launcher (its ranks forked from this process's servers), or `argv` when warm is off."""
    global _servers
    argv = [str(arg) for arg in argv]
    if not enabled():
        return argv
    if _servers is None:
        _servers = _Servers()
        atexit.register(stop)
    return [sys.executable, str(WARM_LAUNCH), *argv]


def is_warm(argv) -> bool:
    return isinstance(argv, (list, tuple)) and len(argv) > 1 and str(argv[1]) == str(WARM_LAUNCH)


def rank_pids(launcher_pid: int) -> dict[int, int] | None:
    """rank -> pid of a warm launch's ranks (None for a launch that was not warm)."""
    folder = os.environ.get("FINETUNE_WARM_DIR")
    path = Path(folder) / f"ranks-{launcher_pid}.json" if folder else None
    if path is None or not path.exists():
        return None
    return {int(rank): pid for rank, pid in json.loads(path.read_text()).items()}


class Popen(subprocess.Popen):
    """A warm launch's process: `wait()` returns once its ranks are gone too. Killed (SIGKILL), the launcher cannot pass
    the signal on; its server kills the ranks as soon as it sees the launcher's connection close, a moment later. A
    test that kills a run and starts the next one on its folder waits for that moment, as it would for a cold run's
    own process."""

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        deadline = time.monotonic() + (30 if timeout is None else timeout)
        for pid in (rank_pids(self.pid) or {}).values():
            while _alive(pid):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout or 30)
                time.sleep(0.01)
        return code


def _alive(pid: int) -> bool:
    """Whether `pid` is still a process that is not a zombie (its server reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def stop() -> list[dict]:
    """Stop the servers; the launches that ran cold instead, with why."""
    global _servers
    if _servers is None:
        return []
    cold = _servers.cold_launches()
    _servers.stop()
    _servers = None
    return cold
