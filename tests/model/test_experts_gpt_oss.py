"""gpt-oss as real QLoRA (finetune/model/experts/families/gpt_oss.py): its transposed, interleaved, biased experts split
into one biased Linear per expert projection (weights 4-bit, biases in model.dtype, LoRA on each), computing what
transformers' `GptOssExperts` computes (the clamped SwiGLU), fused back bitwise for export, and read per expert from a
bf16 checkpoint (the fused tensors) or an MXFP4 one (`*_blocks` + `*_scales`, as the hub ships gpt-oss).

Before: split_experts refused gpt-oss under 4-bit ("stored transposed"), so it trained with bf16 experts only."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import recipe_dict, train_losses
from loading_check import held_tensors
from safetensors.torch import load_file, save_file

from finetune.outputs import as_trained


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])


def _mxfp4_exact(shape, generator) -> torch.Tensor:
    """Random weights MXFP4 holds exactly (each 32-block: e2m1 values times one power of two), so that a checkpoint of
    them in MXFP4 and one in bf16 must load as the same bytes."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    grid = torch.tensor(FP4_VALUES)
    values = grid[torch.randint(0, 16, shape, generator=generator)]
    experts, width, out = shape  # blocks run along `width` (the input dimension) for each output column
    exponents = torch.randint(-6, -1, (experts, width // 32, out), generator=generator).float()
    values = values.reshape(experts, width // 32, 32, out)
    values[:, :, 0, :] = 6.0  # each block's largest magnitude is 6 x its scale: the scale is unambiguous
    return (values * torch.exp2(exponents)[:, :, None, :]).reshape(shape)


@pytest.fixture(scope="module")
def gpt_oss_checkpoints(tmp_path_factory):
    """A tiny gpt-oss saved by transformers' `save_pretrained` (bf16 fused experts, as unsloth/gpt-oss-20b-BF16 stores
    them) with random biases and MXFP4-exact expert weights large enough to reach the SwiGLU clamp, and the same model
    with its expert weights in MXFP4 blocks and scales (as openai/gpt-oss-20b stores them)."""
    from transformers import AutoModelForCausalLM

    from finetune.cli.tiny import build_tokenizer
    from finetune.model.experts.families.gpt_oss import quantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(_mxfp4_exact(tuple(experts.gate_up_proj.shape), generator) * 8)
            experts.down_proj.copy_(_mxfp4_exact(tuple(experts.down_proj.shape), generator))
            experts.gate_up_proj_bias.normal_(0, 1, generator=generator)
            experts.down_proj_bias.normal_(0, 0.1, generator=generator)
            layer.mlp.router.bias.normal_(0, 0.1, generator=generator)
    bf16 = tmp_path_factory.mktemp("gpt-oss-bf16")
    model.save_pretrained(bf16)
    build_tokenizer().save_pretrained(bf16)
    mxfp4 = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    tensors = load_file(str(bf16 / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = quantize_mxfp4(tensors.pop(key))
    save_file(tensors, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    for name in [p.name for p in bf16.iterdir() if p.suffix != ".safetensors"]:
        (mxfp4 / name).write_bytes((bf16 / name).read_bytes())
    config = json.loads((mxfp4 / "config.json").read_text())  # as openai/gpt-oss-20b's config.json says it
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(config, indent=2))
    return {"bf16": bf16, "mxfp4": mxfp4}


def _recipe(model_dir, **sections):
    from finetune.recipe import Recipe

    lora = {"r": 2, "alpha": 4, "dropout": 0.05, "target_modules": "all-linear"}
    return Recipe.model_validate(recipe_dict(model_dir, model_dir / "unused.jsonl", model_dir / "unused-run",
                                             model={"dtype": "bfloat16"}, lora=lora, **sections))


def test_split_computes_what_gpt_oss_experts_compute_and_fuses_back_bitwise(gpt_oss_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.model.experts import RoutedExperts, fuse_experts, split_experts

    model = AutoModelForCausalLM.from_pretrained(gpt_oss_checkpoints["bf16"], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reached = []  # the clamp at swiglu_limit is exercised: some gate/up pre-activations exceed it
        hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, args, out: reached.append(
            (args[0] @ m.gate_up_proj[0] + m.gate_up_proj_bias[0]).abs().max().item()))
        fused = model(input_ids=ids).logits
        hook.remove()
        assert reached[0] > model.config.swiglu_limit
        assert split_experts(model, dtype=torch.float32) == model.config.num_hidden_layers
        split = model(input_ids=ids).logits
    expert = next(m for m in model.modules() if isinstance(m, RoutedExperts))[0]
    assert [(n, tuple(p.shape)) for n, p in expert.named_parameters()] == [
        ("gate_proj.weight", (64, 64)), ("gate_proj.bias", (64,)),
        ("up_proj.weight", (64, 64)), ("up_proj.bias", (64,)),
        ("down_proj.weight", (64, 64)), ("down_proj.bias", (64,))]
    torch.testing.assert_close(split, fused, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused, torch.zeros_like(fused))

    # Fused back: transformers' own module and parameters, every tensor bitwise what the checkpoint held.
    assert fuse_experts(model) == model.config.num_hidden_layers
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    back = model.state_dict()
    assert sorted(back) == sorted(stored)
    assert [k for k in stored if not torch.equal(back[k], stored[k])] == []
    model.save_pretrained(tmp_path / "export")  # the checkpoint's own names (the fused bf16 layout)
    assert sorted(load_file(str(tmp_path / "export" / "model.safetensors"))) == \
        sorted(load_file(str(gpt_oss_checkpoints["bf16"] / "model.safetensors")))


@pytest.mark.parametrize("stored", ["bf16", "mxfp4"])
def test_experts_load_4bit_with_biases_and_lora_from_bf16_and_mxfp4_checkpoints(gpt_oss_checkpoints, stored):
    """The per-tensor loader reads each expert's weight and bias out of the fused (or MXFP4) tensors; the bytes it
    holds are those of transformers' from_pretrained of the bf16 checkpoint, split and quantized."""
    from finetune.model import base, loading

    cpu = torch.device("cpu")
    reference = base.build_model(_recipe(gpt_oss_checkpoints["bf16"]), device=cpu, gradient_checkpointing=False)
    loaded = loading.load_model(_recipe(gpt_oss_checkpoints[stored]), sharded=False, device=cpu, device_map=None,
                                gradient_checkpointing=False)
    assert loaded.builder is not None  # read tensor by tensor, not through from_pretrained
    # What `finetune plan` says one process reads (the experts as stored: bf16 values, or MXFP4 blocks + scales), and
    # each expert's slab read once for gate and up (a read per part read the fused gate_up bytes twice).
    from finetune.planner.facts import model_config_for
    from finetune.planner.fit import decide

    recipe = _recipe(gpt_oss_checkpoints[stored])
    planned = decide(recipe, model_config_for(recipe), gpus_per_node=1, gpu_memory_bytes=24 * 1024**3)
    stored_bytes = sum(t.numel() * t.element_size()
                       for t in load_file(str(gpt_oss_checkpoints[stored] / "model.safetensors")).values())
    assert loaded.bytes_read == planned.estimates[0].reads.rank_bytes == stored_bytes  # every stored tensor once
    model, config = loaded.model, reference.config
    held, expected = held_tensors(model), held_tensors(reference)
    assert sorted(held) == sorted(expected)
    assert [k for k in held if not torch.equal(held[k], expected[k])] == []

    weights = {n: p for n, p in model.named_parameters()
               if ".experts." in n and n.endswith(".weight") and ".lora_" not in n}
    biases = {n: p for n, p in model.named_parameters() if ".experts." in n and n.endswith(".bias")}
    assert len(weights) == len(biases) == config.num_hidden_layers * config.num_local_experts * 3
    assert all(type(p).__name__ == "Params4bit" for p in weights.values())
    packed_bytes = sum(p.numel() * p.element_size() for p in weights.values())  # 4 bits an element
    assert packed_bytes == config.num_hidden_layers * config.num_local_experts * 3 * 64 * 64 // 2
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in biases.values())
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    lora = [m for n, m in model.named_modules() if ".experts." in n and "default" in getattr(m, "lora_dropout", {})]
    assert len(lora) == len(weights)
    routers = [p for n, p in model.named_parameters() if ".router." in n]
    assert len(routers) == 2 * config.num_hidden_layers  # weight and bias: model.dtype, frozen
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in routers)


def test_mxfp4_checkpoint_is_refused_with_the_fix_where_from_pretrained_would_load_it(gpt_oss_checkpoints):
    """lora.dora loads through transformers' from_pretrained, which cannot dequantize MXFP4 and store NF4 in one load
    (it raised "quantized with Mxfp4Config but you are passing a BitsAndBytesConfig", blamed on the folder)."""
    from finetune.errors import ModelLoadError
    from finetune.model import loading

    recipe = _recipe(gpt_oss_checkpoints["mxfp4"])
    recipe.lora = recipe.lora.model_copy(update={"dora": True})
    with pytest.raises(ModelLoadError, match=r"stored in MXFP4.*Fix: use a bf16 checkpoint.*unsloth/gpt-oss-20b-BF16"):
        loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                           gradient_checkpointing=False)


def test_4bit_gpt_oss_learns(gpt_oss_checkpoints):
    """A few steps of LoRA on the 4-bit model read from MXFP4 (experts included) lower the loss on a fixed batch; every
    expert's LoRA moves, and so do the routers with lora.train_router (weight and bias, PEFT's modules_to_save)."""
    from finetune.model import loading

    recipe = _recipe(gpt_oss_checkpoints["mxfp4"])
    recipe.model.dtype = "float32"
    recipe.lora = recipe.lora.model_copy(update={"train_router": True})
    model = loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                               gradient_checkpointing=False).model
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    expert_lora = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n}
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".router.modules_to_save." in n}
    assert len(routers) == 2 * 2 and all(p.requires_grad for n, p in model.named_parameters() if n in routers)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    before = expert_lora | routers
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert len(moved) == len(before)


