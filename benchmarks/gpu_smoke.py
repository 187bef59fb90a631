"""The CUDA path on one GPU, in one run (benchmarks/gpu_smoke.sh picks the Python; `make gpu-smoke` runs both).

    bash benchmarks/gpu_smoke.sh [--json FILE] [--hidden N --layers N --steps N] [--deadline-s S]
    make gpu-smoke ARGS="--deadline-s 420"                 # the JSON: --json FILE, else $GPU_SMOKE_JSON, else
    WHEELS=.whl make gpu-smoke                              # $OUT/gpu_smoke.json where OUT is set (a lent machine
                                                            # brings back only $OUT), else benchmarks/gpu_smoke.json
    python benchmarks/gpu_smoke.py --dry-run --work DIR [--json FILE]      # the same runs and checks on the CPU

First a probe of about ten seconds (benchmarks/gpu_probe.py, its own process): the library versions and where each
comes from, whether torch sees the GPU and the driver, the cuBLAS workspace (given to the planner below), `_foreach_copy_`
on bf16 NaN payloads, a 1-rank `fully_shard` with `param_dtype=None`, FSDP2's 2-rank copy-in, finetune's byte guard
on a 2-rank unshard in one process; printed, and in the JSON under "probe" (where it failed: its error).

A Llama-shaped model built from a config (no hub: the lent GPU machine has no network; 2048 x 8, heads of 128; built
and saved in this process, timed as "build"), NF4 + LoRA in bf16 with checkpointing on, the same recipe for every
run, rows longer than max_length (256) so that every micro-batch fills it, as the planner sizes it. One line per
check, each of which can fail for a reason of finetune's on this GPU:
  * single process; FSDP2 at world size 1 with and without CPU offload; FSDP1 at world size 1 with and without CPU
    offload (also with the library's LoRA dropout 0.05, which crashed FSDP1 under checkpointing); HSDP's 2-D mesh as
    2 nodes x 1 process on loopback (2 GPUs or more; the `cpu:gloo,cuda:nccl` group); DeepSpeed ZeRO-3 at world size
    1 when installed (its wheel and hjson's are built by benchmarks/gpu_wheels.sh, installed with WHEELS=DIR):
    each "trains" (its loss falls);
  * the losses of the dropout-free runs equal to the single process within the suite's bf16 tolerance;
  * FSDP2's copy-in gives back a unit of mixed dtypes (bf16 packed bytes + fp32 LoRA) bitwise, as uint8 views: the
    route finetune takes on torch < 2.12 depends on it (a FAIL: that route is broken on this GPU); whether a
    bf16-only unit loses its NaN payloads there is reported beside it, not checked (a fact of torch);
  * the FSDP2 byte guard: the route finetune's guard picks for this GPU's copy keeps rank 0's packed bytes through a
    real 2-rank FSDP2 unshard (the probe's fake process group: this GPU's copy-in and copy-out, finetune's checksums),
    and the fsdp2 run took that route (its note). A torch that cannot make the 2-rank group here is a SKIP;
  * the allocator's peak while loading sharded (benchmarks/bench_loading.py's worker, FSDP2, one rank) against the
    planner's load term for the same model and recipe, CUDA context left out (within 15%; the term counts what the
    allocator does: the fp32 LoRA, the byte guard's float64 chunk, the cuBLAS workspace: finetune/planner/allocator.py);
  * the CUDA allocator's peak during FSDP2's step 2 (FINETUNE_MEASURE_STEP=2) against the planner's training figure
    for the same recipe at world size 1, CUDA context and fragmentation left out (within 15%). Both planner lines
    give the planner the probe's measured cuBLAS workspace, and their JSON holds the parts: the planner's, the step's
    tensor-bytes meter's, and the allocator at its peak (gpu_smoke_device.py --memory: its statistics and the blocks
    alive at the peak by where they were allocated), so that a first FAIL can be read part by part;
  * this project against the plain PEFT loop (benchmarks/bench_peers.py, both clocks synchronized with the GPU; a
    random 2048 x 8-layer model built from a config, large enough that the GPU, not Python, bounds a step): in both
    modes (unpacked, packed) our tokens/s >= PEER_MIN_SPEEDUP x the loop's and our peak GPU memory <= 1.0x its peak.
    The loop is PEFT's QLoRA recipe as published: prepare_model_for_kbit_training, which casts the embeddings, the
    norms and the lm_head to fp32 (ours keeps them in bf16), so part of any margin is that recipe's cost.
A part this machine cannot run (ZeRO-3 without deepspeed, HSDP on one GPU) is `SKIP  <check>: <reason>`: listed, never a
pass.
The processes, one at a time on the GPU, most informative first (ORDER): the probe, the model build, single, fsdp2,
the load worker, the peers, then fsdp2+offload, fsdp1, fsdp1+dropout, zero3, fsdp1+offload (the least tested, most
likely to hang), hsdp. A hung run costs at most its timeout (train 120 s), so the load and peers lines run even after
two hung runs. One deadline bounds the whole smoke (--deadline-s, default 8 minutes: a lent GPU machine cuts a
command at 10): each subprocess gets the lesser of its own timeout and the time left, and one is started only while
the time left covers what a process of its kind needs (the longest of that kind so far, else `Cuda.needs`); what is
not started is `SKIP  <check>: not run: deadline (...)`. A failed check's detail is the child's own reason: its last
`finetune: error:` paragraph, else its last exception line (never torchrun's footer). The JSON and the table are
written in every case.
Ends with `gpu-smoke: N passed, M failed, K skipped`; exits 0 when no check failed, 1 when one did, 2 without a GPU
(before anything runs; the JSON then holds the reason).

--dry-run rehearses every code path but the CUDA calls on the CPU (CUDA hidden from every process; torchrun at one
rank forms a gloo group), with a tiny model (hidden 64, 2 layers, 3 steps) and short timeouts: a KeyError that would
end the GPU run is found here first (tests/test_gpu_smoke_dry.py). Every process it starts has `_foreach_copy_`
rewriting bf16 NaN payloads as CUDA's does (gpu_smoke_device.py --cuda-like-copy, as tests/parallel/test_byte_guard.py
patches it), so the probe and the FSDP2 runs take the GPU's route through the byte guard ("mixed" on torch < 2.12).
The figures only CUDA has come from `DryRun`, CPU-side stand-ins named as such in each detail, and go through the
same parsing and ratios; the verdicts on a CPU need not pass.
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
from gpu_smoke_report import (  # noqa: F401  (losses_match, verdict: read by the tests through this module)
    FAIL,
    SKIP,
    Check,
    byte_guard_check,
    copy_in_check,
    exit_code,
    losses_check,
    losses_match,
    memory_summary,
    peer_verdict,
    print_table,
    route_of,
    trains_check,
    unfinished,
    verdict,
    within_planner,
    write_report,
)

RUNS = ("single", "fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "fsdp1+dropout", "hsdp", "zero3")
# Not fsdp1+dropout (its dropout masks are its own), nor hsdp (two ranks: twice the rows per step).
SAME_LOSSES = ("fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "zero3")
# The processes in the order they start on the GPU, most informative first: the reference run, FSDP2 (the step
# peak, the byte guard's route), the two processes no later hang may push past the deadline, then the other runs with
# the least tested (FSDP1's NO_SHARD with CPU offload at world size 1) last but HSDP (a SKIP on one GPU).
ORDER = ("single", "fsdp2", "load", "peers", "fsdp2+offload", "fsdp1", "fsdp1+dropout", "zero3", "fsdp1+offload",
         "hsdp")
NO_DEEPSPEED = ("deepspeed is not installed in this Python. Fix: make its wheel and hjson's where the registries are "
                "(bash benchmarks/gpu_wheels.sh DIR; both pure Python) and run with WHEELS=DIR make gpu-smoke")
MEMORY = {"fsdp2": "fsdp2.allocator.json", "load": "load.allocator.json"}  # the allocator at its peak (--memory)


# ---------------------------------------------------------------------------------------------- the probe
def run_probe(device: Cuda, deadline: Deadline) -> dict:
    """benchmarks/gpu_probe.py in its own process (a crash there ends only it): its JSON, or {"error": why}."""
    if late := deadline.would_pass("probe"):
        return {"error": late}
    command = [sys.executable, *device.script(str(REPO / "benchmarks" / "gpu_probe.py")),
               *(["--cpu"] if device.dry_run else [])]
    started = time.monotonic()
    result = run_quietly(command, timeout=device.timeouts["probe"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return {"error": failure(result), "stderr": result.stderr[-4000:]}
    deadline.took("probe", time.monotonic() - started)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"no JSON on the probe's last line: {result.stdout[-200:]!r}"}


def build_inputs(work: Path, sizes: dict[str, int], device: Cuda, deadline: Deadline) -> str | None:
    """The model, rows and recipe every run shares, made in this process and timed as "build"; why not, or None."""
    if late := deadline.would_pass("build"):
        return late
    started = time.monotonic()
    try:
        write_inputs(work, sizes["hidden"], sizes["layers"], sizes["steps"])
    except Exception as exc:  # noqa: BLE001  no process can start: each check says why, in the JSON and the table
        traceback.print_exc()
        return f"inputs not written: {type(exc).__name__}: {exc}"
    deadline.took("build", time.monotonic() - started)
    print(f"[gpu-smoke] build: {sizes['hidden']} x {sizes['layers']} model, rows and recipe "
          f"({time.monotonic() - started:.1f} s)", flush=True)
    return None


# ----------------------------------------------------------------------------------------------- the runs
def plans(recipe: str, *, gpus: int | None = None, script=None) -> dict[str, list[str] | str]:
    """Each run's command; a string in its place says why this machine skips the run. `gpus`: how many this machine
    has (None: the dry run's CPU ranks). `script(path, memory=None)`: how a child starts a script (Cuda.script)."""
    script = script or Cuda().script
    run_py = str(REPO / "finetune" / "run.py")
    fsdp = ["parallel.strategy=fsdp"]
    run = script(run_py)
    commands: dict[str, list[str] | str] = {
        "single": [sys.executable, *run, recipe],
        # The step peak's run: the allocator recorded (its summary at the peak, beside the planner's parts)
        "fsdp2": torchrun(*script(run_py, memory=Path(recipe).parent / MEMORY["fsdp2"]), recipe, *fsdp,
                          "parallel.fsdp_version=2"),
        "fsdp2+offload": torchrun(*run, recipe, *fsdp, "parallel.fsdp_version=2", "parallel.cpu_offload=true"),
        "fsdp1": torchrun(*run, recipe, *fsdp, "parallel.fsdp_version=1"),
        # Where a torch-2.11 user with too little GPU memory is sent: FSDP1's CPUOffload (on a CPU-only torch it stays
        # off with a note: it pins memory).
        "fsdp1+offload": torchrun(*run, recipe, *fsdp, "parallel.fsdp_version=1", "parallel.cpu_offload=true"),
        "fsdp1+dropout": torchrun(*run, recipe, *fsdp, "parallel.fsdp_version=1", "lora.dropout=0.05"),
        "hsdp": two_nodes(*run, recipe, *fsdp, "parallel.fsdp_version=2", "parallel.hybrid_shard=true", gpus=gpus),
        "zero3": NO_DEEPSPEED,
    }
    if gpus is not None and gpus < 2:
        commands["hsdp"] = (f"HSDP needs two ranks on two GPUs (2 nodes x 1 process on loopback) and this machine has "
                            f"{gpus}: NCCL refuses two ranks on one GPU ('Duplicate GPU detected'). It runs in the dry "
                            "run on CPU ranks and here with 2 GPUs or more")
    if importlib.util.find_spec("deepspeed") is not None:
        commands["zero3"] = torchrun(*run, recipe, "parallel.strategy=deepspeed", "parallel.zero_stage=3")
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
              "route": route_of(result.stdout),
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
    """Every process the smoke starts after the probe and the build: the training runs, the bench_loading worker,
    bench_peers. On the GPU one at a time in ORDER (each measures its own peak on the one device; the deadline cuts
    the last ones); the dry run `jobs` at a time (its wall time is mostly Python starting up, one core per process),
    bench_peers first: its processes run one after another, the longest chain."""
    commands = plans(str(recipe), gpus=device.gpus(), script=device.script)
    jobs = {"load": (guarded, "load peak vs planner", load_check, work, recipe, device, deadline),
            "peers": (guarded, "ours vs plain PEFT loop", peer_check, work, device, deadline),
            **{name: (train_logged, name, commands[name], work, device, deadline) for name in RUNS}}
    order = [*(("peers",) if device.jobs > 1 else ()), *(name for name in ORDER if device.jobs == 1 or name != "peers")]
    with ThreadPoolExecutor(max_workers=device.jobs) as pool:
        futures = {name: pool.submit(*jobs[name]) for name in order}
        return ({name: futures[name].result() for name in RUNS}, futures["load"].result(), futures["peers"].result())


# ---------------------------------------------------------------------------------------------- the checks
def fsdp2_estimate(work: Path, recipe_path: Path, device: Cuda):
    """The planner's FSDP2 estimate at world size 1 for the smoke's model and recipe, with the probe's cuBLAS
    workspace where it measured one (Cuda.use_probe); and the model's facts."""
    from transformers import AutoConfig

    from finetune.planner import Hardware, estimate, facts_from_config
    from finetune.recipe import load_recipe

    recipe = load_recipe(str(recipe_path), ["parallel.strategy=fsdp", "parallel.fsdp_version=2"])
    facts = facts_from_config(AutoConfig.from_pretrained(str(work / "model")), recipe)
    hardware = Hardware(1, device.memory_bytes(), cublas_workspace_bytes=device.cublas_workspace_bytes())
    return estimate(facts, recipe, "fsdp", hardware), facts


def planned_load_bytes(work: Path, recipe_path: Path, device: Cuda) -> int:
    """The planner's load term (finetune/planner/memory.py `_load_peak`, sharded: the 4-bit base at one rank + the
    quant state + the largest unit as read in bf16) without the CUDA context, which the allocator never sees. The
    worker's own recipe (r 16 all-linear, bf16, the default NF4) gives the same model facts as the smoke's."""
    return sum(planned_load_parts(work, recipe_path, device).values())


def planned_load_parts(work: Path, recipe_path: Path, device: Cuda) -> dict[str, int]:
    """The load term by part (finetune/planner/allocator.py `load_parts`), CUDA context left out."""
    from finetune.planner import CUDA_CONTEXT_BYTES
    from finetune.planner.allocator import load_parts

    plan, facts = fsdp2_estimate(work, recipe_path, device)
    parts = load_parts(facts, "fsdp", 1, 1, sharded=True, workspace_bytes=device.cublas_workspace_bytes())
    parts.pop("cuda_context")
    if sum(parts.values()) != plan.load_peak_bytes - CUDA_CONTEXT_BYTES:
        raise ValueError(f"the load term's parts ({sum(parts.values())}) are not the estimate's load term "
                         f"({plan.load_peak_bytes - CUDA_CONTEXT_BYTES}): planned_load_parts reads it differently")
    return parts


def load_verdict(record: dict, planned: int, device: Cuda) -> Check:
    """bench_loading.py's worker record ({mode}-w1-rank0.json) against the planner's load term."""
    measured, what = device.load_peak(record)
    what = f"{what} the allocator's load peak" if device.dry_run else f"load {what}"
    return within_planner("load peak vs planner", measured, planned, what, ", ".join(sorted(record)))


def load_check(work: Path, recipe_path: Path, device: Cuda, deadline: Deadline) -> Check:
    """Sharded loading (FSDP2, one rank) against the planner's load term; its figures: the planner's parts and the
    allocator at its peak."""
    name = "load peak vs planner"
    if late := deadline.would_pass("load"):
        return Check(name, SKIP, late)
    worker = str(REPO / "benchmarks" / "bench_loading.py")
    command = torchrun(*device.script(worker, memory=work / MEMORY["load"]), "--worker", "sharded", str(work / "model"),
                       str(work))
    started = time.monotonic()
    result = run_quietly(command, timeout=device.timeouts["load"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return Check(name, FAIL, f"bench_loading worker: {failure(result)}",
                     {"stderr": result.stderr[-4000:], "allocator": memory_summary(work / MEMORY["load"])})
    deadline.took("load", time.monotonic() - started)
    record = json.loads((work / "sharded-w1-rank0.json").read_text())
    parts = planned_load_parts(work, recipe_path, device)
    check = load_verdict(record, sum(parts.values()), device)
    figures = {**check.figures, "planner_parts": parts, "allocator": memory_summary(work / MEMORY["load"])}
    return Check(name, check.verdict, f"{check.detail}; {device.workspace_note()}", figures)


def step_check(run: dict, work: Path, recipe_path: Path, device: Cuda) -> Check:
    """The allocator's peak during FSDP2's step 2 against the planner's training figure (one rank); its figures: the
    planner's parts, the tensor-bytes meter's parts at the step's peak, and the allocator at its peak."""
    from finetune.planner import CUDA_CONTEXT_BYTES

    name = "FSDP2 step peak vs planner"
    if "skip" in run:
        return Check(name, SKIP, run["skip"])
    if not run["ok"]:  # an out-of-memory run wrote its allocator at exit too
        return Check(name, FAIL, unfinished(run), {"allocator": memory_summary(work / MEMORY["fsdp2"])})
    path = work / "fsdp2" / "ranks" / "rank0.step2.tensor_bytes.json"
    if not path.exists():
        return Check(name, FAIL, f"{path} was not written")
    record = json.loads(path.read_text())
    plan, _ = fsdp2_estimate(work, recipe_path, device)
    planned = plan.peak_bytes - plan.parts["overhead"]  # the allocator's peak has no CUDA context, no fragmentation
    measured, what = device.step_peak(record)
    what = f"{what} the allocator's step 2 peak" if device.dry_run else what
    check = within_planner(name, measured, planned, what, ", ".join(sorted(record)))
    context = f"; the planner leaves out the {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB CUDA context; {device.workspace_note()}"
    figures = {**check.figures, "planner_parts": {k: v for k, v in plan.parts.items() if k != "overhead"},
               "meter_parts": {"held": record.get("held_parts"), "step": record.get("step_parts")},
               "allocator": memory_summary(work / MEMORY["fsdp2"])}
    return Check(name, check.verdict, check.detail + context, figures)


def peer_check(work: Path, device: Cuda, deadline: Deadline) -> Check:
    """This project against the plain PEFT loop on this device (benchmarks/bench_peers.py), one repeat."""
    name = "ours vs plain PEFT loop"
    if late := deadline.would_pass("peers"):
        return Check(name, SKIP, late)
    model = device.peer_model()
    command = [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--only", "ours,peft", "--repeats", "1",
               "--steps", str(device.sizes["peer_steps"]), "--no-breakdown", "--json", str(work / "peers.json"), *model]
    started = time.monotonic()
    result = run_quietly(command, timeout=device.timeouts["peers"], deadline=deadline, env=device.child_env())
    if result.returncode != 0:
        return Check(name, FAIL, f"bench_peers: {failure(result)}",
                     {"stderr": result.stderr[-4000:]})
    deadline.took("peers", time.monotonic() - started)
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


def all_checks(runs: dict, load: Check, peers: Check, probe: dict, work: Path, recipe: Path,
               device: Cuda) -> list[Check]:
    """Every check in the table's order. Those made here read what the runs and the probe wrote (in well under a
    second), so they are made after the deadline too; what a process would have measured is `not run: deadline`."""
    checks = [guarded(f"{name} trains", trains_check, runs[name]) for name in RUNS]
    checks += [guarded(f"{name} losses = single", losses_check, runs[name], runs["single"]) for name in SAME_LOSSES]
    checks.append(guarded("FSDP2 copy-in keeps mixed units' bytes", copy_in_check, probe, device))
    checks.append(guarded("FSDP2 byte guard", byte_guard_check, runs["fsdp2"], probe, device))
    checks.append(load)
    checks.append(guarded("FSDP2 step peak vs planner", step_check, runs["fsdp2"], work, recipe, device))
    checks.append(peers)
    return checks


def default_json() -> Path:
    """$GPU_SMOKE_JSON, else $OUT/gpu_smoke.json where OUT is set (a lent machine brings back only $OUT), else
    benchmarks/gpu_smoke.json (git-ignored)."""
    if os.environ.get("GPU_SMOKE_JSON"):
        return Path(os.environ["GPU_SMOKE_JSON"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_smoke.json"
    return REPO / "benchmarks" / "gpu_smoke.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None,
                        help="where the JSON goes (default: $GPU_SMOKE_JSON, else $OUT/gpu_smoke.json where OUT is "
                             "set, else benchmarks/gpu_smoke.json)")
    parser.add_argument("--hidden", type=int, help="model width (default 2048; dry run 64)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; dry run 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 20; dry run 3)")
    parser.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_SMOKE_DEADLINE_S") or 480),
                        help="the whole smoke's time ($GPU_SMOKE_DEADLINE_S); a process that would end past it is not "
                             "started: SKIP 'not run: deadline'")
    parser.add_argument("--dry-run", action="store_true", help="every code path but the CUDA calls, on the CPU")
    args = parser.parse_args(argv)
    args.json = args.json or default_json()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = DryRun() if args.dry_run else Cuda()
    if not device.dry_run and not cuda_available():
        reason = "no CUDA GPU visible to this Python"
        print(f"gpu-smoke: {reason}.")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"error": reason, "stage": "cuda", "exit_code": 2}) + "\n")
        return 2
    deadline = Deadline(args.deadline_s, device.needs)
    about = {**device.describe(), "dry_run": device.dry_run, "deadline_s": args.deadline_s}
    print(f"[gpu-smoke] torch {about['torch']} on {about['device']} (CUDA {about['cuda'] or '-'}); deadline "
          f"{args.deadline_s:.0f} s", flush=True)
    about["probe"] = run_probe(device, deadline)
    for line in probe_lines(about["probe"]):
        print(f"[gpu-smoke] probe: {line}", flush=True)
    device.use_probe(about["probe"])
    sizes = {key: getattr(args, key) or device.sizes[key] for key in ("hidden", "layers", "steps")}
    recipe = args.work / "recipe.yaml"
    if why := build_inputs(args.work, sizes, device, deadline):
        runs = {name: {"name": name, "ok": False, "reason": why} for name in RUNS}
        load, peers = Check("load peak vs planner", FAIL, why), Check("ours vs plain PEFT loop", FAIL, why)
    else:
        runs, load, peers = run_processes(args.work, recipe, device, deadline)
    checks = all_checks(runs, load, peers, about["probe"], args.work, recipe, device)
    about["nan_canonicalized"] = about["probe"].get("foreach_copy_canonicalizes_nans")
    about["cublas_workspace_bytes_given_to_planner"] = device.cublas_workspace_bytes()
    write_report(args.json, about, runs, checks, started)
    print_table(args.json, about, runs, checks, device)
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
