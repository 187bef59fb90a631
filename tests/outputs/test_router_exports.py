"""Adapters with trained routers (lora.train_router) at export: the PEFT verdict of runtimes.json (finetune/outputs/
runtimes.py) on a bf16 base, and the fused expert LoRA (finetune/outputs/export_fused.py) beside a router's integer
table."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import recipe_dict, write_jsonl, write_recipe

ROUTER_BIAS = "e_score_correction_bias"


def _bf16_config(model_type: str):
    """The config of a tiny `model_type` as a bf16 checkpoint's config.json reads (dtype bfloat16)."""
    from finetune.cli.tiny_arch import tiny_config

    config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
    config.dtype = torch.bfloat16
    return config


def _router_adapter(config, out) -> None:
    """finetune's adapter with lora.train_router (routers as PEFT's modules_to_save, fp32 as training holds them; LoRA
    on o_proj only, so the file is PEFT's form as saved), every trained tensor moved off its start and the routing bias
    not zeros, as a trained run on a real checkpoint writes it."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from finetune.model.experts import get_peft_model, split_experts
    from finetune.outputs import adapter_key_map, save_adapter

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith(ROUTER_BIAS):
            buffer.copy_(torch.linspace(-0.5, 0.5, buffer.numel()))
    split_experts(model, dtype=torch.float32, quantized=False)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["o_proj"]),
                                train_router=True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    key_map = adapter_key_map(peft_model)
    save_adapter(peft_model.peft_config["default"], key_map, dict(peft_model.named_parameters()), out)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_peft_verdict_of_a_train_router_adapter_on_a_bf16_base_is_valid(model_type, tmp_path):
    """Found by a bug bash: runtimes.json said PEFT INVALID for every lora.train_router adapter of a bf16 base, which
    plain PeftModel.from_pretrained loads: the check gave real storage to parameters only, so a router copy's buffer
    (DeepSeek-V3's e_score_correction_bias) stayed on the meta device ("1 different tensor"), and the file's fp32
    router was compared after PEFT rounded it into a copy of the bf16 base's router (Qwen3-MoE: "2 different")."""
    from safetensors.torch import load_file

    from finetune.model.classes import from_config
    from finetune.outputs.runtimes import check_peft_load

    config = _bf16_config(model_type)
    _router_adapter(config, tmp_path / "adapter")
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    routers = {key: value for key, value in written.items() if ".lora_" not in key}
    assert routers and all(value.dtype == torch.float32 for value in routers.values())
    with torch.device("meta"):
        base = from_config(copy.deepcopy(config))
    router = base.get_submodule(next(key for key in routers if key.endswith(".weight")).removeprefix(
        "base_model.model.").removesuffix(".weight"))
    assert any(key.endswith(ROUTER_BIAS) for key in routers) == (model_type == "deepseek_v3")
    assert (router.weight.dtype == torch.bfloat16) == (model_type == "qwen3_moe")  # DeepSeek-V3 routes in fp32

    verdict = check_peft_load(tmp_path / "adapter", config)
    assert verdict.status == "valid", verdict.reasons
    assert f"all {len(written)} tensors" in verdict.reasons[0]


@pytest.mark.parametrize(("model_type", "leaf"), [("deepseek_v3", ROUTER_BIAS), ("qwen3_moe", "weight")])
def test_peft_verdict_is_invalid_when_a_loaded_router_tensor_differs(model_type, leaf, tmp_path, monkeypatch):
    """The check still fails: a PEFT loader that put a router tensor in place with another value (the routing bias
    shifted; the router's weight rounded to bf16, what a bf16 copy holds) is reported INVALID, naming the tensor."""
    import peft.utils

    from finetune.outputs.runtimes import check_peft_load

    config = _bf16_config(model_type)
    _router_adapter(config, tmp_path / "adapter")
    load = peft.utils.set_peft_model_state_dict

    def load_then_change(peft_model, state, *args, **kwargs):
        result = load(peft_model, state, *args, **kwargs)
        tensors = {**dict(peft_model.named_parameters()), **dict(peft_model.named_buffers())}
        tensor = next(value for name, value in tensors.items() if name.endswith(f"modules_to_save.default.{leaf}"))
        with torch.no_grad():
            tensor.copy_(tensor + 0.25 if leaf == ROUTER_BIAS else tensor.to(torch.bfloat16).float())
        return result

    monkeypatch.setattr(peft.utils, "set_peft_model_state_dict", load_then_change)
    verdict = check_peft_load(tmp_path / "adapter", config)
    assert verdict.status == "invalid"
    assert "1 different tensor(s)" in verdict.reasons[0] and f"mlp.gate.{leaf}" in verdict.reasons[0], verdict.reasons


def test_fused_expert_lora_ignores_a_router_integer_table_stored_first(tmp_path):
    """Found by a bug bash: the fused expert LoRA took its dtype from the adapter's first tensor, and safetensors stores
    integer tensors first: with a router's integer table in the adapter (DeepSeek-V4's hash-routing `tid2eid`, saved
    with a trained router) the fused LoRA was built in int64, each factor truncated to integers (zeros)."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from finetune import outputs, parallel
    from finetune.model.experts import get_peft_model, split_experts
    from finetune.outputs import export_experts

    config = _bf16_config("deepseek_v4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    split_experts(model, dtype=torch.float32, quantized=False)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))
    key_map = outputs.adapter_key_map(peft_model)
    outputs.save_adapter(peft_model.peft_config["default"], key_map,
                         parallel.trainable_state_dict(peft_model, key_map), tmp_path / "adapter")
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    table = next(name for name, _ in model.named_buffers() if name.endswith("tid2eid"))
    save_file({**adapter, f"base_model.model.{table}": torch.randint(0, 4, model.get_buffer(table).shape)},
              str(tmp_path / "with_table.safetensors"))
    with_table = load_file(str(tmp_path / "with_table.safetensors"))
    assert next(iter(with_table.values())).dtype == torch.int64  # safetensors' order: the table first

    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    fused = {}
    for tensors in (adapter, with_table):
        written, update = export_experts.for_runtimes(export_experts.in_model_names(tensors, config), config,
                                                      adapter_config)
        assert update.get("target_parameters")  # the fused-expert form
        fused[len(tensors)] = {key: value for key, value in written.items() if ".experts." in key and ".lora_" in key}
    reference, got = fused[len(adapter)], fused[len(with_table)]
    assert reference and all(value.dtype == torch.float32 and value.abs().max() > 0 for value in reference.values())
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert got[key].dtype == torch.float32, key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_a_train_router_run_on_a_bf16_base_writes_a_valid_peft_verdict(model_type, tiny_arch, tmp_path):
    """Found by a bug bash: every `finetune train` run with lora.train_router and LoRA on the experts of a bf16 base
    (adapter/runtimes.json: written by the export of the fused-expert form) said PEFT INVALID - the routing bias left on
    the meta device (DeepSeek-V3) and the fp32 router compared with a bf16 copy of it (Qwen3-MoE)."""
    from finetune.run import main

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": f"{a} plus {a + 1} is {2 * a + 1}."} for a in range(16)])
    recipe = recipe_dict(tiny_arch(model_type), data, tmp_path / "run", quantization={"method": "none"},
                         lora={"r": 4, "alpha": 8, "dropout": 0.0, "train_router": True},
                         train={"max_steps": 2, "micro_batch_size": 4, "learning_rate": 3e-2})
    recipe["data"]["datasets"][0]["format"] = "text"
    main([str(write_recipe(tmp_path / "recipe.yaml", recipe))])
    verdicts = {item["runtime"].split(" ")[0]: item
                for item in json.loads((tmp_path / "run" / "adapter" / "runtimes.json").read_text())}
    assert verdicts["PEFT"]["status"] == "valid", verdicts["PEFT"]
    assert "modules_to_save ['mlp.gate']" in " ".join(verdicts["vLLM"]["reasons"])  # the routers are in it
