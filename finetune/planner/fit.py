"""The fit table and the decision: every strategy's estimate on the given GPUs, the one `strategy: auto` takes, the
largest micro-batch that fits, and the size/count arguments of `finetune plan`."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from finetune.errors import train_launch_fix
from finetune.planner.facts import GB, GiB, ModelFacts, PlanError, facts_from_config, gib
from finetune.planner.memory import (
    CUDA_CONTEXT_BYTES,
    SAFETY_MARGIN,
    Estimate,
    Hardware,
    StrategyName,
    estimate,
    estimates_for,
)


def format_table(estimates: list[Estimate], hw: Hardware) -> str:
    """Fixed-width table: one row per strategy, the parts of the peak, margin and verdict."""
    head = ["strategy", "GPUs", "base", "qstate", "LoRA+opt", "gathered", "activ.", "logits", "overhead", "peak/GPU",
            "load/GPU", "CPU/node", "margin", "fits", "read/rank", "read/node", "read s"]
    rows = []
    for e in estimates:
        p = e.parts
        cells = [p["base"], p["quant_state"], p["lora_grads_adamw"], p["fsdp_unsharded"], p["activations"],
                 p["logits_loss"], p["overhead"], e.peak_bytes, e.load_peak_bytes, e.cpu_bytes_per_node]
        verdict = "yes" if e.fits else "NO"
        reads = [f"{e.reads.rank_bytes / GiB:.1f}", f"{e.reads.node_bytes / GiB:.1f}", f"{e.reads.seconds:.0f}"]
        rows.append([e.label, str(e.world_size), *[f"{c / GiB:.1f}" for c in cells], f"{e.margin_bytes / GiB:+.1f}", verdict,
                     *reads])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    notes = [f"  {e.label}: {n}" for e in estimates for n in e.notes]
    unit = f"GiB per GPU; {hw.total_gpus} x {gib(hw.gpu_memory_bytes)}, fits = peak <= {100 - SAFETY_MARGIN * 100:.0f}% of a GPU"
    reads = (f"read/rank, read/node: GiB of checkpoint read at load (FSDP2: each rank its own shard; otherwise every "
             f"rank the whole, once per node from storage); read s: a node's bytes at {hw.read_bytes_per_s / GB:g} GB/s")
    return "\n".join([*lines, f"({unit})", f"({reads})", *notes])


# ------------------------------------------------------------------------------------------------- decision
@dataclass
class Decision:
    """The planner's choice for `parallel.strategy: auto`, with the figures behind it."""

    strategy: StrategyName
    cpu_offload: bool
    reshard_after_forward: bool
    fits: bool
    table: str
    summary: str
    max_micro_batch: int = 0
    estimates: list[Estimate] = field(default_factory=list)
    generic: bool = False
    chosen: str = ""  # the STRATEGIES key of the estimate chosen (or the closest when nothing fits)


_PREFERENCE = ["ddp", "fsdp", "fsdp_offload", "layer_split"]  # the order: DDP, else FSDP, else offload


def choose(estimates: list[Estimate], hw: Hardware) -> Estimate:
    """DDP when the model fits on one GPU (single with one GPU), else FSDP, else FSDP + offload, else layer split.

    When nothing fits, the strategy with the smallest deficit, so its figures say how far off it is.
    """
    by_key = {e.strategy: e for e in estimates}
    order = ["single"] if hw.total_gpus == 1 else _PREFERENCE
    for key in order:
        if key in by_key and by_key[key].fits:
            return by_key[key]
    candidates = [by_key[k] for k in order if k in by_key] or estimates
    return max(candidates, key=lambda e: e.margin_bytes)


def largest_micro_batch(facts: ModelFacts, recipe, key: str, hw: Hardware, *, limit: int = 512, **kwargs) -> int:
    """The largest micro-batch at data.max_length for which strategy `key` fits (0: not even 1); for GRPO a multiple
    of grpo.num_generations (a prompt's group stays in one micro-batch)."""
    fits = lambda b: estimate(facts, recipe, key, hw, micro_batch=b, **kwargs).fits
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low - low % recipe.grpo.num_generations if recipe.train.objective == "grpo" else low


