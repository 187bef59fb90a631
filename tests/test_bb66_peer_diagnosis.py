"""Bug bash bb66 #4: what a rank says about a peer when a collective (or its own step) fails.

DeepSeek-V4 under DDP died at step 2 on both ranks with the same RuntimeError (DDP's reducer); rank 1 printed "rank 1
lost a peer ...: rank 0 (pid ...) is stuck in the kernel (state D: I/O, e.g. a hung network filesystem) ... run the
same command with train.resume=auto added": rank 0 was dying of the same error, its /proc state D for a moment while
it wrote its traceback out. A real process cannot be put in state D (or made to leave it) on demand, so these tests
give the /proc reader the states such a peer shows, read by read: the file /proc/PID/stat of a pid that no process
has is answered from a list (every other path is read as usual). The peers' (host, pid) list is module state, as
init_distributed fills it; no process group is needed."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from finetune import distributed, held_signals, rank_errors
from finetune.distributed import DistInfo

PEER = 4_194_400  # above Linux's largest pid_max (2**22): no process of this machine has it
D, S, Z, GONE = ("D", 0), ("S", 0), ("Z", 0), None
EXITING = ("D", 0x4)  # PF_EXITING


def _proc_shows(monkeypatch, states: list) -> list:
    """/proc/PEER/stat reads as `states` one read after another (the last one from then on); the reads are counted."""
    real, reads = Path.read_text, []

    def read_text(self, *args, **kwargs):
        if str(self) != f"/proc/{PEER}/stat":
            return real(self, *args, **kwargs)
        seen = states[min(len(reads), len(states) - 1)]
        reads.append(seen)
        if seen is None:
            raise FileNotFoundError(f"/proc/{PEER}/stat")
        state, flags = seen
        return f"{PEER} (python) {state} 1 {PEER} {PEER} 0 -1 {flags} 120 0 0 0 8 3 0 0 20 0 1 0 100 1 1"

    monkeypatch.setattr(Path, "read_text", read_text)
    return reads


@pytest.fixture
def rank_1_of_2(monkeypatch):
    """This process is rank 1 of a DDP run on this host; rank 0 is PEER."""
    here = socket.gethostname()
    monkeypatch.setattr(distributed, "_INFO", DistInfo(1, 2, 1, 2, torch.device("cpu"), "gloo"))
    monkeypatch.setattr(distributed, "_PEERS", [(here, PEER), (here, os.getpid())])
    monkeypatch.setattr(distributed, "_DOING", "step 2: forward and backward")
    return here


@pytest.mark.parametrize(("states", "said"), [
    ([D, D, D, GONE], "gone (the process died)"),
    ([D, D, EXITING], "dead (killed or crashed; exiting)"),
    ([D, Z], "dead (killed or crashed; not yet reaped)"),
    ([D, D, S], None),  # a moment of I/O: alive
], ids=["exits", "starts-to-exit", "zombie", "runs-again"])
def test_a_peer_in_state_d_for_a_moment_is_not_a_hung_filesystem(monkeypatch, rank_1_of_2, states, said):
    """Found by a bug bash (bb66 #4): a peer read once in state D was "stuck in the kernel (state D: I/O, e.g. a hung
    network filesystem)", with resume as the fix, though it was dying (or busy writing) and gone a moment later. A peer
    in D is read again for up to 1.5 s: gone, exiting or a zombie by then, it died; running again, it is alive."""
    reads = _proc_shows(monkeypatch, states)
    assert distributed.peer_state(rank_1_of_2, PEER) == (said or "alive")
    assert len(reads) == len(states)  # read until it left state D, no longer
    if said:  # (a live peer is looked at again for 3 s before the paragraph says so: test_distributed.py)
        reads.clear()
        paragraph = str(distributed.peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:1] Connection closed by "
                                                              "peer"), checkpoints="no checkpoint yet."))
        assert f"rank 0 (pid {PEER} on {rank_1_of_2}) is {said}" in paragraph and "stuck" not in paragraph, paragraph


def test_a_peer_still_in_state_d_after_the_wait_is_stuck(monkeypatch, rank_1_of_2):
    """The other side: a peer that stays in state D (a hung network filesystem, a dead NFS server) is still named as
    stuck, after the wait (shortened here to 0.3 s)."""
    monkeypatch.setattr(rank_errors, "_D_SETTLE_S", 0.3, raising=False)
    reads = _proc_shows(monkeypatch, [D])
    state = distributed.peer_state(rank_1_of_2, PEER)
    assert state.startswith("stuck in the kernel (state D") and "hung network filesystem" in state, state
    assert len(reads) >= 2


def test_an_error_this_rank_raised_itself_is_not_a_lost_peer_when_the_peer_dies_of_the_same(monkeypatch, rank_1_of_2):
    """Found by a bug bash (bb66 #4): both ranks raised DDP's "Expected to have finished reduction" at step 2; rank 1
    looked at rank 0 while it was dying of the same error (state D, then gone) and turned its own RuntimeError into
    "lost a peer ... run the same command with train.resume=auto added", which cannot help. The error is this rank's
    own (DDP's reducer, out of memory): it stays what it is, whatever state the peer is in."""
    from finetune.run import _lost_peers_named

    reducer = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. "
                           "This error indicates that your module has parameters that were not used in producing loss.\n"
                           "Parameter indices which did not receive grad for rank 1: 54 55 56 57 58 59 60 61")
    try:
        for own in (reducer, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")):
            _proc_shows(monkeypatch, [D, D, GONE])
            with pytest.raises(type(own)) as raised, _lost_peers_named(Path("/nonexistent")):
                raise own
            assert raised.value is own
    finally:
        held_signals.release_stop_signals()  # held (and left so) by the PeerLost path this test refuses
    _proc_shows(monkeypatch, [D, D, GONE])  # a collective's error with words of its own is still a lost peer
    assert distributed.is_communication_failure(RuntimeError("an op failed: unexpected end of stream"))
