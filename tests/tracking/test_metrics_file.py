"""metrics.jsonl read back in today's names (finetune/tracking/metrics_file.py): runs written before the HF/TRL names
(`lr`, per-step `tokens`), today's runs, and an old run resumed by today's code (both kinds of line in one file)."""

from __future__ import annotations

import json

from finetune.tracking.metrics_file import read_records


def write(path, records, tail: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_an_old_run_reads_in_todays_names(tmp_path):
    old = [{"step": 1, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "tokens": 100},
           {"step": 2, "loss": 1.9, "lr": 2e-4, "grad_norm": 0.9, "tokens": 120},
           {"step": 2, "eval_loss": 2.1},
           {"step": 3, "skipped": "non-finite loss or gradient", "loss": "nan", "grad_norm": "nan"},
           {"step": 4, "loss": 1.8, "lr": 3e-4, "grad_norm": 0.8, "tokens": 90}]
    records = read_records(write(tmp_path / "metrics.jsonl", old, tail='{"step": 5, "lo'))  # a cut-off last line
    # an old `lr` is the next step's rate (bb70 F5): step 2 trained at step 1's line's lr; after the gap, none
    assert [r.get("learning_rate") for r in records] == [None, 1e-4, None, None, None]
    assert [r.get("num_tokens") for r in records] == [100, 220, None, None, 310]  # a skipped step trains no token
    assert not any("lr" in r or "tokens" in r for r in records)


def test_old_tokens_with_gaps_stay_as_written(tmp_path):
    """log_every 2: the steps between are not in the file, so no running count can be made of `tokens`."""
    old = [{"step": 2, "loss": 2.0, "lr": 1e-4, "tokens": 100}, {"step": 4, "loss": 1.9, "lr": 1e-4, "tokens": 100}]
    records = read_records(write(tmp_path / "metrics.jsonl", old))
    assert [(r.get("learning_rate"), r["tokens"], "num_tokens" in r) for r in records] == [(None, 100, False)] * 2


def test_todays_run_and_an_old_run_resumed_today(tmp_path):
    today = [{"step": 1, "loss": 2.0, "learning_rate": 1e-4, "num_tokens": 100, "mean_token_accuracy": 0.25},
             {"step": 2, "loss": 1.9, "learning_rate": 2e-4, "num_tokens": 220, "mean_token_accuracy": 0.5}]
    assert read_records(write(tmp_path / "today.jsonl", today)) == today
    resumed = [{"step": 1, "loss": 2.0, "lr": 1e-4, "tokens": 100}, {"step": 2, "loss": 1.9, "lr": 2e-4, "tokens": 120},
               {"step": 3, "loss": 1.8, "learning_rate": 3e-4, "num_tokens": 300}]  # the checkpoint's running count
    records = read_records(write(tmp_path / "resumed.jsonl", resumed))
    assert [(r.get("learning_rate"), r["num_tokens"]) for r in records] == [(None, 100), (1e-4, 220), (3e-4, 300)]
