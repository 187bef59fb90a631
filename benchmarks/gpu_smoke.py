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
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the planner checks import finetune from this checkout, however the script starts
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_probe import copy_canonicalizes_nans  # (after the path: benchmarks/ is a script folder)

BF16_LOSS_TOLERANCE = 3e-3  # tests/parallel/test_distributed.py, per logged loss
LOSS_RELATIVE = 5e-3  # on a GPU the kernels differ more than on CPU: the larger of the two is allowed
PLANNER_TOLERANCE = 0.15  # measured / planned within 0.85-1.15
# Our tokens/s over the plain PEFT loop's, in each mode: issue 13's goal, docs/benchmarks.md ("tokens/s >= 1.0x the
# plain PEFT loop"; 1.62x / 1.66x measured on 2 CPU cores). Not the CPU's ratio: on a GPU the fused LoRA path saves
# kernel launches and memory traffic, not the CPU's dropout draws, and no figure of it on a GPU is published yet.
PEER_MIN_SPEEDUP = 1.0
PEER_MAX_PEAK = 1.0  # our peak GPU memory over the plain PEFT loop's, in each mode
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DEADLINE = "not run: deadline"
FOOTER = re.compile(r"^[EWI]\d{4} .*torch/distributed/elastic/.*failed \(exitcode")  # torchrun's report of a failed child
LOG_LINE = re.compile(r"^([EWIF]\d{4} \d\d:|\[[EWIF] ?\d|\S+\.py:\d+: \w*Warning:|Traceback |=+$)")
EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b|Fatal Python error)")
RUNS = ("single", "fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "fsdp1+dropout", "hsdp", "zero3")
# Not fsdp1+dropout (its dropout masks are its own), nor hsdp (two ranks: twice the rows per step).
SAME_LOSSES = ("fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload", "zero3")
NO_DEEPSPEED = ("deepspeed is not installed in this Python. Fix: make its wheel and hjson's where the registries are "
                "(bash benchmarks/gpu_wheels.sh DIR; both pure Python) and run with WHEELS=DIR make gpu-smoke")
MAX_LENGTH = 256  # data.max_length; every row of the smoke's data is longer, so each micro-batch fills it


@dataclass(frozen=True)
class Check:
    """One line of the verdict: PASS and FAIL are checked, SKIP says why this machine could not check it."""

    name: str
    verdict: str
    detail: str
    figures: dict = field(default_factory=dict)


def verdict(ok: bool) -> str:
    return PASS if ok else FAIL


class Deadline:
    """One clock for the whole smoke: the lent machine cuts a command at 10 minutes, whatever each run's timeout is.
    A process starts only while the time left covers what one of its kind needs: the longest of that kind that
    finished here so far, else the device's figure (`needs`); what is not started is skipped with the reason."""

    def __init__(self, seconds: float, needs: dict[str, float] | None = None):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.needs = dict(needs or {})
        self.taken: dict[str, float] = {}

    def took(self, kind: str, seconds: float) -> None:
        self.taken[kind] = max(seconds, self.taken.get(kind, 0.0))

    def would_pass(self, kind: str) -> str | None:
        """Why a process of `kind` is not started now (the deadline would pass first), or None."""
        need = self.taken.get(kind, self.needs.get(kind, 0.0))
        left = self.left()
        if left > max(need, 0.0):
            return None
        return f"{DEADLINE} ({max(left, 0.0):.0f} s left of {self.seconds:.0f}; a {kind} process needs ~{need:.0f} s)"

    def left(self) -> float:
        return self.end - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.left() <= 0

    def timeout(self, own: float) -> float:
        return max(0.0, min(own, self.left()))


# ------------------------------------------------------------------------- what only CUDA says, and its stand-ins
class Cuda:
    """The figures only a GPU gives, one small method each; `DryRun` answers the same questions on the CPU."""

    dry_run = False
    jobs = 1  # processes at once
    # 2048 x 8 (~300M parameters, 16 heads of 128): the planner checks compare peaks in which the fixed costs
    # (the cuBLAS workspace, the byte guard's chunk: ~40 MiB) are a small share; at 1024 x 8 they were ~40% of the load.
    sizes: ClassVar[dict[str, int]] = {"hidden": 2048, "layers": 8, "steps": 20, "peer_steps": 10}
    timeouts: ClassVar[dict[str, int]] = {"probe": 60, "train": 240, "load": 240, "peers": 300}
    # Seconds a process of each kind needs before any has run here (estimates: imports ~5 s, NCCL ~2 s, loading and
    # 20 steps of the 2048 x 8 model; the peers: 4 processes of a 2048 x 8 model): replaced by what one took.
    needs: ClassVar[dict[str, float]] = {"probe": 10, "train": 40, "load": 25, "peers": 90}
    peak_label = "peak MiB"

    def describe(self) -> dict:
        import torch

        return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}

    def memory_bytes(self) -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    def cublas_workspace_bytes(self) -> int:
        """What the planner counts for cuBLAS's workspace: torch's default on sm90+ (finetune/planner/allocator.py;
        the probe prints what this GPU's allocator holds)."""
        from finetune.planner import CUBLAS_WORKSPACE_BYTES

        return CUBLAS_WORKSPACE_BYTES

    def gpus(self) -> int | None:
        """GPUs this Python sees (HSDP needs two); None where processes are not bound to GPUs (the dry run)."""
        import torch

        return torch.cuda.device_count()

    def copy_canonicalizes_nans(self) -> bool:
        return copy_canonicalizes_nans("cuda")

    def child_env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, HF_HUB_OFFLINE="1", **extra)

    def load_peak(self, record: dict) -> tuple[int | None, str]:
        """The allocator's peak while the worker loaded and wrapped (bench_loading.py resets it before loading)."""
        return record.get("peak_gpu_allocated"), "peak allocated"

    def step_peak(self, record: dict) -> tuple[int | None, str]:
        return record.get("gpu_step_peak_allocated_bytes"), "step 2 peak allocated"

    def run_peaks(self, rank: dict) -> tuple[float, float | None]:
        """MiB: the run's allocated and reserved peaks (ranks/rank0.json)."""
        return rank.get("peak_gpu_bytes", 0) / 2**20, rank.get("peak_gpu_reserved_bytes", 0) / 2**20

    def peer_peak_mb(self, run: dict) -> float | None:
        return run.get("peak_gpu_mb")

    def peer_model(self) -> list[str]:
        """A model the GPU, not Python, bounds: 2048 wide (matmuls of 2048 x 2048 x 4096 at batch 4 x 512, ~0.1 ms
        each on an H100, longer than a launch), 8 layers, built from a config (the lent machine has no network)."""
        return ["--random", "2048,8"]


