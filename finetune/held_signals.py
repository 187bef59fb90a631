"""Signals held while a paragraph is printed: SIGTERM/SIGINT recorded rather than acted on over the checks every rank
makes alike, and while a lost peer is named, so that the launcher's SIGTERM (sent as soon as one rank exits) does not
cut rank 0's paragraph short; acted on once it is out."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from finetune.errors import FinetuneError

_HELD: dict[int, object] = {}  # signal -> the handler to put back, while a lost peer's paragraph is being written
_HELD_RECEIVED: list[int] = []


def hold_stop_signals(previous: dict | None = None, received: int | None = None) -> bool:
    """Record SIGTERM/SIGINT instead of acting on them until `release_stop_signals`. The launcher SIGTERMs the
    survivors as soon as it sees a dead rank; without this, a survivor that has left the training loop (whose handler
    only records) is killed before it names the peer it lost (seen on a busy CI machine). `previous`: the handlers to
    put back (the training loop's own were in place); `received`: a signal the loop had already recorded."""
    if _HELD or threading.current_thread() is not threading.main_thread():
        return False
    for signum in (signal.SIGTERM, signal.SIGINT):
        before = signal.signal(signum, lambda number, frame: _HELD_RECEIVED.append(number))
        _HELD[signum] = (previous or {}).get(signum, before)
    if received is not None:
        _HELD_RECEIVED.append(received)
    return True


@contextmanager
def checks_every_rank_makes() -> Iterator[None]:
    """Hold SIGTERM/SIGINT over checks that every rank makes alike and that wait on no peer (recipe, files, model
    config, parallel plan). A rank that fails such a check first exits, and the launcher SIGTERMs the others at once:
    rank 0, the one that prints the whole paragraph, was killed before it got there (CI: "(rank 1) the parallel setup
    cannot work:" and nothing more). Released when the checks pass; when one fails, after main() has printed it (a
    caller of run() gets them back as run() ends: `released_as_it_ends`)."""
    took = hold_stop_signals()
    try:
        yield
    except FinetuneError as exc:
        exc.alike_on_every_rank = True  # main(): a rank other than 0 waits for rank 0's paragraph before it exits
        raise
    if took:
        release_stop_signals()


@contextmanager
def released_as_it_ends() -> Iterator[None]:
    """The handlers put back however the body ends (finetune.run.run, which a notebook or a sweep script calls): a run
    that failed a check left SIGINT and SIGTERM held, so Ctrl-C and a scheduler's SIGTERM were ignored for the rest of
    the process, and the Ctrl-C swallowed came back as a KeyboardInterrupt out of the next run that succeeded (bb39).
    main() puts them back itself, once its paragraph is printed (a rank other than 0 waits for rank 0's first)."""
    try:
        yield
    finally:
        release_stop_signals()


def release_stop_signals() -> None:
    """Put the handlers back once the paragraph is printed; a signal that came meanwhile is acted on now (the
    launcher's SIGTERM ends the process, as it would have). Only the main thread holds them, and puts them back."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in _HELD.items():
        signal.signal(signum, handler)
    _HELD.clear()
    if _HELD_RECEIVED:
        signal.raise_signal(_HELD_RECEIVED.pop(0))


def parent_death_signal():
    """A function for a child process, between fork and exec: it is sent SIGTERM when this process ends, however it
    ends (prctl PR_SET_PDEATHSIG, Linux). libc is looked up here, before the fork: the child only calls it."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)
