"""model.adapter: a run starts from everything the adapter holds, through every loader, and its LoRA layout is the
adapter's (finetune/model/lora/adapter.py, init.py, materialize.py).

The oracle is plain PEFT: `PeftModel.from_pretrained` of the same adapter on an independently loaded base (the same
4-bit settings, bitsandbytes' CPU repack off as finetune turns it off) gives the logits the started model must give,
bitwise. The adapters are written by PEFT itself (`save_pretrained`) with every trainable tensor moved off its
initial value, as training leaves them; a MoE router adapter is written as a run writes it (outputs.save_adapter)
and read back by PEFT's `set_peft_model_state_dict` (experts.load_adapter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.errors import RecipeError
from finetune.model import base as model_stage
from finetune.model import loading
from finetune.recipe import Recipe, validate_recipe

CPU = torch.device("cpu")
IDS = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))


def _base(model_dir: Path, quantization: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=bnb if quantization == "nf4" else None)
    model_stage.keep_4bit_weights_trainable_on_cpu(model)
    return model


def _moved(model: torch.nn.Module, seed: int = 0) -> None:
    """Every trainable tensor away from its start, as training leaves it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.05)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def _peft_adapter(model_dir: Path, folder: Path, quantization: str, **config) -> torch.Tensor:
    """A PEFT adapter of `config` (r 4, alpha 8, all-linear) written to `folder`; returns PEFT's logits of it, reloaded
    by `PeftModel.from_pretrained` on a fresh base (the oracle)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    peft_model = get_peft_model(_base(model_dir, quantization),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **config))
    _moved(peft_model)
    peft_model.save_pretrained(folder)
    return _logits(PeftModel.from_pretrained(_base(model_dir, quantization), folder))


def _recipe(model_dir: Path, adapter: Path | None, quantization: str, **lora) -> Recipe:
    model = {"name_or_path": str(model_dir), "dtype": "float32", **({"adapter": str(adapter)} if adapter else {})}
    return validate_recipe({"model": model, "quantization": {"method": quantization}, "lora": {"dropout": 0.0, **lora},
                            "data": {"datasets": [{"path": "unused.jsonl"}]}})


def _started(recipe: Recipe, route: str) -> torch.nn.Module:
    """The model a run builds: `load_model` as run.py calls it (the per-tensor reader of single process / DDP; the
    FSDP skeleton built unit by unit as the wrap builds it), or transformers' from_pretrained + attach_lora."""
    model_stage.load_config(recipe)  # as the run: the recipe's lora section resolved before anything loads
    if route == "from_pretrained":
        return model_stage.build_model(recipe, device=CPU, gradient_checkpointing=False)
    loaded = loading.load_model(recipe, sharded=route == "sharded", device=CPU, device_map=None,
                                gradient_checkpointing=False)
    if loaded.materialize is not None:
        loading._whole_model(loaded.model, loaded.builder)
    return loaded.model


