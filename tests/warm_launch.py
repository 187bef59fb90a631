"""`python tests/warm_launch.py COMMAND...`: run COMMAND with its ranks forked from the suite's warm servers.

COMMAND is what a test would run cold: `python finetune/run.py ...`, `python -m finetune ...`, `python -c CODE`,
`python -m torch.distributed.run ...` or `python -m accelerate.commands.launch ...`. This process stands where that
command's own process would (the test's Popen, its pid, its streams, its exit code) and does its launcher's job, as
torchrun's agent does: the ranks come from the servers of FINETUNE_WARM_SOCKETS (tests/warm_server.py; rank i from
server i mod n, so that two ranks do not share one interpreter's hash seed), each a real process in a session of its
own writing to this process's stdout and stderr; torchrun's store is held for them as its agent holds it. When a rank
fails, the others get SIGTERM and, 30 s later, SIGKILL, and the launcher exits 1 (torchrun's and accelerate's exit);
a signal to this process is passed to every rank, as torchrun passes it. A plain `python` command exits as its one
process did (by the same signal, if a signal ended it).

What the servers do not reproduce (another launcher, an environment that differs where a library reads it at import,
no server) runs cold: this process becomes COMMAND (exec, the same pid), and says why in FINETUNE_WARM_DIR/cold.log.
Only the standard library is imported here: this process costs ~30 ms.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

STOP_GRACE_S = 30  # torchrun's: SIGTERM, then SIGKILL after this long (PContext.close's timeout)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def connect(path: str, message: dict, fds: list[int] | None = None) -> tuple[socket.socket, object]:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(connection, [data], fds)
    else:
        connection.sendall(data)
    return connection, connection.makefile("rb")


def answer(reader) -> dict | None:
    line = reader.readline()
    return json.loads(line) if line else None


def run_cold(argv: list[str], reason: str) -> None:
    folder = os.environ.get("FINETUNE_WARM_DIR")
    if folder:
        with open(os.path.join(folder, "cold.log"), "a") as log:
            log.write(json.dumps({"argv": argv[:6], "why": reason}) + "\n")
    os.execvp(argv[0], argv)


class Launch:
    def __init__(self, sockets: list[str], plan: dict) -> None:
        self.launcher = plan["launcher"]
        self.ranks: dict[int, int] = {}  # rank -> pid
        self.status: dict[int, int] = {}  # rank -> returncode, once ended
        self.failures: list[int] = []  # ranks that ended non-zero, in the order seen
        self.readers: dict[int, object] = {}
        self.selector = selectors.DefaultSelector()
        self.held = []  # the store's connection: closing it ends the store
        self.signalled: int | None = None
        self.stopping_since: float | None = None
        if plan["store"]:
            store, reader = connect(sockets[0], {"op": "store", **plan["store"]})
            if not answer(reader):
                raise OSError("the warm server could not hold the launcher's store")
            self.held.append(store)
        env, cwd = dict(os.environ), os.getcwd()
        for rank, spec in enumerate(plan["ranks"]):
            connection, reader = connect(sockets[rank % len(sockets)], {
                "op": "rank", "env": {**env, **spec["env"]}, "cwd": cwd, "target": spec["target"]}, fds=[0, 1, 2])
            started = answer(reader)
            if not started:
                raise OSError(f"the warm server did not start rank {rank}")
            self.ranks[rank] = started["pid"]
            self.readers[rank] = reader
            self.held.append(connection)
            self.selector.register(connection, selectors.EVENT_READ, rank)
        folder = os.environ.get("FINETUNE_WARM_DIR")
        if folder:  # where tests/processes.py's worker_pids finds the ranks (no /proc/PID/environ says RANK here)
            with open(os.path.join(folder, f"ranks-{os.getpid()}.json"), "w") as out:
                json.dump(self.ranks, out)

    def signal_ranks(self, number: int) -> None:
        for rank, pid in self.ranks.items():
            if rank not in self.status:
                try:
                    os.kill(pid, number)
                except ProcessLookupError:
                    pass

    def on_signal(self, number, _frame) -> None:
        self.signalled = self.signalled or number
        self.signal_ranks(number)
        if self.launcher and self.stopping_since is None:
            self.stopping_since = time.monotonic()

    def wait(self) -> int:
        for number in FORWARDED:
            signal.signal(number, self.on_signal)
        while len(self.status) < len(self.ranks):
            timeout = None
            if self.stopping_since is not None:
                timeout = max(0.0, self.stopping_since + STOP_GRACE_S - time.monotonic())
                if timeout == 0.0:
                    self.signal_ranks(signal.SIGKILL)
                    timeout = None
            for key, _ in self.selector.select(timeout):
                rank = key.data
                message = answer(self.readers[rank])
                self.selector.unregister(key.fileobj)
                self.status[rank] = message["status"] if message else -signal.SIGKILL  # the server died
                if self.status[rank] != 0:
                    self.failures.append(rank)
                if self.status[rank] != 0 and self.launcher and self.stopping_since is None:
                    self.stopping_since = time.monotonic()
                    self.signal_ranks(signal.SIGTERM)
        return self.exit_code()

    def exit_code(self) -> int:
        if not self.launcher:
            return self.status[0]
        failed = {rank: code for rank, code in self.status.items() if code != 0}
        if not failed and not self.signalled:
            return 0
        first = self.failures[0] if self.failures else None  # torchrun's root cause: the first observed
        name = f"{self.launcher} (warm, tests/warm_launch.py)"
        lines = [f"{name}: received signal {signal.Signals(self.signalled).name}"] if self.signalled else []
        # the line torchrun's agent logs for the first failed worker, in its words
        if first is not None:
            lines.append(f"{name}: failed (exitcode: {failed[first]}) local_rank: {first} (pid: {self.ranks[first]}) "
                         f"of binary: {sys.executable}")
        lines.append(f"{name}: " + ", ".join(f"rank {rank} (pid {self.ranks[rank]}) exitcode {code}"
                                              for rank, code in sorted(self.status.items())))
        print("\n".join(lines), file=sys.stderr, flush=True)
        return 1


def main(argv: list[str]) -> None:
    sockets = [path for path in os.environ.get("FINETUNE_WARM_SOCKETS", "").split(os.pathsep) if path]
    if not argv:
        sys.exit("usage: python tests/warm_launch.py COMMAND...")
    if not sockets:
        run_cold(argv, "no warm server (FINETUNE_WARM_SOCKETS is unset)")
    try:
        _, reader = connect(sockets[0], {"op": "plan", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
        plan = answer(reader) or {"cold": "the warm server closed the connection"}
    except OSError as exc:
        plan = {"cold": f"the warm server is not there ({exc})"}
    if "cold" in plan:
        run_cold(argv, plan["cold"])
    code = Launch(sockets, plan).wait()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # a plain `python` command ended by a signal: end by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