@pytest.mark.slow
def test_gpt_oss_trains_under_single_process_and_fsdp2_and_exports_both_ways(shipped_run, tiny_gpt_oss, tmp_path):
    """The library's LoRA settings on a tiny gpt-oss: a single process and FSDP2 (2 ranks, loading sharded through the
    per-expert views of the fused checkpoint) both train every expert's LoRA; the single run exports an adapter (the
    experts' LoRA on the fused parameters, which plain PEFT loads and computes what finetune's model computes) and a
    merged model that plain transformers reloads with gpt-oss's own fused experts, under the checkpoint's own tensor
    names, computing what base + adapter computes."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from finetune.cli import main
    from finetune.model.experts import load_adapter, split_experts

    runs = {config: shipped_run(config, "gpt_oss", True) for config in ("single_gpu", "fsdp2")}
    for config, (run_dir, result) in runs.items():
        assert result.returncode == 0, f"{config}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        adapter = load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))
        expert_b = [t for name, t in adapter.items() if ".experts." in name and "lora_B" in name]
        assert len(expert_b) == 2 * 4 * 3 and all(t.abs().sum() > 0 for t in expert_b), config
        losses = train_losses(run_dir)
        assert losses[-1] < losses[0], (config, losses)

    run_dir = runs["single_gpu"][0]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run_dir), str(adapter)]) == 0
    assert main(["export", str(run_dir), str(merged), "--merge"]) == 0
    verdicts = {item["runtime"].split(" ")[0]: item for item in json.loads((adapter / "runtimes.json").read_text())}
    # PEFT 0.21 has no conversion of per-expert LoRA onto gpt-oss's fused, interleaved experts, so the export writes
    # the experts' LoRA as PEFT's LoRA on the fused parameters (target_parameters; finetune/outputs/export_fused.py),
    # and plain PEFT loads it (checked below against finetune's own loader of the run's per-expert adapter).
    assert verdicts["PEFT"]["status"] == "valid", verdicts["PEFT"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config.get("target_parameters"), config
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as handle:
        assert not [k for k in handle.keys() if ".experts.3." in k]  # noqa: SIM118 (not a dict)
    with safe_open(str(merged / "model.safetensors"), "pt") as handle, \
            safe_open(str(tiny_gpt_oss / "model.safetensors"), "pt") as base_handle:
        assert sorted(handle.keys()) == sorted(base_handle.keys())
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    ours = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, dtype=torch.float32)
    split_experts(ours, dtype=torch.float32, quantized=False)
    with torch.no_grad():
        reference = load_adapter(ours, run_dir / "adapter")(input_ids=ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
        assert type(reloaded.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
        got = reloaded(input_ids=ids).logits
        stock = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, dtype=torch.float32)
        plain = PeftModel.from_pretrained(stock, str(adapter)).eval()(input_ids=ids).logits
    assert (plain - reference).abs().max() <= 1e-4 * reference.abs().max(), (plain - reference).abs().max()
    assert (got - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16 rounding of the merged weights
