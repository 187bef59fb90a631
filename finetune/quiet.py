"""Library noise a user can do nothing about, kept out of a run's output unless asked (--verbose, FINETUNE_VERBOSE=1),
and library start-up work a run does not need (`keep_deepspeed_out`, `defer_bitsandbytes_compiles`).

What is filtered, each by its exact message, so that a new warning of the same libraries still shows:
  * bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional CPU kernel package; the
    built-in kernel is used instead), logged once per process at import;
  * transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised by PEFT's own attribute check;
  * FSDP1's torch warnings: the FutureWarnings "FSDP.state_dict_type() ... are being deprecated" and "...deprecating
    ShardedTensor" (every checkpoint save and load goes through those APIs, which FSDP1 still needs), and the
    UserWarnings of a one-process FSDP1 run, which torch runs as NO_SHARD ("FSDP is switching to use `NO_SHARD`",
    "When using ``NO_SHARD`` ... full_state_dict will be returned": the same training and files, nothing to fix);
  * kernels' "Skipping publisher trust check ... offline mode" (bitsandbytes' optional kernel lookup, HF_HUB_OFFLINE);
  * DeepSpeed's "Setting accelerator to CPU" (said by every process of a CPU DeepSpeed run);
  * torchrun's OMP_NUM_THREADS banner (said by the launcher of a DeepSpeed config: the threads are the launcher's);
  * the progress bars of transformers' weight loading and saving (finetune prints its own model line);
  * two transformers warnings about configs as the hub publishes them, said when finetune builds or reads the config
    (validate, plan, train): Llama 4 Scout's llama3 rope has equal low and high frequency factors (the model's own
    values: "high_freq_factor field must be greater than low_freq_factor"), and gpt-oss's config.json states no
    dtype, so the planner's fallback from `config.dtype` to the older name `config.torch_dtype` (planner/facts.py)
    reads transformers' deprecated alias ("`torch_dtype` is deprecated! Use `dtype` instead!");
  * PEFT's UserWarning "Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`", said
    by every run and export with LoRA on `embed_tokens` or `lm_head`. It says PEFT's own save would add the layers'
    base weights; finetune never saves through it: a run asks PEFT only for the names of its trainable tensors
    (outputs/adapter_files.py), so its adapter holds the LoRA tensors and no embedding weight, and export asks only
    for the keys such an adapter may hold (outputs/export.py). The warning described a save that does not happen.
  * matplotlib's lines when its config or cache folder cannot be written (a read-only HOME or XDG_CACHE_HOME: "mkdir
    -p failed for path ...", "... is not a writable directory", "Matplotlib created a temporary cache directory at
    ..."), logged when the end of a run (or `finetune plot`) imports it: it draws in the temporary folder instead and
    the plot is written all the same.
And DeepSpeed stays out of processes that do not use it (`keep_deepspeed_out`). Two things of a process's start that
scripts meet: a reader of stdout that stops early (`| head`, `| grep -q`) is left to go (`drop_output_nobody_reads`),
and a Ctrl-C while the libraries import is acted on once they have (`ctrl_c_after_imports`). And a call of finetune
from a process that goes on (a notebook, a sweep script) leaves it as it found it (`left_as_found`), and runs started
at once from threads import the libraries one at a time (`import_run_libraries`).
"""

from __future__ import annotations

import functools
import importlib.abc
import io
import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

