"""Trackers: metrics.jsonl always; real TensorBoard event files and real MLflow stores (SQLite by default, the file
store when asked) read back; a missing tracker, an unreachable MLflow server, an unwritable store or a tracker failing
mid-run cost one warning line and never stop the run; a preempted training run is KILLED in MLflow and its resume
continues the same MLflow run; `finetune runs` lists a store."""

from __future__ import annotations

import json
import sys
import time

import pytest
from conftest import child_env, free_port, recipe_dict, run_cmd, write_recipe

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.tracking import Trackers, log_run_artifacts, run_tags

RECORDS = [
    {"step": 1, "loss": 2.5, "learning_rate": 1e-4, "grad_norm": 1.5, "num_tokens": 100},
    {"step": 2, "loss": 2.0, "learning_rate": 2e-4, "grad_norm": 1.2, "num_tokens": 200},
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
    assert {"loss", "learning_rate", "eval_loss", "grad_norm"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("eval_loss")] == [(2, 2.2)]


def test_mlflow_file_store_when_asked_params_metrics_resume(tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    uri = f"file:{out / 'mlruns'}"
    recipe = make_recipe(tmp_path, trackers=["mlflow"], run_name="bench-1", mlflow_tracking_uri=uri)
    write_all(Trackers(recipe, out, is_main=True))
    assert warnings_of(capsys) == []
    assert not (out / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
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


def test_mlflow_default_is_sqlite_in_the_run_folder_with_tags_status_and_resume(tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working folder (MLflow's default artifact root is ./mlruns)
    out = tmp_path / "run"
    out.mkdir()
    recipe = make_recipe(tmp_path, trackers=["mlflow"])
    tags = run_tags(strategy="DDP over 2 processes", world_size=2, device="cpu")
    trackers = Trackers(recipe, out, is_main=True, tags=tags)
    trackers.write(step=1, loss=2.5, learning_rate=1e-4, grad_norm=1.5, tokens_per_s=900.0)
    trackers.close(status="KILLED")  # what train.py passes for a preempted run
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert json.loads((out / "trackers.json").read_text())["mlflow_uri"] == uri
    assert uri in capsys.readouterr().out  # the `mlflow ui --backend-store-uri ...` line of a run that stops early
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "run"
    assert run.data.tags["strategy"] == "DDP over 2 processes" and run.data.tags["world_size"] == "2"
    assert run.data.tags["device"].startswith("cpu") and run.data.tags["version.torch"].startswith("2.")
    assert run.data.params["output.dir"] == str(tmp_path / "run")
    assert set(run.data.metrics) == {"loss", "learning_rate", "grad_norm", "tokens_per_s"}

    resumed = Trackers(recipe, out, is_main=True, tags=tags)  # the resume: same MLflow run, RUNNING again
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed.write(step=2, loss=2.0)
    resumed.write(step=2, eval_loss=2.1)
    resumed.close()
    (out / "recipe.yaml").write_text("train: {}\n")
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    log_run_artifacts(out)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    assert {a.path for a in client.list_artifacts(run_id)} == {"adapter", "recipe.yaml"}
    assert (out / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
    assert f"mlflow ui --backend-store-uri {uri}" in capsys.readouterr().out
    assert warnings_of(capsys) == []

    assert main(["runs", str(tmp_path)]) == 0  # a folder of run folders
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if run_id in line)
    assert row.split()[:5] == ["finetune", "run", "FINISHED", "2.0000", "2.1000"] and "DDP over 2 processes" in row


def test_unwritable_mlflow_store_is_one_warning(tmp_path, capsys):
    uri = "sqlite:////proc/finetune-test/mlflow.db"  # /proc takes no new files, not even from root
    out = tmp_path / "run"
    out.mkdir()
    write_all(Trackers(make_recipe(tmp_path, trackers=["mlflow"], mlflow_tracking_uri=uri), out, is_main=True))
    lines = warnings_of(capsys)
    assert len(lines) == 1 and uri in lines[0] and "Training goes on" in lines[0]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(RECORDS)


def test_runs_without_a_store_is_a_clear_error(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no MLflow store" in err and "train.trackers: [mlflow]" in err and "Traceback" not in err


@pytest.mark.slow
def test_training_run_preempted_then_resumed_is_one_mlflow_run(tiny_llama, alpaca_file, tmp_path):
    """A real run: SIGTERM -> the MLflow run is KILLED; `train.resume=auto` continues it to FINISHED with the
    recipe as params, the run's facts as tags, and the adapter, recipe and plot as artifacts."""
    import signal
    import subprocess

    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, alpaca_file, run, train={
        "max_steps": 120, "log_every": 1, "save_every": 0, "trackers": ["mlflow"], "gradient_checkpointing": False}))
    command = [sys.executable, "-m", "finetune", "train", str(recipe)]
    env = child_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(tmp_path / "first.log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()[-3000:]
    uri = f"sqlite:///{(run / 'mlflow.db').resolve()}"
    assert f"mlflow ui --backend-store-uri {uri}" in (tmp_path / "first.log").read_text()
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert client.get_run(run_id).info.status == "KILLED"

    resumed = run_cmd([*command, "train.resume=auto"], cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"mlflow ui --backend-store-uri {uri}" in resumed.stdout
    assert "warning: train.trackers" not in resumed.stderr + (tmp_path / "first.log").read_text()
    found = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert [r.info.run_id for r in found] == [run_id], "the resume continued the same MLflow run"
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.params["train.max_steps"] == "120" and finished.data.params["lora.r"] == "8"
    assert finished.data.tags["strategy"] == "single process" and finished.data.tags["world_size"] == "1"
    assert {"loss", "learning_rate", "grad_norm", "num_tokens", "mean_token_accuracy", "tokens_per_s",
            "eval_loss", "eval_mean_token_accuracy"} <= set(finished.data.metrics)
    steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 120, "one loss per step, across the preemption"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"adapter", "recipe.yaml", "plot.png"} <= artifacts
    assert "adapter/adapter_model.safetensors" in {a.path for a in client.list_artifacts(run_id, "adapter")}


def wandb_history(out) -> tuple[object, list[dict]]:
    """The run record and the history rows of an offline W&B run, read from its .wandb file (W&B's record log: a
    7-byte header, then 32 KiB blocks of records, each a CRC, a length, a type (full, first, middle, last) and a
    protobuf `Record`); wandb 0.31 has no Python reader of its own (its core is in Go)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    paths = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    if not paths:  # not written yet
        return None, []
    (path,) = paths
    raw, position, records, pending = path.read_bytes(), 7, [], b""
    while position + 7 <= len(raw):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a record header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        data, position = raw[position + 7 : position + 7 + length], position + 7 + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            records.append(pending)
    run, history = None, []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return run, history


def test_wandb_offline_run_holds_the_metrics_and_the_name(tmp_path, capsys, monkeypatch):
    """Without an API key the W&B tracker runs offline (synced later with `wandb sync`): the run's record log in the
    run folder holds the recipe's project and run name and every logged metric at its step."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    recipe = make_recipe(tmp_path, trackers=["wandb"], run_name="wb-1", wandb_project="finetune-test")
    write_all(Trackers(recipe, out, is_main=True))
    assert warnings_of(capsys) == []
    deadline = time.monotonic() + 60  # W&B's core writes the record log in its own process: wait for the records
    run, history = wandb_history(out)
    while (run is None or len(history) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
        run, history = wandb_history(out)
    assert run is not None, "no run record in the .wandb file after 60 s"
    assert (run.display_name, run.project) == ("wb-1", "finetune-test")
    assert json.loads((out / "trackers.json").read_text())["wandb"] == run.run_id
    assert [(row["_step"], row["loss"]) for row in history] == [(1, 2.5), (2, 2.0)]
    assert history[1]["eval_loss"] == 2.2 and history[0]["learning_rate"] == 1e-4


COMPLETIONS = [  # GRPO's completion records as the objective hands them (rollouts.completion_rows)
    {"step": 3, "prompt_index": 7, "prompt": [{"role": "user", "content": "2 | 3?"}], "completion": "5",
     "rewards": {"exact_match": 1.0, "length_penalty": None}, "reward": 1.0, "advantage": 0.7071},
    {"step": 3, "prompt_index": 7, "prompt": [{"role": "user", "content": "2 | 3?"}], "completion": "six\nor so",
     "rewards": {"exact_match": 0.0, "length_penalty": -0.009}, "reward": -0.009, "advantage": -0.7071},
]


def test_completions_go_to_tensorboard_and_mlflow_as_tables(tmp_path, capsys, monkeypatch):
    """TRL logs GRPO's completions as a table: here a markdown table in TensorBoard's text tab and an MLflow table
    artifact per step, one row per completion, the rewards flattened into columns, chat prompts as JSON text."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    trackers = Trackers(make_recipe(tmp_path, trackers=["tensorboard", "mlflow"]), out, is_main=True)
    trackers.table("completions", COMPLETIONS, step=3)
    trackers.close()
    assert warnings_of(capsys) == []
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = [e for e in events.Tensors("completions/text_summary")]
    markdown = text.tensor_proto.string_val[0].decode()
    assert text.step == 3 and "| step | prompt_index | prompt | completion | rewards.exact_match |" in markdown
    assert "| six or so |" in markdown and "2 \\| 3?" in markdown and markdown.count("\n") == 3
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    with open(client.download_artifacts(run_id, "completions/step-00000003.json")) as artifact:
        table = json.load(artifact)
    assert table["columns"][:4] == ["step", "prompt_index", "prompt", "completion"]
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [r["rewards.length_penalty"] for r in rows] == [None, -0.009] and rows[1]["advantage"] == -0.7071
    assert json.loads(rows[0]["prompt"]) == COMPLETIONS[0]["prompt"]
