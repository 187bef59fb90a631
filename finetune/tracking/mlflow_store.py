"""MLflow: the store a run logs into (checked up front: a dead server or an unwritable SQLite store is one warning,
not minutes of retries), one MLflow run per training run and its resume, the artifacts of a finished run.

A resume that trains again steps the MLflow run already holds (a run killed after its newest checkpoint) cannot drop
those points: MLflow has no call that deletes metric points. The resume then logs into a new MLflow run that holds
the run's metrics.jsonl, trimmed to the checkpoint, and tags the old one `finetune.replaced_by` (docs/tracking.md).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from finetune.recipe.text import absolute_store_uri

if TYPE_CHECKING:
    from finetune.recipe import Recipe

STATE_FILE = "trackers.json"  # run ids of the trackers, so a resumed run continues the same tracker run


def warn(message: str) -> None:
    """One line on stderr (rank 0 is the only caller)."""
    print(f"[finetune] warning: {message}", file=sys.stderr, flush=True)


# The user and password of a URI (`http://user:pw@host`, `postgresql://user:pw@host/db`): MLflow's REST client and
# SQLAlchemy take them from the URI, so the run logs with them, but nothing finetune prints, writes in the run folder or
# sends to a tracker holds them (docs/tracking.md: MLFLOW_TRACKING_USERNAME / _PASSWORD keep them out of the URI).
USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s\"'<>]+@")


def redacted(text: str) -> str:
    """`text` with the user and password of every URI in it left out: `http://***@host:5000`."""
    return USERINFO.sub(r"\1***@", text)


def redacted_tree(tree: Any) -> Any:
    """A recipe dump (dicts, lists, scalars) with `redacted` text: the params, config and recipe sent to trackers."""
    if isinstance(tree, dict):
        return {key: redacted_tree(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [redacted_tree(value) for value in tree]
    return redacted(tree) if isinstance(tree, str) else tree


def stored_uri(saved: str, out_dir: Path) -> str:
    """The URI a run folder's trackers.json stands for. It holds the URI `redacted`; the one to log with is the
    environment's MLFLOW_TRACKING_URI or the run's recipe.yaml train.mlflow_tracking_uri, whichever reads the same
    once redacted (the recipe's first, as in `mlflow_uri`). Neither matching: `saved` as it is (the store then
    answers that it wants credentials)."""
    if redacted(saved) != saved or "***@" not in saved:
        return saved
    candidates = [_recipe_uri(out_dir / "recipe.yaml"), os.environ.get("MLFLOW_TRACKING_URI")]
    return next((uri for uri in candidates if uri and redacted(uri) == saved), saved)


def _recipe_uri(path: Path) -> str | None:
    """train.mlflow_tracking_uri of a run's recipe.yaml (None when there is none or it cannot be read)."""
    from finetune.recipe import read_yaml

    try:
        uri = (read_yaml(path).get("train") or {}).get("mlflow_tracking_uri") if path.is_file() else None
    except Exception:  # noqa: BLE001 - a recipe.yaml that does not read names no store
        return None
    return uri if isinstance(uri, str) else None


# The database driver SQLAlchemy imports for a store URI's scheme (postgresql -> psycopg, mysql -> MySQLdb,
# mysql+pymysql -> pymysql ...) -> the package that installs it. mlflow and finetune[trackers] bring none of them.
DRIVER_PACKAGES = {"psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                   "pymysql": "pymysql", "mysql": "mysql-connector-python", "pg8000": "pg8000", "pyodbc": "pyodbc",
                   "pymssql": "pymssql", "oracledb": "oracledb", "cx_Oracle": "cx_Oracle"}
DATABASES = ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle")


def missing_driver(uri: str, module: str) -> str | None:
    """What to say when the database store of `uri` cannot import `module`, its driver (None: not a database store,
    or the missing module is MLflow's own or SQLAlchemy's, which `pip install 'finetune[trackers]'` brings)."""
    scheme = uri.partition("://")[0].lower() if "://" in uri else ""
    module = module.split(".")[0]
    if scheme.split("+")[0] not in DATABASES or module in ("mlflow", "sqlalchemy", "alembic"):
        return None
    package = DRIVER_PACKAGES.get(module, module)
    return (f"the MLflow store at {redacted(uri)} needs the database driver {module}, which is not installed "
            f"(SQLAlchemy imports it for `{scheme}://` URIs). Fix: `pip install {package}`")


