"""User-facing errors.

Anything the user can fix (a recipe, a data file, a launcher setting, a folder) raises a subclass of
`FinetuneError`. The entry points (`run.py`, `finetune` CLI) print its message as one paragraph and exit
with code 2, without a traceback. Programming errors stay ordinary exceptions with tracebacks. A message that says how
to launch a run words it with the helpers below (`run_script`, `accelerate_launch_line`, `train_launch_fix`), in the
form that works from where it runs: a checkout's finetune/run.py, or the installed module.
"""

from __future__ import annotations

import os

EXIT_USER_ERROR = 2
# Where a launched rank writes its exit code for `finetune train` (accelerate's launcher exits 1 whatever a rank's).
EXIT_CODE_FILE = "FINETUNE_EXIT_CODE_FILE"


class FinetuneError(Exception):
    """A problem in the user's input; the message names the culprit and the fix."""


class RecipeError(FinetuneError):
    """The recipe (file, key or override) is invalid."""


class DataError(FinetuneError):
    """A data file, row or column is invalid."""


class LaunchError(FinetuneError):
    """The launcher, process group or parallel strategy is inconsistent."""


class CheckpointError(FinetuneError):
    """A checkpoint or output folder cannot be used as asked."""


class ModelLoadError(FinetuneError):
    """The model or tokenizer cannot be found or loaded (offline hub, missing folder...)."""


class GenerationError(FinetuneError):
    """The generation server (grpo.generation: vllm) cannot be started, died, stalled or refused a request."""


class RewardError(FinetuneError):
    """A GRPO reward function raised or returned something unusable; the run stops before the step's update."""


# ------------------------------------------------------------------------------------ launch lines in messages
# A fix that says how to launch a run must work from where the user is: a checkout has finetune/run.py, recipes/ and
# accelerate_configs/ beside it; a pip-installed wheel has none of them (its recipes and configs are package data,
# which `finetune train NAME --accelerate-config CONFIG` finds by name, and its run script is the module finetune.run).
def in_checkout() -> bool:
    """Whether the current folder is a checkout of finetune (its finetune/run.py is there, relative to here)."""
    return os.path.isfile(os.path.join("finetune", "run.py"))


def run_script(launcher: str = "accelerate") -> str:
    """finetune's run script as `launcher` (accelerate, torchrun or deepspeed) takes it from here: finetune/run.py in a
    checkout, else the installed module (`-m finetune.run`; DeepSpeed's launcher spells it `--module finetune.run`)."""
    if in_checkout():
        return "finetune/run.py"
    return "--module finetune.run" if launcher == "deepspeed" else "-m finetune.run"


def accelerate_launch_line(config: str, recipe: str = "RECIPE.yaml", *, processes: int | str | None = None) -> str:
    """The launch of `recipe` under the library accelerate config `config` (a name: fsdp2, ddp, ...): `accelerate launch`
    with the checkout's file in a checkout, else `finetune train` with the config by name (what it runs)."""
    if in_checkout():
        count = f" --num_processes {processes}" if processes is not None else ""
        return f"accelerate launch --config_file accelerate_configs/{config}.yaml{count} finetune/run.py {recipe}"
    count = f" --num-processes {processes}" if processes is not None else ""
    return f"finetune train {recipe} --accelerate-config {config}{count}"


def torchrun_line(recipe: str = "RECIPE.yaml", processes: int | str = "N") -> str:
    return f"torchrun --standalone --nproc_per_node {processes} {run_script('torchrun')} {recipe}"


def train_launch_fix(config: str, recipe: str = "RECIPE.yaml", processes: int | str = "N") -> str:
    """A fix that starts `recipe` as `processes` processes under the library config `config`: `finetune train` (a
    checkout or a wheel alike), or the launchers themselves from here (accelerate's from a checkout, torchrun)."""
    others = [accelerate_launch_line(config, recipe, processes=processes)] if in_checkout() else []
    others.append(torchrun_line(recipe, processes))
    return (f"`finetune train {recipe} --accelerate-config {config} --num-processes {processes}` (or "
            + ", ".join(f"`{line}`" for line in others) + ")")


# ------------------------------------------------------------------ refusals the recipe schema words itself
DATA_PARALLEL_NAMES = ("dp", "data_parallel", "data-parallel", "dataparallel")


def data_parallel_refusal(source: str, asked: str = "dp") -> str:
    """Why `parallel.strategy: dp` (torch.nn.DataParallel) is refused, and the DDP command that replaces it."""
    recipe = source if source.endswith((".yaml", ".yml")) else "RECIPE.yaml"
    gpus = _visible_gpu_count()
    count = str(gpus) if gpus > 1 else "N"
    where = "" if gpus > 1 else " (N = the number of GPUs of this machine)"
    return (
        f"`{asked}` (torch.nn.DataParallel) is not supported: one Python process drives every GPU, so the GIL serializes "
        "their work; each step scatters the batch from GPU 0 and gathers outputs and gradients back onto it (GPU 0 runs "
        "out of memory first); the model, 4-bit base included, is replicated to every GPU again on every step; and it "
        "cannot span machines. DDP does the same job with one process per GPU and none of these costs. Fix: remove "
        "parallel.strategy (or set it to ddp) and run "
        f"`{accelerate_launch_line('ddp', recipe, processes=count)}`"
        f"{where}."
    )


def _visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# ------------------------------------------------------------------------------------------- leaving the process
def exit_process(code: int) -> None:
    """End an entry point (`finetune/run.py`, the `finetune` command) with `code`, skipping the interpreter's teardown.

    Once torch, transformers, PEFT and bitsandbytes (which imports torch's compiler stack) are loaded, Python's module
    teardown alone takes 1.3-2 s of CPU per process (measured: 1.4 s after the imports only, 1.7 s after a tiny run), and
    every rank of every run pays it after its work is done. What that teardown would still do is done here: the
    threads a library left running are joined, the exit hooks run (trackers, loggers), the output is flushed; then
    the process ends. Only the normal way out uses this: an unexpected exception keeps Python's own exit (traceback).
    """
    import atexit
    import os
    import sys
    import threading

    # As the interpreter does at exit: the threading exit hooks first (they tell executors' idle workers to stop; a
    # plain join of a ThreadPoolExecutor's worker waits forever, as a rank of a 2-rank run did), then the joins.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover (CPython has it in every supported version)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    relay = os.environ.get(EXIT_CODE_FILE)
    if relay and code not in (0, None):  # `finetune train` launched this rank: the launcher itself exits 1 for any code
        try:  # the first rank to end tells: a peer the launcher then stops ends later, with a code of its own (1)
            with open(relay, "x", encoding="utf-8") as handle:  # that overwrote the first one's 2 (a CI rehearsal)
                handle.write(str(code))
        except OSError:  # (FileExistsError: another rank's code is there)
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(code if isinstance(code, int) else 1)
