"""The stop signals of the training loop (finetune/training/loop.py: StopSignals), in-process: the handler is called
as the OS would call it."""

from __future__ import annotations

import signal

import pytest

from finetune.training import loop


def test_one_ctrl_c_delivered_twice_is_one_and_a_second_one_interrupts(monkeypatch, capsys):
    """A Ctrl-C reaches a rank twice when both the rank and its launcher get it (the process group's copy, then the
    launcher's forward; a scheduler signalling the job step): the second copy was taken for an impatient second
    Ctrl-C, every rank raised KeyboardInterrupt with a traceback, and the step's checkpoint was never written."""
    now = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    signals = loop.StopSignals()
    signals._handle(signal.SIGINT, None)
    now[0] += 0.2  # the launcher's copy
    signals._handle(signal.SIGINT, None)
    assert signals.received == signal.SIGINT
    assert capsys.readouterr().out.count("SIGINT received: finishing this step, then checkpointing") == 1
    now[0] += loop.ONE_ACTION_S  # a real second Ctrl-C: interrupt now
    with pytest.raises(KeyboardInterrupt):
        signals._handle(signal.SIGINT, None)


def test_a_postponed_stop_says_why_once(capsys):
    """GRPO's num_iterations cycle: the stop waits for the cycle's end, saying so once, not at every step it waits."""
    signals = loop.StopSignals()
    assert signals.postpone("[finetune] finishing the cycle first") is False
    assert signals.postpone("[finetune] finishing the cycle first") is False
    assert capsys.readouterr().out.count("finishing the cycle first") == 1
