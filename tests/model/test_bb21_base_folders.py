"""Base models brought as local folders (bug bash bb21): quantized checkpoints finetune does not read, tied heads
stored apart, a stale index beside model.safetensors, 4-bit checkpoints with unquantized modules, and the load errors'
fixes. The oracle is plain transformers: `AutoModelForCausalLM.from_pretrained(folder, quantization_config=<the
recipe's BitsAndBytesConfig>)` (on the CPU with finetune's `keep_4bit_weights_trainable_on_cpu`, so that both use the
same bitsandbytes kernel); LoRA B starts at zero, so finetune's PeftModel gives its base's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("private_cache")

IDS = torch.tensor([[1, 5, 9, 33, 70, 100, 200, 300, 12, 7]])


def _recipe(name_or_path, *, dtype: str = "float32", quantization: dict | None = None, **model):
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": str(name_or_path), "dtype": dtype, **model},
                                  "lora": {"r": 2, "alpha": 4}, "quantization": quantization or {},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def _copy(source: Path, target: Path, **config) -> Path:
    shutil.copytree(source, target)
    if config:
        values = json.loads((target / "config.json").read_text())
        values.update(config)
        (target / "config.json").write_text(json.dumps(values, indent=2))
    return target


def _finetune_logits(recipe) -> torch.Tensor:
    from finetune.model import load_config, loading

    load_config(recipe)  # resolves attn_implementation: auto, as a run does first
    loaded = loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                                gradient_checkpointing=False)
    with torch.no_grad():
        return loaded.model.eval()(input_ids=IDS).logits.float()


def _transformers_logits(recipe) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from finetune.model.base import keep_4bit_weights_trainable_on_cpu
    from finetune.model.settings import quantization_config, torch_dtype

    model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=torch_dtype(recipe.model.dtype),
                                                 quantization_config=quantization_config(recipe)).eval()
    keep_4bit_weights_trainable_on_cpu(model)
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


# ------------------------------------------------------------------------- 1, 5: quantizations finetune does not read
def _fp8_folder(tiny_llama: Path, target: Path) -> Path:
    """As DeepSeek-V3 / Qwen3-FP8 store their weights: float8_e4m3fn values + a `weight_scale_inv` per block."""
    folder = _copy(tiny_llama, target, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                            "activation_scheme": "dynamic",
                                                            "weight_block_size": [128, 128]})
    state = load_file(str(folder / "model.safetensors"))
    for key in [k for k in state if ".layers." in k and k.endswith("proj.weight")]:
        scale = state[key].abs().max() / 448.0
        state[key] = (state[key] / scale).to(torch.float8_e4m3fn)
        state[key.removesuffix("weight") + "weight_scale_inv"] = scale.reshape(1, 1).float()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


QUANTIZATIONS = {
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32},
    "bnb-8bit": {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
                 "bnb_4bit_quant_type": "fp4"},
}


@pytest.mark.parametrize("method", ["fp8", *QUANTIZATIONS])
def test_quantized_checkpoints_finetune_does_not_read_are_refused_by_validate_and_load(tiny_llama, tmp_path, method):
    """Found by a bug bash: an fp8 checkpoint (or compressed-tensors float-quantized) was trained on its float8 values
    cast to bf16 without their scales (q_proj max|w| 448 where the weight's is 0.08), with no word from validate,
    train, quantize or export; every quant_method but bitsandbytes counted as "unquantized". An 8-bit bitsandbytes
    checkpoint was called "a 4-bit checkpoint" whose fix (set quantization.method: fp4) failed the same way again."""
    from finetune.errors import ModelLoadError
    from finetune.model.quantization import prequantized

    if method == "fp8":
        folder = _fp8_folder(tiny_llama, tmp_path / method)
    else:
        folder = _copy(tiny_llama, tmp_path / method, quantization_config=QUANTIZATIONS[method])
    recipe = _recipe(folder, quantization={"method": "fp4", "double_quant": False})
    with pytest.raises(ModelLoadError) as validated:
        prequantized.check_local_checkpoint(recipe)  # what `finetune validate` asks
    with pytest.raises(ModelLoadError) as loaded:
        _finetune_logits(recipe)
    with pytest.raises(ModelLoadError):  # `finetune quantize`, the quantized cache, the export's base check
        prequantized.stored_quantization(folder)
    for text in (str(validated.value), str(loaded.value)):
        assert f"model.name_or_path `{folder}`" in text and "16-bit (bf16) checkpoint" in text
        if method == "bnb-8bit":
            assert "8-bit" in text and "4-bit checkpoint" not in text and "quantization.method" not in text
        else:
            assert f"quant_method: {method}" in text and "does not read" in text
    assert "FineGrainedFP8Config(dequantize=True)" in str(loaded.value) or method != "fp8"


def test_validate_refuses_a_hub_ids_fp8_config_from_the_hub_cache(tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: `finetune validate` said nothing of an fp8 checkpoint; for a hub id it reads the config.json
    the hub cache holds (no download, no network) as it reads a folder's."""
    import huggingface_hub.constants

    from finetune.errors import ModelLoadError
    from finetune.model.quantization import prequantized

    repo = tmp_path / "hub" / "models--someone--Model-FP8"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = _copy(tiny_llama, repo / "snapshots" / ("0" * 40), quantization_config={"quant_method": "fp8"})
    assert (snapshot / "config.json").is_file()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="model.name_or_path `someone/Model-FP8`: config.json says"):
        prequantized.check_local_checkpoint(_recipe("someone/Model-FP8"))


