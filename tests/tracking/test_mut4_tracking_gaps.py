"""Mutation testing round 4 (mut4): rules of tracking/trackers.py and tracking/metrics_file.py that no test read.

Found by a bug bash: each test below is the one check that a surviving mutant broke without any test failing
(TR01: which TensorBoard events a resume keeps; TR02: a resumed run's elapsed_s; TR03: NaN written as JSON text;
TR04: an old metrics.jsonl's per-step `tokens` summed into num_tokens; TR05: `last_step` after an out-of-order
record). In-process; no tracker service.
"""

from __future__ import annotations

import json

from finetune.recipe import validate_recipe
from finetune.tracking import Trackers
from finetune.tracking.metrics_file import translated
from finetune.tracking.trackers import cut_event_files


def _recipe(tmp_path):
    return validate_recipe({"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                            "train": {"trackers": []}, "output": {"dir": str(tmp_path / "run")}})


def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_a_cut_keeps_the_events_of_the_checkpoint_step_itself(tmp_path):
    """Found by a bug bash (mut4 TR01): a resume from step 2 drops the killed run's events after step 2 and keeps
    step 2's (it is not trained again); `<=` -> `<` dropped the checkpoint step's own loss and no test noticed."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in (1, 2, 3, 4):
        writer.add_scalar("train/loss", 5.0 - step, step)
    writer.close()
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    cut_event_files(files, 2)
    steps = [event.step for file in files for event in EventFileLoader(str(file)).Load() if event.summary.value]
    assert steps == [1, 2]


def test_a_resumed_runs_elapsed_seconds_count_on_from_the_checkpoints(tmp_path):
    """Found by a bug bash (mut4 TR02): a resumed run's elapsed_s adds the seconds trained before the checkpoint;
    written as measured since the resume, the time axis restarted at 0 and no test noticed."""
    trackers = Trackers(_recipe(tmp_path), tmp_path / "run", is_main=True, resumed_step=10, elapsed_before=100.0)
    trackers.write(step=11, loss=1.0, elapsed_s=2.5)
    trackers.close()
    assert json.loads(_lines(tmp_path / "run" / "metrics.jsonl")[-1])["elapsed_s"] == 102.5


def test_a_nan_loss_is_written_as_the_json_string_nan(tmp_path):
    """Found by a bug bash (mut4 TR03): a bare NaN is not JSON (JSON.parse and jq refuse the line); the record says
    "nan" as a string. Writing the value as it is went unnoticed."""
    trackers = Trackers(_recipe(tmp_path), tmp_path / "run", is_main=True)
    trackers.write(step=1, loss=float("nan"), grad_norm=float("inf"), learning_rate=1e-4)
    trackers.close()
    line = _lines(tmp_path / "run" / "metrics.jsonl")[-1]
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 1, "loss": "nan", "grad_norm": "inf", "learning_rate": 1e-4}


def test_an_old_files_per_step_tokens_are_summed_into_num_tokens():
    """Found by a bug bash (mut4 TR04): an older metrics.jsonl logged each step's `tokens`; read today, num_tokens is
    their running sum (as today's cumulative column). Taking each step's own count went unnoticed."""
    old = [{"step": 1, "loss": 2.0, "tokens": 5}, {"step": 2, "loss": 1.5, "tokens": 7},
           {"step": 3, "loss": 1.0, "tokens": 4}]
    assert [record["num_tokens"] for record in translated(old)] == [5, 12, 16]


def test_last_step_is_the_newest_step_written_not_the_latest_record(tmp_path):
    """Found by a bug bash (mut4 TR05): `last_step` is the newest step written, where a record without a step is
    placed; an eval record of an earlier step written after a later one moved it back and no test noticed."""
    trackers = Trackers(_recipe(tmp_path), tmp_path / "run", is_main=True)
    trackers.write(step=5, loss=1.0)
    trackers.write(step=3, eval_loss=1.5)
    assert trackers.last_step == 5
    trackers.close()
