"""finetune called in a process that goes on (a notebook, a sweep script): finetune.run.run / .main and
finetune.cli.command.main. A second call behaves as a fresh process would, and a call leaves the process as it found
it: the random generators, SIGINT/SIGTERM's handlers, the hub's offline switches, --verbose and the progress bars
(bug bash 39)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import sys

import numpy as np
import pytest
import torch
from conftest import addition_rows, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe

SCORE = "def score(prompts, completions, **kwargs):\n    return [{sign}float(len(c)) for c in completions]\n"
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", train={
        "max_steps": 1, "gradient_checkpointing": False}, data={"max_length": 32}))


def _adapter_digest(run_dir) -> str:
    return hashlib.sha256((run_dir / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_a_reward_module_is_imported_afresh_after_a_chdir_or_an_edit(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: `my_rewards:score` was imported once per process. After os.chdir to a folder with another
    my_rewards.py, or after the file was edited in place, the next run scored with the old function (the opposite
    objective, silently), and every folder run from piled up on sys.path. Now each import finds what a fresh process
    would: another file, or the same file changed (here within the same second, of the same size), is imported afresh
    with a note; the same file unchanged is kept; finetune's own modules are left as they are."""
    from finetune.recipe.grpo import import_reward_function

    name = "bb39_in_process_rewards"
    for folder, sign in (("a", "+"), ("b", "-"), ("empty", None)):
        (tmp_path / folder).mkdir()
        if sign:
            (tmp_path / folder / f"{name}.py").write_text(SCORE.format(sign=sign))
    # as under the `finetune` console script: the working folder is not on sys.path (finetune appends it)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    call = {"prompts": ["p"], "completions": ["abc"]}
    try:
        monkeypatch.chdir(tmp_path / "a")
        assert import_reward_function(f"{name}:score")(**call) == [3.0]
        monkeypatch.chdir(tmp_path / "b")
        assert import_reward_function(f"{name}:score")(**call) == [-3.0]
        assert f"reloaded {name} from {tmp_path / 'b' / name}.py (the {name} imported before was " in capsys.readouterr().err
        assert str(tmp_path / "b") in sys.path and str(tmp_path / "a") not in sys.path  # one working folder: this one
        kept = import_reward_function(f"{name}:score")
        assert import_reward_function(f"{name}:score") is kept and "reloaded" not in capsys.readouterr().err
        (tmp_path / "b" / f"{name}.py").write_text(SCORE.format(sign="+"))  # a notebook's %%writefile
        assert import_reward_function(f"{name}:score")(**call) == [3.0]
        assert f"({name}.py changed since it was imported)" in capsys.readouterr().err
        monkeypatch.chdir(tmp_path / "empty")  # a fresh process finds no such module here
        with pytest.raises(ValueError, match=f"`{name}:score` cannot be imported"):
            import_reward_function(f"{name}:score")
    finally:
        sys.modules.pop(name, None)
    import finetune.rewards

    assert import_reward_function("finetune.rewards:exact_match") is finetune.rewards.exact_match


def test_a_run_gives_the_callers_random_generators_back(recipe, tmp_path):
    """Found by a bug bash: each run reseeded Python's, NumPy's and torch's global generators to train.seed and left
    them there, so a notebook's random search drew the same "random" hyperparameters on every trial after the first.
    Now run() and main() give them back as they were (torch's queued CUDA seed too); the runs train alike."""
    from finetune.run import main, run

    _seed(7)
    _draws()
    expected = [_draws() for _ in range(2)]
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    _seed(7)
    queued = dict(vars(tracker)) if tracker is not None else None
    _draws()
    run(str(recipe), [f"output.dir={tmp_path / 'a'}"])
    assert _draws() == expected[0]
    assert main([str(recipe), f"output.dir={tmp_path / 'b'}"]) == 0
    assert _draws() == expected[1]
    if tracker is not None and not torch.cuda.is_initialized():
        assert vars(tracker) == queued  # a CUDA initialized later starts from the caller's seed, not train.seed
    assert _adapter_digest(tmp_path / "a") == _adapter_digest(tmp_path / "b")