# --------------------------------------------------------------------------------- 2: a tied head stored apart
@pytest.fixture
def tied_apart(tiny_llama, tmp_path) -> Path:
    """tiny_llama (its own lm_head.weight, other than the embeddings) with tie_word_embeddings: true in config.json."""
    folder = _copy(tiny_llama, tmp_path / "tied", tie_word_embeddings=True)
    state = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return folder


@pytest.mark.parametrize("quantized_cache", ["off", "auto"])
def test_a_tied_config_with_its_own_stored_head_loads_untied_as_transformers_does(tied_apart, quantized_cache, capsys):
    """Found by a bug bash: config.json saying tie_word_embeddings: true while the checkpoint stores its own, other
    lm_head.weight: transformers loads both apart ("we will NOT tie them"); finetune's per-tensor loaders used the
    embeddings as the head and never read lm_head.weight (logits off by 1.42 of 0.63), so the run trained another
    base than export and generate load. With model.quantized_cache: auto the cache (written from the tied model)
    would drop the head too: it is not used for such a base."""
    recipe = _recipe(tied_apart, quantized_cache=quantized_cache)
    assert torch.equal(_finetune_logits(recipe), _transformers_logits(recipe))
    assert "lm_head.weight is loaded from its own tensor, untied" in capsys.readouterr().out


def test_finetune_quantize_writes_a_head_stored_apart_under_a_tied_config(tied_apart, tmp_path):
    """Found by a bug bash (bb21 #2, `finetune quantize`): the writer built a tied skeleton, so the 4-bit folder of a
    base whose config ties the head while its files store another one had no lm_head.weight: loaded, it was tied to
    the embeddings again, another model than the base. It is written apart, as the loader now loads it."""
    from finetune.cli import main

    out = tmp_path / "q4"
    assert main(["quantize", str(tied_apart), str(out), "--dtype", "float32"]) == 0
    written = {}
    for path in out.glob("*.safetensors"):
        written.update(load_file(str(path)))
    stored = load_file(str(tied_apart / "model.safetensors"))["lm_head.weight"]
    assert "lm_head.weight" in written and torch.equal(written["lm_head.weight"].to(stored.dtype), stored)


def test_a_tied_head_stored_twice_with_equal_values_stays_tied(tied_apart):
    """As transformers: both names stored with equal values (a .bin conversion writes both) is no reason to untie."""
    from finetune.model import load_config, loading

    state = load_file(str(tied_apart / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tied_apart / "model.safetensors"), metadata={"format": "pt"})
    recipe = _recipe(tied_apart)
    skeleton = loading.build_skeleton(recipe, load_config(recipe), gradient_checkpointing=False)
    assert loading.untie_stored_apart(skeleton, loading.checkpoint_index(tied_apart)) == []
    assert skeleton.base_model.model.lm_head.weight is skeleton.base_model.model.model.embed_tokens.weight


