"""LoRA is kept off sparse-attention indexers (finetune/model/lora/attach.py: indexer_linears).

DeepSeek-V3.2's and V4's indexers (and GLM-5's `glm_moe_dsa`, HY-V4's, built on them) return the indices of the keys
each query attends to: no gradient reaches their projections, so all-linear LoRA there never trained (B stayed 0) and
made DDP search the autograd graph for unused parameters at every step. The oracles: plain PEFT's all-linear on the
same model (every other Linear keeps its LoRA), autograd (every LoRA tensor left gets a gradient) and
`PeftModel.from_pretrained` of the saved adapter on a base loaded by plain transformers (the same layout)."""

from __future__ import annotations

import pytest
import torch

from finetune.model import base as model_stage
from finetune.model import loading
from finetune.recipe import validate_recipe

CPU = torch.device("cpu")


def _lora_modules(model: torch.nn.Module) -> set[str]:
    return {name.split("base_model.model.")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_all_linear_puts_no_lora_on_an_indexer_and_every_lora_left_trains(model_type, tiny_arch, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tiny_arch(model_type)
    recipe = validate_recipe({"model": {"name_or_path": str(folder)}, "data": {"datasets": [{"path": "unused.jsonl"}]}})
    model_stage.load_config(recipe)
    model = loading.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=True).model
    trained = _lora_modules(model)

    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(r=8, target_modules="all-linear"))
    everywhere = _lora_modules(plain)
    on_indexers = {name for name in everywhere if ".indexer." in name}
    assert on_indexers, "the tiny model has an indexer with Linear layers"
    assert trained == everywhere - on_indexers

    model.train()
    ids = torch.arange(3, 40).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for name, p in lora.items() if "lora_B" in name)

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                         str(tmp_path / "adapter"))
    assert _lora_modules(reloaded) == trained


def test_a_target_list_naming_only_indexer_layers_is_refused_with_the_linear_layers_that_train(tiny_arch):
    """A name that matches only indexer Linears would get no LoRA: alone in the list, PEFT's "No modules were targeted"
    traceback after loading; beside good names, dropped without a word. Refused like a misspelled name (`finetune
    validate` says it too); a name that also matches the attention's projection (V4's `kv_proj`) is kept."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.lora.attach import target_modules_problem

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_arch("deepseek_v32")))
    problem = target_modules_problem(model, ["q_a_proj", "wk", "weights_proj"])
    assert problem and "`wk`, `weights_proj` name only Linear layers of the sparse-attention indexer" in problem
    assert "q_a_proj" in problem.split("Its Linear layers:")[1] and "wk" not in problem.split("Its Linear layers:")[1]
    assert target_modules_problem(model, ["q_a_proj", "o_proj"]) is None
