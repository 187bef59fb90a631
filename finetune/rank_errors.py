"""How a mistake every rank finds reaches the terminal once, whole: rank 0 prints the paragraph, the others wait
silently until it has (the process group's store), or print it whole themselves if it never does.

Why: the launchers (torchrun under accelerate, the DeepSpeed launcher) SIGTERM every survivor as soon as one rank
exits, so the rank that finds a mistake first must not exit first; rank 0 may still be importing, or in the 4-bit
cache's lock (CI printed only "(rank 1) the checkpoint in ..."; a recipe typo under `accelerate launch` printed
"(rank 1) r.yaml: 1 problem in the recipe:" with nothing under it).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

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
