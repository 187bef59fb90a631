"""The GPU smoke's device (benchmarks/gpu_smoke.py): the figures only CUDA gives, one small method each, and the
dry run's CPU stand-ins for them (`DryRun`), with each device's model sizes, timeouts and time estimates.

Run as a script, it starts another script in its own process with two things added (`launch`):

    python benchmarks/gpu_smoke_device.py [--cuda-like-copy] [--memory FILE] SCRIPT [ARGS...]

  * --cuda-like-copy (the dry run, every process it starts): `torch._foreach_copy_` rewrites bf16 NaN bit patterns as
    CUDA's does (pytorch #159333), as tests/parallel/test_byte_guard.py patches that one op, so that the CPU takes the
    route a GPU takes through finetune's FSDP2 byte guard ("mixed" on torch < 2.12, "uint8" from 2.12) and rehearses it;
  * --memory FILE (the two processes whose peaks the planner checks compare): the CUDA allocator's history is
    recorded, and at exit FILE gets `allocator_summary`: the allocator's statistics and the blocks alive at its peak,
    grouped by where they were allocated, so that a first FAIL can be read part by part.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = Path(__file__).resolve()
sys.path.insert(0, str(REPO))  # the planner's figures import finetune from this checkout, however the script starts
MEMORY_EVENTS = 200_000  # alloc/free events kept (a ring): a 2048 x 8 run's 20 steps make fewer than that
# memory_stats figures kept: each pool's peak is its own (not at the same moment as the others')
STATS = ("allocated_bytes.all.peak", "allocated_bytes.large_pool.peak", "allocated_bytes.small_pool.peak",
         "requested_bytes.all.peak", "active_bytes.all.peak", "reserved_bytes.all.peak",
         "inactive_split_bytes.all.peak", "allocation.all.allocated", "segment.all.peak", "num_alloc_retries", "num_ooms")


class Cuda:
    """The figures only a GPU gives, one small method each; `DryRun` answers the same questions on the CPU."""

    dry_run = False
    jobs = 1  # processes at once
    # 2048 x 8 (~300M parameters, 16 heads of 128): the planner checks compare peaks in which the fixed costs
    # (the cuBLAS workspace, the byte guard's chunk: ~40 MiB) are a small share; at 1024 x 8 they were ~40% of the load.
    sizes: ClassVar[dict[str, int]] = {"hidden": 2048, "layers": 8, "steps": 20, "peer_steps": 10}
    # A run of the 2048 x 8 model is imports, NCCL, loading and 20 steps: tens of seconds. 120 s bounds what a hung one
    # costs (the deadline still has the load and peers lines, which run right after the first two: gpu_smoke.ORDER).
    timeouts: ClassVar[dict[str, int]] = {"probe": 60, "train": 120, "load": 120, "peers": 240}
    # Seconds a process of each kind needs before any has run here (estimates: imports ~5 s, NCCL ~2 s, loading and
    # 20 steps of the 2048 x 8 model; the peers: 4 processes of a 2048 x 8 model; the build: the 2048 x 8 model made
    # from its config and saved, ~600 MB, with the rows and the recipe, in the smoke's process): replaced by what one took.
    needs: ClassVar[dict[str, float]] = {"probe": 10, "build": 30, "train": 40, "load": 25, "peers": 90}
    peak_label = "peak MiB"

    def __init__(self) -> None:
        self.measured_workspace: int | None = None  # the probe's cuBLAS workspace (`use_probe`)

    def describe(self) -> dict:
        import torch

        return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}

    def memory_bytes(self) -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    def use_probe(self, probe: dict) -> None:
        """Take the probe's measured cuBLAS workspace (a positive byte count) for the planner's input."""
        measured = probe.get("cublas_workspace_bytes")
        self.measured_workspace = measured if isinstance(measured, int) and measured > 0 else None

    def cublas_workspace_bytes(self) -> int:
        """What the planner counts for cuBLAS's workspace: the probe's measurement on this GPU where it made one, else
        torch's default on sm90+ (finetune/planner/allocator.py)."""
        from finetune.planner import CUBLAS_WORKSPACE_BYTES

        return self.measured_workspace or CUBLAS_WORKSPACE_BYTES

    def workspace_note(self) -> str:
        """Which cuBLAS workspace the planner was given, for the planner lines' details."""
        from finetune.planner import CUBLAS_WORKSPACE_BYTES

        constant = f"{CUBLAS_WORKSPACE_BYTES / 2**20:.1f} MiB"
        if self.measured_workspace is None:
            return f"cuBLAS workspace: the planner's {constant} (the probe measured none)"
        return f"cuBLAS workspace: the probe's {self.measured_workspace / 2**20:.1f} MiB (the planner's constant: {constant})"

    def gpus(self) -> int | None:
        """GPUs this Python sees (HSDP needs two); None where processes are not bound to GPUs (the dry run)."""
        import torch

        return torch.cuda.device_count()

    def script(self, path: str, *, memory: Path | None = None) -> list[str]:
        """How a child starts `path`: as it ships, or through this file recording the allocator into `memory`."""
        return [str(LAUNCHER), "--memory", str(memory), path] if memory else [path]

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
    """The CPU rehearsal: CUDA hidden from every process, CPU-side figures where the GPU's would be, and the copy
    FSDP2 uses made to rewrite NaNs as CUDA's does (`script`), so that the GPU's route is the one rehearsed."""

    dry_run = True
    jobs = 2  # the 2-core machines the suite runs on: startup (imports) is most of each process, one core each
    # bench_peers needs 3 steps or more (its step 1 is warm-up)
    sizes: ClassVar[dict[str, int]] = {"hidden": 64, "layers": 2, "steps": 3, "peer_steps": 3}
    timeouts: ClassVar[dict[str, int]] = {"probe": 60, "train": 90, "load": 90, "peers": 180}
    needs: ClassVar[dict[str, float]] = {"probe": 5, "build": 10, "train": 8, "load": 8, "peers": 20}
    peak_label = "RSS MiB*"

    def describe(self) -> dict:
        import torch

        return {"device": "CPU (dry run: no CUDA call made)", "torch": torch.__version__, "cuda": None}

    def memory_bytes(self) -> int:
        return 80 * 2**30  # a placeholder: the planner's fit verdict reads it, the peaks compared here do not

    def gpus(self) -> int | None:
        return None  # CPU ranks: any number of processes

    def use_probe(self, probe: dict) -> None:
        self.measured_workspace = None  # no cuBLAS on the CPU: its stand-in peaks have no workspace

    def cublas_workspace_bytes(self) -> int:
        return 0

    def workspace_note(self) -> str:
        return "cuBLAS workspace: none (dry run: no cuBLAS on the CPU)"

    def script(self, path: str, *, memory: Path | None = None) -> list[str]:
        return [str(LAUNCHER), "--cuda-like-copy", *(["--memory", str(memory)] if memory else []), path]

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


