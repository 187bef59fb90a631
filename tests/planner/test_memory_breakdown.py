"""The planner's activation model against what autograd really keeps (benchmarks/memory_breakdown.py).

One process each: a tiny GQA model (4 query heads, 2 key/value heads) in bf16 with NF4 + LoRA on all linears, one
measured optimizer step; every activation kind the planner names (norms, attention, mlp, lora) must be within 15% of
the bytes the saved-tensor hooks counted, and the memory parts must add up to the process's peak RSS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from memory_breakdown import LAYER_KINDS, format_breakdown, measure


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    from finetune.cli.tasks import write_task
    from finetune.cli.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("breakdown")
    model = build_tiny_model(root / "model", hidden_size=128, num_layers=3)
    data = write_task("ledger_report", root / "data.jsonl", 24, seed=0)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model), "dtype": "bfloat16"},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(data), "format": "chat"}], "max_length": 256, "eval_fraction": 0.0,
                 "cache": False, "bad_rows": "skip"},  # rows of ~300 tokens: truncated, a few with no answer left
        "train": {"micro_batch_size": 2, "max_steps": 2, "gradient_checkpointing": False},
    }))
    return path


@pytest.mark.parametrize("overrides", [["data.packing=false"], ["data.packing=true"],
                                       ["data.packing=false", "lora.fused=false"]],
                         ids=["unpacked-fused", "packed-fused", "unpacked-peft-forward"])
def test_planner_activation_kinds_match_the_saved_tensors(recipe, overrides):
    result = measure(str(recipe), overrides)
    measured, planned = result["measured"], result["planner"]
    for kind in LAYER_KINDS:
        got, want = measured[f"activations_{kind}"], planned[f"activations_{kind}"]
        assert abs(want / got - 1) <= 0.15, (kind, want, got, format_breakdown(result))
    assert abs(planned["activations"] / measured["activations"] - 1) <= 0.15
    assert planned["lora_grads_adamw"] == measured["lora_grads_adamw"]  # LoRA fp32 + gradient + two AdamW moments
    assert abs(planned["base"] / measured["base"] - 1) <= 0.05
    # The parts are a partition of the peak: nothing counted twice, nothing negative.
    parts = ["runtime", "base", "quant_state", "lora_grads_adamw", "activations", "loss", "other_transients",
             "allocator_untracked"]
    assert sum(measured[p] for p in parts) == measured["peak_rss"]
    assert all(measured[p] >= 0 for p in parts if p != "allocator_untracked")
    assert measured["step_peak_live"] >= measured["activations"] > 0
