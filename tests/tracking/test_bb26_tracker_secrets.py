"""Trackers and untrusted places (bug bash bb26): the password of an MLflow tracking URI (`http://user:pw@host`, from
the environment or train.mlflow_tracking_uri) never reaches what finetune prints, stores or sends to a tracker, while
the run still logs with it; a store whose database driver is missing names the driver; a symlinked
output.dir/tensorboard never costs another run its event files."""

from __future__ import annotations

import base64
import json
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_port

from finetune.cli import main
from finetune.recipe import recipe_to_yaml, validate_recipe
from finetune.tracking import Trackers, log_run_artifacts
from finetune.tracking.trackers import event_suffix

SECRET = "S3cr3tPW"


def make_recipe(tmp_path, **train):
    raw = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"learning_rate": 3e-4, **train}, "output": {"dir": str(tmp_path / "run")}}
    return validate_recipe(raw)


@pytest.fixture
def fake_mlflow():
    """A catch-all MLflow tracking server on 127.0.0.1 (every call answers with one experiment and one run); yields
    (port, run id, requests), each request as (method, path, Authorization header, body bytes). The run id is new
    for each server: MLflow caches a run's artifact store (its host) by run id."""
    run_id = uuid.uuid4().hex
    run = {"info": {"run_id": run_id, "run_uuid": run_id, "experiment_id": "1", "status": "RUNNING", "start_time": 0,
                    "lifecycle_stage": "active", "run_name": "x",
                    "artifact_uri": f"mlflow-artifacts:/1/{run_id}/artifacts"},
           "data": {"metrics": [], "params": [], "tags": []}}
    answer = json.dumps({"experiment": {"experiment_id": "1", "name": "finetune", "lifecycle_stage": "active",
                                        "artifact_location": "mlflow-artifacts:/1"},
                         "experiment_id": "1", "run": run, "runs": [], "metrics": [], "experiments": [],
                         "files": []}).encode()
    requests: list[tuple[str, str, str | None, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self):
            size = int(self.headers.get("Content-Length") or 0)
            requests.append((self.command, self.path, self.headers.get("Authorization"),
                             self.rfile.read(size) if size else b""))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_GET = do_POST = do_PUT = do_PATCH = answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], run_id, requests
    server.shutdown()
    server.server_close()


def run_with_mlflow(tmp_path, recipe):
    """A short run as train.py drives its trackers: records, close, recipe.yaml and adapter, then the artifacts."""
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    trackers = Trackers(recipe, out, is_main=True)
    trackers.write(step=1, loss=2.5)
    trackers.close()
    (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))  # the run folder's own copy (begin_outputs)
    (out / "adapter").mkdir(exist_ok=True)
    (out / "adapter" / "adapter_config.json").write_text("{}")
    log_run_artifacts(out)
    return out


def assert_logged_with_the_password_but_never_sent_it(requests):
    basic = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert requests and [r[:3] for r in requests if r[2] != basic] == []  # the run used the real URI
    assert not [path for _, path, _, body in requests if SECRET.encode() in body]
    assert any(method == "PUT" and path.endswith("/recipe.yaml") for method, path, _, _ in requests)


def test_mlflow_credentials_from_the_environment_stay_out_of_output_and_trackers_json(tmp_path, capsys, monkeypatch,
                                                                                     fake_mlflow):
    """Found by a bug bash: MLFLOW_TRACKING_URI=http://alice:S3cr3tPW@host was copied into output.dir/trackers.json
    (mode 644), printed in the `mlflow ui` line and by `finetune runs`. The resume and `finetune runs RUN` still
    reach the store: they take the URI with its password from the environment again."""
    port, run_id, requests = fake_mlflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{SECRET}@127.0.0.1:{port}")
    out = run_with_mlflow(tmp_path, make_recipe(tmp_path, trackers=["mlflow"]))
    saved = json.loads((out / "trackers.json").read_text())
    assert saved == {"mlflow": run_id, "mlflow_uri": f"http://***@127.0.0.1:{port}"}
    resumed = Trackers(make_recipe(tmp_path, trackers=["mlflow"], resume="auto"), out, is_main=True, resumed_step=1)
    assert resumed.backends and resumed.backends[0].run_id == run_id  # the resume found its MLflow run
    resumed.close()
    assert main(["runs", str(out)]) == 0
    captured = capsys.readouterr()
    assert "***@127.0.0.1" in captured.out and "warning" not in captured.err
    assert SECRET not in captured.out + captured.err
    assert_logged_with_the_password_but_never_sent_it(requests)
    assert any("runs/get" in path and run_id in path for _, path, _, _ in requests)


