"""model.attn_implementation: auto (finetune/model/attention.py): sdpa where the model class supports it, else eager,
said in one line; explicit values kept. gpt-oss has no sdpa in transformers 5, so its recipes failed with the old
sdpa default."""

from __future__ import annotations

import pytest
import torch

from finetune.model import base as model_lib
from finetune.model.skeleton import meta_base_model
from finetune.recipe import validate_recipe


def make_recipe(model_dir, **model):
    return validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32", **model},
                            "data": {"datasets": [{"path": "unused.jsonl"}]}})


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """A 2-layer gpt-oss config (hidden 64, 4 experts), saved as a folder's config.json."""
    from transformers import GptOssConfig

    config = GptOssConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          vocab_size=128, layer_types=["sliding_attention", "full_attention"])
    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    config.save_pretrained(folder)
    return folder


def test_auto_is_eager_for_gpt_oss_which_has_no_sdpa(tiny_gpt_oss, capsys):
    from transformers import AutoModelForCausalLM

    recipe = make_recipe(tiny_gpt_oss)
    assert recipe.model.attn_implementation == "auto"
    config = model_lib.load_config(recipe)
    assert recipe.model.attn_implementation == "eager"
    assert "model.attn_implementation: auto -> eager (GptOssForCausalLM does not support sdpa" in capsys.readouterr().err
    # The other side, from transformers itself: the old default is refused, the resolved value builds and runs on CPU.
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation=recipe.model.attn_implementation)
    logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()


def test_the_meta_skeleton_picks_what_the_class_supports(tiny_gpt_oss, tiny_llama):
    from transformers import AutoConfig

    for folder, expected in ((tiny_gpt_oss, "eager"), (tiny_llama, "sdpa")):
        model = meta_base_model(AutoConfig.from_pretrained(folder), dtype=torch.float32, bnb_config=None)
        assert model.config._attn_implementation == expected, folder


def test_auto_is_sdpa_for_a_dense_llama(tiny_llama, capsys):
    recipe = make_recipe(tiny_llama)
    model_lib.load_config(recipe)
    assert recipe.model.attn_implementation == "sdpa"
    assert "auto -> sdpa (LlamaForCausalLM supports" in capsys.readouterr().err


def test_an_explicit_value_is_kept_and_not_announced(tiny_llama, capsys):
    recipe = make_recipe(tiny_llama, attn_implementation="eager")
    model = model_lib.load_base_model(recipe, device=torch.device("cpu"))
    assert recipe.model.attn_implementation == "eager" and model.config._attn_implementation == "eager"
    assert "attn_implementation" not in str(capsys.readouterr())


def test_the_per_rank_loader_resolves_auto_before_loading(tiny_llama):
    recipe = make_recipe(tiny_llama)
    model = model_lib.load_base_model(recipe, device=torch.device("cpu"))
    assert recipe.model.attn_implementation == "sdpa" and model.config._attn_implementation == "sdpa"
