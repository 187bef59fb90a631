"""lora.train_router on the mixture-of-experts models finetune trains: PEFT's modules_to_save takes the routers and
nothing else, a router's buffers (DeepSeek-V3's `e_score_correction_bias`) are saved as PEFT saves them, and the
adapter loads with plain `PeftModel.from_pretrained` onto the stock model, computing what the run computed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import recipe_dict, write_jsonl, write_recipe


def _tiny(model_type: str):
    """A tiny fp32 model of `model_type` from transformers' own config class (2 layers, hidden 64), built here."""
    from transformers import AutoModelForCausalLM

    from finetune.cli.tiny_arch import tiny_config

    config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _with_router_lora(model, target_modules):
    """finetune's PEFT model (experts split, unquantized) with lora.train_router, its adapter as if trained: LoRA B and
    every router copy moved away from their start, so the adapter changes the logits."""
    from peft import LoraConfig

    from finetune.model.experts import get_peft_model, split_experts

    split_experts(model, dtype=torch.float32, quantized=False)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules),
                                train_router=True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_next"])
def test_train_router_wraps_the_routers_and_not_the_shared_expert_gate(model_type):
    """Found by a bug bash: lora.train_router on Qwen2-MoE stopped before step 1 (4-bit: `variable.set_data`
    RuntimeError in a deepcopy; quantization none: `modules_to_save cannot be applied to modules of type
    lora.layer.Linear`). modules_to_save was the bare leaf name `gate`, which PEFT matches as a plain suffix, so it
    also took `mlp.shared_expert_gate` (a Linear with LoRA, which finetune's own router test leaves out on purpose).
    The same on every model with a shared-expert gate (Qwen3-Next, Qwen3.5-MoE)."""
    from peft.utils import ModulesToSaveWrapper

    peft_model = _with_router_lora(_tiny(model_type), "all-linear")
    wrapped = sorted(name.removeprefix("base_model.model.") for name, module in peft_model.named_modules()
                     if isinstance(module, ModulesToSaveWrapper))
    layers = peft_model.config.num_hidden_layers
    assert wrapped == [f"model.layers.{index}.mlp.gate" for index in range(layers)]
    assert peft_model.peft_config["default"].modules_to_save == ["mlp.gate"]
    shared_gates = [module for name, module in peft_model.named_modules() if name.endswith("mlp.shared_expert_gate")]
    assert len(shared_gates) == layers and all(hasattr(module, "lora_A") for module in shared_gates)  # LoRA, not a copy


def test_routers_with_a_buffer_train_and_their_adapter_loads_in_plain_peft(tmp_path):
    """Found by a bug bash: lora.train_router on DeepSeek-V3 (GLM-4.5, Kimi K2.5: routers with the persistent buffer
    `e_score_correction_bias`) stopped before step 1 with KeyError 'modules_to_save.default.e_score_correction_bias':
    adapter_key_map gave PEFT the trainable tensors only, and PEFT's state dict of a router copy asks for its buffer
    too. Now the buffer is saved as PEFT saves it (PEFT's loader needs it: a KeyError without it), unchanged, and the
    adapter loads with plain PeftModel.from_pretrained onto the stock model, with the trained model's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.outputs import adapter_key_map, save_adapter

    base = _tiny("deepseek_v3")
    bias = [name for name, _ in base.named_buffers() if name.endswith("e_score_correction_bias")]
    assert bias  # the router's buffer the adapter must carry
    with torch.no_grad():
        for name in bias:  # a real checkpoint's routing bias is not the zeros of a fresh init
            base.get_buffer(name).copy_(torch.linspace(-0.5, 0.5, base.get_buffer(name).numel()))
    base.save_pretrained(tmp_path / "base")
    trained = _with_router_lora(copy.deepcopy(base), ["o_proj"])  # no expert LoRA: the adapter is PEFT's form as is

    key_map = adapter_key_map(trained)
    save_adapter(trained.peft_config["default"], key_map, dict(trained.named_parameters()), tmp_path / "adapter")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for name in bias:
        torch.testing.assert_close(written[f"base_model.model.{name}"], base.get_buffer(name), rtol=0, atol=0)

    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, loaded, untouched = trained(input_ids=ids).logits, plain(input_ids=ids).logits, base(input_ids=ids).logits
    torch.testing.assert_close(loaded, expected, rtol=0, atol=1e-5)
    assert (loaded - untouched).abs().max() > 1e-2  # the routers and LoRA it carries change the logits


def _with_routing_bias(model_dir, out_dir):
    """A copy of the tiny checkpoint whose routing bias (`e_score_correction_bias`) is not the zeros of a fresh init, as
    in a real DeepSeek-V3 checkpoint: a router copy that missed it (a buffer left at its init value) would show."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.linspace(-0.5, 0.5, tensor.numel()).to(tensor.dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _router_recipe(model_dir, data, out_dir, quantization: str) -> dict:
    """3 steps with the routers trained, fp32, no dropout (so that one and two processes train the same curve)."""
    return recipe_dict(model_dir, data, out_dir, quantization={"method": quantization},
                       lora={"r": 4, "alpha": 8, "dropout": 0.0, "train_router": True},
                       train={"max_steps": 3, "micro_batch_size": 4, "learning_rate": 3e-2})