@pytest.fixture(scope="module")
def bias_adapters(tiny_qwen2, tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("bias-adapters")
    return {bias: (root / bias, _peft_adapter(tiny_qwen2, root / bias, "nf4", bias=bias)) for bias in ("all", "lora_only")}


@pytest.mark.parametrize("bias,route", [("all", "per_tensor"), ("all", "sharded"), ("all", "from_pretrained"),
                                        ("lora_only", "per_tensor")])
def test_a_bias_adapter_starts_from_its_trained_biases(bias, route, bias_adapters, tiny_qwen2):
    """Found by a bug bash: a run started from the adapter of a `lora.bias: all` / `lora_only` run copied only its
    `.lora_*` tensors and kept the base's biases (every loader: the per-tensor reader, the FSDP skeleton, attach_lora),
    so it did not start from the trained model (1.46 logits from PEFT's reload) and its own adapter saved the base's
    biases. Now every trained bias comes from the adapter: PEFT's logits, bitwise, on a 4-bit base."""
    folder, expected = bias_adapters[bias]
    recipe = _recipe(tiny_qwen2, folder, "nf4")
    started = _started(recipe, route)
    assert torch.equal(_logits(started), expected)
    assert recipe.lora.bias == bias  # the adapter's layout (the recipe left the default)


def test_the_dpo_reference_of_a_bias_adapter_is_the_adapter(bias_adapters, tiny_qwen2):
    """Found by a bug bash: from a `lora.bias: all` SFT adapter, DPO's reference (base + the starting adapter, its
    trainable values swapped in) had the base's biases. Now, after the policy moved, the reference pass computes
    PEFT's reload of the adapter, bitwise."""
    from finetune.training.objectives.preference import Reference

    folder, expected = bias_adapters["all"]
    recipe = _recipe(tiny_qwen2, folder, "nf4")
    policy = _started(recipe, "per_tensor")
    reference = Reference(policy, recipe, compared=True)
    _moved(policy, seed=7)  # training moves every trainable tensor, the biases too
    assert not torch.equal(_logits(policy), expected)
    with reference.active(policy):
        assert torch.equal(_logits(policy), expected)


@pytest.mark.parametrize("lora", [{"bias": "all"}, {"bias": "lora_only"},
                                  pytest.param({"train_router": True}, marks=pytest.mark.slow)],  # (a MoE load: ~10 s)
                         ids=["bias-all", "bias-lora-only", "train-router"])
def test_a_fresh_adapters_reference_keeps_the_bases_biases_and_routers(lora, tiny_qwen2, tiny_qwen3_moe):
    """Found by a bug bash (bb49 #1): with a fresh adapter, DPO / KTO / GRPO's reference (adapter_off) only flipped
    PEFT's LoRA switch, which leaves trained biases (lora.bias) and trained router copies (lora.train_router) on: from
    step 2 the reference was no longer the base (dpo.reference: precomputed gave other losses). Now the starting values
    are swapped in: the reference pass computes the base model's logits, bitwise, after the policy moved."""
    from finetune.training.objectives.preference import Reference

    recipe = _recipe(tiny_qwen3_moe if "train_router" in lora else tiny_qwen2, None, "none", **lora)
    policy = _started(recipe, "per_tensor")
    base = _logits(policy)  # B = 0, biases and routers as loaded: the base model
    reference = Reference(policy, recipe, compared=True)
    _moved(policy, seed=7)
    assert not torch.equal(_logits(policy), base)
    with reference.active(policy):
        assert torch.equal(_logits(policy), base)
    assert not torch.equal(_logits(policy), base)  # the trained values are back


@pytest.mark.parametrize("said", [False, True])
def test_a_dora_adapter_starts_from_its_magnitudes(said, tiny_qwen2, tmp_path):
    """Found by a bug bash: a DoRA adapter as model.adapter was refused with "tensor ...lora_magnitude_vector.weight is
    missing: the adapter was not trained for this base model" (PEFT saves the magnitudes without `.weight`), so no run
    could continue a DoRA adapter or DPO from one. Now the run starts from its magnitudes, A and B: PEFT's logits,
    whether the recipe says lora.dora: true or leaves it to the adapter."""
    expected = _peft_adapter(tiny_qwen2, tmp_path / "dora", "none", use_dora=True)
    recipe = _recipe(tiny_qwen2, tmp_path / "dora", "none", **({"dora": True} if said else {}))
    started = _started(recipe, "per_tensor")
    assert recipe.lora.dora  # so the plan takes DoRA's loader (magnitudes from full weights) as for any DoRA run
    assert torch.equal(_logits(started), expected)


@pytest.fixture(scope="module")
def router_adapter(tiny_qwen3_moe, tmp_path_factory) -> tuple[Path, torch.Tensor, dict]:
    """A lora.train_router run's adapter, written as the run writes it, and PEFT's logits of it on a fresh base."""
    from safetensors.torch import load_file

    from finetune.model.experts import load_adapter
    from finetune.outputs.adapter_files import adapter_key_map, save_adapter

    trained = model_stage.build_model(_recipe(tiny_qwen3_moe, None, "none", r=4, alpha=8, train_router=True),
                                      device=CPU, gradient_checkpointing=False)
    _moved(trained)
    folder = tmp_path_factory.mktemp("router") / "adapter"
    save_adapter(trained.peft_config["default"], adapter_key_map(trained), dict(trained.named_parameters()), folder)
    oracle = load_adapter(model_stage.load_base_model(_recipe(tiny_qwen3_moe, None, "none"), device=CPU), folder)
    return folder, _logits(oracle), load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("route", ["per_tensor", "sharded", "from_pretrained"])
def test_a_router_adapter_starts_from_its_trained_routers(route, router_adapter, tiny_qwen3_moe):
    """Found by a bug bash: a run started from a `lora.train_router: true` adapter built the routers' trainable copies
    (modules_to_save) from the base checkpoint, not from the trained routers the adapter holds (0.046 logits from
    PEFT's reload). Now each copy is the adapter's router, and the logits are PEFT's, bitwise."""
    folder, expected, saved = router_adapter
    started = _started(_recipe(tiny_qwen3_moe, folder, "none"), route)
    copies = {name: param for name, param in started.named_parameters() if ".modules_to_save." in name}
    assert len(copies) == 2 and all(param.requires_grad for param in copies.values())
    for name, param in copies.items():
        key = "base_model.model." + name.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
        assert torch.equal(param, saved[key])
    assert torch.equal(_logits(started), expected)


@pytest.fixture(scope="module")
def plain_adapter(tiny_qwen2, tmp_path_factory) -> Path:
    """A plain r 8 / alpha 16 all-linear adapter's folder (its config only is read by these checks)."""
    from peft import LoraConfig, get_peft_model

    folder = tmp_path_factory.mktemp("plain") / "adapter"
    get_peft_model(_base(tiny_qwen2, "none"), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
                   ).save_pretrained(folder)
    return folder


def test_recipe_lora_keys_that_differ_from_the_adapter_are_refused_before_weights_load(plain_adapter, tiny_qwen2):
    """Found by a bug bash: with model.adapter, the recipe's lora.r, dora, rslora and bias were ignored without a word
    (`dora: true` trained plain LoRA; the adapter_config.json said r 8, no DoRA). Now a value the recipe sets that
    differs from the adapter's is refused in one paragraph naming both and the fix, by the config check that
    `finetune validate` and the run make before any weight loads."""
    recipe = _recipe(tiny_qwen2, plain_adapter, "nf4", r=4, dora=True, rslora=True, bias="all", alpha=16)
    with pytest.raises(RecipeError) as refused:
        model_stage.load_config(recipe)
    message = str(refused.value)
    assert "lora.r 4, lora.rslora true, lora.dora true, lora.bias all differ" in message, message
    assert "(lora.r 8, lora.rslora false, lora.dora false, lora.bias none)" in message
    assert "Fix: remove lora.r and lora.rslora and lora.dora and lora.bias from the recipe" in message
    assert "lora.alpha" not in message  # set to the adapter's own value: no conflict
    router = _recipe(tiny_qwen2, plain_adapter, "nf4", train_router=True)
    with pytest.raises(RecipeError, match=r"lora.train_router true differs .* \(lora.train_router false\)"):
        model_stage.load_config(router)


def test_lora_keys_left_at_their_defaults_take_the_adapters_and_the_resolved_recipe_reloads(plain_adapter, tiny_qwen2,
                                                                                           capsys):
    """Found by a bug bash: the run's recipe.yaml said r 16 / alpha 32 (the defaults) while it trained the adapter's r 8
    / alpha 16, silently. Now keys left at their defaults take the adapter's values, with a note; the resolved recipe
    (the run's recipe.yaml, read by resume and export) says them and loads again without a conflict."""
    import yaml

    from finetune.recipe import recipe_to_yaml

    recipe = _recipe(tiny_qwen2, plain_adapter, "nf4")
    model_stage.load_config(recipe)
    assert (recipe.lora.r, recipe.lora.alpha, recipe.lora.dora, recipe.lora.bias) == (8, 16.0, False, "none")
    assert "note: model.adapter: its LoRA layout is used" in capsys.readouterr().err
    again = validate_recipe(yaml.safe_load(recipe_to_yaml(recipe)))  # the run folder's recipe.yaml, read back
    model_stage.load_config(again)
    assert again.lora == recipe.lora
    assert "LoRA layout" not in capsys.readouterr().err  # nothing left to resolve, nothing said


def test_a_run_started_from_an_adapter_before_the_layout_was_filled_still_resumes(plain_adapter, tiny_qwen2):
    """A checkpoint of a run started from model.adapter before its lora keys were filled from the adapter saved the
    schema's defaults (r 16, alpha 32) while it trained the adapter's r 8 / alpha 16: its resume would have been refused
    as a changed layout. The saved defaults read as the adapter's; a layout the recipe really changed still differs."""
    from finetune.outputs.resume_checks import _adapter_layout_as_resolved, differences

    old = _recipe(tiny_qwen2, plain_adapter, "nf4").model_dump(mode="json")  # what such a run's recipe.yaml held
    recipe = _recipe(tiny_qwen2, plain_adapter, "nf4")
    model_stage.load_config(recipe)  # resolved: r 8, alpha 16
    current = recipe.model_dump(mode="json")
    assert {key for key, _, _ in differences(old, current) if key.startswith("lora.")} == \
        {"lora.r", "lora.alpha", "lora.target_modules"}
    _adapter_layout_as_resolved(old, current)
    assert not [key for key, _, _ in differences(old, current) if key.startswith("lora.")]
    elsewhere = _recipe(tiny_qwen2, None, "nf4").model_dump(mode="json")  # no adapter: its defaults are its layout
    _adapter_layout_as_resolved(elsewhere, current)
    assert elsewhere["lora"]["r"] == 16


@pytest.mark.parametrize("targets,refused", [(["q_proj", "v_proj"], True),
                                             (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], False)])