def mlflow_uri(recipe: Recipe, out_dir: Path) -> str:
    """The recipe's URI, else $MLFLOW_TRACKING_URI, else a SQLite store in the run folder (output.dir/mlflow.db).

    MLflow 3 keeps the plain-file store (`file:...`) only in maintenance mode; it still works when asked for by URI.
    """
    uri = recipe.train.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return absolute_store_uri(uri) if uri else default_store(out_dir)


def default_store(folder: Path) -> str:
    """A run folder's own store, the default when none is named: its SQLite database output.dir/mlflow.db."""
    return f"sqlite:///{(folder / 'mlflow.db').resolve()}"


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

    if redacted(uri) != uri:  # MLflow prints "View run ... at: <the URI, password and all>" when a run ends
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if uri.startswith("file:") or "://" not in uri:
        # mlflow 3.x refuses the file store unless told it is wanted; the user's URI asked for exactly that.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a dead server costs seconds, not minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # alembic says "Creating initial MLflow database tables..." and every migration; MLflow's engine retry loop
    # (~100 s on a store it cannot open) says each of its 27 tries: the one warning line of Trackers says it all.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.ERROR)
    database = sqlite_file(uri)
    if database is not None and not database.parent.is_dir():
        what = "is a file, not a folder" if database.parent.exists() else "does not exist"
        raise OSError(f"the folder of the SQLite store ({database.parent}) {what}")


def check_writable(uri: str) -> None:
    """Raise OSError at once when a SQLite store cannot be written (a read-only mount, a folder or file without write
    permission), instead of MLflow's ~100 s of retries. SQLite writes its journal beside the database: the folder must
    be writable, and the file too when it exists. `access` also says EROFS for root on a read-only mount."""
    database = sqlite_file(uri)
    if database is None:
        return
    for path in (database.parent, database) if database.exists() else (database.parent,):
        if not os.access(path, os.W_OK):
            raise OSError(f"the SQLite store's {'folder' if path == database.parent else 'file'} {path} cannot be "
                          "written (read-only)")


def folder_store(folder: Path, saved: dict) -> tuple[str | None, str | None]:
    """The MLflow store of a run folder whose trackers.json holds `saved`, and a note to print (None: nothing to say).

    The URI the run used (with the password the environment or recipe.yaml gives: stored_uri), else the folder's own
    mlflow.db. trackers.json holds that URI absolute, so a folder copied or moved from X still names X's own database
    (`sqlite:///X/mlflow.db`): `finetune runs COPY` listed the original's runs, a moved one "cannot be read", and the
    artifacts of a resume went to X (bb46). The folder's own mlflow.db is taken instead when it has one and X's is gone
    or this one holds the run (a copy of it). A store of the user's own (a server, another database) stays."""
    uri = saved.get("mlflow_uri")
    own = folder / "mlflow.db"
    fallback = default_store(folder) if own.is_file() else None
    if not isinstance(uri, str) or not uri:
        return fallback, None
    uri = stored_uri(uri, folder)
    database = sqlite_file(uri)
    if (fallback is None or database is None or database.name != "mlflow.db"
            or database.parent.resolve() == folder.resolve()):
        return uri, None
    if database.is_file() and not _holds_run(own, saved.get("mlflow")):
        return uri, None
    return fallback, (f"{folder / STATE_FILE} names the store {redacted(uri)}, the run folder it was copied or moved "
                      f"from ({'gone' if not database.is_file() else 'another folder, while this one holds the run'}); "
                      f"this folder's own {own} is used instead.")


def _holds_run(database: Path, run_id: Any) -> bool:
    """Whether the SQLite store `database` has the MLflow run `run_id` (read-only; False when it cannot be read)."""
    if not isinstance(run_id, str):
        return False
    try:
        with closing(sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return db.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() is not None
    except sqlite3.Error:
        return False


def adopt_artifact_locations(folder: Path) -> None:
    """Point the artifacts of a run folder's own store (output.dir/mlflow.db) at output.dir/mlartifacts.

    An experiment's artifact location, and each run's under it, is an absolute path fixed when it is created; MLflow has
    no call that changes it. A run folder copied or moved keeps its mlflow.db, which names the mlartifacts/ of the
    folder it came from: resuming a copy wrote its adapter, recipe.yaml and plot.png over the original run's
    artifacts, resuming a moved one created the old folder again (bb46). The locations finetune gave
    (`<another folder>/mlartifacts`, artifact_location) are rewritten in the database itself, for the experiments, their
    runs and logged models: the mlartifacts/ that came along holds what they name. Other locations stay as they are."""
    database, here = folder / "mlflow.db", (folder.resolve() / "mlartifacts")
    if not database.is_file():
        return
    with closing(sqlite3.connect(database)) as db, db:
        try:
            experiments = db.execute("SELECT experiment_id, artifact_location FROM experiments").fetchall()
        except sqlite3.Error:  # not an MLflow database (yet): MLflow makes its tables when it opens it
            return
        for experiment_id, location in experiments:
            path = _local_path(location or "")
            if path is None or path.name != "mlartifacts" or path == here:
                continue
            db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (here.as_uri(), experiment_id))
            for table, column in (("runs", "artifact_uri"), ("logged_models", "artifact_location")):
                try:  # each run's location is its experiment's + /<run id>/artifacts
                    db.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE experiment_id = ? "
                               f"AND substr({column}, 1, ?) = ?",
                               (here.as_uri(), len(location) + 1, experiment_id, len(location), location))
                except sqlite3.OperationalError:  # an MLflow without logged models
                    pass
            print(f"[finetune] note: {database} came with the run folder from {path.parent} (copied or moved): its "
                  f"MLflow artifacts now go to {here}, not {path}.", flush=True)
            _forget_artifact_places()