def _trained_routers(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from finetune.outputs import as_trained

    adapter = load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))
    return {name: tensor for name, tensor in adapter.items() if ".lora_" not in name}


@pytest.mark.slow
@pytest.mark.parametrize("model_type,quantization", [("deepseek_v3", "none"), ("qwen2_moe", "nf4")])
def test_a_train_router_run_finishes_and_plain_peft_loads_its_adapter(tiny_arch, tmp_path, model_type, quantization):
    """Found by a bug bash: `finetune train` with lora.train_router stopped before step 1 on DeepSeek-V3 (KeyError
    'modules_to_save.default.e_score_correction_bias') and on Qwen2-MoE under 4 bits (a deepcopy of the 4-bit
    `shared_expert_gate`, which modules_to_save `gate` also matched). Now both runs finish; the run's adapter/ loads
    with plain PeftModel.from_pretrained onto the stock (unquantized) model with every tensor placed, its routers moved
    and the routing bias saved unchanged; without quantization its logits are those of the run's own model (finetune's
    loader of the adapter as trained)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from finetune.model import load_base_model
    from finetune.model.classes import from_pretrained
    from finetune.model.experts import load_adapter
    from finetune.recipe import load_recipe
    from finetune.run import main

    model_dir = tiny_arch(model_type)
    if model_type == "deepseek_v3":
        model_dir = _with_routing_bias(model_dir, tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": f"{a} plus {a + 1} is {2 * a + 1}."} for a in range(32)])
    recipe = _router_recipe(model_dir, data, tmp_path / "run", quantization)
    recipe["data"]["datasets"][0]["format"] = "text"
    main([str(write_recipe(tmp_path / "recipe.yaml", recipe))])
    run_dir, stock = tmp_path / "run", load_file(str(model_dir / "model.safetensors"))
    routers = _trained_routers(run_dir)
    weights = {name: tensor for name, tensor in routers.items() if name.endswith(".weight")}
    assert sorted(weights) == [f"base_model.model.model.layers.{i}.mlp.gate.weight" for i in range(2)
                               if f"model.layers.{i}.mlp.gate.weight" in stock]  # the routers, no shared_expert_gate
    assert all((tensor - stock[name.removeprefix("base_model.model.")].float()).abs().max() > 1e-4
               for name, tensor in weights.items())
    for name in set(routers) - set(weights):  # the routing bias: saved as PEFT saves it, as the checkpoint has it
        expected = stock[name.removeprefix("base_model.model.")].float()
        assert expected.abs().max() > 0.1 and torch.equal(routers[name], expected)
    assert (model_type == "deepseek_v3") == bool(set(routers) - set(weights))

    base = from_pretrained(str(model_dir), dtype=torch.float32).eval()
    plain = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    placed = plain.load_adapter(str(run_dir / "adapter"), adapter_name="probe")
    assert not placed.unexpected_keys and not [key for key in placed.missing_keys if ".probe" in key]
    if quantization != "none":
        return
    ours = load_adapter(load_base_model(load_recipe(run_dir / "recipe.yaml"), device=torch.device("cpu")),
                        run_dir / "adapter")
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    plain.set_adapter("default")
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, ours.eval()(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_train_router_under_fsdp2_trains_the_single_process_curve(tiny_arch, tmp_path):
    """Found by a bug bash: the DeepSeek-V3 KeyError stopped the FSDP2 and FSDP1 launches as well (the key map is
    made before the wrap). A tiny DeepSeek-V3, 4-bit, routers trained, under the shipped accelerate_configs/fsdp2.yaml
    (2 processes, the same global batch): the loss curve and the saved routers (weights and the routing bias) are the
    single process's."""
    from conftest import accelerate_launch, train_losses

    from finetune.run import main

    model_dir = _with_routing_bias(tiny_arch("deepseek_v3"), tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": f"{a} plus {a + 1} is {2 * a + 1}."} for a in range(32)])
    runs = {}
    for processes in (1, 2):
        recipe = _router_recipe(model_dir, data, tmp_path / f"run{processes}", "nf4")
        recipe["data"]["datasets"][0]["format"] = "text"
        recipe["train"]["micro_batch_size"] = 4 // processes
        path = write_recipe(tmp_path / f"recipe{processes}.yaml", recipe)
        if processes == 1:
            main([str(path)])
        else:
            result = accelerate_launch("fsdp2", path)
            assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
            assert "FSDP2 over 2 processes" in result.stdout
        runs[processes] = tmp_path / f"run{processes}"
    assert train_losses(runs[2]) == pytest.approx(train_losses(runs[1]), abs=1e-4)
    single, sharded = _trained_routers(runs[1]), _trained_routers(runs[2])
    bias = [name for name in single if name.endswith("e_score_correction_bias")]
    assert sorted(sharded) == sorted(single) and bias and all(single[name].abs().max() > 0.1 for name in bias)
    for name, tensor in single.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=1e-4)


