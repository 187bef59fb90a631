"""train.router_aux_loss_coef: the recipe key of a mixture-of-experts model's load-balancing loss (TRL's
router_aux_loss_coef), its refusals in one paragraph, and where TRL's name points.

Found by a bug bash (bb11, finding 3): the key was refused as "a setting of HF's Trainer or TRL's trainers that
finetune makes itself", and finetune added no load-balancing loss at all (tests/training/test_router_aux.py)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.recipe.router_aux import check_router_aux, declared_coef, returns_aux_loss, router_aux_problem

BASE = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "data.jsonl"}]}}


def recipe(coef=None, **train):
    return validate_recipe({**BASE, "train": {"router_aux_loss_coef": coef, **train}})


def test_the_key_is_a_train_key_unset_by_default():
    """Found by a bug bash: `train.router_aux_loss_coef` was an unknown key that finetune claimed to set itself."""
    assert validate_recipe(BASE).train.router_aux_loss_coef is None
    assert recipe(0.02).train.router_aux_loss_coef == 0.02 and recipe(0).train.router_aux_loss_coef == 0


@pytest.mark.parametrize("value", [-0.01, float("inf")])
def test_a_negative_or_infinite_weight_is_refused(value):
    with pytest.raises(RecipeError, match=r"train\.router_aux_loss_coef"):
        recipe(value)


@pytest.mark.parametrize("where", [{"dpo": {"router_aux_loss_coef": 0.02}}, {"router_aux_loss_coef": 0.02}])
def test_trls_name_in_another_place_points_to_the_train_key(where):
    """TRL's DPOConfig / SFTConfig field, written in a section (or at the top) where it is not: the error names
    train.router_aux_loss_coef, not "finetune makes it itself"."""
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, **where})
    message = str(caught.value)
    assert "`train.router_aux_loss_coef`" in message and "makes itself" not in message


def test_a_reward_model_refuses_a_weight_in_one_paragraph():
    """TRL's RewardTrainer adds no load-balancing loss and a score head sees no router logits."""
    raw = {**BASE, "data": {"datasets": [{"path": "d.jsonl", "format": "preference"}]},
           "train": {"objective": "reward", "router_aux_loss_coef": 0.02}}
    with pytest.raises(RecipeError) as caught:
        validate_recipe(raw)
    message = str(caught.value)
    assert "train.router_aux_loss_coef (0.02) with train.objective reward" in message
    assert "1 problem" in message and "so there is nothing to weight. Fix: remove train.router_aux_loss_coef." in message
    raw["train"]["router_aux_loss_coef"] = 0
    assert validate_recipe(raw).train.router_aux_loss_coef == 0


@pytest.mark.parametrize(("model_type", "why"), [
    ("llama", "LlamaForCausalLM (llama) is not a mixture-of-experts model"),
    ("deepseek_v3", "DeepseekV3ForCausalLM (deepseek_v3) returns no load-balancing loss"),
    ("llama4_text", "Llama4ForCausalLM (llama4_text) returns no load-balancing loss"),
])
def test_a_weight_for_a_model_without_the_loss_is_refused_from_its_config(model_type, why):
    """Before any weight loads (from the config alone, as `finetune validate` can): a non-zero weight on a model whose
    forward returns no load-balancing loss. TRL refuses it on a model without router logits, and would crash in the
    first step on DeepSeek-V3 / Llama 4, whose configs have router logits but whose classes compute no such loss."""
    config = AutoConfig.for_model(model_type)
    problem = router_aux_problem(recipe(0.02), config)
    assert problem is not None and why in problem
    assert problem.startswith("train.router_aux_loss_coef (0.02): ") and problem.endswith(
        "Fix: remove train.router_aux_loss_coef (or set it to 0).")
    with pytest.raises(RecipeError):
        check_router_aux(recipe(0.02), config)
    assert router_aux_problem(recipe(None), config) is None and router_aux_problem(recipe(0), config) is None


@pytest.mark.parametrize(("model_type", "coef"), [("mixtral", 0.001), ("qwen3_moe", 0.001), ("olmoe", 0.01),
                                                  ("gpt_oss", 0.001), ("qwen2_moe", 0.001)])
def test_moe_models_with_the_loss_take_any_weight_and_declare_their_own(model_type, coef):
    config = AutoConfig.for_model(model_type)
    assert returns_aux_loss(config) and declared_coef(config) == coef
    assert router_aux_problem(recipe(0.3), config) is None
