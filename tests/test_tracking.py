"""Trackers: metrics.jsonl always; real TensorBoard event files and a real MLflow file store read back; a missing
tracker, an unreachable MLflow server or a tracker failing mid-run cost one warning line and never stop the run."""

from __future__ import annotations

import json
import sys
import time

import pytest
from conftest import free_port

from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.tracking import Trackers

RECORDS = [
    {"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": 1.5, "tokens": 100},
    {"step": 2, "loss": 2.0, "lr": 2e-4, "grad_norm": 1.2, "tokens": 100},
    {"step": 2, "eval_loss": 2.2},
    {"step": 3, "skipped": "non-finite loss or gradient", "loss": "nan"},
]


def make_recipe(tmp_path, **train):
    raw = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"learning_rate": 3e-4, **train}, "output": {"dir": str(tmp_path / "run")}}
    return validate_recipe(raw)


def write_all(trackers: Trackers) -> None:
    for record in RECORDS:
        trackers.write(**record)
    trackers.close()


def warnings_of(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]


def test_metrics_jsonl_always_and_only_on_rank0(tmp_path):
    recipe = make_recipe(tmp_path)
    write_all(Trackers(recipe, tmp_path / "main", is_main=True))
    lines = [json.loads(line) for line in (tmp_path / "main" / "metrics.jsonl").read_text().splitlines()]
    assert lines == RECORDS
    (tmp_path / "other").mkdir()
    write_all(Trackers(recipe, tmp_path / "other", is_main=False))
    assert list((tmp_path / "other").iterdir()) == []


def test_tensorboard_event_files(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    out.mkdir()
    write_all(Trackers(make_recipe(tmp_path, trackers=["tensorboard"]), out, is_main=True))
    assert warnings_of(capsys) == []
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "eval_loss", "grad_norm"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("eval_loss")] == [(2, 2.2)]


def test_mlflow_file_store_params_metrics_resume(tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    recipe = make_recipe(tmp_path, trackers=["mlflow"], run_name="bench-1")
    write_all(Trackers(recipe, out, is_main=True))
    assert warnings_of(capsys) == []
    client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "bench-1" and run.info.status == "FINISHED"
    assert run.data.params["train.learning_rate"] == "0.0003"
    assert run.data.params["train.trackers"] == '["mlflow"]'
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.5), (2, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval_loss")] == [(2, 2.2)]

    resumed = Trackers(recipe, out, is_main=True)  # a resumed run continues the same MLflow run
    resumed.write(step=4, loss=1.5)
    resumed.close()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 4]


def test_missing_tracker_is_one_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    out = tmp_path / "run"
    out.mkdir()
    write_all(Trackers(make_recipe(tmp_path, trackers=["wandb"]), out, is_main=True))
    lines = warnings_of(capsys)
    assert len(lines) == 1 and "wandb is not installed" in lines[0] and "pip install wandb" in lines[0]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(RECORDS)


def test_unreachable_mlflow_is_one_fast_warning(tmp_path, capsys):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = tmp_path / "run"
    out.mkdir()
    started = time.perf_counter()
    trackers = Trackers(make_recipe(tmp_path, trackers=["mlflow", "tensorboard"], mlflow_tracking_uri=uri), out,
                        is_main=True)
    write_all(trackers)
    assert time.perf_counter() - started < 10
    lines = warnings_of(capsys)
    assert len(lines) == 1 and uri in lines[0] and "Training goes on" in lines[0]
    assert (out / "tensorboard").is_dir()  # the other tracker still works


def test_tracker_failing_mid_run_is_switched_off(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    trackers = Trackers(make_recipe(tmp_path, trackers=["tensorboard"]), out, is_main=True)
    trackers.write(step=1, loss=2.0)

    def broken(metrics, step):
        raise OSError("disk full")

    trackers.backends[0].log = broken
    for step in range(2, 6):
        trackers.write(step=step, loss=1.0)
    trackers.close()
    lines = warnings_of(capsys)
    assert len(lines) == 1 and "tensorboard failed to log (OSError: disk full)" in lines[0]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_unknown_tracker_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="train.trackers"):
        make_recipe(tmp_path, trackers=["neptune"])
