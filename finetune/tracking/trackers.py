"""Experiment tracking: metrics.jsonl always, plus TensorBoard, MLflow and Weights & Biases when the recipe asks.

    train:
      trackers: [tensorboard, mlflow, wandb]
      run_name: my-run                  # default: the name of output.dir
      mlflow_tracking_uri: http://...   # default: $MLFLOW_TRACKING_URI, else sqlite:///<output.dir>/mlflow.db

`Trackers.write(**record)` has the call shape of the loop's metrics log (`write(step=..., loss=..., lr=...)`).
Only rank 0 writes anything. A tracker is a convenience, the run is the product: a tracker that is not installed,
cannot reach its server or fails at step 10,000 costs one warning line and is switched off; training goes on and
metrics.jsonl still holds every record. MLflow in detail: docs/tracking.md.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from finetune.recipe import Recipe

STATE_FILE = "trackers.json"  # run ids of the trackers, so a resumed run continues the same tracker run


def warn(message: str) -> None:
    """One line on stderr (rank 0 is the only caller)."""
    print(f"[finetune] warning: {message}", file=sys.stderr, flush=True)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; lists become their JSON text (trackers take scalars)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return flat


def numeric_metrics(record: dict) -> dict[str, float]:
    """The numbers of a record, without `step` (strings such as `skipped` reasons stay in metrics.jsonl only)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


# ---------------------------------------------------------------------------------------------------- backends
class TensorBoardTracker:
    """Scalars in TensorBoard event files under `log_dir` (torch's SummaryWriter, needs the `tensorboard` package)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, run_name: str, recipe_yaml: str):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("recipe", "```yaml\n" + recipe_yaml + "\n```", 0)
        self.writer.add_text("run_name", run_name, 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A markdown table in the TEXT tab (TensorBoard has no table type)."""
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self, status: str = "FINISHED") -> None:
        self.writer.flush()
        self.writer.close()


def mlflow_uri(recipe: Recipe, out_dir: Path) -> str:
    """The recipe's URI, else $MLFLOW_TRACKING_URI, else a SQLite store in the run folder (output.dir/mlflow.db).

    MLflow 3 keeps the plain-file store (`file:...`) only in maintenance mode; it still works when asked for by URI.
    """
    uri = recipe.train.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"


def check_reachable(uri: str, *, timeout_s: float = 3.0) -> None:
    """Raise OSError at once when an http(s) tracking server does not answer, instead of MLflow's minutes of retries."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout_s):
        pass


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (None for other stores and in-memory databases)."""
    if not uri.startswith("sqlite:///") or uri in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: mlartifacts/ next to the database file.

    Without it MLflow would use ./mlruns of whatever folder the run was started from.
    Other stores (a server, the file store) decide themselves.
    """
    database = sqlite_file(uri)
    return (database.resolve().parent / "mlartifacts").as_uri() if database else None


def prepare_mlflow_env(uri: str) -> None:
    """Environment and logging for MLflow's client: fast failure on a dead server, the file store allowed when asked."""
    import logging

    if uri.startswith("file:") or "://" not in uri:
        # mlflow 3.x refuses the file store unless told it is wanted; the user's URI asked for exactly that.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a dead server costs seconds, not minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables...", per migration
        logging.getLogger(name).setLevel(logging.WARNING)
    database = sqlite_file(uri)
    if database is not None and not database.parent.is_dir():
        raise OSError(f"the folder of the SQLite store ({database.parent}) does not exist")


