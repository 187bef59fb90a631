"""Experiment tracking: metrics.jsonl always, plus TensorBoard, MLflow and Weights & Biases when the recipe asks.

    train:
      trackers: [tensorboard, mlflow, wandb]
      run_name: my-run                  # default: the name of output.dir
      mlflow_tracking_uri: http://...   # default: $MLFLOW_TRACKING_URI, else file:<output.dir>/mlruns

`Trackers.write(**record)` has the call shape of the loop's metrics log (`write(step=..., loss=..., lr=...)`).
Only rank 0 writes anything. A tracker is a convenience, the run is the product: a tracker that is not installed,
cannot reach its server or fails at step 10,000 costs one warning line and is switched off; training goes on and
metrics.jsonl still holds every record.
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

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def mlflow_uri(recipe: Recipe, out_dir: Path) -> str:
    """The recipe's URI, else $MLFLOW_TRACKING_URI, else a file store in the run folder."""
    uri = recipe.train.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"file:{(out_dir / 'mlruns').resolve()}"


def check_reachable(uri: str, *, timeout_s: float = 3.0) -> None:
    """Raise OSError at once when an http(s) tracking server does not answer, instead of MLflow's minutes of retries."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout_s):
        pass


class MlflowTracker:
    """A run in an MLflow tracking store: the recipe as params, metrics per step. Uses the client API, not
    mlflow's process-global active run, so nothing leaks into user code that also uses mlflow."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any], run_id: str | None):
        if uri.startswith("file:") or "://" not in uri:
            # mlflow 3.x refuses the file store unless told it is wanted; a local folder is exactly what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a dead server costs seconds, not minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        check_reachable(uri)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self.uri = Metric, uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            items = [Param(key, str(value)[:6000]) for key, value in params.items()]
            for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=items[start : start + 100])
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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

    def close(self) -> None:
        self.run.finish()


# ------------------------------------------------------------------------------------------------- the facade
class Trackers:
    """metrics.jsonl plus the recipe's trackers, rank 0 only; every tracker call is guarded.

    Drop-in for the loop's metrics log: `write(step=..., loss=..., ...)`, then `close()` at the end of the run.
    """

    def __init__(self, recipe: Recipe, out_dir: str | Path, *, is_main: bool):
        self.out_dir = Path(out_dir)
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
                                 flatten(config), run_id)
        if name == "wandb":
            return WandbTracker(recipe.train.wandb_project, self.run_name, config, self.out_dir, run_id)
        raise ValueError(f"unknown tracker {name!r}")

    def _guard(self, name: str, action: str, call: Callable[[], Any]) -> Any:
        """Run a tracker call; on any failure warn once, switch that tracker off and return None."""
        try:
            return call()
        except ImportError as exc:
            package = {"tensorboard": "tensorboard", "mlflow": "mlflow"}.get(name, name)
            warn(f"train.trackers: {name} is not installed ({exc.name or exc}); `pip install {package}` to use it. "
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

    def close(self) -> None:
        """Flush and end every tracker run (idempotent)."""
        for backend in list(self.backends):
            self._guard(backend.name, "close", backend.close)
        self.backends = []
