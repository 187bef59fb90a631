"""bf16 against fp32 on this machine: the GEMM ratio, what `model.dtype: auto` picks, and the quickstart's tokens/s.

    python benchmarks/bench_dtype.py [--steps 6] [--skip-quickstart]

On a CPU without AVX512-BF16/AMX, torch runs bf16 matmuls through its reference kernel: the issue that added
model.dtype: auto measured 3,250 ms (bf16) against 113 ms (fp32) for the GEMM below, and the bf16 quickstart at 6
tokens/s. Every figure here comes from this one invocation, so the ratios compare; absolute numbers do not carry
across machines. The quickstart rows run the shipped recipe (SmolLM2-135M, 4-bit, LoRA; `make quickstart`'s model
and data) for a few steps at each dtype, generation evals off: tokens/s is the tokens of steps 2..N over their time,
from its metrics.jsonl (step 1 is warm-up). A SIGTERM (a timeout) ends the run in progress too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import group_run

from finetune import precision


def gemm_ms(dtype: torch.dtype, repeats: int) -> float:
    """Median wall time of a 2048x576 @ 576x1536 matmul (a 135M model's MLP projection at batch 8 x 256 tokens)."""
    a = torch.randn(2048, 576).to(dtype)
    b = torch.randn(576, 1536).to(dtype)
    a @ b  # warm-up: oneDNN builds its kernel on the first call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run_tokens_per_s(rows: list[dict]) -> float:
    """Tokens/s of steps 2..N of a run from its metrics.jsonl rows (logged every step): the tokens trained after step 1
    over the seconds they took (step 1 is warm-up), as bench_peers counts; one step's own rate for a 1-step run."""
    steps = [row for row in rows if "tokens_per_s" in row]
    if len(steps) < 2:
        return steps[-1]["tokens_per_s"]
    return (steps[-1]["num_tokens"] - steps[0]["num_tokens"]) / (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"])


def quickstart_tokens_per_s(dtype: str, steps: int, root: Path) -> tuple[float, float]:
    """(tokens/s over the run's steps 2..N, wall seconds) of the shipped quickstart recipe at `dtype`."""
    from finetune.cli.quickstart import prepare, quickstart_recipe

    out = root / dtype
    overrides = prepare(out, tiny=False) + [f"model.dtype={dtype}", f"train.max_steps={steps}", "train.warmup_steps=1",
                                            "train.log_every=1", "eval.generation_rows=0", "output.overwrite=true"]
    start = time.perf_counter()
    result = group_run.run([sys.executable, str(REPO / "finetune" / "run.py"), str(quickstart_recipe()), *overrides],
                           capture_output=True, text=True, cwd=root)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"quickstart at {dtype} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return run_tokens_per_s(rows), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="quickstart steps per dtype (default 6; tokens/s: 2..N)")
    parser.add_argument("--repeats", type=int, default=5, help="timed GEMMs per dtype (default 5)")
    parser.add_argument("--skip-quickstart", action="store_true", help="the GEMM and the choice only")
    args = parser.parse_args(argv)
    group_run.stop_on_sigterm()  # a timeout's SIGTERM ends the quickstart run too, and removes the temporary folder

    native, _ = precision.native_bf16(*precision.target_device())
    choice = precision.choose_dtype("auto")
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, bf16 flags {precision.cpu_bf16_flags() or 'none'}, "
          f"oneDNN bf16 {bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}")
    print(f"model.dtype: auto -> {choice.dtype} ({choice.reason})")
    fp32 = gemm_ms(torch.float32, args.repeats)
    bf16 = gemm_ms(torch.bfloat16, max(1, args.repeats if native else 2))  # emulated bf16 takes seconds a call
    print("\n| 2048x576 @ 576x1536 matmul | ms (median) |\n|---|---|")
    print(f"| float32 | {fp32:,.1f} |\n| bfloat16 | {bf16:,.1f} |")
    print(f"bf16 / fp32 time: {bf16 / fp32:.2f}x  ({'bf16 native' if native else 'bf16 emulated'}: auto picks "
          f"{choice.dtype})")
    if args.skip_quickstart:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as tmp:
        rows = {dtype: quickstart_tokens_per_s(dtype, args.steps, Path(tmp)) for dtype in ("float32", "bfloat16")}
    print(f"\n| quickstart ({args.steps} steps, SmolLM2-135M 4-bit + LoRA) | tokens/s | wall s |\n|---|---|---|")
    for dtype, (speed, wall) in rows.items():
        marker = " (auto)" if dtype == choice.dtype else ""
        print(f"| {dtype}{marker} | {speed:,.0f} | {wall:.0f} |")
    ratio = rows["bfloat16"][0] / rows["float32"][0]
    print(f"bf16 / fp32 tokens/s: {ratio:.2f}x; auto's pick is the faster one: "
          f"{'yes' if (ratio >= 1) == (choice.dtype == 'bfloat16') else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
