"""Mutation testing round 6 (bb72): gaps in finetune/planner/shards.py and allocator.py, oracles outside the planner."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from finetune.planner.facts import Tensor
from finetune.planner.shards import ZERO_PERSISTENCE_THRESHOLD, held_parameter_bytes


def _deepspeed_persistent(numels: list[int], threshold: int, monkeypatch) -> list[bool]:
    """Which parameters DeepSpeed 0.19's ZeRO-3 keeps whole: its own rule (DeepSpeedZeRoOffload.
    mark_persistent_parameters, `param.ds_numel <= param_threshold`), run on stand-in parameters."""
    offload = pytest.importorskip("deepspeed.runtime.zero.parameter_offload")
    monkeypatch.setattr(offload, "print_rank_0", lambda *args, **kwargs: None)  # (it asks for a process group)
    params = [torch.nn.Parameter(torch.empty(0)) for _ in numels]
    for param, numel in zip(params, numels):
        param.ds_numel, param.ds_persist = numel, False
    module = SimpleNamespace(named_parameters=lambda recurse=True: [(f"p{i}", p) for i, p in enumerate(params)])
    offload.DeepSpeedZeRoOffload.mark_persistent_parameters(SimpleNamespace(module=module), threshold, sys.maxsize)
    return [param.ds_persist for param in params]


@pytest.mark.parametrize("numel", [
    ZERO_PERSISTENCE_THRESHOLD - 1,
    ZERO_PERSISTENCE_THRESHOLD,
    ZERO_PERSISTENCE_THRESHOLD + 1])
def test_zero3_keeps_whole_the_tensors_deepspeed_keeps_whole_at_the_threshold(numel, monkeypatch):
    """A tensor of exactly stage3_param_persistence_threshold elements is kept whole by DeepSpeed (`<=`); the planner
    counted it partitioned (`<`)."""
    tensor = Tensor("w", rows=numel, row_elems=1, elem_bytes=2, trainable=False, unit="layer0")
    held = held_parameter_bytes(SimpleNamespace(tensors=[tensor]), strategy="zero3", world_size=4)["frozen_bytes"]
    whole = _deepspeed_persistent([numel], ZERO_PERSISTENCE_THRESHOLD, monkeypatch)[0]
    assert held == (tensor.nbytes if whole else -(-numel // 4) * 2), (numel, whole, held)


# --------------------------------------------------------------------------- the byte guard under hybrid shard
SMOKE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 512, "tie_word_embeddings": False}


def test_hybrid_shards_load_peak_has_the_byte_guard_fsdp2_runs_there_too():
    """HSDP is FSDP2's fully_shard on a 2-D mesh (parallel/wrapping.py: the same loop calls byte_guard.unit_checksums
    and verify_unit for every packed unit, whatever plan.replicas), so its load peak holds the guard's float64 chunk
    and the cuBLAS workspace as FSDP2's full shard does; FSDP1's hybrid shard runs no guard."""
    from transformers import AutoConfig

    from finetune.planner import GiB, Hardware, estimate, facts_from_config
    from finetune.planner.allocator import CUBLAS_WORKSPACE_BYTES, byte_guard_bytes
    from finetune.recipe import validate_recipe

    recipe = validate_recipe({"model": {"name_or_path": "x", "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "x.jsonl"}]},
                              "lora": {"r": 16, "target_modules": "all-linear"}})
    config = AutoConfig.for_model("llama", **SMOKE)
    fsdp2, fsdp1 = (facts_from_config(config, recipe, fsdp_version=v) for v in (2, 1))
    hw = Hardware(2, 80 * GiB, nodes=2)
    difference = estimate(fsdp2, recipe, "hsdp", hw).load_peak_bytes - estimate(fsdp1, recipe, "hsdp", hw).load_peak_bytes
    assert byte_guard_bytes(fsdp2) > 0
    assert difference == byte_guard_bytes(fsdp2) + CUBLAS_WORKSPACE_BYTES


# ------------------------------------------------------------------------------------ the LoRA of a unit at load
def test_the_unit_lora_at_load_is_one_decoder_layers_lora_as_peft_builds_it():
    """Sharded loading builds one unit (a decoder layer) with its LoRA whole before sharding it: the load term holds
    the largest layer's LoRA, fp32 as PEFT builds it, not every layer's. Oracle: PEFT's own LoRA of a meta model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.planner import facts_from_config
    from finetune.planner.allocator import unit_lora_bytes
    from finetune.recipe import validate_recipe

    recipe = validate_recipe({"model": {"name_or_path": "x", "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "x.jsonl"}]},
                              "lora": {"r": 16, "target_modules": "all-linear"}})
    config = AutoConfig.for_model("llama", **{**SMOKE, "num_hidden_layers": 3})
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
    per_layer = {}
    for name, param in model.named_parameters():
        if "lora_" in name and ".layers." in name:
            layer = name.split(".layers.")[1].split(".")[0]
            per_layer[layer] = per_layer.get(layer, 0) + param.numel() * 4  # PEFT's LoRA weights are fp32
    assert len(per_layer) == 3 and len(set(per_layer.values())) == 1
    assert unit_lora_bytes(facts_from_config(config, recipe, fsdp_version=2)) == max(per_layer.values())


# --------------------------------------------------------------- per-rank shards at uneven sizes (torch's own rules)
@pytest.mark.parametrize("rows,world", [(5, 4), (3, 2), (9, 4)])
def test_fsdp2_rank_shards_are_torch_chunk_pieces_at_uneven_rows(rows, world):
    """FSDP2's fully_shard splits dim 0 with torch.chunk: the last ranks may hold fewer rows, or none (5 rows over 4
    ranks: 2, 2, 1, 0). The shipped tiny models are even, so the strategy runs never saw an uneven split."""
    tensor = Tensor("w", rows=rows, row_elems=3, elem_bytes=2, trainable=True, unit="lora:w")
    facts = SimpleNamespace(tensors=[tensor])
    pieces = torch.chunk(torch.empty(rows, 3), world, dim=0)
    for rank in range(world):
        expected = pieces[rank].numel() * 2 if rank < len(pieces) else 0
        held = held_parameter_bytes(facts, strategy="fsdp", world_size=world, rank=rank, fsdp_version=2)
        assert held["trainable_bytes"] == expected, (rows, world, rank)


@pytest.mark.parametrize("numel,world", [(7, 2), (10, 4), (65, 8)])
def test_fsdp1_flat_units_are_padded_as_torchs_flat_param_pads_them(numel, world):
    """FSDP1 flattens a unit into one FlatParameter padded to a multiple of the world size: every rank holds
    ceil(numel / world) elements (torch's FlatParamHandle._get_shard, padding included)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    tensor = Tensor("w", rows=numel, row_elems=1, elem_bytes=4, trainable=False, unit="layer0")
    facts = SimpleNamespace(tensors=[tensor])
    for rank in range(world):
        shard, _ = FlatParamHandle._get_shard(torch.empty(numel), rank, world)
        held = held_parameter_bytes(facts, strategy="fsdp", world_size=world, rank=rank, fsdp_version=1)
        assert held["frozen_bytes"] == shard.numel() * 4, (numel, world, rank)
