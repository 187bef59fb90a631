"""The exit code `finetune train` reports for a launch of several ranks (cli/train._launch reads the file each rank's
exit_process writes): the first rank to end tells. Found by a CI rehearsal: a data error one rank met first exited 2,
the launcher then stopped the other rank, whose own exit (1) overwrote the file, and `finetune train` exited 1.
Subprocesses (exit_process ends its process with os._exit); no torch is imported."""
from __future__ import annotations

import subprocess
import sys

from finetune.errors import EXIT_CODE_FILE


def _exit_with(code: int, relay) -> int:
    return subprocess.run([sys.executable, "-c", f"from finetune.errors import exit_process; exit_process({code})"],
                          env={EXIT_CODE_FILE: str(relay), "PATH": "/usr/bin:/bin"}, check=False,
                          timeout=60).returncode


def test_the_first_rank_to_end_gives_the_code(tmp_path):
    relay = tmp_path / "exit_code"
    assert _exit_with(2, relay) == 2  # the rank that met the user's error
    assert _exit_with(1, relay) == 1  # a peer the launcher stopped afterwards
    assert relay.read_text(encoding="utf-8") == "2"


def test_a_rank_that_ends_well_writes_nothing(tmp_path):
    relay = tmp_path / "exit_code"
    assert _exit_with(0, relay) == 0
    assert not relay.exists()
