"""Experiment tracking: metrics.jsonl always, plus TensorBoard, MLflow and Weights & Biases when the recipe asks.

    train:
      trackers: [tensorboard, mlflow, wandb]
      run_name: my-run                  # default: the name of output.dir
      mlflow_tracking_uri: http://...   # default: $MLFLOW_TRACKING_URI, else sqlite:///<output.dir>/mlflow.db

`Trackers.write(**record)` has the call shape of the loop's metrics log (`write(step=..., loss=..., lr=...)`).
Only rank 0 writes anything. A tracker is a convenience, the run is the product: a tracker that is not installed,
cannot reach its server or fails at step 10,000 costs one warning line and is switched off; training goes on and
metrics.jsonl still holds every record. A resumed run's trackers follow metrics.jsonl, which keeps the steps up to the
checkpoint: `Trackers(..., resumed_step=N)`. MLflow (mlflow_store.py) in detail: docs/tracking.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.recipe import Recipe
from finetune.tracking.metrics_file import read_records
from finetune.tracking.mlflow_store import (
    STATE_FILE,
    MlflowTracker,
    missing_driver,
    mlflow_uri,
    redacted,
    redacted_tree,
    ui_line,
    warn,
)


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
EVENTS = "events.out.tfevents.*"


def event_suffix(out_dir: Path) -> str:
    """The end of the name of every event file a run writes (SummaryWriter's filename_suffix): `.ft-` and a short hash
    of its resolved output.dir. In a shared train.tensorboard_dir it tells a run's own files from other runs'."""
    return ".ft-" + hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:8]


def tensorboard_log_dir(recipe: Recipe, out_dir: Path, run_name: str) -> Path:
    """output.dir/tensorboard, or train.tensorboard_dir/<run name>: a folder shared by runs shows each as its own
    TensorBoard run (the run name as one folder name: `/` becomes `_`).

    The default run name is output.dir's last name, which unrelated runs share (`final`, `v2`): when that folder
    already holds another run's event files, this run takes `<name>-<hash of output.dir>` instead (and keeps it:
    a resume finds it). A train.run_name the user set is used as it is."""
    if not recipe.train.tensorboard_dir:
        return out_dir / "tensorboard"
    name = run_name.replace("/", "_").replace("\\", "_")
    named = Path(recipe.train.tensorboard_dir) / (name if name.strip(".") else "run")
    if recipe.train.run_name:
        return named
    suffix = event_suffix(out_dir)
    own = named.with_name(f"{named.name}-{suffix.removeprefix('.ft-')}")
    if own.is_dir() or any(not path.name.endswith(suffix) for path in named.glob(EVENTS)):
        return own
    return named


def cut_event_files(paths: list[Path], last_step: int) -> None:
    """Drop the events after `last_step` from the event files `paths` (each rewritten only if it has any).

    SummaryWriter's purge_step alone is not enough: only TensorBoard's legacy reader honours it; its data server and
    readers of single files (tbparse, scripts) would show the killed run's steps beside the retrained ones."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(paths):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [raw for raw in records if Event.FromString(raw).step <= last_step]
        if len(kept) == len(records):
            continue
        partial = path.with_name(".cut-in-progress.tmp")  # a name TensorBoard never reads (no "tfevents" in it)
        with open(partial, "wb") as handle:
            writer = RecordWriter(handle)
            for raw in kept:
                writer.write(raw)
            writer.flush()
        os.replace(partial, path)


