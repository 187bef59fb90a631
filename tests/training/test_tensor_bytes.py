"""Tensor bytes at a training step's peak, counted op by op (finetune/training/tensor_bytes.py), on real 2-rank runs
through the shipped fsdp2.yaml, fsdp1.yaml and ddp.yaml with the library's settings (the default dtype, auto: bf16
where the CPU computes it, fp32 elsewhere, where bf16 would take torch's reference kernels, ~5x this file's time; LoRA
dropout 0.05 on all linear layers, checkpointing on): deterministic figures where RSS depends on malloc and timing.

  * an FSDP rank holds about half of what a DDP rank holds (its shard of the base, LoRA and AdamW state; the
    quantization state stays whole) and its step peak stays below the DDP rank's;
  * the peak is flat: step 3 has the bytes of step 2 (nothing accumulates from step to step);
  * the planner's per-rank training figure (its GPU figure without the CUDA context and fragmentation) bounds the
    measured one, at most 15% above, for every strategy on two model shapes (many small layers; few wide ones), and
    what a rank holds (base shard, LoRA, AdamW) is the planner's to the byte.
How the meter splits bytes into categories is checked on a program of known sizes (tests/training/test_meter.py): the
sum of its step parts equals its step peak by construction, so no check of a real run can rest on it.
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
# name: (hidden, layers, steps run, steps measured). "deep": a decoder layer is a small part of the base, as in real
# models (FSDP2 keeps two of them unsharded). "wide": few layers 4x the size, so the gathered units weigh more and
# the layer inputs less; measured at step 2 only (the flatness from step to step is the deep shape's check).
SHAPES = {"deep": (256, 12, 3, (2, 3)), "wide": (512, 4, 2, (2,))}


def _recipe(root: Path, hidden: int, layers: int, steps: int) -> Path:
    from finetune.cli.tiny import build_tiny_model

    model_dir = build_tiny_model(root / "model", family="qwen2", hidden_size=hidden, num_layers=layers)
    # Rows longer than data.max_length: every row is truncated to it, as the planner assumes (its worst case).
    rng = random.Random(0)
    rows = [{"instruction": "Continue the digits.", "input": " ".join(str(rng.randint(0, 9)) for _ in range(40)),
             "output": " ".join(str(rng.randint(0, 9)) for _ in range(200))} for _ in range(32)]
    data = write_jsonl(root / "train.jsonl", rows)
    values = recipe_dict(model_dir, data, root / "unused", lora=LIBRARY_LORA,
                         train={"max_steps": steps, "micro_batch_size": 2, "save_every": 0, "eval_every": 0})
    del values["model"]["dtype"]  # the library's default, auto: bf16 where the device computes it, fp32 elsewhere
    values["data"]["eval_fraction"] = 0.0  # no eval after the last step: not measured, only time
    return write_recipe(root / "recipe.yaml", values)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """shape -> {"runs": config -> {rank: {step: record}}, "recipe": path}: one run per config and shape."""
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for shape, (hidden, layers, steps, measured_steps) in SHAPES.items():
            root = tmp_path_factory.mktemp(f"tensor-bytes-{shape}")
            recipe = _recipe(root, hidden, layers, steps)
            patch.setenv("FINETUNE_MEASURE_STEP", ",".join(map(str, measured_steps)))
            runs = {}
            for config in CONFIGS:
                result = accelerate_launch(config, recipe, f"output.dir={root / config}")
                assert result.returncode == 0, result.stderr[-3000:]
                runs[config] = {rank: {step: json.loads((root / config / "ranks" / f"rank{rank}.step{step}.tensor_bytes.json")
                                                        .read_text()) for step in measured_steps} for rank in (0, 1)}
            found[shape] = {"runs": runs, "recipe": recipe}
    return found


@pytest.mark.parametrize("shape", SHAPES)
def test_an_fsdp_rank_holds_half_and_peaks_below_a_ddp_rank(measured, shape):
    """The peak: below DDP's for the deep shape (real models' proportions) in either dtype, and for the wide one in
    bf16. In fp32 the wide shape's gathered units (4 bytes a value) put FSDP1's step peak 1% above DDP's at this toy
    size (29.45 MB against 29.16 MB, 2026-12-05): the held half is what FSDP saves there."""
    from finetune.precision import choose_dtype

    runs = measured[shape]["runs"]
    peak_below = shape == "deep" or choose_dtype("auto").dtype == "bfloat16"  # what the ranks' auto picked too
    for rank in (0, 1):
        ddp = runs["ddp"][rank][2]
        for config in ("fsdp2", "fsdp1"):
            fsdp = runs[config][rank][2]
            assert fsdp["held_bytes"] < 0.6 * ddp["held_bytes"], (config, rank, fsdp, ddp)
            if peak_below:
                assert fsdp["peak_bytes"] < ddp["peak_bytes"], (config, rank, fsdp, ddp)


def test_the_step_peak_is_flat_from_step_to_step(measured):
    for config, ranks in measured["deep"]["runs"].items():
        for rank, steps in ranks.items():
            # (held vs step split moves: DDP's gradient buckets, made in step 2, are held at step 3's start)
            assert steps[3]["peak_bytes"] == pytest.approx(steps[2]["peak_bytes"], rel=0.02), (config, rank, steps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_the_planner_training_figure_bounds_the_measured_one_within_15_percent(measured, config, shape):
    """The planner's per-rank figure is an upper bound, at most 15% above; the held parts are exact. Measured here
    (2026-12-03, bf16), planner / measured, deep and wide: FSDP2 1.036 and 1.055, FSDP1 1.068 and 1.098, DDP 1.012
    and 1.026; in fp32 (2026-12-05, an AVX2-only CPU): FSDP2 1.065 and 1.080, FSDP1 1.047 and 1.062, DDP 1.026 and
    1.036 (before the planner counted the moments of the step apart, docs/planner.md: 1.26/1.19, 1.19/1.13,
    1.15/1.16). The meter's parts say where the rest is: docs/benchmarks.md."""
    from finetune.recipe import load_recipe
    from finetune.training.tensor_bytes import PARTS, planned_parts

    planned = planned_parts(load_recipe(str(measured[shape]["recipe"])), config)
    total = sum(planned[part] for part in PARTS)
    for rank, steps in measured[shape]["runs"][config].items():
        record = steps[2]
        assert 1.0 <= total / record["peak_bytes"] <= 1.15, (config, rank, total / 2**20, record, planned)
        for part in ("base", "lora", "adamw"):  # a rank's shard of each (FSDP2 chunks every tensor, FSDP1 pads)
            assert record["held_parts"][part] == planned[part], (config, rank, part, record["held_parts"], planned)


def test_no_measurement_without_the_variable(measured):
    """The runs above wrote records for the steps asked for only (the loop is unchanged for every other step)."""
    folder = Path(measured["deep"]["recipe"]).parent / "ddp" / "ranks"
    assert sorted(p.name for p in folder.glob("*.tensor_bytes.json")) == [
        f"rank{r}.step{s}.tensor_bytes.json" for r in (0, 1) for s in (2, 3)]