def test_a_run_that_fails_a_check_gives_back_ctrl_c_and_sigterm(recipe):
    """Found by a bug bash: run() that failed a recipe check left SIGINT and SIGTERM held (main() puts them back after
    printing the paragraph; run() never did): Ctrl-C was ignored in the notebook, a scheduler's SIGTERM did not stop
    the process, and the swallowed Ctrl-C came back as a KeyboardInterrupt out of the next run that succeeded."""
    from finetune import held_signals
    from finetune.errors import FinetuneError
    from finetune.run import run

    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    try:
        for _ in range(2):
            with pytest.raises(FinetuneError, match="train.learning_rate"):
                run(str(recipe), ["train.learning_rate=abc"])
            assert {signum: signal.getsignal(signum) for signum in SIGNALS} == before
    finally:
        held_signals.release_stop_signals()  # (before the fix: held for the rest of the session)
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_an_unreachable_hub_is_asked_again_and_the_offline_switches_are_put_back(recipe, monkeypatch):
    """Found by a bug bash: one run while the hub did not answer put the process offline for good: the answer was
    cached for the process's life (later runs said "the hub is not reachable" when it was), and HF_HUB_OFFLINE,
    HF_DATASETS_OFFLINE and huggingface_hub's constant stayed set, so the notebook's own hub calls were offline too."""
    from huggingface_hub import constants

    from finetune import hub
    from finetune.errors import FinetuneError
    from finetune.run import run

    switches = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", hub.UNREACHABLE_MARK)
    for name in switches:
        monkeypatch.delenv(name, raising=False)
    port = free_port()  # nothing listens there: the hub "does not answer"
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    if "datasets.config" in sys.modules:
        for attribute in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            monkeypatch.setattr(sys.modules["datasets.config"], attribute, False)
    with pytest.raises(FinetuneError, match="the hub is not reachable from this machine"):
        run(str(recipe), ["model.name_or_path=someorg/somemodel"])
    assert {name: os.environ.get(name) for name in switches} == dict.fromkeys(switches)
    assert constants.HF_HUB_OFFLINE is False
    with socket.create_server(("127.0.0.1", port)):  # the hub is back
        assert hub.hub_reachable()


def test_a_cli_call_leaves_verbose_and_the_progress_bars_as_it_found_them(recipe, monkeypatch):
    """Found by a bug bash: the first call hid the progress bars of the user's own downloads for the rest of the process
    (HF_HUB_DISABLE_PROGRESS_BARS set, transformers' bars off), and one `--verbose` call set FINETUNE_VERBOSE for
    good, making every later call verbose. Now each call puts them back as it ends."""
    import huggingface_hub.utils.tqdm  # noqa: F401  (the module, read below from sys.modules)
    from huggingface_hub import constants
    from transformers.utils import logging as transformers_logging

    from finetune import quiet
    from finetune.cli.command import main

    hub_tqdm = sys.modules["huggingface_hub.utils.tqdm"]  # (huggingface_hub.utils.tqdm is its tqdm class)
    for name in ("FINETUNE_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    for module in (constants, hub_tqdm):  # as imported without the variable: the bars on
        monkeypatch.setattr(module, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setattr(hub_tqdm, "progress_bar_states", {})
    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)
    assert main(["validate", str(recipe)]) == 0
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    assert transformers_logging.is_progress_bar_enabled() and not hub_tqdm.are_progress_bars_disabled()
    assert main(["validate", str(recipe), "--verbose"]) == 0
    assert "FINETUNE_VERBOSE" not in os.environ and not quiet.verbose()


def test_a_line_said_while_another_threads_run_builds_its_progress_bar_is_printed(capsys):
    """Found by a bug bash (two runs started at once from threads): a run's line died of "AttributeError:
    'tqdm_asyncio' object has no attribute 'disable'" (1 time in 22) when the other run's progress bar was between
    tqdm's __new__ (which lists it) and its __init__ (which sets `disable`). Such a bar is not drawn: a plain print."""
    from tqdm.auto import tqdm

    from finetune import distributed

    bar = tqdm.__new__(tqdm)  # listed in tqdm._instances, no attribute set yet
    try:
        distributed.print0("[finetune] a line")
    finally:
        bar.disable = True  # (what its close() reads)
        tqdm._instances.discard(bar)
    assert capsys.readouterr().out == "[finetune] a line\n"


THREADS = """
import sys
from concurrent.futures import ThreadPoolExecutor

import finetune.run

recipe, out = sys.argv[1], sys.argv[2]
with ThreadPoolExecutor(2) as pool:
    codes = list(pool.map(lambda name: finetune.run.main([recipe, f"output.dir={out}/{name}"]), "ab"))
print("CODES", codes)
"""


@pytest.mark.slow
def test_two_runs_started_at_once_from_threads_in_a_fresh_process_both_train(recipe, tmp_path):
    """Found by a bug bash: two runs started at once from a ThreadPoolExecutor in a fresh process: one died of
    "ImportError: cannot import name 'AutoConfig' from 'transformers'" (its lazy module raced, 3 of 3 times). Now the
    libraries are imported once, one thread at a time, before a run uses them. (A fresh process: cold imports.)"""
    result = run_cmd([sys.executable, "-c", THREADS, str(recipe), str(tmp_path / "runs")], cwd=tmp_path, warm=False)
    assert "CODES [0, 0]" in result.stdout, result.stderr[-3000:]
