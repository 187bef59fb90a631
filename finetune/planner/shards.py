"""Which bytes of the model each rank holds after wrapping, per strategy (FSDP2's row chunks, FSDP1's padded flat
units, ZeRO-3's flat partitions): the planner's per-rank figures and what parallel.local_parameter_bytes reports."""

from __future__ import annotations

import math

from finetune.planner.facts import ModelFacts

# DeepSpeed's ZeRO-3 default persistence threshold (0.19) and finetune's bucket sizes, in elements.
ZERO_PERSISTENCE_THRESHOLD = 100_000


def held_parameter_bytes(facts: ModelFacts, *, strategy: str, world_size: int, rank: int = 0,
                         fsdp_version: int = 2, persistence_threshold: int = ZERO_PERSISTENCE_THRESHOLD) -> dict[str, int]:
    """Parameter bytes one rank holds after wrapping, split frozen / trainable: what parallel.local_parameter_bytes reports.

    FSDP2 shards every tensor along dim 0 in torch.chunk pieces (the last ranks may get fewer rows); FSDP1 flattens
    each unit (decoder layer, LoRA leaf, root) into one tensor padded to a multiple of the world size. ZeRO-3
    partitions each tensor flat (numel / world, padded), except those under its persistence threshold.
    """
    held = {"frozen_bytes": 0, "trainable_bytes": 0}
    key = lambda t: "trainable_bytes" if t.trainable else "frozen_bytes"
    if strategy == "zero3" and world_size > 1:
        for t in facts.tensors:
            whole = t.numel <= persistence_threshold  # DeepSpeed's rule (mark_persistent_parameters: <=)
            held[key(t)] += t.nbytes if whole else math.ceil(t.numel / world_size) * t.elem_bytes
        return held
    if strategy != "fsdp" or world_size == 1:
        for t in facts.tensors:
            held[key(t)] += t.nbytes
        return held
    if fsdp_version == 2:
        for t in facts.tensors:
            chunk = math.ceil(t.rows / world_size)
            rows = max(0, min(chunk, t.rows - rank * chunk))
            held[key(t)] += rows * t.row_elems * t.elem_bytes
        return held
    units: dict[tuple[str, bool], list[int]] = {}
    for t in facts.tensors:
        entry = units.setdefault((t.unit, t.trainable), [0, t.elem_bytes])
        entry[0] += t.numel
    for (_, trainable), (numel, elem_bytes) in units.items():
        held["trainable_bytes" if trainable else "frozen_bytes"] += math.ceil(numel / world_size) * elem_bytes
    return held