# ------------------------------------------------------------------------------- the launcher (run as a script)
def cuda_like_copy() -> None:
    """Make `torch._foreach_copy_` write every bf16 NaN as one canonical pattern, as CUDA's copy does
    (tests/parallel/test_byte_guard.py's `_patch_copy("canonicalize")`): in this process only."""
    import torch

    original = torch._foreach_copy_
    canonical = torch.tensor(float("nan"), dtype=torch.bfloat16)

    def copy(dsts, srcs, *args, **kwargs):
        result = original(dsts, srcs, *args, **kwargs)
        for dst in dsts:
            if dst.dtype == torch.bfloat16:
                nans = torch.isnan(dst)
                if nans.any():
                    dst[nans] = canonical
        return result

    torch._foreach_copy_ = copy


def record_memory(path: Path) -> None:
    """Record the CUDA allocator's history from here on; at exit (finetune's exit_process runs the exit hooks too, and
    a failed run exits the same way) write `allocator_summary` into `path`. Nothing where CUDA is not available."""
    import atexit

    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.init()  # the allocators exist from here on: a history asked for before them records nothing
    # Allocation stacks only (Python frames), and no event `peak_blocks` does not read: fewer entries in the ring
    options = {"context": "alloc", "stacks": "python", "max_entries": MEMORY_EVENTS}
    try:
        torch.cuda.memory._record_memory_history(**options, skip_actions=["free_completed", "segment_alloc",
                                                                         "segment_free", "snapshot"])
    except (TypeError, RuntimeError, ValueError):  # a torch without skip_actions (or without one of these)
        torch.cuda.memory._record_memory_history(**options)

    def write() -> None:
        if int(os.environ.get("RANK", "0") or 0) != 0:
            return
        stats = torch.cuda.memory_stats()
        try:
            summary = allocator_summary(torch.cuda.memory._snapshot(), stats)
        except Exception as exc:  # noqa: BLE001  the statistics still tell the pools apart
            summary = {"stats": {key: stats.get(key) for key in STATS}, "error": f"{type(exc).__name__}: {exc}"}
        path.write_text(json.dumps(summary, indent=1))

    atexit.register(write)


