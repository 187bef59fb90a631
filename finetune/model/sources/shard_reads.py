"""FSDP2: each rank reads and quantizes only its own shard of the base, bitwise what quantizing the whole tensor gives.

Why: with every rank reading and quantizing the whole base, a 70B restart reads ~140 GB of bf16 and quantizes all 80
layers on every GPU, and every node reads the full checkpoint from shared storage. FSDP2 shards every parameter along
dim 0 in `torch.chunk` pieces; a 4-bit weight's parameter is its packed storage, shape (numel / 4, 1) in bf16, so a
rank's shard is a contiguous range of the flattened weight's values. This module:

  * reads only that range from the memory-mapped safetensors file, widened to whole quantization blocks (64 values)
    at its edges (the block a shard boundary falls into is read by both ranks), and quantizes it with bitsandbytes on
    the rank's device: NF4/FP4 quantization is per block (each block's absmax, then each value against it), so the
    packed bytes and absmax of those blocks are the whole tensor's, bit for bit;
  * gathers the per-block absmax (fp32, 1/64 of the values) from every rank, one collective per unit, so that double
    quantization, whose offset is the mean over the whole tensor, runs on the full vector on every rank exactly as
    `bitsandbytes.functional.quantize_4bit(compress_statistics=True)` does;
  * places the rank's packed bytes in a zero-filled packed tensor of the full shape, which `fully_shard` then cuts:
    FSDP2 keeps only this rank's chunk, which is all real bytes (the zeros are other ranks' chunks, never kept);
  * for the parameters that are not quantized (embeddings, LM head, norms, biases), reads only this rank's rows.

The rank's range covers its chunk both as stored (bf16) and re-viewed as uint8, which the wrap does on devices whose
copies rewrite NaN bit patterns (finetune/parallel/byte_guard.py): the chunk boundaries of the two views differ by a
few bytes, so whichever view FSDP2 shards, the bytes it keeps were read and quantized here.

FSDP1 and DeepSpeed keep reading and quantizing the whole tensor on every rank: their flat parameters concatenate a
unit's tensors and cut the concatenation, so a rank's part of one weight is a range whose ends depend on every other
tensor of the unit and on padding; and ZeRO-3 partitions after the model is built (docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from finetune.model.sources.files import TensorReader


@dataclass(frozen=True)
class RankShard:
    """This rank's place among the ranks FSDP2 shards over: the whole world, or under hybrid shard its node's shard
    group (`rank` = global rank % `world_size`, finetune/parallel/decision.py)."""

    rank: int
    world_size: int


# ------------------------------------------------------------------------------------------------ the ranges
def dim0_chunk(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of a tensor that FSDP2 keeps on `rank`: torch.chunk's pieces, ceil(rows / world) each, so
    the last ranks get fewer (or none) and FSDP2 pads them."""
    size = -(-rows // world_size)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def packed_value_range(numel: int, storage_bytes: int, rank: int, world_size: int, blocksize: int) -> tuple[int, int]:
    """Values [start, stop) of a flattened 4-bit weight that `rank` must read and quantize: those packed into its FSDP2
    chunk of the storage (as stored, and as uint8), widened to whole quantization blocks. (0, 0) when it has none."""
    nbytes = (numel + 1) // 2  # two 4-bit values per byte
    chunks = [dim0_chunk(nbytes // size, rank, world_size) for size in {storage_bytes, 1}]
    byte_ranges = [(start * size, stop * size) for (start, stop), size in zip(chunks, {storage_bytes, 1}) if stop > start]
    if not byte_ranges:
        return 0, 0
    first, last = min(r[0] for r in byte_ranges), max(r[1] for r in byte_ranges)
    return 2 * first // blocksize * blocksize, min(numel, -(-2 * last // blocksize) * blocksize)


def packed_read_bytes(numel: int, storage_bytes: int, rank: int, world_size: int, blocksize: int,
                      elem_bytes: int) -> int:
    """Checkpoint bytes `rank` reads for one 4-bit weight stored with `elem_bytes` per value (for the planner)."""
    start, stop = packed_value_range(numel, storage_bytes, rank, world_size, blocksize)
    return (stop - start) * elem_bytes


# ------------------------------------------------------------------------------------------------ building
@dataclass
class PendingQuantState:
    """A 4-bit weight whose packed shard is in place; its quant state waits for the absmax of the other ranks."""

    param: nn.Parameter
    numel: int
    shape: torch.Size
    absmax: torch.Tensor  # this rank's blocks
    first_block: int


def own_parameter(reader: TensorReader, key: str, meta: nn.Parameter, *, shard: RankShard, device: torch.device,
                  load_dtype: torch.dtype, pending: list[PendingQuantState]) -> nn.Parameter:
    """The parameter `meta` with only this rank's FSDP2 chunk read from the checkpoint (zeros elsewhere)."""
    if type(meta).__name__ == "Params4bit":
        return _own_packed(reader, key, meta, shard=shard, device=device, load_dtype=load_dtype, pending=pending)
    value = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    if value.dim() == 0:
        value.copy_(reader.get(key))
    else:
        start, stop = dim0_chunk(meta.shape[0], shard.rank, shard.world_size)
        if stop > start:
            value[start:stop] = reader.get_rows(key, start, stop).to(device=device, dtype=meta.dtype)
    return nn.Parameter(value, requires_grad=meta.requires_grad)


def _own_packed(reader: TensorReader, key: str, meta: nn.Parameter, *, shard: RankShard, device: torch.device,
                load_dtype: torch.dtype, pending: list[PendingQuantState]) -> nn.Parameter:
    import bitsandbytes as bnb

    numel, storage = meta.numel(), meta.quant_storage
    storage_bytes = torch.empty(0, dtype=storage).element_size()
    packed = torch.zeros((numel + 1) // 2 // storage_bytes, 1, dtype=storage, device=device)
    start, stop = packed_value_range(numel, storage_bytes, shard.rank, shard.world_size, meta.blocksize)
    absmax = torch.empty(0, dtype=torch.float32, device=device)
    if stop > start:
        # As transformers' Bnb4bitQuantize: cast to the load dtype on the device, then quantize there (per block).
        values = reader.get_flat_range(key, start, stop).to(device=device, dtype=load_dtype)
        own, state = bnb.functional.quantize_4bit(values, blocksize=meta.blocksize, compress_statistics=False,
                                                  quant_type=meta.quant_type, quant_storage=torch.uint8)
        packed.view(torch.uint8).view(-1)[start // 2 : start // 2 + own.numel()] = own.view(-1)
        absmax = state.absmax
        del values, own, state
    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=None, blocksize=meta.blocksize,
                              compress_statistics=meta.compress_statistics, quant_type=meta.quant_type,
                              quant_storage=storage, module=meta.module, bnb_quantized=True)
    pending.append(PendingQuantState(param, numel, meta.shape, absmax, start // meta.blocksize))
    return param


def finish_quant_states(pending: list[PendingQuantState], *, shard: RankShard, device: torch.device,
                        load_dtype: torch.dtype) -> None:
    """Gather every rank's absmax of the unit's 4-bit weights (one collective), then give each weight the quant state
    that quantizing the whole tensor gives: the full absmax, double-quantized from the full vector when asked."""
    from finetune.distributed import all_gather_padded, world_size

    if not pending:
        return
    # What every rank computed, in the same order on every rank (the ranges are a function of the shapes only).
    per_rank = [[packed_value_range(p.numel, _storage_bytes(p.param), rank, shard.world_size, p.param.blocksize)
                 for p in pending] for rank in range(shard.world_size)]
    lengths = [sum(_blocks(r, p.param.blocksize) for r, p in zip(ranges, pending)) for ranges in per_rank]
    # Hybrid shard: `shard` is the rank's place in its node's shard group, and the world is `replicas` such groups
    # laid out one after another (global rank = group * shard.world_size + shard.rank), each holding the same chunks.
    # The gather runs over the world (every rank's piece, the group's lengths repeated) and keeps the first group's:
    # the same absmax on every rank, with no process group of its own in the model stage.
    replicas = max(1, world_size() // shard.world_size)
    gathered = all_gather_padded(torch.cat([p.absmax for p in pending]), lengths * replicas)[: shard.world_size]
    for index, item in enumerate(pending):
        blocksize = item.param.blocksize
        full = torch.empty(-(-item.numel // blocksize), dtype=torch.float32, device=device)
        for rank, ranges in enumerate(per_rank):
            offset = sum(_blocks(r, p.param.blocksize) for r, p in zip(ranges[:index], pending[:index]))
            count = _blocks(ranges[index], blocksize)
            first = ranges[index][0] // blocksize
            full[first : first + count] = gathered[rank][offset : offset + count]  # overlaps: the same bits
        item.param.quant_state = _quant_state(full, item, device=device, load_dtype=load_dtype)
        item.param.module.quant_state = item.param.quant_state  # what Params4bit._quantize sets too
    pending.clear()


def _blocks(value_range: tuple[int, int], blocksize: int) -> int:
    return -(-(value_range[1] - value_range[0]) // blocksize)


def _storage_bytes(param: nn.Parameter) -> int:
    return torch.empty(0, dtype=param.quant_storage).element_size()


def _quant_state(absmax: torch.Tensor, item: PendingQuantState, *, device: torch.device, load_dtype: torch.dtype):
    """bitsandbytes.functional.quantize_4bit's QuantState, from the full absmax (the same steps, the same order)."""
    from bitsandbytes import functional

    param = item.param
    code = functional.get_4bit_type(param.quant_type, device=device)
    if not param.compress_statistics:
        return functional.QuantState(absmax=absmax, shape=item.shape, dtype=load_dtype, blocksize=param.blocksize,
                                     code=code, quant_type=param.quant_type)
    offset = absmax.mean()
    nested_absmax, nested_state = functional.quantize_blockwise(absmax - offset, blocksize=256)
    return functional.QuantState(absmax=nested_absmax, shape=item.shape, dtype=load_dtype, blocksize=param.blocksize,
                                 code=code, quant_type=param.quant_type, offset=offset, state2=nested_state)
