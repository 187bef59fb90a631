"""4-bit base + LoRA: real bitsandbytes layers, only LoRA trains, the CPU repack trap is defused."""

from __future__ import annotations

import pytest
import torch

from finetune.model import base as model_lib
from finetune.model.lora.attach import lora_config
from finetune.recipe import validate_recipe


def make_recipe(model_dir, **sections):
    raw = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"datasets": [{"path": "unused.jsonl"}]},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return validate_recipe(raw)


def build(recipe, *, checkpointing=False):
    torch.manual_seed(0)
    return model_lib.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=checkpointing)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_projections_are_real_4bit_and_only_lora_trains(fixture, request):
    import bitsandbytes as bnb

    peft_model = build(make_recipe(request.getfixturevalue(fixture)))
    linear4 = [m for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    # 2 layers x 7 projections (q, k, v, o, gate, up, down), each really packed NF4 with a quant state.
    assert len(linear4) == 14
    weight = linear4[0].weight
    assert isinstance(weight, bnb.nn.Params4bit) and weight.quant_state is not None
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quant
    assert weight.dtype == torch.float32  # quant storage = model.dtype, what FSDP shards
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(trainable) == 28  # A and B for 14 projections; lm_head is not targeted


def test_quantization_none_is_plain_lora(tiny_llama):
    import bitsandbytes as bnb

    peft_model = build(make_recipe(tiny_llama, quantization="none"))
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in peft_model.modules())
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)


def test_rslora_dora_and_target_modules(tiny_llama):
    recipe = make_recipe(tiny_llama, lora={"rslora": True, "dora": True, "target_modules": ["q_proj", "v_proj"]})
    config = lora_config(recipe)
    assert config.use_rslora and config.use_dora and set(config.target_modules) == {"q_proj", "v_proj"}
    peft_model = build(recipe)
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)
    assert all(("q_proj" in n or "v_proj" in n) for n in names)


def test_bnb_config_follows_recipe(tiny_llama):
    recipe = make_recipe(tiny_llama, model={"dtype": "bfloat16"}, quantization={"method": "fp4", "double_quant": False})
    config = model_lib.quantization_config(recipe)
    assert config.bnb_4bit_quant_type == "fp4" and not config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_quant_storage == torch.bfloat16 and config.bnb_4bit_compute_dtype == torch.bfloat16


def test_eval_before_training_does_not_cut_gradients(tiny_llama):
    """bitsandbytes repacks 4-bit weights for CPU inference on an eval forward without grad; that layout has no
    backward. After our load-time switch, eval then train must give the same gradients as train alone."""
    ids = torch.randint(0, 100, (2, 12))

    def lora_grad_norm(evaluate_first: bool) -> float:
        peft_model = build(make_recipe(tiny_llama, model={"dtype": "bfloat16"}))
        if evaluate_first:
            peft_model.eval()
            with torch.no_grad():
                peft_model(input_ids=ids)
        peft_model.train()
        peft_model(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for n, p in peft_model.named_parameters() if "lora_B" in n and "layers.0." in n]
        return float(torch.stack([g.float().norm() for g in grads]).norm())

    assert lora_grad_norm(True) == pytest.approx(lora_grad_norm(False), rel=1e-3)


def test_gradient_checkpointing_trains_with_cache_off(tiny_llama):
    peft_model = build(make_recipe(tiny_llama), checkpointing=True)
    assert peft_model.base_model.model.config.use_cache is False
    ids = torch.randint(0, 100, (2, 12))
    peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if p.requires_grad and "lora_A" in n)


def test_missing_local_model_names_path_and_fix(tmp_path):
    from finetune.errors import ModelLoadError

    recipe = make_recipe(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model"):
        model_lib.load_config(recipe)


def test_a_hub_model_missing_offline_does_not_advise_the_setting_already_made(monkeypatch):
    """With HF_HUB_OFFLINE=1 already set, the fix said "or set HF_HUB_OFFLINE=1 to use only the local cache"."""
    from finetune.model.sources.hub import load_error

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("FINETUNE_HUB_UNREACHABLE", raising=False)  # (set by an earlier test's unreachable hub)
    said = str(load_error("config", "meta-llama/Llama-3.1-8B", OSError("not cached")))
    assert "hf download meta-llama/Llama-3.1-8B --local-dir DIR" in said and "or set HF_HUB_OFFLINE=1" in said
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    said = str(load_error("config", "meta-llama/Llama-3.1-8B", OSError("not cached")))
    assert "or set HF_HUB_OFFLINE=1" not in said and "HF_HUB_OFFLINE is set: only the local cache is read" in said
