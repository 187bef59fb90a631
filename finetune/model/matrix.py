"""The models matrix's record (finetune/model/matrix.json, written by `make models-matrix`): every model type of the
installed transformers with a causal-LM or image-text-to-text class, trained tiny in a forked child (tests/
arch_matrix.py: `trained`, `adapter-not-peft`), or why not (`refused`: finetune's own refusal; `failed`: the error
of the tiny run; `no-tiny`: no tiny model could be built from transformers' defaults; `not-a-decoder`).

support.py's tables are what the suite checks on every run; this record covers the rest, as of the transformers
version it names. `finetune models` and docs/models.md list both; a model type the record marks `failed` gets a
warning before loading (a tiny model's failure is not proof that a real checkpoint fails, so it is not refused).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

RECORD = Path(__file__).with_name("matrix.json")
STATUS = {
    "trained": "trained tiny by the models matrix (one process; not in the suite)",
    "adapter-not-peft": "trained tiny by the models matrix; its exported adapter does not load in plain PEFT",
    "refused": "refused: {detail}",
    "failed": "untried: the models matrix's tiny run failed ({detail})",
    "no-tiny": "untried: no tiny model from transformers' defaults ({detail})",
    "not-a-decoder": "not trained: {detail}",
}


@functools.cache
def record() -> dict:
    """{"transformers": version, "torch": version, "rows": {model_type: {"outcome", "detail", "seconds"}}}; empty
    rows when the file is absent."""
    if not RECORD.is_file():
        return {"transformers": None, "rows": {}}
    return json.loads(RECORD.read_text(encoding="utf-8"))


def status(model_type: str) -> str | None:
    """The record's status line for `model_type`, or None when it has no row."""
    row = record()["rows"].get(model_type)
    if row is None:
        return None
    detail = row["detail"].replace("|", "/")[:200]
    return STATUS[row["outcome"]].format(detail=detail)


def failed_warning(model_type: str) -> str | None:
    """What to say before loading a model type whose tiny run failed in the record, else None."""
    row = record()["rows"].get(model_type)
    if row is None or row["outcome"] != "failed":
        return None
    return (f"the models matrix (transformers {record()['transformers']}) could not train a tiny {model_type} "
            f"({row['detail'][:200]}): this architecture is untried, and the run may fail")