def test_a_target_list_other_than_the_adapters_is_refused_before_weights_load(targets, refused, plain_adapter,
                                                                              tiny_qwen2):
    """Found by a bug bash: with model.adapter, lora.target_modules was ignored without a word (the run trained the
    adapter's all-linear targets while the recipe said [q_proj]). Now a list that selects other modules than the
    adapter's is refused by `check_lora_targets` (what `finetune validate` and the run call before any weight loads);
    the same modules under their short names pass, and all-linear (the default) means the adapter's own."""
    recipe = _recipe(tiny_qwen2, plain_adapter, "nf4", target_modules=targets)
    config = model_stage.load_config(recipe)
    if not refused:
        loading.check_lora_targets(recipe, config)
        return
    with pytest.raises(RecipeError) as error:
        loading.check_lora_targets(recipe, config)
    message = str(error.value)
    assert "lora.target_modules ['q_proj', 'v_proj'] selects other modules than model.adapter's" in message
    assert "10 only by the adapter's (e.g. model.layers.0.mlp.down_proj" in message, message
    assert "Fix: remove lora.target_modules from the recipe" in message


@pytest.mark.parametrize("target,kind", [("self_attn", "Qwen2Attention"), ("model.norm", "Qwen2RMSNorm")])
def test_a_target_that_takes_no_lora_is_refused_before_weights_load(target, kind, tiny_qwen2):
    """Found by a bug bash: `target_modules: [self_attn]` or `[model.norm]` passed `finetune validate` and the run
    ended in PEFT's traceback ("Target module Qwen2Attention(...) is not supported", a whole module dump). Now the
    pre-flight check names the module's type, the Linear layers to use instead and the fix."""
    recipe = _recipe(tiny_qwen2, None, "nf4", target_modules=[target, "q_proj"])
    with pytest.raises(RecipeError) as error:
        loading.check_lora_targets(recipe, model_stage.load_config(recipe))
    message = str(error.value)
    assert f"lora.target_modules: `{target}` ({kind}) names modules that take no LoRA" in message, message
    assert "Its Linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj." in message
    assert "Fix: name the Linear layers, or use `all-linear`." in message


