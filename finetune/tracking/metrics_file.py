"""metrics.jsonl read back, in today's metric names whatever version of finetune wrote it.

The names are Hugging Face Trainer's and TRL's (`learning_rate`, `num_tokens`, `grad_norm`, `epoch`,
`mean_token_accuracy`, `rewards/...`). Runs written before took `lr` for the learning rate and `tokens` for the tokens
of the one logged step (TRL's `num_tokens` counts every step so far). A resumed old run holds both kinds of line.

An `lr` (finetune before bd3dd43) is the rate of the step after its line's: it was read after the scheduler's step.
A line's `learning_rate` is its own step's rate, so an `lr` moves one line on (bug bash bb70 F5: a resumed old run
showed steps 1-3 shifted and two equal rates at the seam); step 1's, and a step after a gap, have none. (Files of
eb0949b..bd3dd43 call it `learning_rate` already: they cannot be told apart, docs/tracking.md.)
"""

from __future__ import annotations

import json
from pathlib import Path

RENAMED: dict[str, str] = {}  # old name -> today's, same meaning (`lr` is not: `translated`)


def read_records(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, oldest first, old names translated (`RENAMED`; the per-step `tokens` of
    an old run become `num_tokens` when every step up to the line was logged, the only case where they add up to it).
    A partial last line (a run killed while writing) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return translated(records)


def translated(records: list[dict]) -> list[dict]:
    """`records` with old names replaced (see `read_records`); today's records pass unchanged."""
    out = []
    running, last_step = 0, 0  # num_tokens after step `last_step`; None once an old line's steps have a gap
    next_rate: tuple = (None, None)  # (step, rate) of the last old `lr`: the rate of step + 1
    for record in records:
        record = {RENAMED.get(key, key): value for key, value in record.items()}
        step = record.get("step")
        if "lr" in record:
            rate = record.pop("lr")
            if isinstance(step, int) and next_rate[0] == step - 1:
                record["learning_rate"] = next_rate[1]
            next_rate = (step, rate)
        if "num_tokens" in record:  # today's training line: cumulative already
            running, last_step = record["num_tokens"], step
        elif "skipped" in record and running is not None and step == last_step + 1:
            last_step = step  # a skipped step trained no token
        elif isinstance(record.get("tokens"), int) and isinstance(step, int) and "loss" in record:
            if running is not None and step == last_step + 1:
                running, last_step = running + record.pop("tokens"), step
                record["num_tokens"] = running
            else:  # log_every > 1: the steps between are not in the file, `tokens` stays as written
                running = None
        out.append(record)
    return out
