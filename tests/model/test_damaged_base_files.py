"""A base model folder or a start adapter damaged by a bad copy (bug bash bb30): a config.json field of the wrong
type, a special token of the wrong type in tokenizer_config.json, a cut-short adapter as model.adapter. Each was a
traceback; each is now one paragraph naming the file. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil

import pytest

from finetune.errors import ModelLoadError
from finetune.model import base
from finetune.model.lora.adapter import check_adapter
from finetune.recipe import validate_recipe

DATA = {"datasets": [{"path": "x.jsonl"}]}


def _copy(folder, tmp_path):
    copy = tmp_path / "base"
    shutil.copytree(folder, copy)
    return copy


def test_a_config_field_of_the_wrong_type_is_named(tiny_llama, tmp_path):
    """transformers 5 raises huggingface_hub's StrictDataclassFieldValidationError (no ValueError) for
    `"num_hidden_layers": "two"`: it escaped as a traceback from train and validate."""
    folder = _copy(tiny_llama, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    recipe = validate_recipe({"model": {"name_or_path": str(folder)}, "data": DATA})
    with pytest.raises(ModelLoadError, match=r"cannot load the config"):
        base.load_config(recipe)


def test_a_special_token_of_the_wrong_type_names_tokenizer_config(tiny_llama, tmp_path):
    """`"eos_token": 5` in tokenizer_config.json was a TypeError traceback."""
    folder = _copy(tiny_llama, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": 5}))
    recipe = validate_recipe({"model": {"name_or_path": str(folder)}, "data": DATA})
    with pytest.raises(ModelLoadError) as caught:
        base.load_tokenizer(recipe)
    assert "tokenizer_config.json" in str(caught.value) and "eos_token is 5" in str(caught.value), str(caught.value)


def test_a_cut_short_start_adapter_is_named_before_anything_loads(tiny_llama, tmp_path):
    """A truncated adapter_model.safetensors given as model.adapter was a safetensors traceback while the model
    loaded; now validate's check names the file."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "adapter": str(adapter)}, "data": DATA})
    with pytest.raises(ModelLoadError) as caught:
        check_adapter(recipe)
    assert str(adapter) in str(caught.value) and "copy the adapter folder again" in str(caught.value)
