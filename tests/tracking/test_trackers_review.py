"""Trackers after a bug bash: a resume after a kill brings TensorBoard and MLflow onto the timeline of the trimmed
metrics.jsonl (W&B rewinds), changed recipe keys are tagged in MLflow, elapsed_s counts on, the generation eval sits
at its step, an unwritable SQLite store is one fast warning, and train.tensorboard_dir keeps runs apart."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest

from finetune.outputs.run_folder import begin_outputs
from finetune.recipe import validate_recipe
from finetune.tracking import Trackers


def make_recipe(tmp_path, **train):
    raw = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"learning_rate": 3e-4, **train}, "output": {"dir": str(tmp_path / "run")}}
    return validate_recipe(raw)


def warnings_of(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]


def train_steps(trackers: Trackers, steps, *, elapsed_from: float = 0.0) -> None:
    for step in steps:
        trackers.write(step=step, loss=10.0 - step / 10, learning_rate=1e-4, elapsed_s=elapsed_from + step)
        if step % 5 == 0:
            trackers.write(step=step, eval_loss=9.0 - step / 10)


def killed_after_step_15(out, recipe) -> Trackers:
    """A run killed (SIGKILL) after logging step 15, its newest checkpoint of step 10: the trackers are never closed
    (only what reached the disk stays: the event writer's flush stands for TensorBoard's periodic one)."""
    trackers = Trackers(recipe, out, is_main=True, resumed_step=0)
    train_steps(trackers, range(1, 16))
    for backend in trackers.backends:
        if backend.name == "tensorboard":
            backend.writer.flush()
    return trackers


def resume_from_step_10(out, recipe_yaml: str = "train: {}\n") -> None:
    """What the loop does before its Trackers on `train.resume=auto`: metrics.jsonl trimmed to the checkpoint."""
    checkpoint = out / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 10}))
    begin_outputs(out, recipe_yaml, checkpoint)


def test_resume_after_a_kill_cuts_the_tensorboard_event_files_to_the_checkpoint(tmp_path, capsys):
    """Every event file, read alone or as TensorBoard reads the folder, holds each step once: the retrained 11-15."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    recipe = make_recipe(tmp_path, trackers=["tensorboard"])
    killed_after_step_15(out, recipe)
    resume_from_step_10(out)
    time.sleep(1.05)  # SummaryWriter names its file by the second: the resume's file is a second one
    resumed = Trackers(recipe, out, is_main=True, resumed_step=10)
    train_steps(resumed, range(11, 21))
    resumed.close()
    assert warnings_of(capsys) == []
    files = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    per_file = []
    for path in files:
        events = EventAccumulator(str(path))
        events.Reload()
        per_file.append([e.step for e in events.Scalars("loss")])
    assert per_file == [list(range(1, 11)), list(range(11, 21))]
    folder = EventAccumulator(str(out / "tensorboard"))
    folder.Reload()
    assert [(e.step, round(e.value, 4)) for e in folder.Scalars("loss")] == [(s, 10.0 - s / 10) for s in range(1, 21)]
    assert [e.step for e in folder.Scalars("eval_loss")] == [5, 10, 15, 20]


