"""The adapter_config.json a run writes names the base it trained on, as PEFT, TRL and `finetune export` read it
(finetune/outputs/adapter_files.py: _config_to_write, through run_adapter.save_run_adapter)."""

from __future__ import annotations

import json

from finetune.outputs.adapter_files import adapter_key_map
from finetune.outputs.run_adapter import save_run_adapter
from finetune.recipe import validate_recipe


def test_the_run_adapter_names_the_recipes_base_and_revision(tiny_llama, tmp_path):
    """Found by a bug bash: a Llama 4 run (a text model built from a multimodal config, whose config has no
    `_name_or_path`) wrote "base_model_name_or_path": null, so AutoPeftModelForCausalLM went to the network and
    `finetune export` of the adapter alone asked for --base; and model.revision was never written ("revision": null),
    so a hub base pinned by the recipe was reloaded at main. Now both come from the recipe."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama)
    config._name_or_path = ""  # as the text config of a multimodal model: PEFT then records no base
    peft_model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj"]))
    assert peft_model.peft_config["default"].base_model_name_or_path is None
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "revision": "v1.0"},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    key_map = adapter_key_map(peft_model)
    state = {name: param.detach() for name, param in peft_model.named_parameters() if param.requires_grad}
    save_run_adapter(peft_model.peft_config["default"], key_map, state, tmp_path, None, recipe)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(tiny_llama) and written["revision"] == "v1.0"
    assert written["inference_mode"] is True and peft_model.peft_config["default"].inference_mode is False
