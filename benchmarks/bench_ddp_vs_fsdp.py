"""Per-rank peak memory and step time of DDP vs FSDP2 vs FSDP1 vs DeepSpeed ZeRO-2 / ZeRO-3 at 2 ranks, same model,
data and global batch.

    python benchmarks/bench_ddp_vs_fsdp.py [--hidden-size 512] [--layers 8] [--steps 12] [--no-deepspeed] [--parts]

Runs each strategy through `accelerate launch` with the shipped accelerate_configs/ddp.yaml, fsdp2.yaml and
fsdp1.yaml and reads what every rank wrote: parameter bytes it holds (`ranks/rank{r}.json`), peak RSS, and step times
from metrics.jsonl. Prints figures and ratios against DDP, measured in this one session. On CPU (gloo) the launch
adds ACCELERATE_USE_CPU=true and `--mixed_precision no` with an fp32 recipe (the figures in docs/distributed.md);
on a GPU machine pass --gpu to run the configs as shipped, bf16 (peak figures are then GPU allocator peaks).

The DeepSpeed rows run the shipped accelerate_configs/deepspeed_zero{2,3}.yaml the same way, with a DeepSpeed JSON
that sets the ZeRO-3 persistence thresholds to 0: at this model size every tensor is below DeepSpeed's default
threshold (1e5 elements) and would stay whole on every rank, unlike the projections of any real model. They need
`pip install 'finetune[deepspeed]'` (`--no-deepspeed` leaves them out).

`--parts`: step 2 of the DDP, FSDP2 and FSDP1 runs is also measured tensor by tensor (FINETUNE_MEASURE_STEP=2) and
rank 0's figures are printed part by part next to the planner's for the same recipe and strategy (base, LoRA, AdamW,
quantization state, gradients, gathered units, activations, loss; the same table as bench_train_peak.py --parts and
the same comparison as tests/training/test_tensor_bytes.py: finetune/training/tensor_bytes.py's parts_table).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import group_run

WARM_UP_STEPS = 3  # the step time is the median of steps 4..N: the first steps build kernels and buffers
GLOBAL_ROWS = 8  # micro_batch_size 4 x 2 ranks


def write_inputs(root: Path, hidden: int, layers: int, dtype: str) -> Path:
    from finetune.cli.tiny import build_tiny_model

    model_dir = build_tiny_model(root / "model", hidden_size=hidden, num_layers=layers)
    rng = random.Random(0)
    rows = [{"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)}
            for a, b in ((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(256))]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"name_or_path": str(model_dir), "dtype": dtype},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 128},
        "train": {"micro_batch_size": 4, "learning_rate": 1e-3, "eval_every": 0, "save_every": 0},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_strategy(config: str, recipe: Path, out: Path, steps: int, *, gpu: bool, overrides: tuple[str, ...] = (),
                 parts: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **({"FINETUNE_MEASURE_STEP": "2"} if parts else {}))
    cpu_flags = []
    if not gpu:
        env["ACCELERATE_USE_CPU"] = "true"  # not `--cpu`: that flag starts one process whatever the config says
        cpu_flags = ["--mixed_precision", "no", "--num_processes", "2"]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
               *cpu_flags, str(REPO / "finetune" / "run.py"), str(recipe), f"output.dir={out}", f"train.max_steps={steps}", *overrides]
    result = group_run.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{config} failed:\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank*.json")) if p.name.count(".") == 1]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "elapsed_s" in m]
    step_times = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(steps)][WARM_UP_STEPS - 1:]
    peak_key = "peak_gpu_bytes" if "peak_gpu_bytes" in ranks[0] else "peak_rss_bytes"
    return {
        "params_mb": max(r["frozen_bytes"] + r["trainable_bytes"] for r in ranks) / 2**20,
        "peak_mb": max(r[peak_key] for r in ranks) / 2**20,
        "step_s": statistics.median(step_times),
        "tokens_per_step": steps[-1]["num_tokens"] / len(steps),  # non-pad tokens of the global batch, all ranks
        "tensor_bytes": json.loads((out / "ranks" / "rank0.step2.tensor_bytes.json").read_text()) if parts else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help=f"optimizer steps per run, at least {WARM_UP_STEPS + 1} "
                        f"(the step time is the median of the steps after the first {WARM_UP_STEPS})")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave out the DeepSpeed ZeRO-2/3 rows")
    parser.add_argument("--parts", action="store_true", help="measure step 2 tensor by tensor, against the planner")
    args = parser.parse_args(argv)
    if args.steps <= WARM_UP_STEPS:
        parser.error(f"--steps must be at least {WARM_UP_STEPS + 1}: the step time is the median of the steps after "
                     f"the first {WARM_UP_STEPS} (warm-up), got {args.steps}")
    group_run.stop_on_sigterm()  # a timeout's SIGTERM ends the launch's ranks too, and removes the temporary folder
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recipe = write_inputs(root, args.hidden_size, args.layers, "bfloat16" if args.gpu else "float32")
        results = {name: run_strategy(f"{name}.yaml", recipe, root / name, args.steps, gpu=args.gpu, parts=args.parts)
                   for name in ("ddp", "fsdp2", "fsdp1")}
        parts = parts_text(results, recipe) if args.parts else ""
        if not args.no_deepspeed:
            tuning = root / "zero3_tuning.json"
            tuning.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                                                "stage3_model_persistence_threshold": 0}}))
            for stage in (2, 3):
                results[f"zero{stage}"] = run_strategy(f"deepspeed_zero{stage}.yaml", recipe, root / f"zero{stage}", args.steps,
                                                       gpu=args.gpu, overrides=(f"parallel.deepspeed_config={tuning}",))
    base = results["ddp"]
    print(header(args, base))
    print(f"{'strategy':10} {'params/rank MB':>15} {'peak/rank MB':>13} {'step s':>8} {'params vs DDP':>14} "
          f"{'peak vs DDP':>12} {'step vs DDP':>12}")
    for name, r in results.items():
        print(f"{name:10} {r['params_mb']:15.2f} {r['peak_mb']:13.1f} {r['step_s']:8.3f} "
              f"{r['params_mb'] / base['params_mb']:14.2f} {r['peak_mb'] / base['peak_mb']:12.2f} "
              f"{r['step_s'] / base['step_s']:12.2f}")
    if parts:
        print(parts)


def header(args: argparse.Namespace, ddp: dict) -> str:
    """What ran: the model, and the global batch as it trained (the rows are ~35 tokens: max_length 128 is a cap)."""
    per_row = ddp["tokens_per_step"] / GLOBAL_ROWS
    return (f"model: llama hidden {args.hidden_size} x {args.layers} layers, 4-bit NF4 + LoRA r16, 2 ranks, global batch "
            f"{GLOBAL_ROWS} rows x ~{per_row:.0f} tokens ({ddp['tokens_per_step']:.0f} non-pad tokens a step; "
            f"max_length 128), {'GPU' if args.gpu else 'CPU gloo'}")


def parts_text(results: dict, recipe_path: Path) -> str:
    """Rank 0's tensor bytes at step 2 against the planner, part by part (finetune/training/tensor_bytes.py)."""
    sys.path.insert(0, str(REPO))
    from finetune.recipe import load_recipe
    from finetune.training.tensor_bytes import parts_table, planned_parts

    recipe = load_recipe(str(recipe_path))
    measured = {name: results[name]["tensor_bytes"] for name in ("fsdp2", "fsdp1", "ddp")}
    return ("\ntensor bytes of rank 0 at step 2's peak (measured op by op) vs the planner\n"
            + parts_table(measured, {name: planned_parts(recipe, name) for name in measured}))


if __name__ == "__main__":
    main()
