"""`finetune runs`: the runs of an MLflow tracking store with their final losses, for people who do not open a UI.

    finetune runs                          $MLFLOW_TRACKING_URI, else every run folder under runs/
    finetune runs runs/x                   a run folder (the store in its trackers.json, else its output.dir/mlflow.db;
                                           a copied or moved folder: its own mlflow.db, with a note)
    finetune runs runs/                    every run folder inside
    finetune runs sqlite:///abs/mlflow.db  a store by URI (also http://server, file:/path)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.tracking.mlflow_store import (
    STATE_FILE,
    check_reachable,
    missing_driver,
    prepare_mlflow_env,
    redacted,
    sqlite_file,
    ui_line,
)
from finetune.tracking.mlflow_store import folder_store as saved_store


class RunsError(FinetuneError):
    """No MLflow store where the user pointed, or the store cannot be read."""


def folder_store(folder: Path) -> str | None:
    """The MLflow store of a run folder: the URI its run used (trackers.json), else its own mlflow.db; a folder copied
    or moved keeps its own (mlflow_store.folder_store), with a note saying so."""
    try:
        saved = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {}
    uri, note = saved_store(folder, saved if isinstance(saved, dict) else {})
    if note:
        print(f"[finetune] note: {note}", flush=True)
    return uri


def find_stores(where: str) -> list[str]:
    """URIs of the MLflow stores `where` names: a URI, a .db file, a run folder, or a folder of run folders."""
    database = sqlite_file(where) if "://" in where else None
    if database is not None and not database.is_file():  # MLflow would create an empty one and list 0 runs
        raise RunsError(f"{where}: no such database (looked for {database.resolve()}). Fix: name the run folder or "
                        "the mlflow.db file, or the URI with the database's absolute path (sqlite:////abs/mlflow.db).")
    if where.startswith("file:") and (folder := _file_store_folder(where)) is not None and not folder.exists():
        # MLflow's file store creates the folder (and .trash/, 0/) when it opens it: a typo listed "0 runs" and left
        # the folders behind, where a plain path that does not exist is refused (bb56)
        raise RunsError(f"{where}: no such folder ({folder.absolute()}). Fix: name the run folder, or the URI of a "
                        "store that exists (file:/abs/mlruns, sqlite:////abs/mlflow.db); listing never creates one.")
    if "://" in where or where.startswith("file:"):
        return [where]
    path = Path(where).expanduser()
    if path.is_file() and path.suffix == ".db":
        return [f"sqlite:///{path.resolve()}"]
    if path.is_dir():
        own = folder_store(path)
        if own:
            return [own]
        return list(dict.fromkeys(uri for child in sorted(path.iterdir()) if child.is_dir()
                                  for uri in [folder_store(child)] if uri))
    return []


def _file_store_folder(uri: str) -> Path | None:
    """The local folder of a `file:` URI (`file:/abs`, `file:///abs`, `file:rel`, percent-escapes decoded); None for
    one that names another host (`file://host/path`)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        return None
    return Path(url2pathname(parsed.path)).expanduser() if parsed.path else None


def store_rows(uri: str) -> list[dict]:
    """One row per run of the store, oldest first: name, status, final loss / eval loss, strategy, start, id."""
    prepare_mlflow_env(uri)
    check_reachable(uri)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    runs = client.search_runs(list(experiments), order_by=["attributes.start_time ASC"]) if experiments else []
    return [{
        "experiment": experiments.get(run.info.experiment_id, "?"),
        "name": run.info.run_name or "?",
        "status": run.info.status,
        "loss": run.data.metrics.get("loss"),
        "eval_loss": run.data.metrics.get("eval_loss"),
        "strategy": run.data.tags.get("strategy", ""),
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(run.info.start_time / 1000)),
        "run_id": run.info.run_id,
    } for run in runs]


def format_rows(rows: list[dict]) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    table = [("experiment", "run", "status", "loss", "eval loss", "strategy", "started", "run id")]
    table += [(r["experiment"], r["name"], r["status"], number(r["loss"]), number(r["eval_loss"]), r["strategy"],
               r["started"], r["run_id"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table)


def cli_runs(args: argparse.Namespace) -> int:
    places = args.where or [os.environ.get("MLFLOW_TRACKING_URI") or "runs"]
    stores = list(dict.fromkeys(uri for where in places for uri in find_stores(where)))
    if not stores:
        raise RunsError(f"no MLflow store in {redacted(', '.join(places))}: a run writes one when its recipe has "
                        "`train.trackers: [mlflow]` (default store: output.dir/mlflow.db). Pass a run folder, a folder "
                        "of run folders, or a tracking URI (sqlite:///path/mlflow.db, http://host:5000).")
    if importlib.util.find_spec("mlflow") is None:
        raise RunsError("`finetune runs` reads MLflow stores and needs mlflow: pip install 'finetune[trackers]'.")
    unread = []
    for index, uri in enumerate(stores):
        try:
            rows = store_rows(uri)
        except Exception as exc:  # noqa: BLE001 - one line per unreadable store, the others are still listed
            driver = missing_driver(uri, str(exc.name)) if isinstance(exc, ImportError) and exc.name else None
            reason = redacted((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:200]
            print(f"{redacted(uri)}: cannot be read ({driver or f'{type(exc).__name__}: {reason}'})")
            unread.append(uri)
            continue
        print(("\n" if index else "") + f"{redacted(uri)}: {len(rows)} run{'s' if len(rows) != 1 else ''}")
        if rows:
            print(format_rows(rows))
    if len(unread) == len(stores):  # nothing listed: a script must not read this as success
        raise RunsError(f"none of the MLflow stores of {redacted(', '.join(places))} could be read (the lines above "
                        "say why). Fix: name the run folder, its mlflow.db file, or a store URI that can be read.")
    if len(stores) == 1:
        print(ui_line(stores[0]))
    return 0
