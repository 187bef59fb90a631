"""Each rank's memory at each point of a run, FSDP2 vs FSDP1 vs DDP at 2 ranks, through the shipped accelerate configs.

    python benchmarks/bench_train_peak.py [--hidden-size 1024] [--layers 24] [--steps 8] [--configs fsdp2,fsdp1,ddp]
                                          [--env NAME=VALUE ...] [--parts]

A random Qwen2-architecture model (hidden x layers, the tiny tokenizer; saved sharded in fp32) trained as shipped:
bf16, activation checkpointing on, LoRA r 4 / dropout 0.05, micro-batch 1 of 64 tokens, on CPU (gloo; the suite's
CPU switch, ACCELERATE_USE_CPU=true). Each rank's anonymous memory (RssAnon: file pages such as the memory-mapped
checkpoint excluded) is sampled every 50 ms and read at each log line: the `[finetune] model:` line (loading done),
the `ready:` line (loaded and wrapped: under FSDP the wrap builds and shards the model), after each step,
after the final eval. Prints one table per config, then each config's load peak and training peak
per rank against DDP's. `--env` sets a variable for the runs (e.g. FINETUNE_CPU_ALLOCATOR=default to compare with
glibc's own settings); all figures come from this one session.

`--parts`: step 2 of every run is also measured tensor by tensor (FINETUNE_MEASURE_STEP=2,
finetune/training/tensor_bytes.py: the bytes of tensors alive when the step starts, and the peak of those the step
creates), and each rank's figures are printed next to the planner's for the same recipe and strategy (its GPU
figures without the CUDA context and fragmentation, which a CPU run has not), part by part: what the rank holds
(base shard, LoRA weights, AdamW moments, the quantization state and the rest), what the step adds at its peak
(gradients, FSDP's unsharded units, activations, the loss, optimizer temporaries), the sums and their ratio
(finetune/training/tensor_bytes.py: parts_table).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LINES = re.compile(r"\[finetune\] (model:|ready:|step \d+/\d+ |step \d+: eval)")


def write_inputs(root: Path, hidden: int, layers: int) -> Path:
    from finetune.cli.tiny import build_tiny_model

    model_dir = build_tiny_model(root / "model", family="qwen2", hidden_size=hidden, num_layers=layers,
                                 max_shard_size="200MB")
    rng = random.Random(0)
    rows = [{"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)}
            for a, b in ((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(256))]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.05},
        "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64},
        "train": {"micro_batch_size": 1, "learning_rate": 1e-4, "eval_every": 0, "save_every": 0,
                  "gradient_checkpointing": True},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _descendants(pid: int) -> list[int]:
    found = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in map(int, children):
        found += [child, *_descendants(child)]
    return found


def _rank(pid: int) -> int | None:
    try:
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"RANK="):
                return int(entry[5:])
    except (OSError, ValueError):
        return None
    return None


def _rss_anon_mib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def run_config(config: str, recipe: Path, out: Path, steps: int, env: dict[str, str]) -> dict:
    """One launch; returns {"rows": [(label, {rank: (now, peak)})], "load_peak": {rank: MiB}, "train_peak": ...}."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "2", str(REPO / "finetune" / "run.py"),
               str(recipe), f"output.dir={out}", f"train.max_steps={steps}"]
    run_env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1", **env)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env)
    now: dict[int, int] = {}
    peak: dict[int, int] = {}
    window: dict[int, int] = {}  # the peak since loading ended (the `ready:` line)

    def sample() -> None:
        while process.poll() is None:
            for pid in _descendants(process.pid):
                rank, mib = _rank(pid), _rss_anon_mib(pid)
                if rank is not None and mib is not None:
                    now[rank], peak[rank] = mib, max(peak.get(rank, 0), mib)
                    window[rank] = max(window.get(rank, 0), mib)
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    rows, tail, load_peak, speeds = [], [], None, []
    for line in process.stdout:
        if " tokens/s " in line:
            speeds.append(float(line.rsplit("tokens/s ", 1)[1].split()[0]))
        tail = (tail + [line])[-40:]
        match = LINES.search(line)
        if match:
            label = line.split("[finetune] ", 1)[1].split(" loss")[0].split(" stored")[0].split(" holds")[0].strip()
            rows.append((label, {r: (now[r], peak[r]) for r in sorted(now)}))
            if match.group(1) == "ready:":  # the model is loaded (under FSDP: built and sharded by the wrap)
                load_peak = dict(peak)
                window.clear()
    process.wait()
    if process.returncode != 0:
        raise SystemExit(f"{config} failed:\n{''.join(tail)}")
    import statistics

    measured = {int(path.name[4:].split(".")[0]): json.loads(path.read_text())
                for path in (out / "ranks").glob("rank*.step2.tensor_bytes.json")}
    return {"rows": rows, "load_peak": load_peak or {}, "train_peak": dict(window), "overall_peak": dict(peak),
            "tokens_per_s": statistics.median(speeds[1:] or speeds), "tensor_bytes": measured}  # step 1 warms up