def test_resume_after_a_kill_logs_mlflow_into_a_new_run_that_matches_metrics_jsonl(tmp_path, capsys, monkeypatch):
    """MLflow cannot delete the killed run's steps 11-15: the resume goes on in a new MLflow run holding steps 1-10
    from metrics.jsonl and the retrained ones; the old run is KILLED and names its successor; one warning says so."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    recipe = make_recipe(tmp_path, trackers=["mlflow"], max_steps=300)
    killed_after_step_15(out, recipe)
    old_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    resume_from_step_10(out)
    capsys.readouterr()
    resumed_recipe = make_recipe(tmp_path, trackers=["mlflow"], max_steps=20, resume="auto")
    resumed = Trackers(resumed_recipe, out, is_main=True, resumed_step=10)
    train_steps(resumed, range(11, 21))
    resumed.close()
    (line,) = warnings_of(capsys)
    assert old_id in line and "steps 11-15" in line and "new MLflow run" in line
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    new_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert new_id != old_id
    jsonl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "eval_loss", "elapsed_s"):
        expected = [(r["step"], pytest.approx(r[key])) for r in jsonl if key in r]
        assert [(m.step, m.value) for m in client.get_metric_history(new_id, key)] == expected, key
    new, old = client.get_run(new_id), client.get_run(old_id)
    assert new.info.status == "FINISHED" and new.info.run_name == old.info.run_name == "run"
    assert old.info.status == "KILLED" and old.data.tags["finetune.replaced_by"] == new_id
    assert new.data.tags["finetune.replaces"] == old_id and new.data.tags["resumed_from_step"] == "10"
    # params are those of the first start (MLflow's are immutable); the keys this resume changed are tags
    assert new.data.params["train.max_steps"] == "300"
    assert new.data.tags["resumed_at_10.train.max_steps"] == "20"
    assert new.data.tags["resumed_at_10.train.resume"] == "auto"
    assert "resumed_at_10.train.learning_rate" not in new.data.tags


def test_resume_without_later_steps_continues_the_mlflow_run_and_tags_changed_keys(tmp_path, capsys, monkeypatch):
    """A preempted run (its checkpoint is its last step) has nothing to drop: the same MLflow run goes on, and the
    keys its resume changed are tags `resumed_at_<step>.<key>` (the params keep the first start's values)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    first = Trackers(make_recipe(tmp_path, trackers=["mlflow"], max_steps=300), out, is_main=True)
    train_steps(first, range(1, 11))
    first.close(status="KILLED")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    resume_from_step_10(out)
    resumed = Trackers(make_recipe(tmp_path, trackers=["mlflow"], max_steps=40, resume="auto"), out, is_main=True,
                       resumed_step=10)
    train_steps(resumed, range(11, 13))
    resumed.close()
    assert warnings_of(capsys) == []
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    run = client.get_run(run_id)
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 13))
    assert run.data.params["train.max_steps"] == "300" and run.data.tags["resumed_at_10.train.max_steps"] == "40"
    assert run.data.tags["resumed_from_step"] == "10"


def test_elapsed_s_counts_on_across_a_resume(tmp_path):
    """The loop's clock restarts in every launch: the resumed run's elapsed_s goes on from the checkpoint's."""
    out = tmp_path / "run"
    recipe = make_recipe(tmp_path)
    killed_after_step_15(out, recipe)
    resume_from_step_10(out)
    resumed = Trackers(recipe, out, is_main=True, resumed_step=10)
    for step in (11, 12):
        resumed.write(step=step, loss=1.0, elapsed_s=0.5 * (step - 10))  # this launch's own clock
    resumed.close()
    elapsed = [json.loads(x)["elapsed_s"] for x in (out / "metrics.jsonl").read_text().splitlines()
               if "elapsed_s" in json.loads(x)]
    assert elapsed == [*range(1, 11), 10.5, 11.0]


