"""A run folder copied or moved keeps its own MLflow store (output.dir/mlflow.db): a resume logs its artifacts into the
folder it runs in, never into the folder it came from, and `finetune runs` reads the folder's own store (bb46)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3

import pytest

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.tracking import Trackers, log_run_artifacts


def recipe_for(folder):
    raw = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"learning_rate": 3e-4, "trackers": ["mlflow"]}, "output": {"dir": str(folder)}}
    return validate_recipe(raw)


def finished_run(folder, *, step: int, weights: bytes, resumed_step: int = 0) -> None:
    """What a training run leaves: metrics into MLflow, then its adapter as artifacts (run.py's order)."""
    trackers = Trackers(recipe_for(folder), folder, is_main=True, resumed_step=resumed_step)
    trackers.write(step=step, loss=2.0 / step)
    trackers.close()
    (folder / "adapter").mkdir(exist_ok=True)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(weights)
    log_run_artifacts(folder)


def artifact_uris(folder) -> list[str]:
    with sqlite3.connect(folder / "mlflow.db") as db:
        return [uri for (uri,) in db.execute("SELECT artifact_uri FROM runs")]


def digests(folder) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted((folder / "mlartifacts").rglob("*")) if path.is_file()}


@pytest.fixture
def original(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    finished_run(run, step=1, weights=b"original")
    return run


def test_resuming_a_copied_run_keeps_the_originals_mlflow_artifacts(original, tmp_path, capsys):
    """Found by a bug bash: the copy's mlflow.db named the original folder's mlartifacts/ (absolute, fixed when the
    experiment is made), so resuming the copy wrote its adapter over the original run's MLflow artifacts."""
    before = digests(original)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    finished_run(copy, step=2, weights=b"the copy's", resumed_step=1)
    assert digests(original) == before  # the original run's artifacts as they were
    assert all(uri.startswith((copy / "mlartifacts").as_uri()) for uri in artifact_uris(copy))
    copied = [path for path in (copy / "mlartifacts").rglob("adapter_model.safetensors")]
    assert [path.read_bytes() for path in copied] == [b"the copy's"]
    assert f"its MLflow artifacts now go to {copy / 'mlartifacts'}" in capsys.readouterr().out


def test_resuming_a_moved_run_does_not_make_the_old_folder_again(original, tmp_path):
    """Found by a bug bash: after `mv run moved`, resuming in moved/ created run/mlartifacts/ again at the old path."""
    moved = tmp_path / "moved"
    original.rename(moved)
    finished_run(moved, step=2, weights=b"moved", resumed_step=1)
    assert not original.exists()
    assert [path.read_bytes() for path in (moved / "mlartifacts").rglob("adapter_model.safetensors")] == [b"moved"]


def test_runs_of_a_copied_or_moved_folder_reads_its_own_store_and_fails_when_none_reads(original, tmp_path, capsys):
    """Found by a bug bash: `finetune runs` took trackers.json's absolute store URI, the old folder's mlflow.db: a copy
    silently listed the original's runs, a moved folder "cannot be read", and it exited 0 when nothing was read."""
    from mlflow.tracking import MlflowClient

    copy, moved = tmp_path / "copy", tmp_path / "moved"
    shutil.copytree(original, copy)
    client = MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow.db'}")
    client.create_run(client.get_experiment_by_name("finetune").experiment_id, run_name="only-in-the-copy")
    capsys.readouterr()
    assert main(["runs", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "only-in-the-copy" in out and f"sqlite:///{copy / 'mlflow.db'}: 2 runs" in out
    assert f"(another folder, while this one holds the run); this folder's own {copy / 'mlflow.db'} is used" in out

    original.rename(moved)
    assert main(["runs", str(moved)]) == 0
    out = capsys.readouterr().out
    assert f"sqlite:///{moved / 'mlflow.db'}: 1 run" in out and "the run folder it was copied or moved from" in out

    (moved / "mlflow.db").unlink()  # trackers.json names a store that is gone and there is no other
    assert main(["runs", str(moved)]) == 2
    captured = capsys.readouterr()
    assert "cannot be read" in captured.out and "none of the MLflow stores" in captured.err
    assert json.loads((moved / "trackers.json").read_text())["mlflow_uri"].endswith("/run/mlflow.db")