def decide(recipe, model_config, *, gpus_per_node: int, gpu_memory_bytes: int, nodes: int = 1,
           cpu_memory_bytes: int | None = None, per_rank_full_load: bool | None = None,
           read_bytes_per_s: float | None = None) -> Decision:
    """Choose the strategy for `parallel.strategy: auto` from the model's config and the GPUs present."""
    hw = Hardware(gpus_per_node, gpu_memory_bytes, nodes, cpu_memory_bytes)
    if read_bytes_per_s:
        hw.read_bytes_per_s = read_bytes_per_s
    fsdp_version = recipe.parallel.fsdp_version or 2
    facts = facts_from_config(model_config, recipe, name=recipe.model.name_or_path, fsdp_version=fsdp_version)
    estimates = estimates_for(facts, recipe, hw, per_rank_full_load=per_rank_full_load)
    chosen = choose(estimates, hw)
    strategy: StrategyName = "fsdp" if chosen.strategy.startswith("fsdp") else chosen.strategy  # type: ignore[assignment]
    max_batch = largest_micro_batch(facts, recipe, chosen.strategy, hw, per_rank_full_load=per_rank_full_load)
    decision = Decision(strategy=strategy, cpu_offload=chosen.strategy == "fsdp_offload",
                        reshard_after_forward=chosen.strategy != "fsdp_grad_op", fits=chosen.fits,
                        table=format_table(estimates, hw), summary="", max_micro_batch=max_batch, estimates=estimates,
                        generic=facts.generic, chosen=chosen.strategy)
    decision.summary = _summary(facts, recipe, chosen, max_batch, hw)
    return decision


def _summary(facts: ModelFacts, recipe, chosen: Estimate, max_batch: int, hw: Hardware) -> str:
    name = f"{facts.name} ({facts.model_type}{', GENERIC ESTIMATE: architecture not built' if facts.generic else ''})"
    shape = f"micro-batch {recipe.train.micro_batch_size} x {recipe.data.max_length} tokens"
    if chosen.fits:
        text = (f"{name}: {chosen.label} on {chosen.world_size} GPU(s) fits, {chosen.needs(f' of {gib(hw.gpu_memory_bytes)}')}"
                f" and {gib(chosen.cpu_bytes_per_node)} of CPU RAM per node at "
                f"{shape}; largest micro-batch that fits: {max_batch}.")
    elif chosen.margin_bytes >= 0:  # the GPUs would hold it; the node's CPU RAM (--cpu-memory) does not
        text = (f"{name}: nothing fits on {hw.total_gpus} x {gib(hw.gpu_memory_bytes)} at {shape}; closest is "
                f"{chosen.label}, which fits the GPUs ({chosen.needs()}) but needs {gib(chosen.cpu_bytes_per_node)} of "
                f"CPU RAM per node. Fix: a machine with more CPU RAM, or more GPUs.")
    else:
        text = (f"{name}: nothing fits on {hw.total_gpus} x {gib(hw.gpu_memory_bytes)} at {shape}; closest is "
                f"{chosen.label} at {chosen.needs()}, {gib(-chosen.margin_bytes)} short."
                + _fix_advice(facts, recipe, chosen, max_batch, hw))
    if chosen.reads is not None:
        reads = chosen.reads
        how = "its own shard" if reads.own_shard else "the whole checkpoint"
        how += {"checkpoint": " of the 4-bit checkpoint", "cache": " of the 4-bit cache entry"}.get(facts.stored_4bit, "")
        text += (f" Loading: each rank reads {how} ({gib(reads.rank_bytes)}), a node {gib(reads.node_bytes)}: "
                 f"~{reads.seconds:.0f} s at {hw.read_bytes_per_s / GB:g} GB/s.")
    said = chosen.load_peak_bytes > chosen.peak_bytes  # the load peak, with why, is in the text (Estimate.needs)
    notes = [n for n in chosen.notes if not (said and n.startswith("loading needs"))] + facts.notes
    return text + "".join(f" Note: {n}." for n in notes)


