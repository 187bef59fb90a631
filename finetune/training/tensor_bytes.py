"""Tensor bytes alive during one training step, counted op by op: what a GPU allocator's peak counts, on any device.

    FINETUNE_MEASURE_STEP=2 accelerate launch ... finetune/run.py RECIPE.yaml       (or 2,3: several steps)

On the CPU there are no allocator statistics and the process's memory (RSS) also holds malloc's free lists and the
runtime, so the planner's figures (tensor bytes per rank) cannot be checked against it directly. With the variable set
to a step number, that step runs under a dispatch mode that adds up the storage of every tensor an op creates while it
is alive; each rank writes `ranks/rank{r}.step{N}.tensor_bytes.json` into output.dir:
  * held_bytes: every tensor alive when the step starts (the rank's base shard and quantization state, the LoRA
    weights and the optimizer state; under FSDP the rank's shards only), each storage once;
  * step_peak_bytes: the most bytes of tensors created during the step and alive at once (gradients, FSDP's unsharded
    layers and all-gather buffers, activations, the loss chunks, bitsandbytes' dequantized weights, optimizer
    temporaries), above held_bytes.
On a GPU the record also has gpu_step_peak_allocated_bytes, the CUDA allocator's peak during the step (its peak
statistics are reset when the step starts; the pre-step peak is kept as gpu_peak_allocated_before_step_bytes).
benchmarks/bench_train_peak.py --parts compares them with the planner, part by part; benchmarks/gpu_smoke.py the GPU
figure. The step is slower while it is measured (Python runs for every op); nothing else changes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ENV = "FINETUNE_MEASURE_STEP"


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory: a wrapper subclass (FSDP2's DTensor) owns none itself, its inner tensors do."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name, None) for name in names]
        return [leaf for value in inner if isinstance(value, torch.Tensor) for leaf in _plain(value)]
    return [] if tensor.device.type == "meta" else [tensor]


def _storage(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without storage of its own
        return None


def alive_storages() -> list:
    """Every tensor storage alive in the process now (each once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    found: dict[int, object] = {}
    for tensor in tensors:
        for leaf in _plain(tensor):
            storage = _storage(leaf)
            if storage is not None and storage.nbytes() > 0:
                found.setdefault(storage.data_ptr() or id(storage), storage)
    return list(found.values())


# FSDP frees an unsharded parameter by resizing its storage to 0 and allocates it again by resizing it back (no op the
# dispatcher sees): (module, function) pairs whose calls are counted as frees and allocations.
_RESIZERS = (("torch.distributed.fsdp._fully_shard._fsdp_param", "alloc_storage"),
             ("torch.distributed.fsdp._fully_shard._fsdp_param", "free_storage"),
             ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "alloc_storage"),
             ("torch.distributed.fsdp._flat_param", "_alloc_storage"),
             ("torch.distributed.fsdp._flat_param", "_free_storage"))


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while it is alive, and their peak. Storages alive when the mode
    is entered (weights, optimizer state, the batch) are not counted again when an op returns a view of them or updates
    them in place; they are held until the mode exits, so their ids cannot be reused meanwhile. FSDP's storage resizes
    (see _RESIZERS) count as the allocations and frees they are."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.mark_live = self.mark_peak = 0
        self._seen: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self):
        import importlib

        self._before = alive_storages()
        self._before_ids = {id(storage) for storage in self._before}
        self.held_bytes = sum(storage.nbytes() for storage in self._before)
        for module_name, name in _RESIZERS:
            with contextlib.suppress(ImportError, AttributeError):
                module = importlib.import_module(module_name)
                original = getattr(module, name)
                self._patched.append((module, name, original))
                setattr(module, name, self._resizer(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched, self._before, self._before_ids = [], [], set()
        return super().__exit__(*exc)

    def _resizer(self, original):
        def resize(tensor, *args, **kwargs):
            storage = tensor.untyped_storage()
            before = storage.nbytes()
            result = original(tensor, *args, **kwargs)
            key, after = id(storage), storage.nbytes()
            self.live += after - before  # a storage held at entry that is freed makes `live` negative: right
            if key not in self._before_ids:
                if key not in self._seen:
                    self._seen.add(key)
                    weakref.finalize(storage, self._free, key)
                self._sizes[key] = after
            self._track_peak()
            return result
        return resize

    def _track_peak(self) -> None:
        self.peak = max(self.peak, self.live)
        self.mark_peak = max(self.mark_peak, self.live)

    def _free(self, key: int) -> None:
        self._seen.discard(key)
        self.live -= self._sizes.pop(key, 0)

    def mark(self) -> None:
        """Start a window: peak_since_mark() is measured from here."""
        self.mark_live = self.mark_peak = self.live

    def peak_since_mark(self) -> int:
        return self.mark_peak - self.mark_live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            for leaf in _plain(tensor):
                storage = _storage(leaf)
                key = id(storage)
                if storage is None or key in self._seen or key in self._before_ids or storage.nbytes() == 0:
                    continue
                self._seen.add(key)
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, key)
                self._track_peak()
        return out


@contextlib.contextmanager
def measured_step(step: int, out_dir: Path, rank: int):
    """Count step `step`'s tensor bytes when FINETUNE_MEASURE_STEP asks for it (see the module doc); else nothing."""
    if str(step) not in os.environ.get(ENV, "").replace(" ", "").split(","):
        yield
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:  # the allocator's own figure too (the run's peak_gpu_bytes then counts from this step on)
        torch.cuda.synchronize()
        run_peak_so_far = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    mode = LiveBytes()
    with mode:
        yield
    record = {"step": step, "held_bytes": mode.held_bytes, "step_peak_bytes": mode.peak,
              "peak_bytes": mode.held_bytes + mode.peak}
    if cuda:
        torch.cuda.synchronize()
        record.update(gpu_step_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      gpu_peak_allocated_before_step_bytes=run_peak_so_far)
    folder = Path(out_dir) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.step{step}.tensor_bytes.json").write_text(json.dumps(record, indent=1))