# ---------------------------------------------------------------------- 3: model.safetensors beside an index
def _with_tokenizer(folder: Path, model_dir: Path) -> Path:
    for side in model_dir.glob("tokenizer*"):
        shutil.copy2(side, folder / side.name)
    return folder


def test_model_safetensors_wins_over_the_index_a_resave_leaves_behind(tiny_llama, tmp_path):
    """Found by a bug bash: a folder holding both model.safetensors and model.safetensors.index.json (transformers'
    own save_pretrained leaves one: a sharded save, then a single-file save into the same folder deletes the shards,
    not their index) was read through the index and refused, by validate and train, with "download the missing
    shard": nothing is missing. transformers reads the single file."""
    from transformers import AutoModelForCausalLM

    from finetune.model.quantization import prequantized

    resaved = tmp_path / "resaved"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.save_pretrained(resaved, max_shard_size="50KB")
    model.save_pretrained(resaved)
    assert (resaved / "model.safetensors.index.json").is_file()
    recipe = _recipe(_with_tokenizer(resaved, tiny_llama))
    prequantized.check_local_checkpoint(recipe)  # `finetune validate`: no "missing shard"
    assert torch.equal(_finetune_logits(recipe), _transformers_logits(recipe))


def test_model_safetensors_wins_over_stale_shards_beside_it(tiny_llama, tmp_path):
    """Found by a bug bash: with the old shards and their index still beside model.safetensors, finetune trained on
    the shards' weights (logits off by 0.95 of 1.47), transformers (export, generate) loads the single file."""
    from finetune.model.sources.files import SINGLE_FILE, checkpoint_index

    stale = tmp_path / "stale"
    shutil.copytree(tiny_llama, stale)
    state = load_file(str(tiny_llama / SINGLE_FILE))
    names = sorted(state)
    for number, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        save_file({name: state[name] for name in part}, str(stale / f"model-0000{number}-of-00002.safetensors"))
    (stale / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: f"model-0000{1 + (name not in names[: len(names) // 2])}-of-00002.safetensors" for name in names}}))
    save_file({key: value * 1.5 for key, value in state.items()}, str(stale / SINGLE_FILE), metadata={"format": "pt"})
    assert set(checkpoint_index(stale).files.values()) == {stale / SINGLE_FILE}
    assert torch.equal(_finetune_logits(_recipe(stale)), _transformers_logits(_recipe(stale)))


