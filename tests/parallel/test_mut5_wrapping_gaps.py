"""Wrapping gaps found by mutation testing round 5 (bb61): DDP on a multimodal checkpoint trained on text, FSDP1 with a
frozen fp32 leaf in a bf16 model, and FSDP1's reduction dtype.

The wraps run in this process on a real one-rank gloo group (torch.distributed is not mocked; nothing is launched):
the oracles are DDP's reducer and FSDP1's own flat-parameter checks, which refuse the wrong wrap at one rank as at
eight. The group is destroyed after each test, so nothing else in the session sees it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from finetune.distributed import DistInfo
from finetune.model import loading
from finetune.parallel import wrapping
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import validate_recipe

CPU = torch.device("cpu")
ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU, backend="gloo")


@contextlib.contextmanager
def one_rank_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loaded(model_dir: Path, dtype: str, targets) -> torch.nn.Module:
    """The PeftModel a single-process / DDP run builds (finetune's own loader), without 4-bit."""
    from finetune.model import base as model_stage

    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": dtype},
                              "quantization": {"method": "none"}, "lora": {"dropout": 0.0, "target_modules": targets},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    model_stage.load_config(recipe)
    return loading.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False).model


def test_ddp_of_a_multimodal_model_trained_on_text_finds_its_unused_vision_lora(tiny_arch):
    """Found by mutation testing (bb61 wp1): `find_unused_parameters` forced off for every model passed the fast
    tier: DDP's reducer then stops at the second step of a Gemma 3 12B/27B run ("did not receive grad"), as all-linear
    LoRA on the vision tower gets no gradient from text rows. Oracle: DDP's own reducer, two steps on one rank."""
    model = _loaded(tiny_arch("gemma3"), "float32", "all-linear")  # Gemma 3 with its vision tower
    assert getattr(model.config, "vision_config", None) is not None
    assert any("vision" in name for name, p in model.named_parameters() if p.requires_grad)  # LoRA on the tower
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with one_rank_group():
        wrapped = wrapping.wrap(model, ParallelPlan(strategy="ddp", world_size=1), ONE_RANK)
        for _ in range(2):  # the reducer refuses at the second step's forward
            wrapped(input_ids=ids, labels=ids).loss.backward()
    assert wrapped.find_unused_parameters


def test_fsdp1_makes_a_frozen_fp32_router_of_a_bf16_model_its_own_unit(tiny_arch):
    """Found by mutation testing (bb61 wp2): FSDP1's auto-wrap policy without the `p.dtype != base_dtype` leaf rule
    survived test_fsdp1_units.py (one dtype throughout): DeepSeek-V3's router weight, kept fp32 by transformers
    (`_keep_in_fp32_modules_strict`) in a bf16 model, was flattened with its bf16 layer and FSDP1 refused the wrap
    ("Must flatten tensors with uniform dtype"). Oracle: FSDP1's flat-parameter check; a step runs after the wrap."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _loaded(tiny_arch("deepseek_v3"), "bfloat16", ["q_a_proj", "o_proj"])
    routers = [name for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert routers and all(model.get_parameter(name).dtype == torch.float32 for name in routers)  # transformers' fp32
    layer_class = type(model.base_model.model.model.layers[0]).__name__
    plan = ParallelPlan(strategy="fsdp", world_size=1, fsdp_version=1, layer_class=layer_class,
                        param_dtype=torch.bfloat16)
    ids = torch.tensor([[3, 4, 5, 6]])
    with one_rank_group():
        wrapped = wrapping.wrap(model, plan, ONE_RANK)
        units = [name.replace("_fsdp_wrapped_module.", "") for name, m in wrapped.named_modules() if isinstance(m, FSDP)]
        wrapped(input_ids=ids, labels=ids).loss.backward()
    assert [unit for unit in units if unit.endswith("mlp.gate")] == [name.removesuffix(".weight") for name in routers]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fsdp1_reduces_gradients_in_fp32_whatever_the_compute_dtype(dtype):
    """Found by mutation testing (bb61 wp3): FSDP1's reduce_dtype set to the compute dtype passed every test (the
    FSDP1 tests run in fp32, where the two are the same): a bf16 run reduced its LoRA gradients in bf16, FSDP2 in fp32.
    The policy FSDP1 gets must be FSDP2's (param_dtype = the plan's, reductions fp32) with buffers left alone."""
    from torch.distributed.fsdp import MixedPrecision

    policy = wrapping.fsdp1_mixed_precision(ParallelPlan(strategy="fsdp", world_size=2, fsdp_version=1,
                                                         param_dtype=dtype))
    assert policy == MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=None,
                                    cast_forward_inputs=True)
