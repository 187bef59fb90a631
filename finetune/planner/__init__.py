"""Planner: per-GPU memory of a QLoRA recipe for every strategy, from the model's config alone (no weights).

    facts.py    ModelFacts: every tensor's stored bytes and FSDP unit, from the meta-device model
    allocator.py  what CUDA's allocator holds beyond tensors (cuBLAS workspace, the byte guard's chunk) and the load peak
    memory.py   estimate: the per-rank parts of the peak for each strategy, the load peak, the CPU RAM
    shards.py   held_parameter_bytes: the parameter bytes each rank holds per strategy (FSDP2 rows, FSDP1 flat units, ZeRO-3)
    reads.py    checkpoint_reads: the checkpoint bytes each rank and node reads at load, and the time at a disk bandwidth
    fit.py      decide: the fit table on given GPUs and the strategy `auto` takes; the largest micro-batch

docs/planner.md has the derivations and the checks against published figures; `finetune plan` is its command.
"""

from finetune.planner.allocator import CUBLAS_WORKSPACE_BYTES
from finetune.planner.facts import GB, GiB, ModelFacts, PlanError, facts_from_config, generic_facts, model_config_for
from finetune.planner.fit import Decision, decide, format_table, parse_count, parse_size
from finetune.planner.memory import (
    CUDA_CONTEXT_BYTES,
    STRATEGIES,
    Estimate,
    Hardware,
    activation_parts_per_token_layer,
    estimate,
    estimates_for,
    held_parameter_bytes,
    loss_bytes,
    zero_parts,
)

__all__ = [
    "CUBLAS_WORKSPACE_BYTES", "CUDA_CONTEXT_BYTES", "GB", "STRATEGIES", "Decision", "Estimate", "GiB", "Hardware", "ModelFacts", "PlanError",
    "activation_parts_per_token_layer", "decide", "estimate", "estimates_for", "facts_from_config", "format_table",
    "generic_facts", "held_parameter_bytes", "loss_bytes", "model_config_for", "parse_count", "parse_size", "zero_parts",
]
