"""Tensor bytes alive during one training step, counted op by op: what a GPU allocator's peak counts, on any device.

    FINETUNE_MEASURE_STEP=2 accelerate launch ... finetune/run.py RECIPE.yaml       (or 2,3: several steps)

On the CPU there are no allocator statistics and the process's memory (RSS) also holds malloc's free lists and the
runtime, so the planner's figures (tensor bytes per rank) cannot be checked against it directly. With the variable set
to a step number, that step runs under a dispatch mode that adds up the storage of every tensor an op creates while it
is alive; each rank writes `ranks/rank{r}.step{N}.tensor_bytes.json` into output.dir:
  * held_bytes: every tensor alive when the step starts (the rank's base shard and quantization state, the LoRA
    weights and the optimizer state; under FSDP the rank's shards only), each storage once; held_parts splits it
    into base (frozen parameters), lora (trainable ones), adamw (optimizer state) and other (the quantization state,
    buffers, the batch);
  * step_peak_bytes: the most bytes of tensors created during the step and alive at once (gradients, FSDP's unsharded
    layers and all-gather buffers, activations, the loss chunks, bitsandbytes' dequantized weights, optimizer
    temporaries), above held_bytes; step_parts splits it at that moment into fsdp_unsharded (FSDP's all-gathers and
    unsharded parameters), gradients (parameters' gradients, FSDP's reduce-scatter buffers, DDP's buckets),
    logits_loss (finetune/training/loss.py's chunks and kept gradient), optimizer (temporaries of the optimizer
    step) and activations (the rest: what the forward saves, the recomputed layer, gradients of activations).
On a GPU the record also has gpu_step_peak_allocated_bytes, the CUDA allocator's peak during the step (its peak
statistics are reset when the step starts; the pre-step peak is kept as gpu_peak_allocated_before_step_bytes).
benchmarks/bench_train_peak.py --parts compares them with the planner, part by part; benchmarks/gpu_smoke.py the GPU
figure. The step is slower while it is measured (Python runs for every op); nothing else changes.
"""

from __future__ import annotations

import contextlib
import functools
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


# (module, function or Class.method, category): what is allocated while one of them runs belongs to that category
# (finetune.training.loss.head_loss: the chunked loss, called by the LM head's patched forward).
_CATEGORIES = (("torch.distributed.fsdp._fully_shard._fsdp_param_group", "foreach_all_gather", "fsdp_unsharded"),
               ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "foreach_reduce", "gradients"),
               ("torch.distributed.fsdp._runtime_utils", "_unshard", "fsdp_unsharded"),
               ("torch.distributed.fsdp._runtime_utils", "_reduce_grad", "gradients"),
               ("torch.nn.parallel.distributed", "DistributedDataParallel._pre_forward", "gradients"),  # bucket rebuild
               ("finetune.training.loss", "head_loss", "logits_loss"))


def _patch(module_name: str, path: str, make_wrapper) -> tuple[object, str, object] | None:
    """Replace module.path (a function, or Class.method) by make_wrapper(original); returns how to undo it."""
    import importlib

    try:
        owner = importlib.import_module(module_name)
        *classes, name = path.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    except (ImportError, AttributeError, KeyError):
        return None
    setattr(owner, name, make_wrapper(original))
    return owner, name, original