def _fix_advice(facts: ModelFacts, recipe, chosen: Estimate, max_batch: int, hw: Hardware) -> str:
    """What would make the closest strategy fit, only what can help: no shorter sequences when the base or its
    loading is what does not fit, no checkpointing when it is on; the largest micro-batch when a smaller one fits."""
    usable = int(hw.gpu_memory_bytes * (1 - SAFETY_MARGIN))
    base = chosen.parts["base"] + chosen.parts["quant_state"] + CUDA_CONTEXT_BYTES
    if base > usable:
        return (f" The 4-bit base, its quant state and the CUDA context alone take {gib(base)} per GPU, so a shorter "
                f"data.max_length or a smaller micro-batch cannot help. Fix: {_more_memory(facts, recipe, hw)}.")
    if chosen.load_peak_bytes > usable:
        loading = ("Loading is the limit" if chosen.load_peak_bytes > chosen.peak_bytes  # (said above, with why)
                   else f"Loading alone needs {gib(chosen.load_peak_bytes)} per GPU ({chosen.load_how})")
        return (f" {loading}, so a shorter data.max_length or a smaller micro-batch cannot help. Fix: "
                f"{_more_memory(facts, recipe, hw)}.")
    if max_batch:
        return (f" Fix: lower train.micro_batch_size to {max_batch}, the largest that fits (raise "
                "train.grad_accum to keep the batch size).")
    fixes = ["lower data.max_length" + (" (micro-batch 1 does not fit either)" if recipe.train.micro_batch_size > 1 else "")]
    if recipe.parallel.activation_checkpointing is False:
        fixes.append("turn on parallel.activation_checkpointing")
    elif recipe.parallel.activation_checkpointing is None and not recipe.train.gradient_checkpointing:
        fixes.append("turn on train.gradient_checkpointing")
    fixes.append("add GPUs (FSDP shards the base over them)")
    return " Fix: " + ", ".join(fixes[:-1]) + f" or {fixes[-1]}."


def _more_memory(facts: ModelFacts, recipe, hw: Hardware) -> str:
    """The routes to more GPU memory for the base: more GPUs, or on one GPU FSDP + CPU offload over one process (which
    parallel.strategy: auto takes only when asked: the base lives in CPU RAM and every step reads it over PCIe)."""
    more = "add GPUs (FSDP shards the base over them and loads a shard per GPU; `finetune plan --gpus N` says how many)"
    if hw.total_gpus > 1:
        return more
    offload = estimate(facts, recipe, "fsdp_offload", hw)
    if not offload.fits:
        return f"{more}; FSDP + CPU offload over this one GPU does not fit either ({offload.needs()})"
    return (f"{more}, or on this one GPU FSDP + CPU offload, which fits ({offload.needs()}, "
            f"{gib(offload.cpu_bytes_per_node)} of CPU RAM): set parallel.cpu_offload: true and start it as one process "
            f"with a process group, {train_launch_fix('fsdp2', processes=1)}")


# ------------------------------------------------------------------------------------------------------ CLI
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": GiB, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": GB, "gb": GB, "gib": GiB, "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ki": 1024, "mi": 1024**2,
          "gi": GiB, "ti": 1024**4}


def parse_size(text: str, flag: str) -> int:
    """`24GiB`, `80GB`, `80G` (decimal), `24` (GiB) -> bytes; anything else is a PlanError naming the flag."""
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if match and unit in _UNITS and float(match.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r}: a memory size must be more than 0. Fix: e.g. {flag} 24GiB.")
    if not match or unit not in _UNITS:
        raise PlanError(f"{flag} {text!r}: not a memory size. Fix: write a number with a unit, e.g. {flag} 24GiB or "
                        f"{flag} 80GB (GB = 10^9 bytes, GiB = 2^30; a bare number means GiB).")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_count(text: str, flag: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise PlanError(f"{flag} {text!r}: expected a whole number of at least 1. Fix: e.g. {flag} 2.")
    return value
