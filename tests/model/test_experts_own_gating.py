"""DeepSeek-V4 as real QLoRA (finetune/model/experts/families/own_gating.py): its experts are the concatenated layout
with a gating of their own (SwiGLU with the gate clamped above and up clamped both ways at swiglu_limit, the class's
`_apply_gate`). Split into one Linear per expert projection they compute what transformers' fused module computes,
the clamp included; loaded by finetune every expert weight is 4-bit with a LoRA, and the hash-routing table
(`tid2eid`, a persistent buffer the checkpoint ships and init leaves at zeros) is the checkpoint's.

Before: refused before loading ("its experts apply their own gating"); and finetune's per-tensor loaders kept
init-time persistent buffers instead of the checkpoint's, so every hash-routed token went to expert 0."""

from __future__ import annotations

import pytest
import torch


def _model(tiny_arch, limit: float | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch("deepseek_v4"), dtype=torch.float32).eval()
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4Experts" and limit is not None:
            module.limit = limit  # small enough that the tiny model's activations are clamped
    return model


def test_split_experts_compute_what_deepseek_v4_experts_compute_clamp_included(tiny_arch):
    from finetune.model.experts import split_experts
    from finetune.model.experts.families import family_for
    from finetune.model.experts.split import fused_expert_modules

    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unclamped = _model(tiny_arch)(input_ids=ids).logits
        model = _model(tiny_arch, limit=0.01)
        assert {family_for(module)[0] for _, module in fused_expert_modules(model)} == {"own_gating"}
        fused = model(input_ids=ids).logits
        assert (fused - unclamped).abs().max() > 1e-4, "the clamp must matter at this limit"
        assert split_experts(model, dtype=torch.float32) == model.config.num_hidden_layers
        split = model(input_ids=ids).logits
    torch.testing.assert_close(split, fused, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sharded", [False, True])
def test_deepseek_v4_loads_4bit_experts_with_lora_and_the_checkpoints_hash_routes(tiny_arch, sharded):
    import bitsandbytes as bnb
    from safetensors import safe_open

    from finetune.model import load_model
    from finetune.model.experts import RoutedExperts
    from finetune.recipe import validate_recipe

    folder = tiny_arch("deepseek_v4")
    recipe = validate_recipe({"model": {"name_or_path": str(folder), "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    loaded = load_model(recipe, sharded=sharded, device=torch.device("cpu"), device_map=None,
                        gradient_checkpointing=True)
    model = loaded.model
    if sharded:  # the skeleton's units, each built as the wrap builds it
        for layer in model.base_model.model.model.layers:
            loaded.materialize(layer)
        loaded.materialize(model)
    experts = [module for module in model.modules() if isinstance(module, RoutedExperts)]
    assert len(experts) == 2
    for expert in (e for module in experts for e in module):
        for name in ("w1", "w2", "w3"):
            projection = getattr(expert, name)
            assert isinstance(projection.base_layer, bnb.nn.Linear4bit) and "default" in projection.lora_A
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        stored = handle.get_tensor("model.layers.0.ffn.gate.tid2eid")  # the checkpoint's names (ffn: mlp)
    routes = dict(model.named_buffers())["base_model.model.model.layers.0.mlp.gate.tid2eid"]
    assert stored.unique().numel() > 1 and torch.equal(routes, stored)