def parts_text(results: dict, recipe_path: Path) -> str:
    """Rank 0's tensor bytes at step 2, part by part, next to the planner's (finetune/training/tensor_bytes.py: the
    same comparison tests/training/test_tensor_bytes.py asserts and bench_ddp_vs_fsdp.py --parts prints)."""
    from finetune.recipe import load_recipe
    from finetune.training.tensor_bytes import parts_table, planned_parts

    recipe = load_recipe(str(recipe_path))
    measured = {name: result["tensor_bytes"][0] for name, result in results.items()}
    return ("\ntensor bytes of rank 0 at step 2's peak (measured op by op) vs the planner\n"
            + parts_table(measured, {name: planned_parts(recipe, name) for name in measured}))


def env_setting(text: str) -> tuple[str, str]:
    """`--env NAME=VALUE` as (NAME, VALUE); anything else is argparse's error (`--env NAME` alone sets nothing)."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. FINETUNE_CPU_ALLOCATOR=default; an empty "
                                         "value: NAME=)")
    return name, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", default="fsdp2,fsdp1,ddp")
    parser.add_argument("--env", action="append", default=[], type=env_setting, metavar="NAME=VALUE",
                        help="a variable for the runs (repeat for more)")
    parser.add_argument("--parts", action="store_true", help="measure step 2 tensor by tensor, against the planner")
    args = parser.parse_args(argv)
    env = dict(args.env)
    if args.parts:
        env["FINETUNE_MEASURE_STEP"] = "2"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recipe = write_inputs(root, args.hidden_size, args.layers)
        results = {name: run_config(name, recipe, root / name, args.steps, env) for name in args.configs.split(",")}
        parts = parts_text(results, recipe) if args.parts else ""
    print(f"model: random Qwen2 hidden {args.hidden_size} x {args.layers} layers, NF4 + LoRA r4, bf16, checkpointing on, "
          f"2 ranks, {args.steps} steps of 64 tokens, CPU gloo{' ' + str(env) if env else ''}")
    for name, result in results.items():
        print(f"\n{name}: RssAnon per rank, MiB (now / peak so far)")
        for label, row in result["rows"]:
            print(f"  {label[:34]:34} " + "  ".join(f"r{r}: {n:6d} / {p:6d}" for r, (n, p) in row.items()))
    base = results.get("ddp")
    print(f"\n{'config':8} {'load peak/rank':>15} {'train peak/rank':>16} {'train vs DDP':>13} {'tokens/s':>9}")
    for name, result in results.items():
        load, train = max(result["load_peak"].values()), max(result["train_peak"].values())
        ratio = f"{train / max(base['train_peak'].values()):13.2f}" if base else f"{'-':>13}"
        print(f"{name:8} {load:15d} {train:16d} {ratio} {result['tokens_per_s']:9.1f}")
    if parts:
        print(parts)


if __name__ == "__main__":
    main()
