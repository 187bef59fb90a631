"""The entry points' way out (finetune/errors.py exit_process): without the interpreter's module teardown, but with
everything that teardown would still do for the user: threads joined (an executor's idle workers told to stop first),
exit hooks run, output flushed, the exit code kept."""

from __future__ import annotations

import subprocess
import sys

from conftest import child_env

LEAVE = r"""
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from finetune.errors import exit_process

pool = ThreadPoolExecutor(2)  # idle workers left behind, as torch.distributed.checkpoint and loaders leave them
pool.submit(print, "the pool ran", flush=True).result()
threading.Thread(target=lambda: (time.sleep(0.5), Path(sys.argv[1]).write_text("written"))).start()
import atexit
atexit.register(lambda: print("the exit hook ran", flush=True))
sys.stdout.write("unflushed output")
exit_process(3)
"""


def test_exit_process_joins_threads_runs_exit_hooks_and_keeps_the_code(tmp_path):
    """A rank of a 2-rank run hung here once: a plain join of a ThreadPoolExecutor's idle worker waits forever."""
    result = subprocess.run([sys.executable, "-c", LEAVE, str(tmp_path / "late.txt")], check=False, capture_output=True,
                            text=True, timeout=60, env=child_env())
    assert result.returncode == 3, result.stdout + result.stderr
    assert (tmp_path / "late.txt").read_text() == "written"  # the non-daemon thread finished its work
    assert "the pool ran" in result.stdout and "the exit hook ran" in result.stdout and "unflushed output" in result.stdout
