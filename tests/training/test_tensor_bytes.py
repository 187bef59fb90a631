"""Tensor bytes at a training step's peak, counted op by op (finetune/training/tensor_bytes.py), on real 2-rank runs
through the shipped fsdp2.yaml, fsdp1.yaml and ddp.yaml with the library's settings (bf16, LoRA dropout 0.05 on all
linear layers, checkpointing on): deterministic figures where RSS depends on malloc and timing.

  * an FSDP rank holds about half of what a DDP rank holds (its shard of the base, LoRA and AdamW state; the
    quantization state stays whole) and its step peak stays below the DDP rank's;
  * the peak is flat: step 3 has the bytes of step 2 (nothing accumulates from step to step);
  * the planner's per-rank training figure (its GPU figure without the CUDA context) bounds the measured one, at most
    30% above, for every strategy.
The RSS side (glibc's heap, which is where an FSDP rank's training memory went on CPU) is tests/test_host_memory.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import LIBRARY_LORA, accelerate_launch, recipe_dict, write_jsonl, write_recipe

pytestmark = pytest.mark.slow

CONFIGS = ("fsdp2", "fsdp1", "ddp")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """config -> ({rank: {step: record}}, recipe path) of one 3-step run each, steps 2 and 3 measured."""
    from finetune.cli.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tensor-bytes")
    # 12 layers: a decoder layer is a small part of the base, as in real models (FSDP keeps two of them unsharded).
    model_dir = build_tiny_model(root / "model", family="qwen2", hidden_size=256, num_layers=12)
    # Rows longer than data.max_length: every row is truncated to it, as the planner assumes (its worst case).
    rng = random.Random(0)
    rows = [{"instruction": "Continue the digits.", "input": " ".join(str(rng.randint(0, 9)) for _ in range(40)),
             "output": " ".join(str(rng.randint(0, 9)) for _ in range(200))} for _ in range(32)]
    data = write_jsonl(root / "train.jsonl", rows)
    values = recipe_dict(model_dir, data, root / "unused", lora=LIBRARY_LORA,
                         train={"max_steps": 3, "micro_batch_size": 2, "save_every": 0, "eval_every": 0})
    values["model"]["dtype"] = "bfloat16"
    recipe = write_recipe(root / "recipe.yaml", values)
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FINETUNE_MEASURE_STEP", "2,3")
        for config in CONFIGS:
            result = accelerate_launch(config, recipe, f"output.dir={root / config}")
            assert result.returncode == 0, result.stderr[-3000:]
            found[config] = {rank: {step: json.loads((root / config / "ranks" / f"rank{rank}.step{step}.tensor_bytes.json")
                                                     .read_text()) for step in (2, 3)} for rank in (0, 1)}
    return {"runs": found, "recipe": recipe}


def test_an_fsdp_rank_holds_half_and_peaks_below_a_ddp_rank(measured):
    runs = measured["runs"]
    for rank in (0, 1):
        ddp = runs["ddp"][rank][2]
        for config in ("fsdp2", "fsdp1"):
            fsdp = runs[config][rank][2]
            assert fsdp["held_bytes"] < 0.6 * ddp["held_bytes"], (config, rank, fsdp, ddp)
            assert fsdp["peak_bytes"] < ddp["peak_bytes"], (config, rank, fsdp, ddp)


def test_the_step_peak_is_flat_from_step_to_step(measured):
    for config, ranks in measured["runs"].items():
        for rank, steps in ranks.items():
            # (held vs step split moves: DDP's gradient buckets, made in step 2, are held at step 3's start)
            assert steps[3]["peak_bytes"] == pytest.approx(steps[2]["peak_bytes"], rel=0.02), (config, rank, steps)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_planner_training_figure_bounds_the_measured_one(measured, config):
    """The planner's per-rank figure is an upper bound, at most 30% above. Measured here (2026-12-02): planned /
    measured 1.15 DDP, 1.19 FSDP1, 1.26 FSDP2. DDP's gradient buckets (C++ tensors no Python object refers to) are
    invisible to the meter and counted by the planner: with them DDP is 1.01. The FSDP excess (2.9 MB of its step
    part on this model) is not taken apart yet: the planner adds two unsharded layers, the gradients and all the
    activations at one moment."""
    from transformers import AutoConfig

    from finetune.planner import GiB, Hardware, estimate, facts_from_config
    from finetune.recipe import load_recipe

    recipe = load_recipe(str(measured["recipe"]))
    facts = facts_from_config(AutoConfig.from_pretrained(recipe.model.name_or_path), recipe)
    plan = estimate(facts, recipe, "ddp" if config == "ddp" else "fsdp", Hardware(2, 24 * GiB), per_rank_full_load=False)
    planned = plan.peak_bytes - plan.parts["overhead"]
    for rank, steps in measured["runs"][config].items():
        got = steps[2]["peak_bytes"]
        assert 1.0 <= planned / got <= 1.3, (config, rank, planned / 2**20, got / 2**20, plan.parts, steps[2])


def test_no_measurement_without_the_variable(measured):
    """The runs above wrote records for the steps asked for only (the loop is unchanged for every other step)."""
    folder = Path(measured["recipe"]).parent / "ddp" / "ranks"
    assert sorted(p.name for p in folder.glob("*.tensor_bytes.json")) == [
        f"rank{r}.step{s}.tensor_bytes.json" for r in (0, 1) for s in (2, 3)]