class MlflowTracker:
    """One run in an MLflow tracking store: the recipe as params, run facts as tags, metrics per step. Uses the
    client API, not mlflow's process-global active run, so nothing leaks into user code that also uses mlflow.

    A resumed training run passes the saved `run_id` and continues that MLflow run (its status goes back to
    RUNNING); `close(status)` ends it as FINISHED, or KILLED (preempted) / FAILED."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
                 run_id: str | None):
        prepare_mlflow_env(uri)
        check_reachable(uri)
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self.uri = Metric, uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None and self._continue(run_id):
            self.run_id = run_id
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found else
                         self.client.create_experiment(experiment, artifact_location=artifact_location(uri)))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[start : start + 100])
        self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])

    def _continue(self, run_id: str) -> bool:
        """Reopen the saved run; False (a new run is started) when this store does not have it."""
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException (unknown id): another store than the first start used
            warn(f"MLflow run {run_id} (trackers.json) is not in {self.uri}; the resumed run starts a new MLflow run.")
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """An MLflow table artifact per step (`<name>/step-<N>.json`), shown in the run's artifacts and evaluation."""
        data = {column: [row[i] for row in rows] for i, column in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{name}/step-{step:08d}.json")

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def run_tags(*, strategy: str, world_size: int, device: str) -> dict[str, str]:
    """What ran where: strategy, world size, device type, library versions (MLflow tags)."""
    import platform
    from importlib import metadata

    tags = {"strategy": strategy, "world_size": str(world_size), "device": device_name(device),
            "python": platform.python_version()}
    for package in ("finetune", "torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets"):
        try:
            tags[f"version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return tags


def device_name(device: str) -> str:
    """`NVIDIA H100 80GB HBM3` for a CUDA device, else the CPU's name (or just `cpu`)."""
    import platform

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def ui_line(uri: str) -> str:
    return f"[finetune] MLflow: mlflow ui --backend-store-uri {uri}   (the UI needs the full `pip install mlflow`)"


class WandbTracker:
    """A Weights & Biases run; offline (synced later with `wandb sync`) when no API key is configured."""

    name = "wandb"

    def __init__(self, project: str, run_name: str, config: dict, out_dir: Path, run_id: str | None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(out_dir), mode=mode,
                              id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


# ------------------------------------------------------------------------------------------------- the facade
class Trackers:
    """metrics.jsonl plus the recipe's trackers, rank 0 only; every tracker call is guarded.

    Drop-in for the loop's metrics log: `write(step=..., loss=..., ...)`, then `close()` at the end of the run.
    """

    def __init__(self, recipe: Recipe, out_dir: str | Path, *, is_main: bool, tags: dict[str, str] | None = None):
        self.out_dir = Path(out_dir)
        self.tags = tags or {}
        self.path = self.out_dir / "metrics.jsonl" if is_main else None
        self.backends: list = []
        self.mlflow_uri: str | None = None
        if not is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = recipe.train.run_name or self.out_dir.resolve().name
        saved = self._saved_ids()
        for name in dict.fromkeys(recipe.train.trackers):  # in order, each once
            backend = self._guard(name, "start", lambda name=name: self._start(name, recipe, saved.get(name)))
            if backend is not None:
                self.backends.append(backend)
        ids = {b.name: b.run_id for b in self.backends if getattr(b, "run_id", None)}
        if "mlflow" in ids:
            ids["mlflow_uri"] = self.mlflow_uri  # for the artifacts after training and for `finetune runs`
        if ids:
            (self.out_dir / STATE_FILE).write_text(json.dumps(ids))

    def _saved_ids(self) -> dict[str, str]:
        """Tracker run ids of an earlier start in this folder (a resumed run logs into the same tracker run)."""
        try:
            return json.loads((self.out_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _start(self, name: str, recipe: Recipe, run_id: str | None):
        from finetune.recipe import recipe_to_yaml

        config = recipe.model_dump(mode="json")
        if name == "tensorboard":
            log_dir = Path(recipe.train.tensorboard_dir) if recipe.train.tensorboard_dir else self.out_dir / "tensorboard"
            return TensorBoardTracker(log_dir, self.run_name, recipe_to_yaml(recipe))
        if name == "mlflow":
            self.mlflow_uri = mlflow_uri(recipe, self.out_dir)
            return MlflowTracker(self.mlflow_uri, recipe.train.mlflow_experiment, self.run_name,
                                 flatten(config), self.tags, run_id)
        if name == "wandb":
            return WandbTracker(recipe.train.wandb_project, self.run_name, config, self.out_dir, run_id)
        raise ValueError(f"unknown tracker {name!r}")

    def _guard(self, name: str, action: str, call: Callable[[], Any]) -> Any:
        """Run a tracker call; on any failure warn once, switch that tracker off and return None."""
        try:
            return call()
        except ImportError as exc:
            package = {"tensorboard": "tensorboard", "mlflow": "'finetune[trackers]'"}.get(name, name)
            missing = exc.name or exc
            needs = " (the SQLite store needs sqlalchemy and alembic)" if missing in ("sqlalchemy", "alembic") else ""
            warn(f"train.trackers: {name} is not installed ({missing}){needs}; `pip install {package}` to use it. "
                 "Training goes on; metrics.jsonl has every metric.")
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop a run
            where = f" (tracking URI {self.mlflow_uri})" if name == "mlflow" else ""
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            warn(f"train.trackers: {name}{where} failed to {action} ({type(exc).__name__}: {reason}); it is switched off "
                 "for this run. Training goes on; metrics.jsonl has every metric.")
        self.backends = [b for b in self.backends if b.name != name]
        return None

    def write(self, **record) -> None:
        """Append the record to metrics.jsonl and send its numbers to every live tracker at record['step']."""
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        metrics, step = numeric_metrics(record), int(record.get("step", 0))
        if not metrics:
            return
        for backend in list(self.backends):
            self._guard(backend.name, "log", lambda backend=backend: backend.log(metrics, step))

    def table(self, name: str, records: list[dict], step: int) -> None:
        """Rows (dicts; nested dicts flattened as `key.inner`, lists as JSON text) to every tracker's table at
        `step` (rank 0 only). TRL logs GRPO's completions this way."""
        if self.path is None or not records:
            return
        flat = [flatten(record) for record in records]
        columns = list(dict.fromkeys(key for record in flat for key in record))
        plain = lambda value: value if isinstance(value, (int, float, str)) or value is None else json.dumps(value)
        rows = [[plain(record.get(column)) for column in columns] for record in flat]
        for backend in list(self.backends):
            self._guard(backend.name, "log a table", lambda backend=backend: backend.table(name, columns, rows, step))

    def close(self, status: str = "FINISHED") -> None:
        """Flush and end every tracker run (idempotent). `status`: FINISHED, KILLED (preempted) or FAILED.

        A finished run's artifacts come afterwards (log_run_artifacts); a run that ends otherwise prints the
        `mlflow ui` line here, as it gets no further."""
        live_mlflow = any(b.name == "mlflow" for b in self.backends)
        for backend in list(self.backends):
            self._guard(backend.name, "close", lambda backend=backend: backend.close(status))
        self.backends = []
        if live_mlflow and status != "FINISHED":
            print(ui_line(self.mlflow_uri), flush=True)


# ------------------------------------------------------------------------------------------ after the training
def log_run_artifacts(out_dir: str | Path) -> None:
    """Adapter, recipe and plot of a finished run into its MLflow run (rank 0, after the adapter is written).

    Does nothing for a run without MLflow; a failure is one warning line (the files are in the run folder anyway).
    """
    out_dir = Path(out_dir)
    try:
        saved = json.loads((out_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return
    if "mlflow" not in saved or "mlflow_uri" not in saved:
        return
    uri, run_id = saved["mlflow_uri"], saved["mlflow"]
    try:
        prepare_mlflow_env(uri)
        check_reachable(uri)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if (out_dir / "adapter").is_dir():
            client.log_artifacts(run_id, str(out_dir / "adapter"), artifact_path="adapter")
        for name in ("recipe.yaml", "plot.png"):
            if (out_dir / name).is_file():
                client.log_artifact(run_id, str(out_dir / name))
    except Exception as exc:  # noqa: BLE001 - the run is done and its files are on disk; the tracker is a convenience
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warn(f"train.trackers: mlflow (tracking URI {uri}) failed to store the artifacts ({type(exc).__name__}: "
             f"{reason}); they are in {out_dir}.")
        return
    print(ui_line(uri), flush=True)
