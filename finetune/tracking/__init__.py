"""Tracking: metrics.jsonl always, TensorBoard / MLflow / W&B when the recipe asks; the run's plot; `finetune runs`.

    trackers.py   Trackers (every backend behind one log call): TensorBoard, W&B, resumes brought onto one timeline
    mlflow_store.py  MLflow: the store (checked up front), the run and its resume, log_run_artifacts
    metrics_file.py  metrics.jsonl read back in today's metric names (old runs' `lr`, `tokens` translated)
    plot.py       plot.png of a run (loss and learning rate against steps), `finetune plot`
    runs.py       `finetune runs`: an MLflow store's runs with their final losses
"""

from finetune.tracking.mlflow_store import log_run_artifacts
from finetune.tracking.plot import plot_run
from finetune.tracking.trackers import Trackers, run_tags

__all__ = ["Trackers", "finish_run", "log_run_artifacts", "plot_run", "run_tags"]


def finish_run(out_dir) -> None:
    """A finished run's last writes (rank 0): plot.png (loss, eval loss and learning rate against steps), then the
    adapter, recipe and plot into the MLflow run, when there is one."""
    plot_run(out_dir)
    log_run_artifacts(out_dir)