def test_a_router_buffer_without_a_value_is_refused_in_one_paragraph(tmp_path):
    """The routing bias is saved from the model as it is at the save; a model built without weights (`finetune export`
    of a checkpoint step builds one) has none to save, and an adapter without it fails in PEFT's loader (KeyError):
    refused, naming lora.train_router and the fix, with nothing written."""
    from peft import LoraConfig

    from finetune.errors import CheckpointError
    from finetune.model.experts import get_peft_model, split_experts
    from finetune.outputs import adapter_key_map, save_adapter

    with torch.device("meta"):
        model = _tiny("deepseek_v3")
    split_experts(model, dtype=torch.float32, quantized=False)
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["o_proj"]), train_router=True)
    key_map = adapter_key_map(peft_model)
    state = {name: torch.zeros(param.shape) for name, param in peft_model.named_parameters() if name in key_map}
    with pytest.raises(CheckpointError, match="lora.train_router") as error:
        save_adapter(peft_model.peft_config["default"], key_map, state, tmp_path / "adapter")
    assert "e_score_correction_bias" in str(error.value) and "Fix:" in str(error.value)
    assert not (tmp_path / "adapter").exists()


def test_experts_take_the_fp32_input_a_trained_router_scales_for_bf16_weights():
    """Found with a sweep of lora.train_router: Llama 4 multiplies the experts' input by the router's scores, and a
    trained router (fp32) made that input fp32 for bf16 experts: `quantization: none` in bf16 stopped at the first
    forward ("expected m1 and m2 to have the same dtype"). The experts now compute in their weights' dtype."""
    from torch.nn import functional as F

    from finetune.model.experts.routed import ExpertMLP, ExpertNames

    torch.manual_seed(0)
    expert = ExpertMLP(ExpertNames(("gate_proj", "up_proj"), ("down_proj",)), 8, 16, F.silu, dtype=torch.bfloat16)
    x = torch.randn(3, 8)
    out = expert(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expert(x.to(torch.bfloat16)))
