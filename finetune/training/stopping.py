"""Stopping a run on a signal (SIGTERM: preemption, scancel, the launcher passing one on; SIGINT: Ctrl-C): the loop
finishes its step, every rank checkpoints after the same step, then stops. And the launcher's grace: torch elastic
SIGKILLs the ranks a fixed time after it passes a SIGTERM on, so a step longer than that is warned about once."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Self

from finetune import distributed, held_signals

ONE_ACTION_S = 1.0  # SIGINTs this close are one Ctrl-C delivered twice (directly and forwarded by the launcher)
# SIGHUP: a closed terminal, which torch elastic passes on to the ranks as SIGHUP (their default: die, no checkpoint)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
DEFAULT_GRACE_S = 30  # torch elastic's wait between the SIGTERM it passes on and its SIGKILL


def launcher_grace_s() -> int | None:
    """Seconds torch elastic (torchrun, accelerate launch) waits after passing a SIGTERM on before it SIGKILLs the
    ranks; None when not started by it. torch >= 2.12 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (or torchrun's
    --shutdown-timeout, which this rank cannot see: the variable is the way to say it here); before, 30 s, fixed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    if not _grace_is_settable():
        return DEFAULT_GRACE_S
    try:
        return max(0, int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_GRACE_S)))
    except ValueError:
        return DEFAULT_GRACE_S


def _grace_is_settable() -> bool:
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in getattr(LaunchConfig, "__dataclass_fields__", {})


class StopSignals:
    """While active, SIGTERM, SIGINT and SIGHUP only set `received`: the loop finishes the step, checkpoints, then
    stops.

    A second SIGINT (an impatient Ctrl-C) interrupts at once; one within ONE_ACTION_S of the first is the same Ctrl-C
    reaching the rank twice (the process group's and the launcher's copy), not a second one. Outside the main thread
    (signals cannot be caught there) it does nothing.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._at = 0.0
        self._postponed = False
        self._previous: dict[int, object] = {}
        self.grace_s = launcher_grace_s()
        self._warned = False

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            if time.monotonic() - self._at < ONE_ACTION_S:  # the launcher's copy of the same Ctrl-C, or a job step's
                return
            raise KeyboardInterrupt
        self.received, self._at = signum, time.monotonic()
        grace = (f" (a launcher that passed it on SIGKILLs the ranks {self.grace_s} s after: TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"
                 if self.grace_s is not None and signum == signal.SIGTERM else "")
        distributed.print0(f"[finetune] {signal.Signals(signum).name} received: finishing this step, then checkpointing"
                           f"{grace}")

    def timed(self, step: int, first_step: int, seconds: float) -> None:
        """Warn once (rank 0) when a step, after this launch's first, takes more than half the launcher's grace: a
        SIGTERM then finds the ranks unable to finish the step and checkpoint before the SIGKILL, and the run loses
        the steps since its last checkpoint."""
        if self._warned or self.grace_s is None or step <= first_step or seconds <= self.grace_s / 2:
            return
        self._warned = True
        wanted = max(60, int(seconds * 3 + 30))
        how = (f"Launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wanted} in the environment (or torchrun --shutdown-timeout "
               f"{wanted})" if _grace_is_settable() else
               f"This torch's launcher waits a fixed {DEFAULT_GRACE_S} s (torch >= 2.12 reads "
               f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT); meanwhile train.save_every bounds what such a stop loses")
        distributed.print0(
            f"[finetune] warning: a step takes {seconds:.0f} s, and the launcher gives the ranks {self.grace_s} s after "
            "it passes a SIGTERM on (preemption, scancel, Ctrl-C) before it SIGKILLs them: such a stop would lose the "
            f"steps since the last checkpoint instead of checkpointing this one. {how}, and give the scheduler at least "
            "as long (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds).", file=sys.stderr)

    def postpone(self, note: str) -> bool:
        """The stop waits for a step after which a checkpoint resumes exactly (`note` says why, printed once)."""
        if not self._postponed:
            distributed.print0(note)
            self._postponed = True
        return False

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # `nohup`: a logout must not stop the run
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is not None and self._previous and distributed.is_communication_failure(exc):
            # A peer is lost: keep recording until the entry point has printed which one (the launcher's SIGTERM follows).
            held_signals.hold_stop_signals(self._previous, self.received)
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
