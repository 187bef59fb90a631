"""Bug bash bb66 #3: DeepSeek-V4 under the shipped ddp.yaml stopped at step 2 ("Expected to have finished reduction in
the prior iteration ... Parameter indices which did not receive grad"): all-linear LoRA on its lightning indexer never
gets a gradient (the indexer's output is top-k indices), nor its KV compressors on a row shorter than a compression
window. DDP looked for unused parameters only on models with a `vision_config`.

The wraps run in this process on a real one-rank gloo group (torch.distributed is not mocked; nothing is launched):
the oracle is DDP's own reducer, which refuses an unused parameter at one rank as at two. The group is destroyed after
each test, so nothing else in the session sees it."""

from __future__ import annotations

from pathlib import Path

import torch
from test_mut5_wrapping_gaps import CPU, ONE_RANK, one_rank_group  # a real one-rank gloo group

from finetune.model import loading
from finetune.parallel import wrapping
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import validate_recipe


def _loaded(model_dir: Path) -> torch.nn.Module:
    """The PeftModel a DDP run builds (finetune's own loader, all-linear LoRA, dropout on), without 4-bit."""
    from finetune.model import base as model_stage

    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                              "quantization": {"method": "none"}, "lora": {"dropout": 0.1, "target_modules": "all-linear"},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    model_stage.load_config(recipe)
    return loading.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False).model


def test_ddp_of_deepseek_v4_finds_the_lora_its_indexer_and_compressors_leave_without_a_gradient(tiny_arch):
    """Found by a bug bash (bb66 #3): DeepSeek-V4 with the shipped ddp.yaml died at step 2 on both ranks with DDP's
    "Expected to have finished reduction in the prior iteration" (raw tracebacks); single process and FSDP2 trained.
    DDP now looks for unused parameters on the models a probe step finds some on. Oracle: DDP's reducer, two steps of
    a 12-token row: the compressors of a 2-token probe row are left without a gradient (the indexer takes no LoRA
    since: tests/model/test_indexer_lora.py)."""
    model = _loaded(tiny_arch("deepseek_v4"))
    ids = torch.arange(3, 15).unsqueeze(0)
    with one_rank_group():
        plan = ParallelPlan(strategy="ddp", world_size=1)
        wrapped = wrapping.wrap(model, plan, ONE_RANK)
        for _ in range(2):  # the reducer refused at the second step's forward
            wrapped(input_ids=ids, labels=ids).loss.backward()
    assert wrapped.find_unused_parameters
    assert "8 trainable tensors got no gradient in a probe step" in plan.notes[-1], plan.notes
    unused = {name.split(".lora_")[0].split("self_attn.")[1] for name in wrapping.unused_by_a_probe(model, CPU)}
    assert unused == {"compressor.kv_proj", "compressor.gate_proj"}, unused  # both layers' compressors


def test_the_probe_finds_nothing_on_a_model_whose_every_lora_trains_and_leaves_the_model_as_it_was(tiny_arch):
    """The cost of looking for unused parameters (a walk of the autograd graph every step) is paid only where the probe
    finds some: Qwen3-MoE's experts all run on every step (finetune/model/experts/routed.py), so nothing is unused.
    The probe changes nothing a run sees: no gradient left, training flags and the random state as they were (a DDP
    run with dropout trains the numbers one process does)."""
    model = _loaded(tiny_arch("qwen3_moe"))
    model.eval()
    model.base_model.model.lm_head.train()  # a mixed state, restored module by module
    state = torch.random.get_rng_state()
    assert wrapping.unused_by_a_probe(model, CPU) == []
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()].count(True) == 1 and model.base_model.model.lm_head.training
    with one_rank_group():
        assert not wrapping.wrap(model, ParallelPlan(strategy="ddp", world_size=1), ONE_RANK).find_unused_parameters


def test_a_reward_models_score_head_is_not_unused(tiny_llama):
    """The reward objective runs its score head in place of the LM head, which the probe's plain forward does not:
    the head is not a reason to walk the autograd graph at every DDP step (nor for a note naming it unused)."""
    from finetune.model.reward_head import attach_score_head

    model = _loaded(tiny_llama)
    attach_score_head(model, seed=0, device=CPU)
    assert wrapping.unused_by_a_probe(model, CPU) == []
