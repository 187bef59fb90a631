"""How the GPU smoke (benchmarks/gpu_smoke.py) starts its processes and says why one failed: one deadline for them
all, a quiet run that a timeout ends whole (torchrun's workers too), the child's own reason (never torchrun's
footer), a 1-rank torchrun and HSDP's two nodes on loopback, and the model, rows and recipe every run shares."""

from __future__ import annotations

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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # write_inputs imports finetune from this checkout, however the script starts

DEADLINE = "not run: deadline"
FOOTER = re.compile(r"^[EWI]\d{4} .*torch/distributed/elastic/.*failed \(exitcode")  # torchrun's report of a failed child
LOG_LINE = re.compile(r"^([EWIF]\d{4} \d\d:|\[[EWIF] ?\d|\S+\.py:\d+: \w*Warning:|Traceback |=+$)")
EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b|Fatal Python error)")
MAX_LENGTH = 256  # data.max_length; every row of the smoke's data is longer, so each micro-batch fills it


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
