"""The stop signals of the training loop (finetune/training/stopping.py: StopSignals), in-process: the handler is called
as the OS would call it."""

from __future__ import annotations

import signal

import pytest

from finetune.training import stopping


def test_one_ctrl_c_delivered_twice_is_one_and_a_second_one_interrupts(monkeypatch, capsys):
    """A Ctrl-C reaches a rank twice when both the rank and its launcher get it (the process group's copy, then the
    launcher's forward; a scheduler signalling the job step): the second copy was taken for an impatient second
    Ctrl-C, every rank raised KeyboardInterrupt with a traceback, and the step's checkpoint was never written."""
    now = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    signals = stopping.StopSignals()
    signals._handle(signal.SIGINT, None)
    now[0] += 0.2  # the launcher's copy
    signals._handle(signal.SIGINT, None)
    assert signals.received == signal.SIGINT
    assert capsys.readouterr().out.count("SIGINT received: finishing this step, then checkpointing") == 1
    now[0] += stopping.ONE_ACTION_S  # a real second Ctrl-C: interrupt now
    with pytest.raises(KeyboardInterrupt):
        signals._handle(signal.SIGINT, None)


def test_a_postponed_stop_says_why_once(capsys):
    """GRPO's num_iterations cycle: the stop waits for the cycle's end, saying so once, not at every step it waits."""
    signals = stopping.StopSignals()
    assert signals.postpone("[finetune] finishing the cycle first") is False
    assert signals.postpone("[finetune] finishing the cycle first") is False
    assert capsys.readouterr().out.count("finishing the cycle first") == 1


def test_a_step_longer_than_the_launchers_grace_is_warned_once_with_the_setting(monkeypatch, capsys):
    """torch elastic SIGKILLs the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default) after it passes a SIGTERM on:
    with steps of 45 s the "finishing this step, then checkpointing" line was followed by the SIGKILL, no checkpoint
    and no word. Now a step over half the grace is warned about once, naming the variable and a value; the SIGTERM line
    says how long the launcher waits. Not under a launcher: nothing."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    plain = stopping.StopSignals()
    plain.timed(5, 1, 1000.0)
    assert plain.grace_s is None and capsys.readouterr() == ("", "")

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "20")
    signals = stopping.StopSignals()
    signals.timed(1, 1, 45.0)  # this launch's first step (compilation, caches): not judged
    signals.timed(2, 1, 9.0)  # within half the grace
    assert capsys.readouterr() == ("", "")
    signals.timed(3, 1, 15.0)
    signals.timed(4, 1, 15.0)
    err = capsys.readouterr().err
    assert err.count("warning: a step takes 15 s") == 1 and "gives the ranks 20 s" in err, err
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=75" in err and "KillWait" in err, err
    signals._handle(signal.SIGTERM, None)
    assert "SIGKILLs the ranks 20 s after" in capsys.readouterr().out

    monkeypatch.setattr(stopping, "_grace_is_settable", lambda: False)  # torch 2.11: a fixed 30 s (simulated here)
    old = stopping.StopSignals()
    old.timed(3, 1, 16.0)
    err = capsys.readouterr().err
    assert old.grace_s == 30 and "waits a fixed 30 s (torch >= 2.12 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT)" in err, err


def test_a_closed_terminal_checkpoints_like_a_sigterm(capsys):
    """torch elastic passes the SIGHUP of a closed terminal on to the ranks as SIGHUP, whose default killed every rank
    at once, with no checkpoint and no word. The loop now takes it as it takes SIGTERM. (SIGHUP's default set first:
    CI's workers may run with it ignored, which the loop leaves alone: the test below.)"""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with stopping.StopSignals() as signals:
            assert signal.getsignal(signal.SIGHUP) == signals._handle
            signal.raise_signal(signal.SIGHUP)
        assert signals.received == signal.SIGHUP and "SIGHUP received: finishing this step" in capsys.readouterr().out
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_nohup_keeps_sighup_ignored_through_the_loop_and_finetune_train():
    """A review found the SIGHUP handling above undid `nohup`: a job started with `nohup ... &` stopped at logout. An
    ignored SIGHUP stays ignored, in the loop and in `finetune train`'s forwarding; and `finetune train` driven from
    a worker thread (a notebook, a sweep harness) launches without touching signals (ValueError before)."""
    import sys
    import threading

    from finetune.cli.train import _launch

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stopping.StopSignals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        codes = []
        worker = threading.Thread(target=lambda: codes.append(_launch([sys.executable, "-c", "pass"])))
        worker.start()
        worker.join(60)
        assert codes == [0] and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


LAUNCHER_AS_PID_1 = """
import os, signal, sys
from finetune import distributed
pids = iter([int(value) for value in sys.argv[1:]])
os.getppid = lambda: next(pids)
os.environ["TORCHELASTIC_RUN_ID"] = "none"
signal.signal(signal.SIGTERM, lambda number, frame: (print("SIGTERM", flush=True), sys.exit(0)))
distributed.end_with_the_launcher()
print("went on", flush=True)
"""


@pytest.mark.slow  # two Python processes importing torch
def test_a_launcher_that_is_pid_1_is_not_taken_for_a_dead_one():
    """A review found every rank killing itself at start where the launcher is pid 1 (a container whose command is
    `torchrun ...`): "parent is 1" was taken for "the launcher died". Now only a parent that changed between the read
    and prctl is. (os.getppid replaced in a child process: a pid namespace needs privileges CI may lack.)"""
    import subprocess
    import sys

    alive = subprocess.run([sys.executable, "-c", LAUNCHER_AS_PID_1, "1", "1"], capture_output=True, text=True,
                           timeout=120, check=False)
    assert alive.stdout.strip() == "went on", alive.stdout + alive.stderr
    died = subprocess.run([sys.executable, "-c", LAUNCHER_AS_PID_1, "4242", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert died.stdout.strip() == "SIGTERM", died.stdout + died.stderr
