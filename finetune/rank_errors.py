"""How a mistake every rank finds reaches the terminal once, whole: rank 0 prints the paragraph, the others wait
silently until it has (the process group's store), or print it whole themselves if it never does. And, for a failed
collective, what a peer's process is (this host's /proc) and which errors are this rank's own, never a lost peer's.

Why: the launchers (torchrun under accelerate, the DeepSpeed launcher) SIGTERM every survivor as soon as one rank
exits, so the rank that finds a mistake first must not exit first; rank 0 may still be importing, or in the 4-bit
cache's lock (CI printed only "(rank 1) the checkpoint in ..."; a recipe typo under `accelerate launch` printed
"(rank 1) r.yaml: 1 problem in the recipe:" with nothing under it).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from finetune.held_signals import release_stop_signals

_PRINTED_KEY = "finetune/rank0-printed"


_READ_KEY = "finetune/rank0-printed-read"


def rank0_printed(*, peers_waiting: bool = False, linger_s: float = 3.0) -> None:
    """Rank 0 has written its error paragraph: a peer waiting in `wait_for_rank0_paragraph` may exit now. With
    `peers_waiting` (a mistake every rank finds alike) rank 0 stays until they have read that (or `linger_s`): where
    rank 0 hosts the store (the DeepSpeed launcher; torchrun's agent hosts it elsewhere), its exit would end the
    store under a peer still waiting, and torch prints the broken connection with C++ frames."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return
        store = dist.distributed_c10d._get_default_store()
        store.set(_PRINTED_KEY, "1")
        deadline = time.monotonic() + (linger_s if peers_waiting else 0.0)
        while time.monotonic() < deadline and store.add(_READ_KEY, 0) < dist.get_world_size() - 1:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001, S110 - the store may be gone with the peers; nothing waits then
        pass


def says_it_too(exc: BaseException) -> bool:
    """Whether this rank, not rank 0, prints an error every rank found alike: the first rank of each machine does, for
    an error each machine's own log must show (its ranks run another recipe or finetune, output.dir is not shared:
    distributed.check_same_run), so that a machine's log does not end without a word."""
    return bool(getattr(exc, "said_on_every_machine", False)) and os.environ.get("LOCAL_RANK", "0") in ("", "0")


def wait_for_rank0_paragraph(timeout_s: float = 30.0, *, before_group_s: float = 120.0) -> bool:
    """A rank other than 0 that failed a check every rank makes says nothing and stays until rank 0 has printed the
    whole paragraph: True once rank 0 says so (the process group's store), False when `timeout_s` passed first or
    there is no group yet (a recipe mistake is found before the group exists: then up to `before_group_s`, as rank 0
    may still be importing torch on a loaded machine, far behind; the ranks after the group are in step). The
    launcher SIGTERMs every survivor
    once one rank exits, and rank 0 may still be on its way to the same check (importing, or in the 4-bit cache's
    lock; CI printed only "(rank 1) the checkpoint in ..."), so this rank must not exit first. Signals are released
    first: the launcher's SIGTERM, sent once rank 0 has printed and exited, ends this rank silently."""
    release_stop_signals()
    deadline = time.monotonic() + before_group_s
    try:
        if dist.is_available() and dist.is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
                store.wait([_PRINTED_KEY], timedelta(seconds=timeout_s))
                store.add(_READ_KEY, 1)  # rank 0 may leave now
                return True
            except Exception:  # noqa: BLE001 - timed out, or rank 0 (hosting the store) is gone
                return False
        while time.monotonic() < deadline:  # no group: rank 0 prints and exits, and the launcher stops this wait
            time.sleep(0.1)
        return False
    except KeyboardInterrupt:  # Ctrl-C while waiting: rank 0 got it too and says what it has to say
        return True


# ------------------------------------------------------------------------------------------------ a peer's process
_PF_EXITING = 0x4  # linux/sched.h: set on a task as it starts to exit (/proc/PID/stat, field 9)
_PF_DUMPCORE = 0x200  # linux/sched.h: set on a task while it writes its core dump
_D_SETTLE_S = 1.5  # how long a peer in state D is watched before it is called stuck
# DDP's reducer, from this rank's own bookkeeping before any message to a peer: a parameter without a gradient.
_OWN_ERROR_WORDS = ("expected to have finished reduction in the prior iteration",
                    "expected to mark a variable ready only once")


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, flags) of process `pid` in this host's /proc/PID/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        return fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return None


def local_peer_state(pid: int) -> str:
    """Alive, stopped, dead, gone or stuck in the kernel: a rank's process on this host.

    State D (uninterruptible sleep, I/O) is also what a dying process shows for a moment, writing its traceback or a
    core dump to a busy disk or flushing its files: a peer that failed at the same step as this rank read as "stuck
    in the kernel (state D: I/O, e.g. a hung network filesystem)" with "run the same command with train.resume=auto"
    as the fix (bug bash bb66). A peer in D is watched for up to `_D_SETTLE_S`: gone, a zombie or exiting by then, it
    died; running again, it is alive; only one still in D is stuck."""
    deadline = time.monotonic() + _D_SETTLE_S
    seen = proc_state(pid)
    while seen and seen[0] == "D" and not seen[1] & (_PF_EXITING | _PF_DUMPCORE) and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = proc_state(pid)
    if seen is None:
        return "gone (the process died)"
    state, flags = seen
    if flags & _PF_EXITING and state != "Z":
        # SIGKILLed (or exiting) and not yet a zombie: the kernel closes its sockets in this state, so a peer can see
        # the broken connection before the process reads as dead (a busy CI machine named no rank without this).
        return "dead (killed or crashed; exiting)"
    if flags & _PF_DUMPCORE:
        return "dead (crashed; writing a core dump)"
    return {"T": "stopped (SIGSTOP or a debugger: state T)", "t": "stopped by a debugger (state t)",
            "Z": "dead (killed or crashed; not yet reaped)",
            "D": f"stuck in the kernel (state D for {_D_SETTLE_S:g} s and more: I/O, e.g. a hung network filesystem)",
            }.get(state, "alive")


def raised_by_this_rank(exc: BaseException) -> bool:
    """An error of this rank's own, never a lost peer's doing even when a peer has died meanwhile: out of memory, and
    DDP's reducer finding a parameter without a gradient. Every rank of such a run raises the same at the same step;
    the one that looked second found the other dying and said "lost a peer ... run the same command with
    train.resume=auto added" (bb66), which cannot help: the error itself is the story."""
    return isinstance(exc, torch.OutOfMemoryError) or any(words in str(exc).lower() for words in _OWN_ERROR_WORDS)