def test_elapsed_s_counts_on_from_the_checkpoint_into_another_output_dir(tmp_path):
    """Found by a bug bash: a resume into another output.dir (the route finetune suggests for resuming a finished run
    from an earlier checkpoint) logged elapsed_s from 0 again, while num_tokens and epoch went on: the new folder has
    no metrics.jsonl to read the offset from. The checkpoint's own elapsed_s is the offset now (and wins over a
    metrics.jsonl's last logged value, which log_every > 1 leaves early)."""
    from finetune.training.loop import TrainResult, trainer_state

    recipe = make_recipe(tmp_path)
    resumed = Trackers(recipe, tmp_path / "elsewhere", is_main=True, resumed_step=50, elapsed_before=81.25)
    resumed.write(step=51, loss=1.0, elapsed_s=1.5)
    resumed.close()
    record = json.loads((tmp_path / "elsewhere" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["elapsed_s"] == 82.75

    class Scheduler:
        def state_dict(self):
            return {}

    class Stream:
        def epochs_done(self, step):
            return 0

        def state_dict(self):
            return {}

    state = trainer_state(50, Scheduler(), Stream(), TrainResult(), 1, "single", elapsed_s=81.2504)
    assert state["elapsed_s"] == 81.25


def test_generation_eval_sits_at_its_step_and_a_resume_drops_the_old_after(tmp_path, monkeypatch):
    """"before" at the step training starts from, "after" at the last step; an extended run (resumed from its last
    checkpoint with a higher max_steps) ends with one "after" record, its own."""
    from finetune.training import evals, loop

    class FakeGenerator:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    scores = iter([0.25, 0.5, 0.75])
    monkeypatch.setattr("finetune.parallel.generation_model", lambda model: FakeGenerator())
    monkeypatch.setattr(evals, "recipe_generation_eval", lambda *a, phase, **k: {
        "phase": phase, "generation_metric": "exact_match", "generation_score": next(scores),
        "generation_correct": 1, "generation_total": 4})
    recipe = make_recipe(tmp_path, trackers=["tensorboard"], max_steps=10)
    recipe.eval.generation_rows = 4
    out = tmp_path / "run"
    metrics = Trackers(recipe, out, is_main=True, resumed_step=0)
    loop.generation_eval(None, object(), ["row"], recipe, "before", metrics)
    train_steps(metrics, range(1, 11))
    loop.generation_eval(None, object(), ["row"], recipe, "after", metrics)
    metrics.close()
    resume_from_step_10(out)  # the extension resumes from the final checkpoint, step 10
    metrics = Trackers(recipe, out, is_main=True, resumed_step=10)
    train_steps(metrics, range(11, 21))
    loop.generation_eval(None, object(), ["row"], recipe, "after", metrics)
    metrics.close()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["step"], r["generation_score"]) for r in records if "phase" in r] == [
        ("before", 0, 0.25), ("after", 20, 0.75)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    # TensorBoard keeps the step-10 "after" of the first launch: a score of the model at step 10, logged at step 10
    # (by step: the files' order, and so the events', follows their names, whose second can be the same under load)
    assert sorted((e.step, e.value) for e in events.Scalars("generation_score")) == [(0, 0.25), (10, 0.5), (20, 0.75)]


def test_unwritable_sqlite_store_is_one_warning_at_once(tmp_path, capsys, monkeypatch):
    """A store on a read-only mount (or a folder without write permission): `access` says so (EROFS even for root),
    and the run warns once at once instead of MLflow's ~100 s of retries and 27 lines of its own. The one OS call
    is simulated (the suite may run as root, whom chmod does not stop)."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    uri = f"sqlite:///{readonly / 'mlflow.db'}"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
        False if mode & os.W_OK and str(path).startswith(str(readonly)) else real_access(path, mode, **kw)))
    out = tmp_path / "run"
    started = time.perf_counter()
    trackers = Trackers(make_recipe(tmp_path, trackers=["mlflow"], mlflow_tracking_uri=uri), out, is_main=True)
    train_steps(trackers, range(1, 3))
    trackers.close()
    assert time.perf_counter() - started < 10
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 1 and uri in lines[0] and "cannot be written" in lines[0] and "Training goes on" in lines[0]
    assert not (readonly / "mlflow.db").exists() and "mlflow.store.db.utils" not in captured.err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: the test above simulates it")
def test_read_only_folder_store_is_one_warning_at_once(tmp_path, capsys):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    uri = f"sqlite:///{readonly / 'mlflow.db'}"
    started = time.perf_counter()
    trackers = Trackers(make_recipe(tmp_path, trackers=["mlflow"], mlflow_tracking_uri=uri), tmp_path / "run",
                        is_main=True)
    trackers.close()
    assert time.perf_counter() - started < 10
    lines = warnings_of(capsys)
    assert len(lines) == 1 and "cannot be written" in lines[0]


def test_tensorboard_dir_keeps_runs_apart_by_run_name_and_overwrite_clears_its_own(tmp_path, capsys):
    """train.tensorboard_dir shared by two runs: each logs into <dir>/<run name> (default: output.dir's name); a run
    started over (output.overwrite) replaces its own events there, not the other run's."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    shared = tmp_path / "tb"

    def run(name, steps, out="run"):
        recipe = make_recipe(tmp_path, trackers=["tensorboard"], tensorboard_dir=str(shared), run_name=name)
        trackers = Trackers(recipe, tmp_path / out, is_main=True)
        train_steps(trackers, steps)
        trackers.close()

    run("a", range(1, 4))
    run("b", range(1, 4))
    run(None, range(1, 3), out="c-dir")
    run("a", range(1, 3))  # run "a" started over
    assert warnings_of(capsys) == []
    runs = EventMultiplexer().AddRunsFromDirectory(str(shared))
    runs.Reload()
    assert sorted(runs.Runs()) == ["a", "b", "c-dir"]
    assert {name: [e.step for e in runs.Scalars(name, "loss")] for name in ("a", "b", "c-dir")} == {
        "a": [1, 2], "b": [1, 2, 3], "c-dir": [1, 2]}


def test_wandb_resume_rewinds_to_the_first_retrained_step(tmp_path, monkeypatch):
    """W&B's rewind (`resume_from="<id>?_step=N"`) cuts the run's history where the resume trains again; a server
    that refuses it (a preview feature) gets the plain resume and one warning."""
    calls = []

    def init(**options):
        calls.append(options)
        if "resume_from" in options and len(calls) > 2:
            raise RuntimeError("rewind is not enabled")
        return types.SimpleNamespace(id="abc123", log=lambda *a, **k: None, finish=lambda **k: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text(json.dumps({"wandb": "abc123"}))
    recipe = make_recipe(tmp_path, trackers=["wandb"])
    Trackers(recipe, out, is_main=True, resumed_step=10).close()
    assert calls[0]["resume_from"] == "abc123?_step=11" and "id" not in calls[0] and "resume" not in calls[0]
    Trackers(recipe, out, is_main=True, resumed_step=0).close()  # no step to go back to
    assert calls[1]["id"] == "abc123" and calls[1]["resume"] == "allow" and "resume_from" not in calls[1]
    Trackers(recipe, out, is_main=True, resumed_step=10).close()
    assert "resume_from" in calls[2] and calls[3]["id"] == "abc123" and calls[3]["resume"] == "allow"


@pytest.mark.slow
def test_killed_run_resumed_has_each_step_once_in_mlflow_and_tensorboard(tiny_llama, alpaca_file, tmp_path):
    """A real run killed with SIGKILL after its newest checkpoint, then `train.resume=auto`: the MLflow run that goes
    on and TensorBoard's event files (each read alone) hold every step of metrics.jsonl once."""
    import signal
    import subprocess

    from conftest import child_env, recipe_dict, run_cmd, write_recipe
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, alpaca_file, run, train={
        "max_steps": 400, "log_every": 1, "save_every": 5, "trackers": ["mlflow", "tensorboard"],
        "gradient_checkpointing": False}))
    command = [sys.executable, "-m", "finetune", "train", str(recipe)]
    env = child_env()
    env.pop("MLFLOW_TRACKING_URI", None)

    def logged_steps(*, finished: bool = False) -> list[int]:
        path = run / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        lines = lines if finished else lines[:-1]  # a running run's last line may be partial
        return [json.loads(line)["step"] for line in lines if '"loss"' in line]

    with open(tmp_path / "first.log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and max(logged_steps(), default=0) < 7:
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert max(logged_steps()) > newest, "the kill came after steps past the newest checkpoint were logged"
    resumed = run_cmd([*command, "train.resume=auto", f"train.max_steps={newest + 3}"], cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = list(range(1, newest + 4))
    assert logged_steps(finished=True) == expected
    client = MlflowClient(tracking_uri=f"sqlite:///{(run / 'mlflow.db').resolve()}")
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == expected
    tensorboard_steps = []
    for path in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        events = EventAccumulator(str(path))
        events.Reload()
        tensorboard_steps += [e.step for e in events.Scalars("loss")]
    assert tensorboard_steps == expected
