"""What CUDA's caching allocator counts beyond the model's tensors (finetune/planner/allocator.py): the cuBLAS
workspace, the fp32 LoRA at load, the FSDP2 byte guard's float64 chunk (issue 57, finding 3). Each was missing from
the planner's figures, so each test here fails on the planner without it."""

from __future__ import annotations

import pytest
import torch

from finetune.planner import GiB, Hardware, estimate, facts_from_config, held_parameter_bytes
from finetune.planner.allocator import (
    CHECKSUM_CHUNK,
    CUBLAS_WORKSPACE_BYTES,
    byte_guard_bytes,
    checksum_bytes,
    cublas_workspace_bytes,
    unit_lora_bytes,
)
from finetune.recipe import validate_recipe

# A Llama shape of the GPU smoke's kind, 1024 wide and 8 layers (the smoke itself is 2048 wide: benchmarks/gpu_smoke_device.py, Cuda.sizes).
SMOKE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 512, "tie_word_embeddings": False}


def _recipe(**lora):
    return validate_recipe({"model": {"name_or_path": "x", "dtype": "bfloat16"}, "data": {"datasets": [{"path": "x.jsonl"}]},
                            "lora": {"r": 16, "target_modules": "all-linear", **lora}})


def _facts(recipe, *, fsdp_version: int = 2):
    from transformers import AutoConfig

    return facts_from_config(AutoConfig.for_model("llama", **SMOKE), recipe, fsdp_version=fsdp_version)


def test_torchs_default_cublas_workspace_is_in_the_step_and_goes_with_the_gpu():
    """torch's documented CUBLAS_WORKSPACE_CONFIG defaults: ":4096:8" (32 MiB) on sm90+, ":4096:2:16:8" (8 MiB +
    128 KiB, the 8,519,680-byte block of a memory snapshot) before; the step's peak holds one, whatever the strategy."""
    assert cublas_workspace_bytes(9) == CUBLAS_WORKSPACE_BYTES == 32 * 2**20
    assert cublas_workspace_bytes(8) == 8_519_680
    recipe = _recipe()
    facts = _facts(recipe)
    for key in ("single", "fsdp"):
        hopper = estimate(facts, recipe, key, Hardware(1, 80 * GiB))
        ampere = estimate(facts, recipe, key, Hardware(1, 80 * GiB, cublas_workspace_bytes=cublas_workspace_bytes(8)))
        assert hopper.parts["cublas_workspace"] == 32 * 2**20, hopper.parts
        assert hopper.peak_bytes - ampere.peak_bytes == 32 * 2**20 - 8_519_680


def test_the_load_peak_counts_the_fp32_lora_each_rank_builds():
    """Sharded loading builds each unit's LoRA (fp32) on the GPU and shards it: the rank's LoRA shards + the unit's
    own, whole; the per-rank loader holds all of it. A larger rank raises the load peak by exactly that."""
    small, large = _recipe(), _recipe(r=64)
    for key, world, sharded in (("fsdp", 2, True), ("fsdp_offload", 2, True), ("single", 1, False)):
        peaks, lora = [], []
        for recipe in (small, large):
            facts = _facts(recipe)
            peaks.append(estimate(facts, recipe, key, Hardware(world, 80 * GiB)).load_peak_bytes)
            shards = held_parameter_bytes(facts, strategy="fsdp", world_size=world)["trainable_bytes"]
            if not sharded:
                lora.append(facts.total_bytes(trainable=True))
            else:
                lora.append((0 if key == "fsdp_offload" else shards) + unit_lora_bytes(facts))
            assert all(t.elem_bytes == 4 for t in facts.tensors if t.trainable)  # PEFT's fp32
        assert lora[1] > lora[0] > 0
        assert peaks[1] - peaks[0] == lora[1] - lora[0], key


def test_the_byte_guards_float64_chunk_is_what_checksum_allocates():
    """finetune/parallel/byte_guard.py's checksum, measured op by op (the suite's tensor-bytes meter) on CPU tensors of
    under one chunk, one period and two chunks: the planner's term is the peak, within a few scalars."""
    from finetune.parallel.byte_guard import checksum
    from finetune.training.tensor_bytes import LiveBytes

    generator = torch.Generator().manual_seed(0)
    for size in (1000, 100_000, 2 * CHECKSUM_CHUNK + 17):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        with LiveBytes() as meter:
            checksum(data)
        assert meter.peak <= checksum_bytes(size) <= meter.peak + 64, (size, meter.peak, checksum_bytes(size))
    assert checksum_bytes(2 * CHECKSUM_CHUNK) > 16 * 2**20  # two float64 chunks at the hand-over


@pytest.mark.parametrize("key", ["fsdp", "fsdp_offload"])
def test_fsdp2s_load_peak_has_the_byte_guard_and_the_workspace_its_checksum_allocates(key):
    """At one rank FSDP1 and FSDP2 hold the same bytes; only FSDP2 runs the byte guard, whose float64 dot and
    matrix-vector product allocate the cuBLAS workspace too."""
    recipe = _recipe()
    fsdp2, fsdp1 = _facts(recipe), _facts(recipe, fsdp_version=1)
    hw = Hardware(1, 80 * GiB)
    guard = byte_guard_bytes(fsdp2)
    largest_packed = max(t.nbytes for t in fsdp2.tensors if t.quantized_numel)
    assert guard == checksum_bytes(largest_packed) > 8 * largest_packed
    difference = estimate(fsdp2, recipe, key, hw).load_peak_bytes - estimate(fsdp1, recipe, key, hw).load_peak_bytes
    assert difference == guard + CUBLAS_WORKSPACE_BYTES