def launch(argv: list[str]) -> None:
    """`[--cuda-like-copy] [--memory FILE] SCRIPT ARGS...`: SCRIPT as `python SCRIPT ARGS...` would run it."""
    while argv and argv[0] in ("--cuda-like-copy", "--memory"):
        option = argv.pop(0)
        if option == "--cuda-like-copy":
            cuda_like_copy()
        else:
            record_memory(Path(argv.pop(0)))
    script, *rest = argv
    if sys.path[:2] == [str(REPO), str(LAUNCHER.parent)]:  # this file's own entries: the script gets its own, as
        del sys.path[:2]  # `python SCRIPT` gives it (its folder first)
    sys.path.insert(0, str(Path(script).resolve().parent))
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


# ------------------------------------------------------------------------------------- the allocator at its peak
def allocator_summary(snapshot: dict, stats: dict, *, top: int = 10) -> dict:
    """The allocator's statistics (STATS) and the blocks alive at the peak of allocated bytes in the recorded history,
    by where they were allocated (`place`) and the largest ones. `trace_complete`: the history holds every event of
    the process (fewer than MEMORY_EVENTS), so its peak is the process's."""
    trace = (snapshot.get("device_traces") or [[]])[0]
    peak, blocks = peak_blocks(snapshot, trace)
    places: dict[str, list[int]] = {}
    for size, frames in blocks:
        entry = places.setdefault(place(frames), [0, 0])
        entry[0] += size
        entry[1] += 1
    by_place = sorted(places.items(), key=lambda item: -item[1][0])[:top]
    largest = sorted(blocks, key=lambda block: -block[0])[:top]
    return {"peak_allocated_bytes": peak, "trace_events": len(trace), "trace_complete": len(trace) < MEMORY_EVENTS,
            "at_peak_by_place": [{"where": where, "bytes": size, "blocks": count} for where, (size, count) in by_place],
            "largest_blocks_at_peak": [{"bytes": size, "where": place(frames, depth=3)} for size, frames in largest],
            "stats": {key: stats.get(key) for key in STATS}}


def peak_blocks(snapshot: dict, trace: list[dict]) -> tuple[int, list[tuple[int, list]]]:
    """The most bytes allocated at once in the history, and the blocks (size, allocation frames) alive then. Walked
    back from the blocks alive at the snapshot: before an alloc its block was not there, before a free it was. A
    block counts until its free is requested, as the allocator's `allocated_bytes` does."""
    free = "free_requested" if any(e.get("action") == "free_requested" for e in trace) else "free_completed"
    states = ("active_allocated",) if free == "free_requested" else ("active_allocated", "active_awaiting_free")
    alloc_frames: dict[int, list] = {}
    frames_at: dict[int, list] = {}  # the frames of the alloc each free event ends
    for index, event in enumerate(trace):
        if event.get("action") == "alloc":
            alloc_frames[event["addr"]] = event.get("frames") or []
        elif event.get("action") == free:
            frames_at[index] = alloc_frames.get(event["addr"], [])
    end = {block["address"]: (block["size"], block.get("frames") or [])
           for segment in snapshot.get("segments", []) for block in segment.get("blocks", [])
           if block.get("state") in states}

    def walk(stop: int | None) -> tuple[int, int, dict]:
        live, total = dict(end), sum(size for size, _ in end.values())
        best, best_at = total, len(trace)
        for index in range(len(trace) - 1, -1, -1):
            event = trace[index]
            if event.get("action") == "alloc" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
            elif event.get("action") == free and event["addr"] not in live:
                live[event["addr"]] = (event["size"], frames_at.get(index, []))
                total += event["size"]
            if index == stop:
                break  # the state before event `stop`
            if total > best:
                best, best_at = total, index
        return best, best_at, live

    best, best_at, _ = walk(None)
    live = dict(end) if best_at == len(trace) else walk(best_at)[2]  # the blocks alive before event best_at: the peak
    return best, list(live.values())


def place(frames: list, *, depth: int = 1) -> str:
    """Where a block was allocated: its innermost `depth` frames outside torch's module and autograd plumbing, as
    `package/file.py:function`, innermost first."""
    skip = ("torch/nn/modules/module.py", "torch/utils/", "torch/autograd/function.py", "torch/_tensor.py", "<")
    kept = [frame for frame in frames if not any(part in frame.get("filename", "") for part in skip)]
    if not kept:  # backward runs on autograd's own thread, whose allocations have no Python frame
        return "no Python frame (autograd's backward thread, or a library's own)"
    return " < ".join(f"{short(frame.get('filename', '?'))}:{frame.get('name', '?')}" for frame in kept[:depth])


def short(filename: str) -> str:
    """A frame's file from its package on (`torch/...`, `finetune/...`), not the machine's folders."""
    for marker in ("site-packages/", "dist-packages/", f"{REPO}/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


if __name__ == "__main__":
    launch(sys.argv[1:])