class DryRun(Cuda):
    """The CPU rehearsal: CUDA hidden from every process, CPU-side figures where the GPU's would be."""

    dry_run = True
    jobs = 2  # the 2-core machines the suite runs on: startup (imports) is most of each process, one core each
    # bench_peers needs 3 steps or more (its step 1 is warm-up)
    sizes: ClassVar[dict[str, int]] = {"hidden": 64, "layers": 2, "steps": 3, "peer_steps": 3}
    timeouts: ClassVar[dict[str, int]] = {"probe": 60, "train": 90, "load": 90, "peers": 180}
    needs: ClassVar[dict[str, float]] = {"probe": 5, "train": 8, "load": 8, "peers": 20}
    peak_label = "RSS MiB*"

    def describe(self) -> dict:
        import torch

        return {"device": "CPU (dry run: no CUDA call made)", "torch": torch.__version__, "cuda": None}

    def memory_bytes(self) -> int:
        return 80 * 2**30  # a placeholder: the planner's fit verdict reads it, the peaks compared here do not

    def gpus(self) -> int | None:
        return None  # CPU ranks: any number of processes

    def cublas_workspace_bytes(self) -> int:
        return 0  # no cuBLAS on the CPU: its stand-in peaks have no workspace

    def copy_canonicalizes_nans(self) -> bool:
        return copy_canonicalizes_nans("cpu")

    def child_env(self, **extra: str) -> dict[str, str]:
        # One thread each: two processes at once (`jobs`) on the suite's 2 cores, beside the CPU tests' own runs.
        return dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                    TOKENIZERS_PARALLELISM="false", **extra)

    def load_peak(self, record: dict) -> tuple[int | None, str]:
        return record.get("peak_over_baseline"), "dry run: the CPU's RssAnon peak over baseline stands in for"

    def step_peak(self, record: dict) -> tuple[int | None, str]:
        return record.get("peak_bytes"), "dry run: the tensor bytes alive at step 2's peak (CPU) stand in for"

    def run_peaks(self, rank: dict) -> tuple[float, float | None]:
        return rank.get("peak_rss_bytes", 0) / 2**20, None

    def peer_peak_mb(self, run: dict) -> float | None:
        return run.get("peak_rss_mb")  # dry run: the process's peak RSS stands in for the GPU peak

    def peer_model(self) -> list[str]:
        return ["--tiny"]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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


