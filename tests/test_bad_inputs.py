"""A catalogue of bad inputs: each gives exit code 2, a message naming the culprit, no traceback, and changes no file.

Most cases run in this process through `finetune.cli.main(["train", ...])` (imports paid once); a handful go
through real processes (`python finetune/run.py`, the `finetune` console script, torchrun) to prove the exit code
and the absence of a traceback end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO, RUN_PY, addition_rows, child_env, free_port, recipe_dict, write_jsonl, write_recipe
from processes import sigtermed_during

from finetune import cli, outputs
from finetune.outputs import checkpoint


@dataclass
class Workspace:
    root: Path
    model: Path
    data: Path

    def recipe(self, name: str = "recipe.yaml", **sections) -> Path:
        return write_recipe(self.root / name, recipe_dict(self.model, self.data, self.root / "out", **sections))

    def raw(self, name: str, text: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def without(self, section: str, key: str | None = None) -> Path:
        values = recipe_dict(self.model, self.data, self.root / "out")
        values.pop(section) if key is None else values[section].pop(key)
        return write_recipe(self.root / "recipe.yaml", values)

    def fake_checkpoint(self, run: Path, step: int = 3, *, manifest: bool = True, lora_r: int = 8) -> Path:
        """A checkpoint folder with the files and manifest a real save writes (checks run before any tensor loads)."""
        folder = checkpoint.checkpoint_dir(run, step)
        (folder / "trainable").mkdir(parents=True)
        (folder / "trainable" / "__0_0.distcp").write_bytes(os.urandom(256))
        values = recipe_dict(self.model, self.data, run, lora={"r": lora_r, "alpha": 16, "dropout": 0.0})
        (folder / "recipe.yaml").write_text(yaml.safe_dump(values))
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
        if manifest:
            checkpoint._write_manifest(folder, step, {"world_size": 1, "strategy": "single process"})
        return folder


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under `root` with its hash and mtime: the 'no user file changed' evidence."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_dir():
            state[key] = ("dir",)
        else:
            state[key] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return state


# Each case: (id, setup(ws) -> (argv after `train`, culprit text expected in the message)).
Case = Callable[[Workspace], tuple[list[str], str]]


def _finished_run(ws: Workspace) -> tuple[list[str], str]:
    (ws.root / "out" / "adapter").mkdir(parents=True)
    (ws.root / "out" / "adapter" / outputs.ADAPTER_WEIGHTS).write_bytes(b"weights")
    return [str(ws.recipe())], "already holds a finished run"


def _unfinished_run(ws: Workspace) -> tuple[list[str], str]:
    ws.fake_checkpoint(ws.root / "out")
    return [str(ws.recipe())], "holds checkpoints of a run that did not finish"


_HELD_LOCKS: list = []  # descriptors holding a "running run's" OS lock for the rest of the session


def _busy_run(ws: Workspace) -> tuple[list[str], str]:
    import fcntl

    (ws.root / "out").mkdir()
    lock = ws.root / "out" / outputs.LOCK_FILE
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    handle = open(lock)  # noqa: SIM115 - held open: the lock lives as long as the descriptor
    fcntl.flock(handle, fcntl.LOCK_EX)  # what a live run holds
    _HELD_LOCKS.append(handle)
    return [str(ws.recipe())], f"is in use by a running run (pid {os.getpid()}"


def _tampered(ws: Workspace) -> tuple[list[str], str]:
    folder = ws.fake_checkpoint(ws.root / "old")
    (folder / "trainable" / "__0_0.distcp").write_bytes(os.urandom(256))
    return [str(ws.recipe()), f"train.resume={folder}"], "__0_0.distcp does not match its checksum"


def _all_damaged(ws: Workspace) -> tuple[list[str], str]:
    ws.fake_checkpoint(ws.root / "old", 3, manifest=False)
    ws.fake_checkpoint(ws.root / "old", 6, manifest=False)
    return [str(ws.recipe()), f"train.resume={ws.root / 'old'}"], "has no usable checkpoint"


def _data_file(name: str, text: str, culprit: str) -> Case:
    def case(ws: Workspace) -> tuple[list[str], str]:
        path = ws.raw(f"data/{name}", text)
        return [str(ws.recipe()), f"data.datasets.0.path={path}"], culprit
    return case


ROWS = "".join(json.dumps(row) + "\n" for row in addition_rows(8))
CASES: dict[str, Case] = {
    # recipe files
    "recipe missing": lambda ws: ([str(ws.root / "nope.yaml")], "nope.yaml: recipe file not found"),
    "recipe is a folder": lambda ws: ([str(ws.root / "data")], "(it is a folder)"),
    "yaml syntax": lambda ws: ([str(ws.raw("bad.yaml", "model: [unclosed\n"))], "YAML syntax error"),
    "recipe is a list": lambda ws: ([str(ws.raw("list.yaml", "- a\n- b\n"))], "must be a YAML mapping"),
    "unknown section": lambda ws: ([str(ws.recipe(trian={"max_steps": 3}))], "trian: unknown key"),
    "misspelled key": lambda ws: ([str(ws.recipe(train={"learning_rte": 1e-3}))], "Did you mean `learning_rate`"),
    "model missing": lambda ws: ([str(ws.without("model"))], "model: required key is missing"),
    "datasets missing": lambda ws: ([str(ws.without("data", "datasets"))], "data.datasets: required key is missing"),
    "max_steps not a number": lambda ws: ([str(ws.recipe(train={"max_steps": "ten"}))], "train.max_steps"),
    "negative learning rate": lambda ws: ([str(ws.recipe(train={"learning_rate": -1}))], "train.learning_rate"),
    "dropout above 1": lambda ws: ([str(ws.recipe(lora={"dropout": 1.5}))], "lora.dropout"),
    "quant storage mismatch": lambda ws: ([str(ws.recipe(quantization={"quant_storage": "bfloat16"}))],
                                          "quantization.quant_storage"),
    "warmup negative": lambda ws: ([str(ws.recipe(train={"warmup_steps": -1}))], "train.warmup_steps"),
    "unknown optimizer": lambda ws: ([str(ws.recipe(train={"optimizer": "sgd"}))], "train.optimizer"),
    "keep_last zero": lambda ws: ([str(ws.recipe(train={"keep_last": 0}))], "train.keep_last"),
    "save_every negative": lambda ws: ([str(ws.recipe(train={"save_every": -5}))], "train.save_every"),
    "resume blank": lambda ws: ([str(ws.recipe(train={"resume": "  "}))], "train.resume"),
    "nan_policy unknown": lambda ws: ([str(ws.recipe(train={"nan_policy": "ignore"}))], "train.nan_policy"),
    # overrides
    "override without =": lambda ws: ([str(ws.recipe()), "train.max_steps"], "expected KEY.PATH=VALUE"),
    "override unknown key": lambda ws: ([str(ws.recipe()), "train.lr=1"], "`train.lr` is not a recipe key"),
    "override bad yaml": lambda ws: ([str(ws.recipe()), "train.max_steps=[1"], "the value is not valid YAML"),
    "override into a value": lambda ws: ([str(ws.recipe()), "train.max_steps.x=1"], "is a value, not a section"),
    "override list index": lambda ws: ([str(ws.recipe()), "data.datasets.5.path=x"], "is not an index of the list"),
    # checkpoint folders
    "resume path missing": lambda ws: ([str(ws.recipe()), f"train.resume={ws.root / 'gone'}"], "does not exist"),
    "resume not a checkpoint": lambda ws: ([str(ws.recipe()), f"train.resume={ws.root / 'data'}"], "is not a checkpoint"),
    "resume without manifest": lambda ws: ([str(ws.recipe()), f"train.resume={ws.fake_checkpoint(ws.root / 'old', manifest=False)}"],
                                           "no manifest.json"),
    "resume tampered": _tampered,
    "resume all damaged": _all_damaged,
    "resume other lora shape": lambda ws: ([str(ws.recipe()), f"train.resume={ws.fake_checkpoint(ws.root / 'old', lora_r=4)}"],
                                           "lora.r is 8 here, 4 in the checkpoint"),
    # output folders
    "output is a file": lambda ws: ([str(ws.recipe()), f"output.dir={ws.raw('out.txt', 'x')}"], "is a file, not a folder"),
    "output holds a finished run": _finished_run,
    "output holds an unfinished run": _unfinished_run,
    "output in use": _busy_run,
    # data files
    "data file missing": lambda ws: ([str(ws.recipe()), "data.datasets.0.path=./no/such.jsonl"], "no/such.jsonl"),
    "data file type": _data_file("rows.txt", ROWS, "rows.txt"),
    "data bad json line": _data_file("rows.jsonl", ROWS + "{oops\n", "line 9"),
    "data json not a list": _data_file("rows.json", '{"instruction": "x"}', "rows.json"),
    "data row misses output": _data_file("rows.jsonl", json.dumps({"instruction": "add", "input": "1 2"}) + "\n", "`output`"),
    "data too small for the batch": _data_file("rows.jsonl", "".join(ROWS.splitlines(True)[:2]), "micro"),
    # model and launcher
    "model folder missing": lambda ws: ([str(ws.recipe()), f"model.name_or_path={ws.root / 'no-model'}"], "no-model"),
    "model folder empty": lambda ws: ([str(ws.recipe()), f"model.name_or_path={ws.root / 'data'}"], str(ws.root / "data")),
    "hub model offline": lambda ws: ([str(ws.recipe()), "model.name_or_path=no-such-org/no-such-model"],
                                     "no-such-org/no-such-model"),
    "ddp with one process": lambda ws: ([str(ws.recipe()), "parallel.strategy=ddp"], "parallel.strategy is `ddp`"),
    "DataParallel (dp)": lambda ws: ([str(ws.recipe()), "parallel.strategy=dp"],
                                     "--config_file accelerate_configs/ddp.yaml --num_processes"),
    "DataParallel in the file": lambda ws: ([str(ws.recipe(parallel={"strategy": "data_parallel"}))],
                                            "`data_parallel` (torch.nn.DataParallel) is not supported"),
}


@pytest.fixture
def workspace(tiny_llama, tmp_path) -> Workspace:
    data = write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows())
    return Workspace(tmp_path, tiny_llama, data)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_in_process(name, workspace, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, culprit = CASES[name](workspace)
    before = snapshot(workspace.root)
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert culprit in err, err[-2000:]
    assert "finetune: error:" in err and "Traceback" not in err
    assert snapshot(workspace.root) == before


def test_world_size_without_master_address(workspace, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    recipe = workspace.recipe()
    before = snapshot(workspace.root)
    assert cli.main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "MASTER_ADDR" in err and "Traceback" not in err
    assert snapshot(workspace.root) == before


# --------------------------------------------------------------------------------------- real processes
def _check_process(result: subprocess.CompletedProcess, culprit: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert culprit in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


def _run(args: list[str], env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["run.py", "console"])
def test_bad_inputs_through_real_entry_points(entry, workspace):
    """The two user entry points exit 2 with the culprit and no traceback, for a recipe and an output-folder error."""
    launcher = [sys.executable, str(RUN_PY)] if entry == "run.py" else [str(Path(sys.executable).parent / "finetune"), "train"]
    argv, culprit = CASES["misspelled key"](workspace)
    before = snapshot(workspace.root)
    _check_process(_run([*launcher, *argv]), culprit)
    assert snapshot(workspace.root) == before
    argv, culprit = CASES["output in use"](workspace)  # the lock names this test process, which is alive
    before = snapshot(workspace.root)
    _check_process(_run([*launcher, *argv]), culprit)
    assert snapshot(workspace.root) == before


@pytest.mark.slow
def test_strategy_single_under_torchrun_is_refused_on_every_rank(workspace):
    recipe = workspace.recipe()
    before = snapshot(workspace.root)
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                   str(RUN_PY), str(recipe), "parallel.strategy=single"])
    assert result.returncode != 0
    assert "parallel.strategy is `single` but 2 processes were started" in result.stderr
    assert f'File "{RUN_PY.parent}' not in result.stderr  # torchrun reports the failed workers; no frame of ours
    assert snapshot(workspace.root) == before


@pytest.mark.slow
def test_the_launchers_sigterm_does_not_cut_rank_0s_paragraph(workspace):
    """Every rank makes the pre-flight checks; the first to fail exits and the launcher SIGTERMs the rest at once. Rank
    0 prints the whole paragraph (the others its first line), so it must not die before printing (CI, a busy machine:
    torchrun's `strategy: single` refusal showed "(rank 1) the parallel setup cannot work:" and nothing else). The
    signal is held over the checks and acted on once the paragraph is out. (One process: the SIGTERM sent where a
    slower rank 0 would receive it.)"""
    recipe = workspace.recipe(train={"lr": "fast"})
    result = subprocess.run([sys.executable, "-c", sigtermed_during("finetune.recipe", "load_recipe"), str(recipe)], capture_output=True,
                            text=True, timeout=120, check=False, env=child_env(RANK="0"), cwd=REPO)
    assert "train.lr" in result.stderr and "finetune: error:" in result.stderr, result.stderr
    assert result.returncode == -signal.SIGTERM, result.stderr  # and then the launcher's SIGTERM is acted on


@pytest.mark.slow
def test_hub_model_without_offline_flag_fails_within_seconds(workspace):
    env = child_env(HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0")
    started = time.monotonic()
    result = _run([sys.executable, str(RUN_PY), str(workspace.recipe()), "model.name_or_path=no-such-org/no-such-model"],
                  env=env, timeout=20)
    _check_process(result, "no-such-org/no-such-model")
    assert time.monotonic() - started < 15