@pytest.mark.parametrize("targets,said", [([], "an empty list puts LoRA on no module"),
                                          (["all-linear"], "write it without brackets")])
def test_an_empty_target_list_is_refused_by_the_schema(targets, said):
    """Found by a bug bash: `target_modules: []` passed `finetune validate` and the run ended in PEFT's
    NoMatchingPeftModuleError traceback; `[all-linear]` was told to "use `all-linear`". Now the schema says why."""
    with pytest.raises(RecipeError, match=f"lora.target_modules: .*{said}"):
        validate_recipe({"model": {"name_or_path": "unused"}, "lora": {"target_modules": targets},
                         "data": {"datasets": [{"path": "unused.jsonl"}]}})


def test_a_grpo_vllm_run_from_an_adapter_vllm_cannot_serve_is_refused(bias_adapters, tiny_qwen2):
    """Found by the fixer of the adapter start: grpo.generation vllm's check (no DoRA, bias or trained routers: vLLM
    serves none) read the recipe's lora keys before model.adapter filled them, so a bias adapter with lora.bias left at
    its default passed it and would have been served without its biases."""
    folder, _ = bias_adapters["all"]
    raw = _recipe(tiny_qwen2, folder, "nf4").model_dump(mode="json", exclude_defaults=True)
    raw["data"]["datasets"][0]["format"] = "prompt"
    raw["train"] = {"objective": "grpo", "micro_batch_size": 2}
    raw["grpo"] = {"generation": "vllm", "vllm_server_base_url": "http://127.0.0.1:9", "num_generations": 2,
                   "max_completion_length": 16, "reward_functions": ["finetune.rewards:exact_match"]}
    recipe = validate_recipe(raw)
    with pytest.raises(RecipeError, match=r"lora.bias none -> all\) is one vLLM cannot serve .*lora.bias: vLLM loads"):
        model_stage.load_config(recipe)