def probe_lines(probe: dict) -> list[str]:
    """The probe's answers, one line each (an answer that failed shows its error)."""
    if "error" in probe:
        return [f"failed: {probe['error']}"]
    versions = ", ".join(f"{name} {version or '-'}" for name, version in probe["versions"].items())
    lines = [f"{probe['seconds']} s on {probe['device']}: {versions}"]
    for key, say in (("cuda", _gpus_line), ("cublas_workspace_bytes", _workspace_line),
                     ("foreach_copy_canonicalizes_nans", _copy_line), ("fully_shard_param_dtype_none", _shard_line),
                     ("fsdp_copy_in", _copy_in_line)):
        answer = probe.get(key, {"error": "not asked"})
        lines.append(f"{key}: error: {answer['error']}" if isinstance(answer, dict) and "error" in answer else say(answer))
    return lines


def _gpus_line(cuda: dict) -> str:
    seen = f" ({cuda['device']}, sm {cuda['capability']})" if cuda.get("device") else ""
    return (f"torch sees {cuda['device_count']} GPU(s){seen}, built for CUDA {cuda['torch_cuda'] or '-'}; nvidia-smi "
            f"lists {len(cuda.get('gpus', []))}, driver {cuda.get('driver') or '-'} (CUDA {cuda.get('driver_cuda') or '-'})")


def _workspace_line(workspace: int | None) -> str:
    return "cuBLAS workspace: " + ("- (CPU)" if workspace is None else f"{workspace / 2**20:.1f} MiB")


def _copy_line(canonicalizes: bool) -> str:
    return "_foreach_copy_ of bf16 NaN payloads: " + ("rewrites them" if canonicalizes else "keeps the bytes")


def _copy_in_line(result: dict) -> str:
    return (f"FSDP2's 2-rank copy-in: mixed unit as uint8 bitwise {result['mixed_unit_as_uint8_bitwise']}; bf16 unit "
            f"bitwise {result['bf16_unit_bitwise']}")


def _shard_line(result: dict) -> str:
    mixed, bf16 = result["mixed_unit"], result["bf16_only_unit"]
    return (f"fully_shard(param_dtype=None), 1 rank: mixed unit (bf16 payload + fp32 LoRA) bitwise {mixed['bitwise']}, "
            f"LoRA grad {mixed['lora_grad_dtype']} finite {mixed['lora_grad_finite']}; bf16-only unit bitwise "
            f"{bf16['bitwise']}")