# ------------------------------------------------------------------ 4: a 4-bit checkpoint with unquantized modules
@pytest.fixture
def bnb4_skip(tiny_llama, tmp_path) -> Path:
    """transformers' bnb-4bit save of tiny_llama with llm_int8_skip_modules (lm_head and down_proj kept in bf16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["lm_head", "down_proj"])
    folder = tmp_path / "bnb4-skip"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16, quantization_config=config
                                         ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)
    return folder


def test_a_4bit_checkpoint_with_llm_int8_skip_modules_loads_as_transformers_reloads_it(bnb4_skip):
    """Found by a bug bash: a transformers bnb-4bit save with llm_int8_skip_modules (Unsloth's "dynamic" 4-bit
    repositories) passed validate, then train refused it ("does not match the model's config.json ... 8192 packed
    bytes ([64, 128] uint8)": a bf16 [64, 128] weight, and the config.json was the right one): the skeleton was
    built from the recipe's BitsAndBytesConfig, which quantizes the modules the checkpoint keeps in bf16."""
    from finetune.model.quantization import prequantized

    recipe = _recipe(bnb4_skip, dtype="bfloat16")
    assert prequantized.check_local_checkpoint(recipe) is True  # validate: a 4-bit checkpoint as the recipe says
    assert torch.equal(_finetune_logits(recipe), _transformers_logits(recipe))


def test_a_weight_stored_unquantized_in_a_4bit_checkpoint_is_described_as_it_is(bnb4_skip):
    """Found by a bug bash: a bf16 [64, 128] weight in a 4-bit checkpoint was described as "8192 packed bytes
    ([64, 128] uint8)" (the byte count from config.json's storage dtype, not the file's)."""
    from finetune.errors import ModelLoadError

    values = json.loads((bnb4_skip / "config.json").read_text())
    values["quantization_config"]["llm_int8_skip_modules"] = ["lm_head"]  # down_proj is stored bf16 all the same
    (bnb4_skip / "config.json").write_text(json.dumps(values))
    with pytest.raises(ModelLoadError) as error:
        _finetune_logits(_recipe(bnb4_skip, dtype="bfloat16"))
    text = str(error.value)
    assert "model.layers.0.mlp.down_proj.weight in model.safetensors: stored unquantized ([64, 128] bfloat16)" in text
    assert "llm_int8_skip_modules" in text and "packed bytes" not in text


# --------------------------------------------------------------------------- 6: load errors name the fixing key
def test_local_folder_load_errors_name_the_recipe_key_that_fixes_them(tiny_llama, tmp_path):
    """Found by a bug bash: every local-folder load error ended in "check that X is a saved transformers folder":
    no tokenizer files (model.tokenizer fixes it), custom code (model.trust_remote_code), a PEFT adapter folder or a
    run folder given as the base (model.adapter, or export --merge); and validate passed a folder with config.json
    and no weights, which train then refused."""
    from finetune.errors import ModelLoadError
    from finetune.model import base as model_base
    from finetune.model.quantization import prequantized

    no_tokenizer = _copy(tiny_llama, tmp_path / "no-tokenizer")
    for path in no_tokenizer.glob("tokenizer*"):
        path.unlink()
    with pytest.raises(ModelLoadError, match="Set model.tokenizer to the folder or hub id"):
        model_base.load_tokenizer(_recipe(no_tokenizer))

    custom = _copy(tiny_llama, tmp_path / "custom-code", model_type="custom_llama_bb21",
                   auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                             "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (custom / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom_llama_bb21'\n")
    with pytest.raises(ModelLoadError, match="Set model.trust_remote_code: true"):
        model_base.load_config(_recipe(custom))

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_llama),
                                                                      "peft_type": "LORA"}))
    for given in (run, run / "adapter"):
        with pytest.raises(ModelLoadError) as error:
            model_base.load_config(_recipe(given))
        text = str(error.value)
        assert f"model.name_or_path to its base ({tiny_llama})" in text and f"model.adapter: {run / 'adapter'}" in text
        assert f"finetune export --merge {given} OUT" in text

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy2(tiny_llama / "config.json", config_only / "config.json")
    with pytest.raises(ModelLoadError, match="the folder holds no model weights") as validated:
        prequantized.check_local_checkpoint(_recipe(config_only))  # `finetune validate`
    with pytest.raises(ModelLoadError) as loaded:
        _finetune_logits(_recipe(config_only, tokenizer=str(tiny_llama)))
    assert str(loaded.value) == str(validated.value)


def test_packed_weights_without_a_quantization_config_get_the_16bit_fix(tiny_llama, tmp_path):
    """Found by a bug bash: GPTQ-style packed tensors (`qweight`, `scales`) whose config.json names no quantization
    were refused as "use the config.json that came with these weights", which no config.json fixes; float8 weights
    without their config were cast to bf16 as if they were the weights."""
    from finetune.errors import ModelLoadError
    from finetune.model import load_config, loading

    folder = _fp8_folder(tiny_llama, tmp_path / "fp8-no-config")
    values = json.loads((folder / "config.json").read_text())
    values.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(values))
    recipe = _recipe(folder)
    skeleton = loading.build_skeleton(recipe, load_config(recipe), gradient_checkpointing=False)
    with pytest.raises(ModelLoadError) as error:
        loading.check_checkpoint(skeleton, loading.checkpoint_index(folder))
    text = str(error.value)
    assert "stored as float8_e4m3fn" in text and "weight_scale_inv and" in text and "16-bit (bf16) checkpoint" in text
    assert "came with these weights" not in text