class TensorBoardTracker:
    """Scalars in TensorBoard event files under `log_dir` (torch's SummaryWriter, needs the `tensorboard` package).

    The run's own event files are those of its earlier starts, at the top of `log_dir` (a subfolder is another
    TensorBoard run, or a link to one): every one in output.dir/tensorboard (the run folder's), and in a folder
    `shared` by runs (train.tensorboard_dir) or an output.dir/tensorboard that is a symbolic link (into a shared
    logdir, kept by begin_outputs) those whose names end in `suffix` (event_suffix of its output.dir). A fresh start
    (`resumed_step` 0) removes them (output.overwrite); a resume cuts them to `resumed_step` (the steps a run killed
    after its newest checkpoint logged are trained again) and writes on with SummaryWriter's purge_step, so each step
    shows once. Another run's files are never touched (a note says they are there): the default run name, output.dir's
    last name, once made a run delete an unrelated run's history, and a linked tensorboard/ every run's under it."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, run_name: str, recipe_yaml: str, *, resumed_step: int = 0, suffix: str = "",
                 shared: bool = False):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        linked = log_dir.is_symlink()
        found = list(log_dir.glob(EVENTS))  # never `**`: it followed a linked folder into every run's files there
        own = [path for path in found if not (shared or linked) or path.name.endswith(suffix)]
        if not resumed_step:
            for old in own:
                old.unlink()
        else:
            cut_event_files(own, resumed_step)
        if others := len(found) - len(own):
            fix = (f"it links to {log_dir.resolve()}: link this run's own folder there instead" if linked else
                   "set train.run_name to a name of this run's own")
            print(f"[finetune] note: {log_dir} also holds {others} event file(s) of another run, kept; TensorBoard "
                  f"shows them as one run with this one's. Fix: {fix}.", flush=True)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resumed_step + 1 if resumed_step else None,
                                    filename_suffix=suffix)
        first = resumed_step + 1 if resumed_step else 0  # the recipe of this launch, from its first step
        self.writer.add_text("recipe", "```yaml\n" + recipe_yaml + "\n```", first)
        self.writer.add_text("run_name", run_name, first)

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


class WandbTracker:
    """A Weights & Biases run; offline (synced later with `wandb sync`) when no API key is configured."""

    name = "wandb"

    def __init__(self, project: str, run_name: str, config: dict, out_dir: Path, run_id: str | None, *,
                 resumed_step: int = 0):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        options = {"project": project, "name": run_name, "config": config, "dir": str(out_dir), "mode": mode}
        self.run = None
        if run_id and resumed_step:
            # W&B's rewind: the run's history is cut before the first step trained again (a run killed after its
            # newest checkpoint logged later steps; W&B drops steps below its newest one). A preview feature of
            # W&B's cloud: where the server refuses it, the run is continued as before.
            try:
                self.run = wandb.init(**options, resume_from=f"{run_id}?_step={resumed_step + 1}")
            except Exception as exc:  # noqa: BLE001 - the plain resume below still works
                warn(f"W&B refused to rewind run {run_id} to step {resumed_step + 1} ({type(exc).__name__}); it is "
                     "continued instead, and W&B drops the steps below the newest one it holds.")
        if self.run is None:
            self.run = wandb.init(**options, id=run_id, resume="allow" if run_id else None)
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
    `resumed_step`: the checkpoint's step a resume starts from (0: a fresh start). The run folder's metrics.jsonl is
    then already trimmed to it (outputs/run_folder.py); the trackers are brought to the same timeline (the steps after
    it go, where the tracker can drop them: docs/tracking.md) and `elapsed_s` counts on from its last value there.
    `last_step`: the newest step written (`resumed_step` before any), where a record without a step is placed.
    """

    def __init__(self, recipe: Recipe, out_dir: str | Path, *, is_main: bool, tags: dict[str, str] | None = None,
                 resumed_step: int = 0, elapsed_before: float | None = None):
        self.out_dir = Path(out_dir)
        self.tags = tags or {}
        self.path = self.out_dir / "metrics.jsonl" if is_main else None
        self.backends: list = []
        self.mlflow_uri: str | None = None
        self.resumed_step = self.last_step = resumed_step
        self.elapsed_offset = 0.0
        if not is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = recipe.train.run_name or self.out_dir.resolve().name
        kept = read_records(self.path) if resumed_step and self.path.is_file() else []
        self.history = [(int(r.get("step", 0)), numeric_metrics(r)) for r in kept if numeric_metrics(r)]
        # seconds trained before the checkpoint: the checkpoint's own (a resume into another output.dir has no
        # metrics.jsonl), else the last elapsed_s kept (log_every > 1: up to log_every - 1 steps early)
        self.elapsed_offset = elapsed_before if elapsed_before is not None else next(
            (float(r["elapsed_s"]) for r in reversed(kept) if isinstance(r.get("elapsed_s"), (int, float))), 0.0)
        saved = self._saved_ids()
        for name in dict.fromkeys(recipe.train.trackers):  # in order, each once
            backend = self._guard(name, "start", lambda name=name: self._start(name, recipe, saved.get(name)))
            if backend is not None:
                self.backends.append(backend)
        ids = {b.name: b.run_id for b in self.backends if getattr(b, "run_id", None)}
        if "mlflow" in ids:
            # for the artifacts after training and for `finetune runs`; without a password, which they take from the
            # environment or recipe.yaml again (mlflow_store.stored_uri): the run folder is shared, copied, tarred
            ids["mlflow_uri"] = redacted(self.mlflow_uri)
        if ids:
            (self.out_dir / STATE_FILE).write_text(json.dumps(ids), encoding="utf-8")

    def _saved_ids(self) -> dict[str, str]:
        """Tracker run ids of an earlier start in this folder (a resumed run logs into the same tracker run)."""
        try:
            return json.loads((self.out_dir / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _start(self, name: str, recipe: Recipe, run_id: str | None):
        from finetune.recipe import recipe_to_yaml

        config = redacted_tree(recipe.model_dump(mode="json"))  # what a tracker shows: no password of a URI
        step = self.resumed_step
        if name == "tensorboard":
            return TensorBoardTracker(tensorboard_log_dir(recipe, self.out_dir, self.run_name), self.run_name,
                                      redacted(recipe_to_yaml(recipe)), resumed_step=step,
                                      suffix=event_suffix(self.out_dir), shared=bool(recipe.train.tensorboard_dir))
        if name == "mlflow":
            self.mlflow_uri = mlflow_uri(recipe, self.out_dir)
            return MlflowTracker(self.mlflow_uri, recipe.train.mlflow_experiment, self.run_name, flatten(config),
                                 self.tags, run_id, resumed_step=step, history=self.history, run_folder=self.out_dir)
        if name == "wandb":
            return WandbTracker(recipe.train.wandb_project, self.run_name, config, self.out_dir, run_id,
                                resumed_step=step)
        raise ValueError(f"unknown tracker {name!r}")

    def _guard(self, name: str, action: str, call: Callable[[], Any]) -> Any:
        """Run a tracker call; on any failure warn once, switch that tracker off and return None."""
        try:
            return call()
        except ImportError as exc:
            package = {"tensorboard": "tensorboard", "mlflow": "'finetune[trackers]'"}.get(name, name)
            missing = str(exc.name or exc)
            needs = " (the SQLite store needs sqlalchemy and alembic)" if missing in ("sqlalchemy", "alembic") else ""
            driver = missing_driver(self.mlflow_uri or "", missing) if name == "mlflow" else None
            warn(f"train.trackers: {driver}. Training goes on; metrics.jsonl has every metric." if driver else
                 f"train.trackers: {name} is not installed ({missing}){needs}; `pip install {package}` to use it. "
                 "Training goes on; metrics.jsonl has every metric.")
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop a run
            where = f" (tracking URI {redacted(self.mlflow_uri or '')})" if name == "mlflow" else ""
            reason = redacted((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:200]
            warn(f"train.trackers: {name}{where} failed to {action} ({type(exc).__name__}: {reason}); it is switched off "
                 "for this run. Training goes on; metrics.jsonl has every metric.")
        self.backends = [b for b in self.backends if b.name != name]
        return None

    def write(self, **record) -> None:
        """Append the record to metrics.jsonl and send its numbers to every live tracker at record['step'] (a record
        without one: at `last_step`). A resumed run's `elapsed_s` counts on from the checkpoint's."""
        step = int(record.get("step", self.last_step))
        self.last_step = max(self.last_step, step)
        if self.path is None:
            return
        if self.elapsed_offset and isinstance(record.get("elapsed_s"), (int, float)):
            record["elapsed_s"] = round(record["elapsed_s"] + self.elapsed_offset, 3)
        with open(self.path, "a", encoding="utf-8") as handle:
            # NaN / inf as the strings a skipped step writes ("nan"): a bare NaN is not JSON (JSON.parse and jq refuse it)
            handle.write(json.dumps({key: str(value) if isinstance(value, float) and not math.isfinite(value) else value
                                     for key, value in record.items()}) + "\n")
        metrics = numeric_metrics(record)
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


