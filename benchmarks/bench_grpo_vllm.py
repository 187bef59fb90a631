"""GRPO's two samplers on the GRPO quickstart: the built-in one (the policy decodes in the training process) against a
vLLM server with the adapter hot-loaded (grpo.generation: vllm), over several seeds, in one invocation.

    python benchmarks/bench_grpo_vllm.py [--seeds 4] [--steps 16] [--out DIR]        (needs `make vllm`)

One SFT run (the quickstart's, 10 steps) gives the starting adapter; then for each seed (train.seed) and sampler the
quickstart's GRPO run (16 steps of 8 completions, exact-match reward), each in its own process. Printed per sampler:
the reward per step (mean over seeds, and the spread: min..max), the step time (steps 2 on: the first pays the
server's warm-up), the seconds spent sampling, and with vLLM the importance ratio and the trainer-sampler log-prob
difference (grpo.vllm_base as_trained: the 4-bit base as trained, dequantized). The goal (issue 55): the same reward
curve within the spread of the seeds, the ratio near 1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import group_run


def finetune(*args: str, log: Path) -> None:
    """`python -m finetune ARGS` run from the checkout (where `make vllm` put .venv-vllm); every path in ARGS is
    absolute (main() resolves --out), so the caller's folder does not matter."""
    with open(log, "w") as out:
        code = group_run.run([sys.executable, "-m", "finetune", *args], stdout=out, stderr=subprocess.STDOUT,
                             cwd=REPO).returncode
    if code:
        raise SystemExit(f"{' '.join(args)} failed ({code}); see {log}")


def steps_of(run: Path) -> list[dict]:
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def summary(runs: list[Path]) -> dict:
    curves = [[m["reward"] for m in steps_of(run)] for run in runs]
    per_step = list(zip(*curves))
    durations = []
    for run in runs:
        elapsed = [m["elapsed_s"] for m in steps_of(run)]
        durations += [b - a for a, b in itertools.pairwise(elapsed)]
    later = [m for run in runs for m in steps_of(run)[1:]]
    out = {"reward_mean": [round(statistics.mean(s), 3) for s in per_step],
           "reward_min": [round(min(s), 3) for s in per_step], "reward_max": [round(max(s), 3) for s in per_step],
           "last4_mean": round(statistics.mean(r for c in curves for r in c[-4:]), 3),
           "step_s": round(statistics.mean(durations), 1),
           "generation_s": round(statistics.mean(m["generation_s"] for m in later), 1)}
    if "sampling/importance_sampling_ratio/mean" in later[0]:
        out["is_ratio_mean"] = round(statistics.mean(m["sampling/importance_sampling_ratio/mean"] for m in later), 3)
        out["logp_diff_mean"] = round(statistics.mean(m["sampling/sampling_logp_difference/mean"] for m in later), 4)
    return out


def vllm_problem() -> str | None:
    """Why the vLLM runs would fail, found before the SFT and built-in runs take their minutes (None: vLLM is there).
    Asked from the checkout, where the runs start (.venv-vllm is looked for in the folder run from)."""
    from finetune.recipe.grpo import VLLMNotFound, vllm_command

    with contextlib.chdir(REPO):
        try:
            vllm_command(None)
        except VLLMNotFound as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> None:
    from finetune.cli.quickstart import SFT_STEPS, TRAIN_ROWS, prepare, quickstart_recipe
    from finetune.cli.quickstart_grpo import GRPO_OVERRIDES, write_prompt_sets
    from finetune.precision import cpu_summary

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="needs `make vllm` (.venv-vllm in the checkout, or FINETUNE_VLLM_PYTHON)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (relative: to the folder you run "
                        "from; default: a new temporary folder, kept)")
    args = parser.parse_args(argv)
    problem = vllm_problem()
    if problem:
        raise SystemExit(f"bench_grpo_vllm: {problem}")
    group_run.stop_on_sigterm()  # a timeout's SIGTERM ends the running `finetune train` too
    # The runs start in the checkout (cwd=REPO): a relative --out is the caller's, so it is made absolute here.
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench-grpo-vllm-"))).resolve()
    recipe = str(quickstart_recipe())
    sft = out / "sft"
    overrides = [*prepare(sft, tiny=False), f"train.max_steps={SFT_STEPS}", "train.warmup_steps=2"]
    print(f"[bench] {cpu_summary()}; load average {os.getloadavg()[0]:.1f}; runs in {out}", flush=True)
    finetune("train", recipe, *overrides, log=out / "sft.log")
    prompts, _ = write_prompt_sets(out / "data", sft_rows=TRAIN_ROWS, tiny=False)
    runs: dict[str, list[Path]] = {"builtin": [], "vllm": []}
    for seed in range(args.seeds):
        for sampler, done in runs.items():
            run = out / f"{sampler}-seed{seed}"
            finetune("train", recipe, f"output.dir={run}", f"data.datasets.0.path={prompts}",
                     f"model.adapter={sft / 'adapter'}", *GRPO_OVERRIDES, f"train.max_steps={args.steps}",
                     f"train.seed={seed}", f"grpo.generation={sampler}", log=out / f"{sampler}-seed{seed}.log")
            done.append(run)
            print(f"[bench] {sampler} seed {seed}: rewards {[m['reward'] for m in steps_of(run)]}", flush=True)
    results = {sampler: summary(paths) for sampler, paths in runs.items()}
    for sampler, figures in results.items():
        print(f"[bench] {sampler}: {json.dumps(figures)}")
    builtin, vllm = results["builtin"], results["vllm"]
    print(f"[bench] last-4-steps reward: vllm {vllm['last4_mean']} vs builtin {builtin['last4_mean']}; step time "
          f"vllm/builtin {vllm['step_s'] / builtin['step_s']:.2f}x; importance ratio {vllm.get('is_ratio_mean')} "
          f"(SFT {SFT_STEPS} steps, {args.seeds} seeds, {args.steps} GRPO steps)")


if __name__ == "__main__":
    main()