# ------------------------------------------------------------------------------ 7: export of a custom-code run
def test_the_exports_meta_model_of_a_custom_code_base_is_built_without_a_prompt(tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: `finetune export` of a run trained with model.trust_remote_code: true built its meta model
    (the MoE check) without trust_remote_code: transformers asked "Do you wish to run the custom code? [y/N]" on stdin,
    then failed with a traceback."""
    from transformers import AutoConfig

    from finetune.errors import ModelLoadError
    from finetune.outputs import export_experts

    def custom_folder(model_type: str) -> Path:
        folder = _copy(tiny_llama, tmp_path / model_type, model_type=model_type, architectures=["CustomForCausalLM"],
                       auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                 "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
        (folder / "configuration_custom.py").write_text(
            f"from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = '{model_type}'\n")
        (folder / "modeling_custom.py").write_text(
            "from transformers import LlamaForCausalLM\nfrom .configuration_custom import CustomConfig\n"
            "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
        return folder

    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("asked on stdin"))
    config = AutoConfig.from_pretrained(custom_folder("custom_llama_bb21x"), trust_remote_code=True)  # as the run's
    assert export_experts.is_moe(config) is False
    assert type(export_experts.split_meta_model(config)).__name__ == "CustomForCausalLM"
    # Without the opt-in (a new model type: transformers remembers a class it has built once): the fix, no prompt.
    config = AutoConfig.from_pretrained(custom_folder("custom_llama_bb21y"), trust_remote_code=True)
    with pytest.raises(ModelLoadError, match="model.trust_remote_code: true"):
        export_experts.split_meta_model(config, trust_remote_code=False)


@pytest.mark.slow
def test_export_of_a_run_trained_with_trust_remote_code_builds_its_base_without_a_prompt(tiny_llama, tmp_path):
    """Found by a bug bash: `finetune export` of a run trained with model.trust_remote_code: true asked "Do you wish to
    run the custom code? [y/N]" on stdin, then failed with a traceback (the MoE check built the base without the
    recipe's opt-in). Trained and exported as the user runs them (two processes; transformers' module cache for the
    base's code in tmp_path)."""
    import subprocess
    import sys

    from conftest import addition_rows, child_env, recipe_dict, write_jsonl, write_recipe

    folder = _copy(tiny_llama, tmp_path / "custom", model_type="custom_llama_bb21e", architectures=["CustomForCausalLM"],
                   auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                             "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (folder / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom_llama_bb21e'\n")
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_custom import CustomConfig\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(folder, data, run, model={"trust_remote_code": True},
                                                           train={"max_steps": 2, "gradient_checkpointing": False}))
    env = child_env(HF_MODULES_CACHE=str(tmp_path / "modules"), FINETUNE_CACHE=str(tmp_path / "cache"))

    def finetune(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "finetune", *args], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300, check=False)

    trained = finetune("train", str(recipe))
    assert trained.returncode == 0, trained.stderr[-2000:]
    exported = finetune("export", str(run), str(tmp_path / "adapter"))
    assert "Do you wish to run the custom code" not in exported.stdout + exported.stderr
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    merged = finetune("export", str(run), str(tmp_path / "merged"), "--merge")  # the merge reloads the saved folder
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert (tmp_path / "merged" / "modeling_custom.py").is_file()


def test_the_vllm_servers_weight_names_read_model_safetensors_before_a_leftover_index(tmp_path):
    """Found by a bug bash (bb21 #3, the vLLM side): the GRPO vLLM server's check of a base's tensor names read a
    leftover index first (names of deleted or stale shards), where transformers and vLLM read model.safetensors."""
    import json

    import torch
    from safetensors.torch import save_file

    from finetune.training.objectives.grpo.vllm_server import _weight_names

    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model-00001-of-00001.safetensors"))  # a stale shard beside it
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.mlp.experts.0.up_proj.weight": "model-00001-of-00001.safetensors"}}))
    assert _weight_names(tmp_path) == ["model.layers.0.mlp.up_proj.weight"]


def test_a_hub_base_says_it_is_fetched_before_the_download(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: the hub's download bars are off (quiet.py), and a first run of a large hub base showed its
    `length:` line and then nothing for the whole download. A line now says the base is fetched from the hub."""
    import huggingface_hub

    from finetune.model.sources import files, hub
    from finetune.recipe import validate_recipe

    monkeypatch.setattr(hub, "offline_guard", lambda name: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kwargs: str(tmp_path))
    recipe = validate_recipe({"model": {"name_or_path": "someorg/somemodel"}, "data": {"datasets": [{"path": "d.jsonl"}]}})
    assert files.checkpoint_folder(recipe) == tmp_path
    assert "[finetune] model: fetching someorg/somemodel from the hub into its cache" in capsys.readouterr().out