VERBOSE_ENV = "FINETUNE_VERBOSE"
_LOGGED = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "DeepSpeed": "Setting accelerator to CPU",
    "kernels._internals.hf_hub": "Skipping publisher trust check",
    # torchrun's banner in the launcher (accelerate's DeepSpeed path starts torchrun without OMP_NUM_THREADS set)
    "torch.distributed.run": "\n*****************************************\nSetting OMP_NUM_THREADS",
    "transformers.modeling_rope_utils": "`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor",
    "transformers.configuration_utils": "`torch_dtype` is deprecated! Use `dtype` instead!",
}
# Logged messages matched as a whole (a regular expression), where the variable part comes first: matplotlib's.
_LOGGED_MATCHING = {
    "matplotlib": r"mkdir -p failed for path |.* is not a writable directory$|Matplotlib created a temporary cache "
                  r"directory at ",
}
_WARNINGS = (  # (category, start of the message as a regular expression)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    (UserWarning, r"FSDP is switching to use `NO_SHARD`"),
    (UserWarning, r"When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned"),
    (UserWarning, r"Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`"),
    # PEFT's own conversion of per-expert LoRA to the fused experts, when finetune builds a PeftModel to check a MoE
    # adapter: the ranks are applied (outputs/export_experts.py); it ended every MoE run and export, said as ignored
    (RuntimeWarning, r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored"),
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


class _DropMessage(logging.Filter):
    def __init__(self, start: str, *, pattern: str | None = None):
        super().__init__()
        self.start = start
        self.pattern = re.compile(pattern, re.DOTALL) if pattern else None

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not (self.pattern.match(message) if self.pattern else message.startswith(self.start))


def install() -> None:
    """Filter the noise above in this process (and, through the environment, in the processes it launches); and lines
    written to a stdout or stderr whose reader has gone are dropped (`drop_output_nobody_reads`), in every process that
    installs this: the `finetune` command and each rank of a run."""
    drop_output_nobody_reads()
    if verbose():
        return
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    filters = [(name, _DropMessage(start)) for name, start in _LOGGED.items()]
    filters += [(name, _DropMessage("", pattern=pattern)) for name, pattern in _LOGGED_MATCHING.items()]
    for name, drop in filters:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(drop)
    # Read by huggingface_hub and transformers at import. In a process that goes on, put back after the call with the
    # progress bars (`output_settings`): the user's own downloads show theirs.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def keep_deepspeed_out() -> None:
    """A process that does not use DeepSpeed never imports it (150-200 MB of RSS and seconds of start-up).

    accelerate's `extract_model_from_parallel`, which transformers' `save_pretrained` calls on every save, imports
    `deepspeed` whenever it is installed, only to check `isinstance(model, DeepSpeedEngine)`. No model of such a
    process is a DeepSpeed engine, so that module's availability check is answered "no" for this process only.
    """
    if "deepspeed" in sys.modules:
        return
    try:
        import accelerate.utils.other as accelerate_other
    except ImportError:
        return
    accelerate_other.is_deepspeed_available = lambda: False


# The one bitsandbytes module that calls torch.compile at import (bitsandbytes 0.50: its CPU fallback kernels).
_COMPILES_AT_IMPORT = "bitsandbytes.backends.default.ops"


def defer_bitsandbytes_compiles() -> None:
    """bitsandbytes' fallback kernels are wrapped in torch.compile when it is imported; defer each call to the kernel's
    first use, so that a process which never calls them never loads torch's compiler.

    torch.compile compiles lazily anyway, at the first call; but the call itself imports torch._inductor's compiler
    (compile_fx, lowering: 0.9-1.5 s of CPU per process, measured here), and every rank of every run imports
    bitsandbytes (PEFT and transformers do). A kernel that is used is compiled at its first call, as before, and a
    compile that fails there falls back to the plain function by bitsandbytes' own wrapper, as before. Safe to call
    more than once; a no-op once bitsandbytes is imported.
    """
    if _COMPILES_AT_IMPORT in sys.modules or any(isinstance(f, _CompileOnFirstCall) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CompileOnFirstCall())


def compile_on_first_call(compile_):
    """`torch.compile`'s signature, but the real call happens at the compiled function's first call."""

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


class _CompileOnFirstCall(importlib.abc.MetaPathFinder):
    """Finds _COMPILES_AT_IMPORT through the other finders and runs its module with torch.compile deferred."""

    def find_spec(self, name, path, target=None):
        if name != _COMPILES_AT_IMPORT:
            return None
        sys.meta_path.remove(self)  # one module, once
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source (tracebacks), get_code, ... as the real loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import torch

        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real


# ------------------------------------------------------------------------------------ a reader that stops early
class _UnreadFile(io.FileIO):
    """A standard stream's file descriptor (1, 2) whose reader may go away: the write that finds the pipe closed points
    the descriptor at os.devnull, so that write and every later one are dropped (Python's own advice, the "Note on
    SIGPIPE" of its signal module) instead of raising BrokenPipeError."""

    def write(self, data) -> int:
        try:
            return super().write(data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fileno())  # (the launched processes that share the pipe find it closed themselves)
            os.close(devnull)
            return memoryview(data).nbytes


def drop_output_nobody_reads() -> None:
    """The process's stdout and stderr, as they are (encoding, errors, buffering), over `_UnreadFile`: once their reader
    has stopped (`finetune recipes list | grep -q NAME`, `finetune --version | head -1`, `finetune train r.yaml |
    head -2`), what is still written there is dropped. Every verb died with a BrokenPipeError traceback and exit 1
    (under `set -o pipefail` the grep that found its match failed the script), and a run stopped at its next log line
    (bb29). A stream that is not the process's own (a test's capture, a wrapper) is left as it is."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not getattr(sys, f"__{name}__") or type(stream) is not io.TextIOWrapper:
            continue
        try:
            descriptor = stream.fileno()
        except (OSError, ValueError):  # closed, or no descriptor
            continue
        stream.flush()
        raw = _UnreadFile(descriptor, "wb", closefd=False)
        buffered = isinstance(stream.buffer, io.BufferedWriter)  # not under `python -u` (PYTHONUNBUFFERED): as it was
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw) if buffered else raw, encoding=stream.encoding,
                                            errors=stream.errors, line_buffering=stream.line_buffering,
                                            write_through=stream.write_through))


# ---------------------------------------------------------------------------------- a Ctrl-C while libraries import
@contextmanager
def ctrl_c_after_imports() -> Iterator[None]:
    """SIGINT held (signal.pthread_sigmask) over the libraries' imports, and acted on as they end: a Ctrl-C that came
    meanwhile raises KeyboardInterrupt there, in place of anything the imports raised.

    torch imports numpy from its C module and swallows a KeyboardInterrupt raised meanwhile, leaving numpy half
    imported: then accelerate's `np.dtypes` recursed until a RecursionError traceback, the verb's own import failed
    ("not available in this build"), or the command ran to its end as if no Ctrl-C had come (bb29, 0.5-1 s after the
    start). Held, the signal waits for the imports to end whole; `finetune: interrupted` and 130 follow."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        # Unblocked, a pending SIGINT runs its handler here (pthread_sigmask checks for signals before it returns):
        # Python's raises KeyboardInterrupt, which replaces an ImportError the half-imported library caused.
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def import_libraries(*, deepspeed_out: bool) -> None:
    """torch imported whole (Ctrl-C held over it: `ctrl_c_after_imports`), and DeepSpeed kept out when the process will
    not use it (`keep_deepspeed_out`, which imports accelerate)."""
    with ctrl_c_after_imports():
        try:
            import torch  # noqa: F401
        except ImportError:  # the verb that needs it says so
            pass
        if deepspeed_out:
            keep_deepspeed_out()


def printable_streams() -> None:
    """stdout and stderr write a character their encoding cannot hold as an escape (`\\u4f60`) instead of raising:
    under a locale that is not UTF-8 (LC_ALL=C with PYTHONUTF8=0, ISO-8859-x) or PYTHONIOENCODING=ascii, printing a
    CJK row (`finetune data`), a template's token (`<｜end▁of▁sentence｜>`) or a path was a UnicodeEncodeError
    traceback, in a training run before its first step. A UTF-8 stream holds every character: left as it is (so is a
    stream that says it seeks and cannot, a test server's, whose reconfigure raised "Illegal seek")."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):  # (a wrapper without it: left as it is)
            try:
                stream.reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass


# ------------------------------------------------------------------------ a call in a process that goes on
_KEPT_LOCK = threading.Lock()
_KEPT: dict[Callable, list] = {}  # a snapshot -> [its calls under way, the function that puts back what it took]


@contextmanager
def left_as_found(*snapshots: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """A call of finetune from a process that goes on (a notebook, a sweep script: finetune.run.run and .main,
    finetune.cli.command.main) leaves what each of `snapshots` takes as it found it, however the call ends: a run left
    the hub offline, the progress bars off, --verbose on and the random generators at train.seed for the rest of the
    process (bb39). A snapshot takes the state and returns the function that puts it back. Calls inside calls (the
    CLI's `train` runs finetune.run.main) and calls side by side in threads: the first to start takes, the last to
    end puts back."""
    taken = []
    try:
        with _KEPT_LOCK:
            for take in snapshots:
                entry = _KEPT.setdefault(take, [0, None])
                if entry[0] == 0:
                    entry[1] = take()
                entry[0] += 1
                taken.append(take)
        yield
    finally:
        with _KEPT_LOCK, ExitStack() as putting_back:  # each put back, even when one raises; the last taken first
            for take in taken:
                entry = _KEPT[take]
                entry[0] -= 1
                if entry[0] == 0:
                    putting_back.callback(_KEPT.pop(take)[1])


def settings_kept(variables: tuple[str, ...], attributes: tuple[tuple[str, str, Callable[[], Any]], ...]):
    """A snapshot for `left_as_found`: environment `variables` and library settings (module, attribute, fresh) as they
    are now; returns the function that puts them back. A module imported meanwhile gets `fresh()`, what it reads from
    the environment put back when it is imported (huggingface_hub reads HF_HUB_OFFLINE then, once)."""
    environment = {name: os.environ.get(name) for name in variables}
    found = {}
    for module_name, attribute, _ in attributes:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attribute):
            value = getattr(module, attribute)
            found[module_name, attribute] = dict(value) if isinstance(value, dict) else value

    def put_back() -> None:
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for module_name, attribute, fresh in attributes:  # in order: a fresh value may read one put back before it
            module = sys.modules.get(module_name)
            if module is None or not hasattr(module, attribute):
                continue
            value = found[module_name, attribute] if (module_name, attribute) in found else fresh()
            current = getattr(module, attribute)
            if isinstance(current, dict) and isinstance(value, dict):  # the same dict: another module may hold it
                current.clear()
                current.update(value)
            else:
                setattr(module, attribute, value)

    return put_back


def environment_flag(name: str) -> bool | None:
    """A variable as huggingface_hub reads a flag at import: None when unset."""
    value = os.environ.get(name)
    return None if value is None else value.upper() in ("1", "ON", "YES", "TRUE")


def _hub_progress_bars_enabled() -> bool:
    return not sys.modules["huggingface_hub.utils"].are_progress_bars_disabled()


# The progress bars' switches, which HF_HUB_DISABLE_PROGRESS_BARS sets when the libraries are imported (in this order:
# transformers' reads huggingface_hub's).
_PROGRESS_BARS = (
    ("huggingface_hub.constants", "HF_HUB_DISABLE_PROGRESS_BARS", lambda: environment_flag("HF_HUB_DISABLE_PROGRESS_BARS")),
    ("huggingface_hub.utils.tqdm", "HF_HUB_DISABLE_PROGRESS_BARS", lambda: environment_flag("HF_HUB_DISABLE_PROGRESS_BARS")),
    ("huggingface_hub.utils.tqdm", "progress_bar_states", dict),
    ("transformers.utils.logging", "_tqdm_active", _hub_progress_bars_enabled),
)


def output_settings() -> Callable[[], None]:
    """A snapshot for `left_as_found`: what `install` and --verbose set for the whole process (FINETUNE_VERBOSE,
    HF_HUB_DISABLE_PROGRESS_BARS and the progress bars of huggingface_hub and transformers)."""
    return settings_kept((VERBOSE_ENV, "HF_HUB_DISABLE_PROGRESS_BARS"), _PROGRESS_BARS)


_IMPORT_LOCK = threading.RLock()
# What a run resolves of transformers, whose lazy module imports each name on its first use.
_TRANSFORMERS_NAMES = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                       "PreTrainedTokenizerFast", "GenerationConfig", "StopStringCriteria", "BitsAndBytesConfig",
                       "CONFIG_MAPPING", "MODEL_FOR_CAUSAL_LM_MAPPING")
_RUN_LIBRARIES_IMPORTED: list[bool] = []


@contextmanager
def one_thread_importing() -> Iterator[None]:
    """Libraries imported by one thread at a time: two runs started at once from threads (a ThreadPoolExecutor sweep)
    in a fresh process raced in transformers' lazy module, and one died of "cannot import name 'AutoConfig' from
    'transformers'" (bb39)."""
    with _IMPORT_LOCK:
        yield


def import_run_libraries() -> None:
    """torch and transformers imported whole, and the names of transformers a run uses resolved, once per process and
    one thread at a time (`one_thread_importing`); at once after the first call. (A run imports PEFT and bitsandbytes
    later, the same way: model.import_backends.)"""
    with one_thread_importing():
        if _RUN_LIBRARIES_IMPORTED:
            return
        with ctrl_c_after_imports():
            try:
                import torch  # noqa: F401
                import transformers
            except ImportError:  # the run's own import says what is missing, where it needs it
                return
            for name in _TRANSFORMERS_NAMES:
                getattr(transformers, name, None)
        _RUN_LIBRARIES_IMPORTED.append(True)
