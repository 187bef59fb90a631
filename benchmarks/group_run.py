"""A benchmark's child run that ends with the benchmark: started in a process group of its own, and that whole group
ended when the benchmark stops waiting for it (an error, Ctrl-C, or a SIGTERM from `timeout`, `kill` or a CI step
limit, once `stop_on_sigterm()` turned SIGTERM into an exit). Without it, a SIGTERM to the benchmark left its training
run going on as an orphan, and the benchmark's temporary folder behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

GRACE_S = 5.0  # what a run gets to end on SIGTERM (finetune checkpoints at the end of its step) before SIGKILL


def stop_on_sigterm() -> None:
    """SIGTERM exits this process as Ctrl-C would stop it: `finally` blocks and `with` blocks run, so the child runs
    are ended (run() below) and the temporary folders removed. Exit status 128 + 15, as the shell reports it."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run(command: list[str], **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, ...) (no check, no timeout) with the child in a process group of its own, which is
    ended whole (torchrun's or accelerate's ranks too) if anything interrupts the wait."""
    capture = popen_kwargs.pop("capture_output", False)
    if capture:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(command, start_new_session=True, **popen_kwargs) as process:
        try:
            stdout, stderr = process.communicate()
        except BaseException:
            end_group(process)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the child's whole process group; after GRACE_S, SIGKILL to whatever is left of the group."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is gone
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the group outlives its leader while a member is left
    process.wait()