def _forget_artifact_places() -> None:
    """MLflow keeps each run's artifact place for the life of the process (by run id, not store): a process that
    logged the original's artifacts (a notebook, the tests) would otherwise still write there."""
    try:
        from mlflow.tracking._tracking_service import utils
    except ImportError:
        return
    getattr(utils, "_artifact_repos_cache", {}).clear()


def _local_path(location: str) -> Path | None:
    """The folder of a local artifact location (`file:///abs` or `/abs`); None for other schemes (s3://, a server)."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(location) if location.startswith("/") else None


def step_ranges(steps: list[int]) -> str:
    """[11, 12, 13, 15] -> '11-13, 15'."""
    spans: list[list[int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class MlflowTracker:
    """One run in an MLflow tracking store: the recipe as params, run facts as tags, metrics per step. Uses the
    client API, not mlflow's process-global active run, so nothing leaks into user code that also uses mlflow.

    A resumed training run (`resumed_step` > 0) passes the saved `run_id` and continues that MLflow run (its status
    goes back to RUNNING), unless the run holds steps after `resumed_step` (logged by a run killed after its newest
    checkpoint): MLflow cannot delete metric points, so those steps would be there twice; a new MLflow run then takes
    over with `history` (the kept metrics.jsonl, as (step, metrics) pairs). Params are immutable in MLflow: a resume
    that changes recipe keys tags them `resumed_at_<step>.<key>`. `close(status)` ends the run as FINISHED, or KILLED
    (preempted) / FAILED."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
                 run_id: str | None, *, resumed_step: int = 0, history: list[tuple[int, dict[str, float]]] = (),
                 run_folder: Path | None = None):
        prepare_mlflow_env(uri)
        check_reachable(uri)
        check_writable(uri)
        if run_folder is not None and uri == default_store(run_folder):  # the folder's own store, maybe copied
            adopt_artifact_locations(run_folder)
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._param, self._tag, self.uri = Metric, Param, RunTag, uri
        self.client = MlflowClient(tracking_uri=uri)
        params = {key: str(value)[:6000] for key, value in params.items()}
        saved = self._saved_run(run_id) if run_id is not None else None
        if saved is not None and resumed_step:
            later = self._steps_after(saved, resumed_step)
            self.run_id = self._replace(saved, later, resumed_step, history) if later else run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self._tag_changes(saved.data.params, params, resumed_step)
            return
        if saved is not None:  # no step to go back to (a caller without resumed_step): as before, the same run
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found else
                         self.client.create_experiment(experiment, artifact_location=artifact_location(uri)))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._log_facts(params, tags)
        self._log_history(history)
        if resumed_step:
            self._batches(tags=[RunTag("resumed_from_step", str(resumed_step))])

    def _saved_run(self, run_id: str):
        """The saved run; None (a new run is started) when this store does not have it."""
        try:
            return self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException (unknown id): another store than the first start used
            warn(f"MLflow run {run_id} (trackers.json) is not in {redacted(self.uri)}; the resumed run starts a new "
                 "MLflow run.")
            return None

    def _steps_after(self, run, resumed_step: int) -> list[int]:
        """Steps after the checkpoint the run already holds: they are trained again."""
        return sorted({point.step for key in run.data.metrics
                       for point in self.client.get_metric_history(run.info.run_id, key) if point.step > resumed_step})

    def _replace(self, old, later: list[int], resumed_step: int, history) -> str:
        """A new MLflow run for the resumed timeline: the old run's name, params and tags, the kept history. The old
        run stays as it was (KILLED if it was left RUNNING), tagged with its successor."""
        facts = {key: value for key, value in old.data.tags.items() if not key.startswith("mlflow.")}
        new_id = self.client.create_run(old.info.experiment_id, run_name=old.info.run_name).info.run_id
        self.run_id = new_id
        self._log_facts(old.data.params, {**facts, "finetune.replaces": old.info.run_id})
        self._log_history(history)
        self.client.set_tag(old.info.run_id, "finetune.replaced_by", new_id)
        if old.info.status == "RUNNING":  # killed without a word (SIGKILL, OOM, a lost node)
            self.client.set_terminated(old.info.run_id, status="KILLED")
        warn(f"MLflow run {old.info.run_id} holds steps {step_ranges(later)}, which the resume from step "
             f"{resumed_step} trains again; MLflow cannot delete metric points, so the run goes on in a new MLflow run "
             f"{new_id} (steps up to {resumed_step} copied from metrics.jsonl); the old one is kept, tagged "
             "finetune.replaced_by.")
        return new_id

    def _tag_changes(self, logged: dict[str, str], params: dict[str, str], resumed_step: int) -> None:
        """Recipe keys this resume changed, as tags (MLflow refuses to change a logged param)."""
        changed = [self._tag(f"resumed_at_{resumed_step}.{key}", value) for key, value in params.items()
                   if logged.get(key) != value]
        self._batches(tags=[self._tag("resumed_from_step", str(resumed_step)), *changed])

    def _log_facts(self, params: dict[str, str], tags: dict[str, str]) -> None:
        self._batches(params=[self._param(key, value) for key, value in params.items()])
        self._batches(tags=[self._tag(key, str(value)) for key, value in tags.items()])

    def _log_history(self, history) -> None:
        import time

        now = int(time.time() * 1000)
        self._batches(metrics=[self._metric(key, value, now, step) for step, metrics in history
                               for key, value in metrics.items()])

    def _batches(self, *, params=(), tags=(), metrics=()) -> None:
        """log_batch within MLflow's limits: 100 params, 100 tags, 1000 metrics per call."""
        for items, size, name in ((params, 100, "params"), (tags, 100, "tags"), (metrics, 1000, "metrics")):
            for start in range(0, len(items), size):
                self.client.log_batch(self.run_id, **{name: list(items[start : start + size])})

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