# ----------------------------------------------------------------------------------------------- the runs
def run_quietly(command: list[str], *, timeout: float, deadline: Deadline, env: dict) -> subprocess.CompletedProcess:
    """The command's result; a timeout (its own or the deadline) is a failed result (a failed check), not a traceback.
    The command gets a session of its own so that a timeout ends torchrun's workers too (they would hold the GPU)."""
    limit = deadline.timeout(timeout)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        cause = "its timeout" if limit >= timeout else "the smoke's deadline"
        note = f"timed out after {limit:.0f} s ({cause})"
        return subprocess.CompletedProcess(command, 124, stdout, f"{stderr[-2000:]}\n{note}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def failure(result: subprocess.CompletedProcess) -> str:
    """Why a process failed, on one line (a check's detail is one line of the table): a timeout says only that; else
    the exit code and the child's own reason (`reason_in`; the end of its stderr is in the JSON)."""
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    if result.returncode == 124 and lines and lines[-1].startswith("timed out after"):
        return lines[-1]
    return f"exit {result.returncode}: {reason_in(result.stderr)}"


def reason_in(stderr: str, limit: int = 300) -> str:
    """The child's own reason in a process's stderr, never torchrun's footer (which follows it, and says only
    "exitcode ... To enable traceback see ..."): its last `finetune: error:` paragraph (whole: it names the fix), else
    the last exception line of its last traceback, else the last exception-looking line, else the exit code and
    signal of torchrun's root cause, else the last `limit` characters."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line.rstrip()) for line in stderr.splitlines()]
    footer = next((i for i, line in enumerate(lines) if FOOTER.match(line)), len(lines))
    child, torchrun_footer = lines[:footer], lines[footer:]
    errors = [i for i, line in enumerate(child) if line.startswith("finetune: error:")]
    if errors:
        paragraph = [child[errors[-1]]]
        for line in child[errors[-1] + 1:]:
            if not line.strip() or LOG_LINE.match(line):
                break
            paragraph.append(line.strip())
        return " ".join(paragraph)
    tracebacks = [i for i, line in enumerate(child) if line.startswith("Traceback (most recent call last)")]
    after = child[tracebacks[-1] + 1:] if tracebacks else []
    raised = next((line for line in after if line.strip() and not line[0].isspace()), None)
    raised = raised or next((line for line in reversed(child) if EXCEPTION.match(line)), None)
    if raised:
        return raised.strip()
    cause = [line.strip() for line in torchrun_footer if line.strip().startswith(("exitcode", "traceback : Signal"))]
    if cause:
        return "torchrun: " + "; ".join(cause)
    return " | ".join(line.strip() for line in child if line.strip())[-limit:]


def torchrun(*args: str) -> list[str]:
    """One rank under torchrun (a 1-rank process group); --standalone picks a free port when the run starts, so two
    dry-run processes at once never race for one."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *args]


def write_inputs(work: Path, hidden: int, layers: int, steps: int) -> Path:
    """The model (built from a config, in this process), 512 counting rows and the recipe every run shares.

    Heads of 128 (4 heads below 512 wide), as many key/value heads as query heads: SDPA keeps what the planner
    counts with or without a mask (with one, transformers repeats k/v to every query head). Every row is longer than
    data.max_length (a few hundred numbers counted on; the default `overlong: truncate` keeps the first MAX_LENGTH
    tokens, the answer starting within them), so every micro-batch is MAX_LENGTH wide with no padding: the planner
    sizes activations at max_length, and rows of 32-35 tokens (the addition rows this replaced) made the measured
    step peak ~0.6 of its figure."""
    from finetune.cli.tiny import build_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    build_tiny_model(work / "model", hidden_size=hidden, num_layers=layers, **heads_of(hidden))
    rng = random.Random(0)
    with open(work / "data.jsonl", "w") as handle:
        for _ in range(512):
            start = rng.randint(0, 999)
            row = {"instruction": "Count on from the number.", "input": str(start),
                   "output": " ".join(str(start + step) for step in range(1, MAX_LENGTH))}
            handle.write(json.dumps(row) + "\n")
    recipe = work / "recipe.yaml"
    recipe.write_text(
        f"model: {{name_or_path: {work / 'model'}, dtype: bfloat16}}\n"
        "lora: {r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}\n"
        f"data: {{datasets: [{{path: {work / 'data.jsonl'}}}], max_length: {MAX_LENGTH}}}\n"
        f"train: {{max_steps: {steps}, micro_batch_size: 8, learning_rate: 1.0e-3, gradient_checkpointing: true, "
        f"eval_every: 0, save_every: 0}}\n"
        f"output: {{dir: {work / 'unused'}}}\n")
    return recipe


def two_nodes(*args: str, gpus: int | None) -> list[str]:
    """HSDP's 2-D mesh needs two nodes: two torchrun launches of one process each on loopback (--nnodes 2, node ranks
    0 and 1, as tests/parallel/test_distributed.py runs them), one GPU each on a GPU machine (CUDA_VISIBLE_DEVICES), in
    one shell whose status is the first failure's (0 when both succeed). The process group is `cpu:gloo,cuda:nccl`: both libraries pick
    their interface on loopback (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; docs/distributed.md). The shell's "$@" is
    what the caller appends (output.dir)."""
    port = free_port()
    launches = []
    for node in (0, 1):
        command = shlex.join([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                              f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", *args])
        launches.append(("" if gpus is None else f"CUDA_VISIBLE_DEVICES={node} ") + command + ' "$@"')
    # The first node to fail ends the other, which would wait for minutes: in a collective (its torchrun stops its
    # worker on SIGTERM), or in torchrun's exit barrier, where SIGTERM waits for the barrier's 300 s (measured: 5.5 min)
    # and only SIGKILL ends it (its worker has ended by then). Each pid is waited for by name: `wait -n` answers 127
    # when both have ended before it is asked.
    script = ('export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}; '
              f'{launches[0]} & a=$!; {launches[1]} & b=$!; '
              'while kill -0 $a 2>/dev/null && kill -0 $b 2>/dev/null; do sleep 1; done; '
              'for p in $a $b; do if ! kill -0 $p 2>/dev/null; then wait $p; s=$?; if [ $s -ne 0 ]; then '
              'kill $a $b 2>/dev/null; sleep 5; kill -KILL $a $b 2>/dev/null; exit $s; fi; fi; done; '
              'wait $a; s=$?; wait $b; t=$?; exit $(( s ? s : t ))')
    return ["bash", "-c", script, "hsdp"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def heads_of(hidden: int) -> dict[str, int]:
    """The smoke model's heads: of 128 (4 below 512 wide), as many key/value heads as query heads."""
    heads = max(4, hidden // 128)
    return {"num_attention_heads": heads, "num_key_value_heads": heads}


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


# --------------------------------------------------------------------------------------------- the verdict
def summary(checks: list[Check]) -> dict[str, int]:
    return {"passed": sum(c.verdict == PASS for c in checks), "failed": sum(c.verdict == FAIL for c in checks),
            "skipped": sum(c.verdict == SKIP for c in checks)}


def exit_code(checks: list[Check]) -> int:
    """0 when no check failed (skips allowed: they are listed), else 1."""
    return 1 if any(c.verdict == FAIL for c in checks) else 0


def write_report(path: Path, about: dict, runs: dict, checks: list[Check], started: float) -> None:
    report = {**about, "seconds": round(time.monotonic() - started, 1),
              # A failed run keeps its stderr's end: on a lent GPU there may be no second try to see it.
              "runs": {k: {key: v for key, v in r.items() if key != "stdout" and (key != "stderr" or not r["ok"])}
                       for k, r in runs.items()},
              "checks": [{"check": c.name, "verdict": c.verdict, "detail": c.detail, **c.figures} for c in checks],
              "summary": summary(checks)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def print_table(path: Path, about: dict, runs: dict, checks: list[Check], device: Cuda) -> None:
    print(f"\nGPU smoke on {about['device']} (torch {about['torch']}, CUDA {about['cuda'] or '-'}); JSON: {path}")
    print(f"{'run':<15} {'tokens/s':>9} {device.peak_label:>9} {'reserved':>9}  losses (first -> last)")
    for name, run in runs.items():
        if run["ok"] and run["losses"]:
            reserved = "-" if run["reserved_mib"] is None else f"{run['reserved_mib']:.0f}"
            print(f"{name:<15} {run['tokens_per_s'] or 0:>9.0f} {run['peak_mib']:>9.0f} {reserved:>9}  "
                  f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}")
        else:
            print(f"{name:<15} {run['reason'][-100:] if run['reason'] else 'no losses logged'}")
    if device.dry_run:
        print("* dry run: CPU-side figures stand in for the GPU's (peak RSS; each check's detail names its stand-in)")
    for check in checks:
        print(f"{check.verdict}  {check.name}: {check.detail}")
    counts = summary(checks)
    print(f"gpu-smoke: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
          + (" (dry run on the CPU)" if device.dry_run else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("GPU_SMOKE_JSON") or REPO / "benchmarks" / "gpu_smoke.json"),
                        help="where the JSON goes ($GPU_SMOKE_JSON; on a lent machine: $OUT/gpu_smoke.json comes back)")
    parser.add_argument("--hidden", type=int, help="model width (default 1024; dry run 64)")
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
