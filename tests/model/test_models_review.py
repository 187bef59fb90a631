"""Checks of the model stage that `finetune train` makes before any weight loads, as `finetune validate` makes them:
lora.target_modules on every loading path, a checkpoint index naming a missing shard; and `finetune tiny-model --arch`
for every model type docs/models.md says it builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune.cli import main
from finetune.errors import ModelLoadError, RecipeError

# (sharded, device_map, dora): the per-tensor whole model (single process, DDP, DeepSpeed), FSDP's meta skeleton, and
# the loads through from_pretrained (layer split's device map; DoRA)
PATHS = {"whole": (False, None, False), "fsdp-skeleton": (True, None, False), "layer-split": (False, {"": "cpu"}, False),
         "dora": (False, None, True)}


def _recipe(model_dir: Path, target_modules, **lora):
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
                                  "lora": {"r": 2, "alpha": 4, "target_modules": target_modules, **lora},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def _no_weight_read(monkeypatch) -> None:
    """Any read of a weight (finetune's per-tensor reader, transformers' from_pretrained) fails the test."""
    from finetune.model import classes, loading

    def read(*args, **kwargs):
        raise AssertionError("a weight was read before lora.target_modules was checked")

    monkeypatch.setattr(loading.TensorReader, "get", read)
    monkeypatch.setattr(classes, "from_pretrained", read)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("targets", [["q_proj", "v_prj"], ["q_projj"]])
def test_a_target_that_matches_no_module_is_refused_before_any_weight_loads(tiny_llama, monkeypatch, path, targets):
    """Before: only `finetune validate` checked; a run trained without `v_prj`'s LoRA (its adapter_config listing it),
    or ended in PEFT's NoMatchingPeftModuleError traceback when no name matched."""
    from finetune.model import load_config, loading

    sharded, device_map, dora = PATHS[path]
    recipe = _recipe(tiny_llama, targets, dora=dora)
    with pytest.raises(RecipeError) as said:  # what `finetune validate` calls
        loading.check_lora_targets(recipe, load_config(recipe))
    validate_says = str(said.value)
    assert validate_says and targets[-1] in validate_says
    _no_weight_read(monkeypatch)
    with pytest.raises(RecipeError) as refused:
        loading.load_model(recipe, sharded=sharded, device=torch.device("cpu"), device_map=device_map,
                           gradient_checkpointing=False)
    assert str(refused.value) == validate_says


def test_mixtral_style_names_on_mistral4_are_refused_before_any_weight_loads(tiny_arch, monkeypatch):
    """Before: `[w1, w2, w3, q_a_proj]` trained q_a_proj alone, the experts without LoRA, silently."""
    from finetune.model import loading

    recipe = _recipe(tiny_arch("mistral4"), ["w1", "w2", "w3", "q_a_proj"])
    _no_weight_read(monkeypatch)
    with pytest.raises(RecipeError, match=r"`w1`, `w2`, `w3` match no module of this model.*gate_proj"):
        loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                           gradient_checkpointing=False)


def test_good_targets_still_load(tiny_llama):
    from finetune.model import loading

    for sharded, device_map, _ in (PATHS["whole"], PATHS["layer-split"]):
        loaded = loading.load_model(_recipe(tiny_llama, ["q_proj", "v_proj"]), sharded=sharded,
                                    device=torch.device("cpu"), device_map=device_map, gradient_checkpointing=False)
        names = {name.rsplit(".", 1)[-1] for name, module in loaded.model.named_modules() if hasattr(module, "lora_A")}
        assert names == {"q_proj", "v_proj"}


def test_validate_reports_a_shard_the_index_names_but_the_folder_lacks(tmp_path):
    """Before: validate passed; train then failed on the missing shard (finetune/model/sources/files.py)."""
    from finetune.cli.tiny import build_tiny_model
    from finetune.cli.validate import validate

    model_dir = build_tiny_model(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(model_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    data = write_jsonl(tmp_path / "data.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(model_dir, data, tmp_path / "run"))
    with pytest.raises(ModelLoadError, match=rf"names the shard {shards[-1].name} .* Fix: download the missing shard"):
        validate(str(recipe), [])


@pytest.mark.parametrize("model_type", ["mistral4", "glm5_next"])
def test_tiny_model_arch_builds_the_multimodal_types_the_table_lists(model_type, tmp_path, capsys):
    """Before: "--arch mistral4: not a text causal LM of this transformers" for mistral4, kimi_k25, glm5_next,
    mistral_large4, gemma4 and mistral3, which docs/models.md lists as trained (and tiny_arch builds)."""
    from transformers import AutoConfig

    from finetune.cli.tiny_arch import tiny_arch_types
    from finetune.model.support import TRAINED

    assert set(TRAINED) <= set(tiny_arch_types())
    assert main(["tiny-model", str(tmp_path / "tiny"), "--arch", model_type]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "tiny").model_type == model_type
    assert "written to" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--layers", "4"], ["--hidden-size", "128"]])
def test_tiny_model_arch_refuses_sizes_it_would_ignore(flags, tmp_path, capsys):
    """Before: --layers and --hidden-size were silently ignored with --arch."""
    assert main(["tiny-model", str(tmp_path / "tiny"), "--arch", "llama", *flags]) == 2
    error = capsys.readouterr().err
    assert f"--arch llama with {' '.join(flags)}" in error and "Fix:" in error
    assert not (tmp_path / "tiny").exists()
    assert main(["tiny-model", str(tmp_path / "family"), "--layers", "3", "--hidden-size", "32"]) == 0
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "family")
    assert (config.num_hidden_layers, config.hidden_size) == (3, 32)