def ui_line(uri: str) -> str:
    return (f"[finetune] MLflow: mlflow ui --backend-store-uri {redacted(uri)}   (the UI needs the full "
            "`pip install mlflow`)")


# ------------------------------------------------------------------------------------------ after the training
def log_run_artifacts(out_dir: str | Path) -> None:
    """Adapter, recipe and plot of a finished run into its MLflow run (rank 0, after the adapter is written).

    Does nothing for a run without MLflow; a failure is one warning line (the files are in the run folder anyway).
    """
    out_dir = Path(out_dir)
    try:
        saved = json.loads((out_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if "mlflow" not in saved or "mlflow_uri" not in saved:
        return
    uri, note = folder_store(out_dir, saved)
    if note:
        print(f"[finetune] note: {note}", flush=True)
    run_id = saved["mlflow"]
    try:
        prepare_mlflow_env(uri)
        check_reachable(uri)
        if uri == default_store(out_dir):  # never into another folder's mlartifacts/ (a copied store names them)
            adopt_artifact_locations(out_dir)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if (out_dir / "adapter").is_dir():
            client.log_artifacts(run_id, str(out_dir / "adapter"), artifact_path="adapter")
        if (out_dir / "recipe.yaml").is_file():  # a copy without the passwords of URIs (train.mlflow_tracking_uri)
            with tempfile.TemporaryDirectory() as folder:
                shown = Path(folder) / "recipe.yaml"
                shown.write_text(redacted((out_dir / "recipe.yaml").read_text(encoding="utf-8")), encoding="utf-8")
                client.log_artifact(run_id, str(shown))
        if (out_dir / "plot.png").is_file():
            client.log_artifact(run_id, str(out_dir / "plot.png"))
    except Exception as exc:  # noqa: BLE001 - the run is done and its files are on disk; the tracker is a convenience
        reason = redacted((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:200]
        warn(f"train.trackers: mlflow (tracking URI {redacted(uri)}) failed to store the artifacts "
             f"({type(exc).__name__}: {reason}); they are in {out_dir}.")
        return
    print(ui_line(uri), flush=True)
