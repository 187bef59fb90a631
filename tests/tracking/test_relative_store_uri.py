"""A relative MLflow store URI names the same database from every folder (bb25 #5)."""
from __future__ import annotations

import pytest
import yaml

from finetune.recipe import load_recipe, validate_recipe
from finetune.tracking.mlflow_store import mlflow_uri
from finetune.tracking.runs import RunsError, find_stores


def test_a_relative_store_uri_is_made_absolute_where_the_run_starts(tmp_path, monkeypatch):
    """Found by a bug bash (bb25 #5): `train.mlflow_tracking_uri: sqlite:///rel.db` (or MLFLOW_TRACKING_URI) was kept
    relative in recipe.yaml and trackers.json, so `finetune runs RUN` from another folder found 0 runs, and a resume
    there started a second MLflow run in a second database. Now the path is absolute from the folder the run starts
    in, as output.dir is; other URIs stay as given."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    raw = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"mlflow_tracking_uri": "sqlite:///rel.db"}}
    path.write_text(yaml.safe_dump(raw))
    assert load_recipe(path).train.mlflow_tracking_uri == f"sqlite:///{tmp_path}/rel.db"
    bare = validate_recipe({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]}})
    for given, expected in [("sqlite:///env.db", f"sqlite:///{tmp_path}/env.db"), ("file:mlruns", f"file:{tmp_path}/mlruns"),
                            ("mlruns", str(tmp_path / "mlruns")), ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
                            ("http://host:5000", "http://host:5000"), ("sqlite:///:memory:", "sqlite:///:memory:")]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", given)
        assert mlflow_uri(bare, tmp_path / "run") == expected, given


def test_runs_of_a_database_that_does_not_exist_is_refused_without_creating_it(tmp_path, monkeypatch):
    """Found by a bug bash (bb25 #5): `finetune runs sqlite:///rel.db` from the wrong folder said "0 runs" and MLflow
    created an empty rel.db there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunsError, match=r"sqlite:///rel.db: no such database"):
        find_stores("sqlite:///rel.db")
    assert not (tmp_path / "rel.db").exists()
