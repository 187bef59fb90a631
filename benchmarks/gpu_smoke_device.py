"""The GPU smoke's device (benchmarks/gpu_smoke.py): the figures only CUDA gives, one small method each, and the
dry run's CPU stand-ins for them (`DryRun`), with each device's model sizes, timeouts and time estimates."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the planner's figures import finetune from this checkout, however the script starts
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_probe import copy_canonicalizes_nans  # (after the path: benchmarks/ is a script folder)


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
