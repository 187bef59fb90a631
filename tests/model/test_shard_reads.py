"""Each rank reads and quantizes only its FSDP2 chunk (finetune/model/sources/shard_reads.py): the ranges, and the bytes.

In one process, for each rank of a simulated world: the rank's packed chunk and its absmax blocks are bitwise what
quantizing the whole tensor gives, and the quant state built from the assembled absmax is bitwise the whole tensor's
(absmax, nested absmax, code, offset). The real 2-rank runs (collective included) are in tests/model/test_loading.py.
"""

from __future__ import annotations

import pytest
import torch

from finetune.model.sources.shard_reads import (
    PendingQuantState,
    _quant_state,
    dim0_chunk,
    own_parameter,
    packed_value_range,
)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunks_are_torch_chunk_as_fsdp2_uses_it(rows, world):
    pieces = torch.arange(rows).chunk(world)
    for rank in range(world):
        start, stop = dim0_chunk(rows, rank, world)
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, stop)) == expected


@pytest.mark.parametrize("numel", [64 * 4, 5776, 11476, 2888, 8, 100])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_rank_covers_its_chunk_in_either_view_and_little_more(numel, world):
    """The rank's values cover its chunk of the packed storage as bf16 and as uint8 (the wrap's re-view), start on a
    block, and exceed the bf16 chunk by less than two blocks and the few bytes the views differ by at each edge."""
    nbytes = numel // 2
    for rank in range(world):
        start, stop = packed_value_range(numel, 2, rank, world, 64)
        assert start % 64 == 0 and (stop % 64 == 0 or stop == numel)
        for size in (2, 1):
            first, last = dim0_chunk(nbytes // size, rank, world)
            if last > first:
                assert start <= 2 * first * size and 2 * last * size <= stop
        first, last = dim0_chunk(nbytes // 2, rank, world)
        assert stop - start <= 4 * (last - first) + 2 * 64 + 4 * world or (start, stop) == (0, 0)


def _full_quantization(weight: torch.Tensor):
    import bitsandbytes as bnb

    return bnb.functional.quantize_4bit(weight.to(torch.bfloat16), blocksize=64, compress_statistics=True,
                                       quant_type="nf4", quant_storage=torch.bfloat16)


@pytest.mark.parametrize("shape,world", [((151, 76), 2), ((38, 76), 3), ((76, 151), 4)])
def test_each_ranks_chunk_and_the_quant_state_are_the_whole_tensors(tmp_path, shape, world):
    import bitsandbytes as bnb
    from safetensors.torch import save_file

    from finetune.model.sources.files import TensorReader, checkpoint_index

    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    weight[0, :5] = 0  # an all-zero stretch and a large value: absmax edge cases
    weight[-1, -1] = 3.0
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    packed, state = _full_quantization(weight)
    meta = bnb.nn.Params4bit(torch.empty(shape, device="meta"), blocksize=64, compress_statistics=True,
                             quant_type="nf4", quant_storage=torch.bfloat16, module=torch.nn.Module())
    full_absmax = torch.zeros(-(-weight.numel() // 64))
    for rank in range(world):
        reader, pending = TensorReader(checkpoint_index(tmp_path)), []
        param = own_parameter(reader, "w", meta, shard=_shard(rank, world), device=torch.device("cpu"),
                              load_dtype=torch.bfloat16, pending=pending)
        first, last = dim0_chunk(packed.shape[0], rank, world)
        assert torch.equal(param.data[first:last].view(torch.uint8), packed[first:last].view(torch.uint8))
        start, stop = packed_value_range(weight.numel(), 2, rank, world, 64)
        assert reader.bytes_read == (stop - start) * 4 < weight.numel() * 4  # only its range, as stored (fp32)
        item = pending[0]
        full_absmax[item.first_block : item.first_block + item.absmax.numel()] = item.absmax
    expected_absmax = bnb.functional.quantize_4bit(weight.to(torch.bfloat16), blocksize=64, quant_type="nf4")[1].absmax
    assert torch.equal(full_absmax, expected_absmax)  # every block computed by some rank, bitwise
    rebuilt = _quant_state(full_absmax, PendingQuantState(param, weight.numel(), torch.Size(shape), None, 0),
                           device=torch.device("cpu"), load_dtype=torch.bfloat16)
    for part in ("absmax", "code", "offset"):
        assert torch.equal(getattr(rebuilt, part).view(-1).view(torch.uint8), getattr(state, part).view(-1).view(torch.uint8))
    for part in ("absmax", "code"):
        assert torch.equal(getattr(rebuilt.state2, part), getattr(state.state2, part))
    assert (rebuilt.shape, rebuilt.dtype, rebuilt.blocksize, rebuilt.state2.blocksize) == \
        (state.shape, state.dtype, state.blocksize, state.state2.blocksize)


def _shard(rank: int, world: int):
    from finetune.model.sources.shard_reads import RankShard

    return RankShard(rank, world)


def test_a_flat_range_reads_exactly_its_bytes(tmp_path):
    """Every [start, stop) of a matrix: the values of the flattened tensor, and the reader counts exactly their bytes."""
    from safetensors.torch import save_file

    from finetune.model.sources.files import TensorReader, checkpoint_index

    matrix = torch.arange(70.0).reshape(7, 10)
    save_file({"w": matrix, "n": torch.arange(5.0)}, str(tmp_path / "model.safetensors"))
    reader = TensorReader(checkpoint_index(tmp_path))
    for start in range(71):
        for stop in range(start, 71):
            before = reader.bytes_read
            assert torch.equal(reader.get_flat_range("w", start, stop), matrix.reshape(-1)[start:stop])
            assert reader.bytes_read - before == 4 * (stop - start)
    assert torch.equal(reader.get_rows("n", 1, 4), torch.arange(1.0, 4.0))
