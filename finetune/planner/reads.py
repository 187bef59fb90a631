"""Checkpoint reads at load: the bytes each rank and each node reads, and the time that takes at a stated bandwidth.

Which loader reads what (finetune/model/loading.py, finetune/model/sources/shard_reads.py):
  * FSDP2 with sharded loading: a rank reads its dim-0 chunk of every tensor; of a 4-bit weight, the values packed
    into its chunk widened to whole quantization blocks. A node's ranks read disjoint ranges (but for the blocks at
    chunk edges), so the node reads about its share of the checkpoint.
  * a 4-bit checkpoint (model.name_or_path one, or the quantized cache's entry on every start after the first): packed
    bytes instead of values (a quarter of the bf16 bytes), FSDP2 ranks their chunk's, and every rank every stored
    quant state whole; the first start with the cache on reads the bf16 base once to write the entry.
  * an MXFP4 checkpoint (gpt-oss as the hub ships it): the experts as stored, blocks + scales (17/32 byte a value),
    every rank each expert's whole slab (it is dequantized whole); the other tensors as for a bf16 checkpoint.
  * everything else (FSDP1, DDP, DeepSpeed, single process, layer split): every rank reads the whole checkpoint. The
    ranks of a node share the page cache of the memory-mapped files, so the node reads it from storage once (when
    the page cache can hold it).
The load time is the node's bytes over the read bandwidth of one node's storage (`finetune plan --read-bandwidth`):
reading only; quantizing on a GPU takes seconds for a 70B model.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.model.sources.shard_reads import dim0_chunk, packed_read_bytes, packed_value_range
from finetune.planner.facts import GB, NF4_BLOCK, ModelFacts

# A node's read bandwidth when none is stated: a local NVMe disk reads 2-7 GB/s, a shared network file system gives
# one node ~1-2 GB/s. 2 GB/s is a middle, stated figure, not a measurement of this machine.
DEFAULT_READ_BANDWIDTH = 2 * GB


@dataclass
class CheckpointReads:
    """Bytes read from the checkpoint at load: by the rank that reads the most, by a node, and the node's time."""

    rank_bytes: int
    node_bytes: int
    seconds: float
    own_shard: bool  # True: each rank reads only its FSDP2 shard


def rank_read_bytes(facts: ModelFacts, *, rank: int, world_size: int, own_shard: bool) -> int:
    """Bytes `rank` reads from the checkpoint (values as stored: config.json's dtype)."""
    elem = facts.checkpoint_dtype_bytes or facts.dtype_bytes
    if facts.stored_4bit == "cache":
        elem = facts.dtype_bytes  # the entry stores what is not quantized in model.dtype
    total = facts.stored_quant_state_bytes if facts.stored_4bit else 0
    for tensor in facts.tensors:
        if tensor.trainable:
            continue  # LoRA starts from its seed (or model.adapter, not counted): not in the base checkpoint
        if tensor.whole_read_bytes and not facts.stored_4bit:  # MXFP4 experts: one expert's slab, whole, any rank
            total += tensor.whole_read_bytes
            continue
        if tensor.quantized_numel and facts.stored_4bit:  # packed bytes: two 4-bit values per byte
            start, stop = (packed_value_range(tensor.quantized_numel, tensor.elem_bytes, rank, world_size, NF4_BLOCK)
                           if own_shard else (0, tensor.quantized_numel))
            total += -(-stop // 2) - start // 2
        elif tensor.quantized_numel:
            total += (packed_read_bytes(tensor.quantized_numel, tensor.elem_bytes, rank, world_size, NF4_BLOCK, elem)
                      if own_shard else tensor.quantized_numel * elem)
        else:
            first, last = dim0_chunk(tensor.rows, rank, world_size) if own_shard else (0, tensor.rows)
            total += (last - first) * tensor.row_elems * elem
    return total


def checkpoint_reads(facts: ModelFacts, *, processes: int, per_node: int, own_shard: bool,
                     read_bytes_per_s: float = DEFAULT_READ_BANDWIDTH) -> CheckpointReads:
    """Reads of one load with `processes` ranks, `per_node` on a node (the first node: it holds rank 0's full chunk)."""
    if not own_shard or processes == 1:
        whole = rank_read_bytes(facts, rank=0, world_size=1, own_shard=False)
        return CheckpointReads(whole, whole, whole / read_bytes_per_s, own_shard=False)
    ranks = [rank_read_bytes(facts, rank=r, world_size=processes, own_shard=True) for r in range(min(per_node, processes))]
    node = sum(ranks)
    return CheckpointReads(max(ranks), node, node / read_bytes_per_s, own_shard=True)