def test_mlflow_credentials_in_the_recipe_are_not_sent_as_params_artifacts_or_tensorboard_text(
        tmp_path, capsys, monkeypatch, fake_mlflow):
    """Found by a bug bash: train.mlflow_tracking_uri=http://alice:S3cr3tPW@host went to the MLflow server as the
    param train.mlflow_tracking_uri (every reader of the experiment saw it), again in the recipe.yaml artifact, and
    into TensorBoard's `recipe` text."""
    port, _, requests = fake_mlflow
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = make_recipe(tmp_path, trackers=["mlflow", "tensorboard"],
                         mlflow_tracking_uri=f"http://alice:{SECRET}@127.0.0.1:{port}")
    out = run_with_mlflow(tmp_path, recipe)
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err and "warning" not in captured.err
    assert SECRET not in (out / "trackers.json").read_text()
    params = b"".join(body for _, path, _, body in requests if path.endswith("log-batch"))
    assert f"http://***@127.0.0.1:{port}".encode() in params  # the key is there, without its password
    assert_logged_with_the_password_but_never_sent_it(requests)
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and not [path for path in events if SECRET.encode() in path.read_bytes()]


def test_mlflow_credentials_stay_out_of_the_failed_to_start_warning(tmp_path, capsys):
    """Found by a bug bash: `warning: train.trackers: mlflow (tracking URI http://alice:S3cr3tPW@127.0.0.1:9/) failed
    to start` printed the password of a server that did not answer."""
    out = tmp_path / "run"
    out.mkdir()
    uri = f"http://alice:{SECRET}@127.0.0.1:{free_port()}/"
    Trackers(make_recipe(tmp_path, trackers=["mlflow"], mlflow_tracking_uri=uri), out, is_main=True).close()
    err = capsys.readouterr().err
    assert "failed to start" in err and f"http://***@127.0.0.1:{uri.split(':')[-1]}" in err and SECRET not in err


def test_a_database_store_without_its_driver_names_the_driver_not_mlflow(tmp_path, capsys, monkeypatch):
    """Found by a bug bash: MLFLOW_TRACKING_URI=postgresql://... without psycopg said `mlflow is not installed
    (psycopg); pip install 'finetune[trackers]'`: mlflow was installed, and that extra holds no database driver."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://alice:pw0rd@127.0.0.1:9/mlflow")
    out = tmp_path / "run"
    out.mkdir()
    Trackers(make_recipe(tmp_path, trackers=["mlflow"]), out, is_main=True).close()
    err = capsys.readouterr().err
    assert "mlflow is not installed" not in err and "finetune[trackers]" not in err and "pw0rd" not in err
    assert "postgresql://***@127.0.0.1:9/mlflow" in err and "driver" in err
    assert "pip install 'psycopg[binary]'" in err or "pip install psycopg2-binary" in err


def test_a_symlinked_tensorboard_folder_keeps_other_runs_event_files(tmp_path, capsys):
    """Found by a bug bash: output.dir/tensorboard linked into a shared TensorBoard logdir (kept by design, "a link to
    scratch space"): the run's next fresh start globbed `**/events.out.tfevents.*` under the link and deleted every
    run's event files there. Now a fresh start removes only the files this run wrote (their names end in its event
    suffix), never a file in a subfolder."""
    shared = tmp_path / "shared_tb"
    colleague = shared / "colleague_run" / "events.out.tfevents.1700000000.colleague"
    colleague.parent.mkdir(parents=True)
    colleague.write_bytes(b"a colleague's history")
    beside = shared / "events.out.tfevents.1700000001.another"  # another run's, at the top of the shared logdir
    beside.write_bytes(b"another run's history")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").symlink_to(shared)
    recipe = make_recipe(tmp_path, trackers=["tensorboard"])
    for _ in range(2):  # the first run, then a fresh start of it (output.overwrite=true)
        trackers = Trackers(recipe, out, is_main=True)
        trackers.write(step=1, loss=2.5)
        trackers.close()
    assert colleague.read_bytes() == b"a colleague's history" and beside.read_bytes() == b"another run's history"
    own = [path for path in shared.glob("events.out.tfevents.*") if path.name.endswith(event_suffix(out))]
    assert len(own) == 1  # the first start's file went: only the second start's is left
    # a real tensorboard/ folder holding a link to another logdir: nothing under that link is touched either
    (out / "tensorboard").unlink()
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "elsewhere").symlink_to(shared)
    Trackers(recipe, out, is_main=True).close()
    assert colleague.is_file() and beside.is_file() and len(own) == 1 and own[0].is_file()
