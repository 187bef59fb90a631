"""LoRA start gaps found by mutation testing round 5 (bb61): the cross-rank LoRA checksum's sensitivity to the tensors'
names, and model.adapter from a base of another width (refused in one paragraph, not a traceback).

Oracles: PEFT's own LoRA layers (get_peft_model, save_pretrained) and arithmetic on the tensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from finetune.errors import ModelLoadError
from finetune.model import loading
from finetune.model.lora.init import lora_checksum
from finetune.recipe import validate_recipe

CPU = torch.device("cpu")


def _peft(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_the_lora_checksum_changes_when_equal_tensors_swap_names(tiny_llama):
    """Found by mutation testing (bb61 in2): the cross-rank LoRA checksum weighted by a plain 1.0 instead of the
    tensor name's crc32 passed every test: two ranks holding the same values under swapped names (same shapes) would
    agree. The swap keeps every value (the plain sum is the same, to the last bit), so only the names can tell."""
    model = _peft(tiny_llama)
    first = model.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    second = model.get_parameter("base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight")
    assert first.shape == second.shape and not torch.equal(first, second)

    def plain_sum() -> float:
        return sum(float(p.detach().double().sum()) for n, p in model.named_parameters() if ".lora_" in n)

    before, total = lora_checksum(model), plain_sum()
    with torch.no_grad():
        held = first.detach().clone()
        first.copy_(second)
        second.copy_(held)
    assert plain_sum() == total  # the same values, only under other names
    assert lora_checksum(model) != pytest.approx(before, rel=1e-9, abs=1e-12)


@pytest.fixture(scope="module")
def wider_qwen2(tiny_qwen2, tmp_path_factory) -> Path:
    """tiny_qwen2's architecture and tokenizer at twice its hidden size: the same LoRA layout, other tensor shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("wider-qwen2")
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.hidden_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for path in tiny_qwen2.iterdir():
        if "token" in path.name or path.name == "chat_template.jinja":
            shutil.copy(path, folder / path.name)
    return folder


@pytest.mark.parametrize("route", ["per_tensor", "from_pretrained"])
def test_an_adapter_of_a_base_of_another_width_is_refused_in_one_paragraph(route, tiny_qwen2, wider_qwen2, tmp_path):
    """Found by mutation testing (bb61 in3): without the shape check in start_value, model.adapter trained on another
    base (same LoRA layout: r, targets) reached torch's bare `copy_` size mismatch (a RuntimeError traceback); the
    refusal tests all differed in layout keys and were refused before weights load. Now it is the ModelLoadError
    naming the tensor, both shapes (PEFT's, of the adapter, and the model's) and the fix."""
    from finetune.model import base as model_stage

    adapter = tmp_path / "adapter"
    _peft(tiny_qwen2).save_pretrained(adapter)
    recipe = validate_recipe({"model": {"name_or_path": str(wider_qwen2), "dtype": "float32", "adapter": str(adapter)},
                              "quantization": {"method": "none"}, "lora": {"dropout": 0.0},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    model_stage.load_config(recipe)
    with pytest.raises(ModelLoadError) as refused:
        if route == "from_pretrained":
            model_stage.build_model(recipe, device=CPU, gradient_checkpointing=False)
        else:
            loading.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False)
    message = str(refused.value)
    from safetensors.torch import load_file

    key = "model.layers.0.self_attn.q_proj.lora_A.weight"
    saved = list(load_file(adapter / "adapter_model.safetensors")[f"base_model.model.{key}"].shape)  # PEFT's [4, 64]
    assert (f"model.adapter: tensor {key} is shape {saved}, the model's [4, 128]: the adapter was not trained for this "
            "base model and LoRA layout. Fix: use the adapter of a run on the same model.name_or_path.") in message