def _held_parts(storages: list) -> dict[str, int]:
    """Bytes of the storages alive at the step's start by what they are: parameters (frozen, trainable), AdamW state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
    kind: dict[int, str] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Parameter):
            for leaf in _plain(obj):
                kind.setdefault(leaf.untyped_storage().data_ptr(), "lora" if obj.requires_grad else "base")
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:  # not the step counters
                        for leaf in _plain(value):
                            kind[leaf.untyped_storage().data_ptr()] = "adamw"
    parts = dict.fromkeys(("base", "lora", "adamw", "other"), 0)
    for storage in storages:
        parts[kind.get(storage.data_ptr(), "other")] += storage.nbytes()
    return parts


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while it is alive, and their peak. Storages alive when the mode
    is entered (weights, optimizer state, the batch) are not counted again when an op returns a view of them or updates
    them in place; they are held until the mode exits, so their ids cannot be reused meanwhile. FSDP's storage resizes
    (see _RESIZERS) count as the allocations and frees they are. Each byte is counted in one category (_CATEGORIES,
    the module doc), and `peak_parts` has the categories at the peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.mark_live = self.mark_peak = 0
        self._seen: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._patched: list[tuple[object, str, object]] = []
        self._category: dict[int, str] = {}  # storage key -> category
        self._by_category: dict[str, int] = {}
        self.peak_parts: dict[str, int] = {}
        self._context: list[str] = []  # categories of the functions running now (_CATEGORIES)
        self._hooks: list = []

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._before = alive_storages()
        self._before_ids = {id(storage) for storage in self._before}
        self.held_bytes = sum(storage.nbytes() for storage in self._before)
        self.held_parts = _held_parts(self._before)
        for module_name, name in _RESIZERS:
            self._patched.append(_patch(module_name, name, self._resizer))
        for module_name, name, category in _CATEGORIES:
            self._patched.append(_patch(module_name, name, functools.partial(self._within, category)))
        self._hooks = [register_optimizer_step_pre_hook(lambda *_: self._context.append("optimizer")),
                       register_optimizer_step_post_hook(lambda *_: self._context.pop())]
        # A gradient is made by an op like any activation gradient; it becomes a gradient when it is accumulated.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainable = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Parameter) and obj.requires_grad]
        self._hooks += [param.register_post_accumulate_grad_hook(self._gradient) for param in trainable
                        if type(param) in (torch.Tensor, torch.nn.Parameter)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        for module, name, original in reversed([p for p in self._patched if p is not None]):
            setattr(module, name, original)
        self._patched, self._hooks, self._before, self._before_ids = [], [], [], set()
        return super().__exit__(*exc)

    def _within(self, category: str, original):
        @functools.wraps(original)
        def run(*args, **kwargs):
            self._context.append(category)
            try:
                return original(*args, **kwargs)
            finally:
                self._context.pop()
        return staticmethod(run) if isinstance(original, staticmethod) else run

    def _gradient(self, param: torch.Tensor) -> None:
        key = id(param.grad.untyped_storage()) if param.grad is not None else None
        if key in self._sizes and self._category.get(key) != "gradients":
            self._count(key, -self._sizes[key])
            self._category[key] = "gradients"
            self._count(key, self._sizes[key])

    def _count(self, key: int, nbytes: int, category: str | None = None) -> None:
        if category is not None and key not in self._category:
            self._category[key] = category
        name = self._category.get(key, "activations")
        self._by_category[name] = self._by_category.get(name, 0) + nbytes

    def _resizer(self, original):
        def resize(tensor, *args, **kwargs):
            storage = tensor.untyped_storage()
            before = storage.nbytes()
            result = original(tensor, *args, **kwargs)
            key, after = id(storage), storage.nbytes()
            self.live += after - before  # a storage held at entry that is freed makes `live` negative: right
            self._count(key, after - before, "fsdp_unsharded")
            if key not in self._before_ids:
                if key not in self._seen:
                    self._seen.add(key)
                    weakref.finalize(storage, self._free, key)
                self._sizes[key] = after
            self._track_peak()
            return result
        return resize

    def _track_peak(self) -> None:
        if self.live > self.peak:
            self.peak_parts = {name: nbytes for name, nbytes in self._by_category.items() if nbytes}
        self.peak = max(self.peak, self.live)
        self.mark_peak = max(self.mark_peak, self.live)

    def _free(self, key: int) -> None:
        self._seen.discard(key)
        size = self._sizes.pop(key, 0)
        self.live -= size
        self._count(key, -size)
        self._category.pop(key, None)

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
                self._count(key, storage.nbytes(), self._context[-1] if self._context else "activations")
                weakref.finalize(storage, self._free, key)
                self._track_peak()
        return out


def attach() -> None:
    """Measure the steps FINETUNE_MEASURE_STEP names: `measured_step` joins the loop's step hooks (run.py calls this
    only when the variable is set; the loop itself never imports this module)."""
    from finetune.training import loop

    if measured_step not in loop.STEP_HOOKS:
        loop.STEP_HOOKS.append(measured_step)


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
              "peak_bytes": mode.held_bytes + mode.peak, "held_parts": mode.held_parts, "step_parts": mode.peak_parts}
    if cuda:
        torch.cuda.synchronize()
        record.update(gpu_step_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      gpu_peak_allocated_before_step_bytes=run_peak_so_far)
    folder = Path(out_dir) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.step{step}.tensor_bytes.json").write_text(json.dumps(record, indent=1), encoding="utf-8")


# --------------------------------------------------------------------------------------- against the planner
PARTS = ("base", "lora", "adamw", "other", "gradients", "fsdp_unsharded", "activations", "logits_loss", "optimizer")


def planned_parts(recipe, config: str, *, world_size: int = 2) -> dict[str, int]:
    """The planner's per-rank training figures for a shipped config ("fsdp2", "fsdp1", "ddp") in the meter's categories:
    what a rank holds (base shard, LoRA weights, AdamW's moments; `other`: the quantization state) and what the step adds
    at its peak (gradients with DDP's buckets, FSDP's gathered units, activations, the loss). The CUDA context and the
    allocator's fragmentation are left out: a tensor count has neither. Also `moment`: when the planner puts the peak."""
    from finetune.planner import GiB, Hardware, estimate, facts_from_config, model_config_for

    facts = facts_from_config(model_config_for(recipe), recipe, fsdp_version=1 if config == "fsdp1" else 2)
    plan = estimate(facts, recipe, "ddp" if config == "ddp" else "fsdp", Hardware(world_size, 80 * GiB),
                    per_rank_full_load=False)
    lora_and_moments = plan.parts["lora_grads_adamw"] - plan.gradient_bytes
    parts = {"base": plan.parts["base"], "lora": lora_and_moments // 3, "adamw": lora_and_moments - lora_and_moments // 3,
             "other": plan.parts["quant_state"], "gradients": plan.gradient_bytes,
             **{name: plan.parts[name] for name in ("fsdp_unsharded", "activations", "logits_loss")}, "optimizer": 0}
    return {**parts, "moment": plan.peak_moment}


def parts_table(measured: dict[str, dict], planned: dict[str, dict]) -> str:
    """Per part, MiB, measured (a rank's record of this module) next to the planner's figure (`planned_parts`), one
    column pair per config; the last rows: the sums, their ratio and when the planner puts the peak."""
    names = list(measured)
    lines = [f"{'part (MiB)':16}" + "".join(f" {name + ' meas':>13} {'planner':>8}" for name in names)]
    for part in PARTS:
        cells = []
        for name in names:
            record = measured[name]
            got = {**record.get("held_parts", {}), **record.get("step_parts", {})}.get(part, 0)
            cells.append(f" {got / 2**20:13.2f} {planned[name][part] / 2**20:8.2f}")
        lines.append(f"{part:16}" + "".join(cells))
    totals = [(measured[n]["peak_bytes"], sum(v for k, v in planned[n].items() if k != "moment")) for n in names]
    lines.append(f"{'sum':16}" + "".join(f" {got / 2**20:13.2f} {plan / 2**20:8.2f}" for got, plan in totals))
    lines.append(f"{'planner/measured':16}" + "".join(f" {plan / got:22.3f}" for got, plan in totals))
    lines += [f"planner's peak, {name}: {planned[name]['moment']}" for name in names]
    return "\n".join(lines)
