"""The CUDA path on one GPU, in one run (benchmarks/gpu_smoke.sh picks the Python; `make gpu-smoke` runs both).

    bash benchmarks/gpu_smoke.sh [--json FILE] [--hidden N --layers N --steps N] [--deadline-s S]
    make gpu-smoke ARGS="--json $OUT/gpu_smoke.json --deadline-s 420"     # or GPU_SMOKE_JSON=... GPU_SMOKE_DEADLINE_S=...
    python benchmarks/gpu_smoke.py --dry-run --work DIR [--json FILE]      # the same runs and checks on the CPU

First a probe of about ten seconds (benchmarks/gpu_probe.py, its own process): the library versions, whether torch
sees the GPU and the driver, the cuBLAS workspace, `_foreach_copy_` on bf16 NaN payloads, a 1-rank `fully_shard` with
`param_dtype=None`, FSDP2's 2-rank copy-in; printed, and in the JSON under "probe" (where it failed: its error).

A Llama-shaped model built from a config (no hub: the lent GPU machine has no network; 2048 x 8, heads of 128), NF4 +
LoRA in bf16 with checkpointing on, the same recipe for every run, rows longer than max_length (256) so that every
micro-batch fills it, as the planner sizes it. One line per check, each of which can fail:
  * single process; FSDP2 at world size 1 with and without CPU offload; FSDP1 at world size 1 with and without CPU
    offload (also with the library's LoRA dropout 0.05, which crashed FSDP1 under checkpointing); HSDP's 2-D mesh as
    2 nodes x 1 process on loopback (2 GPUs or more; the `cpu:gloo,cuda:nccl` group); DeepSpeed ZeRO-3 at world size
    1 when installed (its wheel and hjson's are built by benchmarks/gpu_wheels.sh, installed with WHEELS=DIR):
    each "trains" (its loss falls);
  * the losses of the dropout-free runs equal to the single process within the suite's bf16 tolerance;
  * whether this GPU's copy canonicalizes NaN bit patterns and whether the FSDP2 byte guard said so;
  * the allocator's peak while loading sharded (benchmarks/bench_loading.py's worker, FSDP2, one rank) against the
    planner's load term for the same model and recipe, CUDA context left out (within 15%; the term counts what the
    allocator does: the fp32 LoRA, the byte guard's float64 chunk, the cuBLAS workspace: finetune/planner/allocator.py);
  * the CUDA allocator's peak during FSDP2's step 2 (FINETUNE_MEASURE_STEP=2) against the planner's training figure
    for the same recipe at world size 1, CUDA context and fragmentation left out (within 15%);
  * this project against the plain PEFT loop (benchmarks/bench_peers.py, both clocks synchronized with the GPU; a
    random 2048 x 8-layer model built from a config, large enough that the GPU, not Python, bounds a step): in both
    modes (unpacked, packed) our tokens/s >= PEER_MIN_SPEEDUP x the loop's and our peak GPU memory <= 1.0x its peak.
A part this machine cannot run (ZeRO-3 without deepspeed, HSDP on one GPU) is `SKIP  <check>: <reason>`: listed, never a
pass.
One deadline bounds the whole smoke (--deadline-s, default 8 minutes: a lent GPU machine cuts a command at 10, and the
runs' own timeouts add up to more): each subprocess gets the lesser of its own timeout and the time left, and one is
started only while the time left covers what a process of its kind needs (the longest of that kind so far, else
`Cuda.needs`); what is not started is `SKIP  <check>: not run: deadline (...)`. A failed check's detail is the child's
own reason: its last `finetune: error:` paragraph, else its last exception line (never torchrun's footer). The JSON and
the table are written in every case.
Ends with `gpu-smoke: N passed, M failed, K skipped`; exits 0 when no check failed, 1 when one did, 2 without a GPU
(before anything runs).

--dry-run rehearses every code path but the CUDA calls on the CPU (CUDA hidden from every process; torchrun at one
rank forms a gloo group), with a tiny model (hidden 64, 2 layers, 3 steps) and short timeouts: a KeyError that would
end the GPU run is found here first (tests/test_gpu_smoke_dry.py). The figures only CUDA has come from `DryRun`,
CPU-side stand-ins named as such in each detail, and go through the same parsing and ratios; the verdicts on a CPU
need not pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the planner checks import finetune from this checkout, however the script starts
sys.path.insert(0, str(REPO / "benchmarks"))
# (after the path: benchmarks/ is a script folder)
from gpu_probe import probe_lines
from gpu_smoke_device import Cuda, DryRun, cuda_available
from gpu_smoke_processes import Deadline, failure, run_quietly, torchrun, two_nodes, write_inputs
from gpu_smoke_report import FAIL, SKIP, Check, exit_code, print_table, verdict, write_report

BF16_LOSS_TOLERANCE = 3e-3  # tests/parallel/test_distributed.py, per logged loss
LOSS_RELATIVE = 5e-3  # on a GPU the kernels differ more than on CPU: the larger of the two is allowed
PLANNER_TOLERANCE = 0.15  # measured / planned within 0.85-1.15
# Our tokens/s over the plain PEFT loop's, in each mode: issue 13's goal, docs/benchmarks.md ("tokens/s >= 1.0x the
# plain PEFT loop"; 1.62x / 1.66x measured on 2 CPU cores). Not the CPU's ratio: on a GPU the fused LoRA path saves
# kernel launches and memory traffic, not the CPU's dropout draws, and no figure of it on a GPU is published yet.
PEER_MIN_SPEEDUP = 1.0
PEER_MAX_PEAK = 1.0  # our peak GPU memory over the plain PEFT loop's, in each mode
RUNS = ("single", "fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "fsdp1+dropout", "hsdp", "zero3")
# Not fsdp1+dropout (its dropout masks are its own), nor hsdp (two ranks: twice the rows per step).
SAME_LOSSES = ("fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "zero3")
NO_DEEPSPEED = ("deepspeed is not installed in this Python. Fix: make its wheel and hjson's where the registries are "
                "(bash benchmarks/gpu_wheels.sh DIR; both pure Python) and run with WHEELS=DIR make gpu-smoke")


# ---------------------------------------------------------------------------------------------- the probe
def run_probe(device: Cuda, deadline: Deadline) -> dict:
    """benchmarks/gpu_probe.py in its own process (a crash there ends only it): its JSON, or {"error": why}."""
    if late := deadline.would_pass("probe"):
        return {"error": late}
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_probe.py"), *(["--cpu"] if device.dry_run else [])]
    started = time.monotonic()
    result = run_quietly(command, timeout=device.timeouts["probe"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return {"error": failure(result), "stderr": result.stderr[-4000:]}
    deadline.took("probe", time.monotonic() - started)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"no JSON on the probe's last line: {result.stdout[-200:]!r}"}




# ----------------------------------------------------------------------------------------------- the runs
def plans(recipe: str, *, gpus: int | None = None) -> dict[str, list[str] | str]:
    """Each run's command; a string in its place says why this machine skips the run. `gpus`: how many this machine
    has (None: the dry run's CPU ranks)."""
    run_py = str(REPO / "finetune" / "run.py")
    fsdp = ["parallel.strategy=fsdp"]
    commands: dict[str, list[str] | str] = {
        "single": [sys.executable, run_py, recipe],
        "fsdp2": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=2"),
        "fsdp2+offload": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=2", "parallel.cpu_offload=true"),
        "fsdp1": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=1"),
        # Where a torch-2.11 user with too little GPU memory is sent: FSDP1's CPUOffload (on a CPU-only torch it stays
        # off with a note: it pins memory).
        "fsdp1+offload": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=1", "parallel.cpu_offload=true"),
        "fsdp1+dropout": torchrun(run_py, recipe, *fsdp, "parallel.fsdp_version=1", "lora.dropout=0.05"),
        "hsdp": two_nodes(run_py, recipe, *fsdp, "parallel.fsdp_version=2", "parallel.hybrid_shard=true", gpus=gpus),
        "zero3": NO_DEEPSPEED,
    }
    if gpus is not None and gpus < 2:
        commands["hsdp"] = (f"HSDP needs two ranks on two GPUs (2 nodes x 1 process on loopback) and this machine has "
                            f"{gpus}: NCCL refuses two ranks on one GPU ('Duplicate GPU detected'). It runs in the dry "
                            "run on CPU ranks and here with 2 GPUs or more")
    if importlib.util.find_spec("deepspeed") is not None:
        commands["zero3"] = torchrun(run_py, recipe, "parallel.strategy=deepspeed", "parallel.zero_stage=3")
    return commands


def train(name: str, command: list[str] | str, out: Path, device: Cuda, deadline: Deadline) -> dict:
    """One run's record: ok, or why not (skip, reason); its losses, median tokens/s and peaks when it finished."""
    if isinstance(command, str):
        return {"name": name, "ok": False, "skip": command, "reason": f"skipped: {command}"}
    if late := deadline.would_pass("train"):
        return {"name": name, "ok": False, "skip": late, "reason": late}
    start = time.perf_counter()
    env = device.child_env(**({"FINETUNE_MEASURE_STEP": "2"} if name == "fsdp2" else {}))  # the step peak check
    result = run_quietly([*command, f"output.dir={out}"], timeout=device.timeouts["train"], deadline=deadline, env=env)
    record = {"name": name, "ok": result.returncode == 0, "seconds": round(time.perf_counter() - start, 1),
              "stdout": result.stdout[-4000:], "stderr": result.stderr[-4000:],
              # The note is printed while wrapping, before the step lines: searched in the whole output.
              "nan_guard_noted": "rewrite NaN bit patterns" in result.stdout,
              "reason": "" if result.returncode == 0 else failure(result)}
    if record["ok"]:
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rank = json.loads((out / "ranks" / "rank0.json").read_text())
        rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
        peak, reserved = device.run_peaks(rank)
        record.update(losses=[m["loss"] for m in metrics if "loss" in m], peak_mib=peak, reserved_mib=reserved,
                      tokens_per_s=rates[len(rates) // 2] if rates else None)
        deadline.took("train", record["seconds"])
    return record


def train_logged(name: str, command: list[str] | str, work: Path, device: Cuda, deadline: Deadline) -> dict:
    try:
        run = train(name, command, work / name.replace("+", "-"), device, deadline)
    except Exception as exc:  # noqa: BLE001  a run's files unreadable: its checks fail, the others still run
        traceback.print_exc()
        run = {"name": name, "ok": False, "reason": f"error: {type(exc).__name__}: {exc}"}
    state = "ok" if run["ok"] else run["reason"][-120:]
    print(f"[gpu-smoke] {name}: {state} ({run.get('seconds', 0)} s)", flush=True)
    return run


def run_processes(work: Path, recipe: Path, device: Cuda, deadline: Deadline) -> tuple[dict[str, dict], Check, Check]:
    """Every process the smoke starts: the training runs, the bench_loading worker, bench_peers. On the GPU one at a
    time in this order (each measures its own peak on the one device; the deadline cuts the last ones); the dry run
    `jobs` at a time (its wall time is mostly Python starting up, one core per process), bench_peers first: its five
    processes run one after another, the longest chain."""
    with ThreadPoolExecutor(max_workers=device.jobs) as pool:
        peer_args = ("ours vs plain PEFT loop", peer_check, work, device, deadline)
        peers = pool.submit(guarded, *peer_args) if device.jobs > 1 else None
        runs = {name: pool.submit(train_logged, name, command, work, device, deadline)
                for name, command in plans(str(recipe), gpus=device.gpus()).items()}
        load = pool.submit(guarded, "load peak vs planner", load_check, work, recipe, device, deadline)
        peers = peers or pool.submit(guarded, *peer_args)
        return {name: future.result() for name, future in runs.items()}, load.result(), peers.result()


# ---------------------------------------------------------------------------------------------- the checks
def losses_match(got: list[float], reference: list[float]) -> bool:
    return len(got) == len(reference) and all(
        abs(a - b) <= max(BF16_LOSS_TOLERANCE, LOSS_RELATIVE * abs(b)) for a, b in zip(got, reference))


def unfinished(run: dict, *, own: bool = False) -> str:
    """Why a run gives no figures, as a check's detail: the whole reason in the run's own "trains" line (`own`), a
    pointer to it in the others."""
    return f"{run['name']} did not finish: " + (run["reason"] if own else f"see '{run['name']} trains'")


def trains_check(run: dict) -> Check:
    name = f"{run['name']} trains"
    if "skip" in run:
        return Check(name, SKIP, run["skip"])
    if not run["ok"]:
        return Check(name, FAIL, unfinished(run, own=True))
    losses = run["losses"]
    if len(losses) < 2:
        return Check(name, FAIL, f"{len(losses)} losses logged, 2 or more needed")
    return Check(name, verdict(losses[-1] < losses[0]), f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def losses_check(run: dict, reference: dict) -> Check:
    name = f"{run['name']} losses = single"
    if "skip" in run:
        return Check(name, SKIP, run["skip"])
    if "skip" in reference:
        return Check(name, SKIP, f"no single-process run to compare with: {reference['skip']}")
    for each in (run, reference):
        if not each["ok"]:
            return Check(name, FAIL, unfinished(each))
    got, expected = run["losses"], reference["losses"]
    if len(got) != len(expected) or not got:
        return Check(name, FAIL, f"{len(got)} losses against the single process's {len(expected)}")
    worst = max(abs(a - b) for a, b in zip(got, expected))
    return Check(name, verdict(losses_match(got, expected)), f"max diff {worst:.2e}")


def byte_guard_check(run: dict, device: Cuda) -> Check:
    """The FSDP2 byte guard switches to uint8 exactly where this device's copy rewrites NaN bit patterns."""
    name = "FSDP2 byte guard"
    if "skip" in run:
        return Check(name, SKIP, run["skip"])
    if not run["ok"]:
        return Check(name, FAIL, unfinished(run))
    canonical = device.copy_canonicalizes_nans()
    detail = f"copy canonicalizes NaNs: {canonical}; guard switched to uint8: {run['nan_guard_noted']}"
    if device.dry_run:
        detail += " (dry run: the probe ran on the CPU)"
    return Check(name, verdict(canonical == run["nan_guard_noted"]), detail, {"nan_canonicalized": canonical})


def within_planner(name: str, measured: int | None, planned: int, what: str, keys: str) -> Check:
    """measured / planned within PLANNER_TOLERANCE; a missing figure is a failed check that names the keys it had."""
    if measured is None:
        return Check(name, FAIL, f"no {what} figure in the record (it has: {keys})")
    ratio = measured / planned
    low, high = 1 - PLANNER_TOLERANCE, 1 + PLANNER_TOLERANCE
    detail = (f"{what} {measured / 2**20:.1f} MiB, planner {planned / 2**20:.1f} MiB "
              f"(ratio {ratio:.2f}; allowed {low:.2f}-{high:.2f})")
    return Check(name, verdict(low <= ratio <= high), detail, {"measured_bytes": measured, "planned_bytes": planned})


def fsdp2_estimate(work: Path, recipe_path: Path, device: Cuda):
    """The planner's FSDP2 estimate at world size 1 for the smoke's model and recipe."""
    from transformers import AutoConfig

    from finetune.planner import Hardware, estimate, facts_from_config
    from finetune.recipe import load_recipe

    recipe = load_recipe(str(recipe_path), ["parallel.strategy=fsdp", "parallel.fsdp_version=2"])
    facts = facts_from_config(AutoConfig.from_pretrained(str(work / "model")), recipe)
    hardware = Hardware(1, device.memory_bytes(), cublas_workspace_bytes=device.cublas_workspace_bytes())
    return estimate(facts, recipe, "fsdp", hardware)


def planned_load_bytes(work: Path, recipe_path: Path, device: Cuda) -> int:
    """The planner's load term (finetune/planner/memory.py `_load_peak`, sharded: the 4-bit base at one rank + the
    quant state + the largest unit as read in bf16) without the CUDA context, which the allocator never sees. The
    worker's own recipe (r 16 all-linear, bf16, the default NF4) gives the same model facts as the smoke's."""
    from finetune.planner import CUDA_CONTEXT_BYTES

    return fsdp2_estimate(work, recipe_path, device).load_peak_bytes - CUDA_CONTEXT_BYTES


def load_verdict(record: dict, planned: int, device: Cuda) -> Check:
    """bench_loading.py's worker record ({mode}-w1-rank0.json) against the planner's load term."""
    measured, what = device.load_peak(record)
    what = f"{what} the allocator's load peak" if device.dry_run else f"load {what}"
    return within_planner("load peak vs planner", measured, planned, what, ", ".join(sorted(record)))


def load_check(work: Path, recipe_path: Path, device: Cuda, deadline: Deadline) -> Check:
    """Sharded loading (FSDP2, one rank) against the planner's load term."""
    name = "load peak vs planner"
    if late := deadline.would_pass("load"):
        return Check(name, SKIP, late)
    worker = str(REPO / "benchmarks" / "bench_loading.py")
    command = torchrun(worker, "--worker", "sharded", str(work / "model"), str(work))
    started = time.monotonic()
    result = run_quietly(command, timeout=device.timeouts["load"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return Check(name, FAIL, f"bench_loading worker: {failure(result)}",
                     {"stderr": result.stderr[-4000:]})
    deadline.took("load", time.monotonic() - started)
    record = json.loads((work / "sharded-w1-rank0.json").read_text())
    return load_verdict(record, planned_load_bytes(work, recipe_path, device), device)


def step_check(run: dict, work: Path, recipe_path: Path, device: Cuda) -> Check:
    """The allocator's peak during FSDP2's step 2 against the planner's training figure (one rank)."""
    from finetune.planner import CUDA_CONTEXT_BYTES

    name = "FSDP2 step peak vs planner"
    if "skip" in run:
        return Check(name, SKIP, run["skip"])
    if not run["ok"]:
        return Check(name, FAIL, unfinished(run))
    path = work / "fsdp2" / "ranks" / "rank0.step2.tensor_bytes.json"
    if not path.exists():
        return Check(name, FAIL, f"{path} was not written")
    record = json.loads(path.read_text())
    plan = fsdp2_estimate(work, recipe_path, device)
    planned = plan.peak_bytes - plan.parts["overhead"]  # the allocator's peak has no CUDA context, no fragmentation
    measured, what = device.step_peak(record)
    what = f"{what} the allocator's step 2 peak" if device.dry_run else what
    check = within_planner(name, measured, planned, what, ", ".join(sorted(record)))
    context = f"; the planner leaves out the {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB CUDA context"
    return Check(name, check.verdict, check.detail + context, check.figures)


def peer_verdict(runs: list[dict], device: Cuda, model: str) -> Check:
    """Per mode (unpacked, packed): our tokens/s >= PEER_MIN_SPEEDUP x the plain loop's, our peak <= PEER_MAX_PEAK x."""
    lines, figures, ok = [], {}, True
    for mode in ("unpacked", "packed"):
        pair = {r["runner"]: r for r in runs if r.get("mode") == mode and r.get("procs", 1) == 1}
        if not {"ours", "peft"} <= set(pair):
            ok = False
            lines.append(f"{mode}: not measured (runners: {', '.join(sorted(pair)) or 'none'})")
            continue
        ours, peft = pair["ours"], pair["peft"]
        speed = ours["median_tokens_per_s"] / peft["median_tokens_per_s"]
        ours_peak, peft_peak = device.peer_peak_mb(ours), device.peer_peak_mb(peft)
        memory = ours_peak / peft_peak if ours_peak and peft_peak else None
        ok = ok and speed >= PEER_MIN_SPEEDUP and memory is not None and memory <= PEER_MAX_PEAK
        figures[mode] = {"tokens_per_s_ratio": speed, "peak_ratio": memory, "ours_peak_mb": ours_peak,
                         "peft_peak_mb": peft_peak}
        shown = "no peak figure" if memory is None else f"{ours_peak:.0f} vs {peft_peak:.0f} MiB = {memory:.2f}x"
        lines.append(f"{mode} {speed:.2f}x tokens/s (>= {PEER_MIN_SPEEDUP}), peak {shown} (<= {PEER_MAX_PEAK})")
    model += " (dry run: peak RSS stands in for the GPU peak)" if device.dry_run else ""
    return Check("ours vs plain PEFT loop", verdict(ok), f"{model}: " + "; ".join(lines), figures)


def peer_check(work: Path, device: Cuda, deadline: Deadline) -> Check:
    """This project against the plain PEFT loop on this device (benchmarks/bench_peers.py), one repeat."""
    name = "ours vs plain PEFT loop"
    if late := deadline.would_pass("peers"):
        return Check(name, SKIP, late)
    model = device.peer_model()
    command = [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--only", "ours,peft", "--repeats", "1",
               "--steps", str(device.sizes["peer_steps"]), "--no-breakdown", "--json", str(work / "peers.json"), *model]
    result = run_quietly(command, timeout=device.timeouts["peers"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return Check(name, FAIL, f"bench_peers: {failure(result)}",
                     {"stderr": result.stderr[-4000:]})
    runs = json.loads((work / "peers.json").read_text())["runs"]
    return peer_verdict(runs, device, "tiny model" if model == ["--tiny"] else f"random model {model[-1].replace(',', ' x ')}")


def guarded(name: str, check, *args) -> Check:
    """A check that raises is a failed check with the error, so the JSON and the table are still written; the
    traceback goes to stderr, where the dry run's test looks for it."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001  whatever it was, the verdict is still written
        traceback.print_exc()
        return Check(name, FAIL, f"error: {type(exc).__name__}: {exc}")


def all_checks(runs: dict, load: Check, peers: Check, work: Path, recipe: Path, device: Cuda) -> list[Check]:
    """Every check in the table's order. Those made here read what the runs wrote (in well under a second), so they
    are made after the deadline too; what a process would have measured is `not run: deadline` by then."""
    checks = [guarded(f"{name} trains", trains_check, runs[name]) for name in RUNS]
    checks += [guarded(f"{name} losses = single", losses_check, runs[name], runs["single"]) for name in SAME_LOSSES]
    checks.append(guarded("FSDP2 byte guard", byte_guard_check, runs["fsdp2"], device))
    checks.append(load)
    checks.append(guarded("FSDP2 step peak vs planner", step_check, runs["fsdp2"], work, recipe, device))
    checks.append(peers)
    return checks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("GPU_SMOKE_JSON") or REPO / "benchmarks" / "gpu_smoke.json"),
                        help="where the JSON goes ($GPU_SMOKE_JSON; on a lent machine: $OUT/gpu_smoke.json comes back)")
    parser.add_argument("--hidden", type=int, help="model width (default 2048; dry run 64)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; dry run 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 20; dry run 3)")
    parser.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_SMOKE_DEADLINE_S") or 480),
                        help="the whole smoke's time ($GPU_SMOKE_DEADLINE_S); a process that would end past it is not "
                             "started: SKIP 'not run: deadline'")
    parser.add_argument("--dry-run", action="store_true", help="every code path but the CUDA calls, on the CPU")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = DryRun() if args.dry_run else Cuda()
    if not device.dry_run and not cuda_available():
        print("gpu-smoke: no CUDA GPU visible to this Python.")
        return 2
    deadline = Deadline(args.deadline_s, device.needs)
    about = {**device.describe(), "dry_run": device.dry_run, "deadline_s": args.deadline_s}
    print(f"[gpu-smoke] torch {about['torch']} on {about['device']} (CUDA {about['cuda'] or '-'}); deadline "
          f"{args.deadline_s:.0f} s", flush=True)
    about["probe"] = run_probe(device, deadline)
    for line in probe_lines(about["probe"]):
        print(f"[gpu-smoke] probe: {line}", flush=True)
    sizes = {key: getattr(args, key) or device.sizes[key] for key in ("hidden", "layers", "steps")}
    recipe = args.work / "recipe.yaml"
    try:
        write_inputs(args.work, sizes["hidden"], sizes["layers"], sizes["steps"])
    except Exception as exc:  # noqa: BLE001  no process can start: each check says why, in the JSON and the table
        traceback.print_exc()
        why = f"inputs not written: {type(exc).__name__}: {exc}"
        runs = {name: {"name": name, "ok": False, "reason": why} for name in RUNS}
        load, peers = Check("load peak vs planner", FAIL, why), Check("ours vs plain PEFT loop", FAIL, why)
    else:
        runs, load, peers = run_processes(args.work, recipe, device, deadline)
    checks = all_checks(runs, load, peers, args.work, recipe, device)
    about["nan_canonicalized"] = next((c.figures.get("nan_canonicalized") for c in checks
                                       if c.name == "FSDP2 byte guard"), None)
    write_report(args.json, about, runs, checks, started)
    print_table(args.json, about, runs, checks, device)
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
