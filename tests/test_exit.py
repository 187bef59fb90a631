"""The entry points' way out (finetune/errors.py exit_process): without the interpreter's module teardown, but with
everything that teardown would still do for the user: threads joined (an executor's idle workers told to stop first),
exit hooks run, output flushed, the exit code kept."""

from __future__ import annotations

import subprocess
import sys

import pytest
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


CTRL_C_IN_IMPORT = r"""
import sys

class CtrlC:  # Ctrl-C arriving while torch imports its submodules (a launch's first seconds), deterministically
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn.modules.conv":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finetune train", "finetune recipes", "run.py rank 0", "run.py rank 1"])
def test_ctrl_c_while_torch_imports_is_one_line_and_130(how, tmp_path):
    """It printed "finetune: interrupted" and then an AttributeError traceback of a half-imported torch (the command's
    cleanup imported finetune.distributed again), a RecursionError (`finetune recipes`), or each rank's KeyboardInterrupt
    traceback (run.py's imports ran before any handler); found in a bug bash with real signals at 1-12 s."""
    from conftest import REPO, RUN_PY

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_IN_IMPORT)
    rank = {"run.py rank 1": "1"}.get(how, "0")
    env = child_env(PYTHONPATH=f"{hook}:{REPO}", RANK=rank)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: m}\ndata: {datasets: [{path: x.jsonl}]}\n")
    command = {"finetune train": [sys.executable, "-m", "finetune", "train", str(recipe)],
               "finetune recipes": [sys.executable, "-m", "finetune", "recipes"]}.get(
        how, [sys.executable, str(RUN_PY), str(recipe)])
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr == ("" if rank == "1" else "finetune: interrupted\n"), result.stderr[-2000:]


def test_the_command_line_imports_no_torch_before_its_handlers():
    """The handlers above are installed by finetune/cli's entry, so everything imported before it runs must not import
    torch: a module-level `from finetune import distributed` in finetune/files.py (whose path helpers the CLI reads)
    brought torch in first, and a Ctrl-C during the launch's first seconds printed a traceback and exited -2 (CI,
    stop 66). The fast tier's guard of the slow case above."""
    probe = "import sys, finetune.cli, finetune.cli.command; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60,
                            env=child_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


CTRL_C_IN_NUMPY = r"""
import os, signal, sys

class CtrlC:  # a real SIGINT, sent while torch's C module imports numpy (a verb's first second), deterministically
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["CTRL_C_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

# Python installs its Ctrl-C handler only where SIGINT is not ignored at the start, and a test process may have it
# ignored (a child inherits that: the signal was lost, exit 0, in a CI run): given the handler a terminal's has.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.meta_path.insert(0, CtrlC())
"""


@pytest.mark.slow
@pytest.mark.parametrize(("verb", "module"), [
    ("recipes", "numpy._core.multiarray"),  # was: the Ctrl-C ignored, the listing printed, exit 0
    ("recipes", "numpy._core._type_aliases"),  # was: a RecursionError traceback (accelerate's np.dtypes), exit 1
    ("plan", "numpy.dtypes"),  # was: "`finetune plan` is not available in this build", exit 2
])
def test_ctrl_c_while_torch_imports_numpy_is_one_line_and_130(verb, module, tmp_path):
    """Found by a bug bash (Ctrl-C 0.5-1.1 s after the start of `finetune export` and `plan`): torch swallows a
    KeyboardInterrupt raised while its C module imports numpy and leaves numpy half imported. What followed was a
    RecursionError traceback, "not available in this build", or the command run to its end. SIGINT is now held over
    the libraries' imports and acted on once they end."""
    from conftest import REPO

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_IN_NUMPY)
    env = child_env(PYTHONPATH=f"{hook}:{REPO}", CTRL_C_AT=module)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: m}\ndata: {datasets: [{path: x.jsonl}]}\n")
    argv = {"recipes": ["recipes", "list"], "plan": ["plan", str(recipe)]}[verb]
    result = subprocess.run([sys.executable, "-m", "finetune", *argv], check=False, capture_output=True, text=True,
                            env=env, timeout=120, cwd=tmp_path)
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr == "finetune: interrupted\n", result.stderr[-2000:]
