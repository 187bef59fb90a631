"""Recipe checks that mutation testing (bug bash bb54) found unguarded: each test fails when its check is weakened.

Found by a bug bash (bb54, mutation testing): every check below could be weakened (a bound moved by one, a term
dropped, `all` made `any`) with the whole fast suite still passing. Each test pins the edge the old tests missed.
"""

from __future__ import annotations

import pytest
from conftest import write_jsonl, write_recipe

from finetune.errors import RecipeError
from finetune.recipe import load_recipe, validate_recipe
from finetune.recipe.checks import output_in_data_problem, steps_for_epochs

BASE = {"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "d.jsonl"}]}}


def _refused(raw: dict) -> str:
    with pytest.raises(RecipeError) as caught:
        validate_recipe(raw)
    return " ".join(str(caught.value).split())


def test_steps_for_epochs_rounds_away_the_float_error_of_the_product():
    """Found by a bug bash (bb54 RC06): the one rounding case of tests/training/test_epochs.py, 0.1 x 30, is exactly 3.0
    in IEEE doubles, so dropping round() passed. 0.14 x 50 and 0.28 x 25 are 7.000000000000001: 8 steps without it."""
    assert 0.14 * 50 > 7 and 0.28 * 25 > 7  # the float error the rounding is there for
    assert steps_for_epochs(0.14, 50) == 7
    assert steps_for_epochs(0.28, 25) == 7
    assert steps_for_epochs(0.56, 50) == 28


def test_text_training_rows_with_completion_eval_rows_are_asked():
    """Found by a bug bash (bb54 RC02): text rows held out (data.eval_fraction) beside an eval dataset of completion rows
    leave prompts to ask; only eval rows that are all text are refused. `any` for `all` passed every test."""
    raw = {"model": {"name_or_path": "unused"}, "eval": {"generation_rows": 4},
           "data": {"datasets": [{"path": "t.jsonl", "format": "text"}], "eval_fraction": 0.1, "max_length": 64,
                    "eval_datasets": [{"path": "e.jsonl", "format": "completion"}]}}
    assert validate_recipe(raw).eval.generation_rows == 4
    raw["data"]["eval_datasets"][0]["format"] = "text"
    assert "the eval rows are text rows" in _refused(raw)


def test_warmup_steps_equal_to_max_steps_are_clamped_with_a_note():
    """Found by a bug bash (bb54 RC04): warmup_steps == max_steps never reaches the peak learning rate; `>` for `>=`
    in the clamp passed (the tests used 30 warmup steps on 3 or 6)."""
    recipe = validate_recipe({**BASE, "train": {"warmup_steps": 3, "max_steps": 3}})
    assert recipe.train.warmup_steps == 2
    assert any("train.warmup_steps (3) is not below train.max_steps (3): warming up over 2 steps" in note
               for note in recipe.notes), recipe.notes
    below = validate_recipe({**BASE, "train": {"warmup_steps": 2, "max_steps": 3}})
    assert below.train.warmup_steps == 2 and not below.notes


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_a_precomputed_reference_is_refused_under_streaming_for_every_loss_that_uses_one(loss):
    """Found by a bug bash (bb54 RC07): only the default loss (sigmoid) was tested; dropping `hinge` passed."""
    raw = {"model": {"name_or_path": "unused"}, "train": {"objective": "dpo"},
           "data": {"streaming": True, "datasets": [{"path": "a.jsonl", "format": "preference"}]},
           "dpo": {"reference": "precomputed", "loss": loss}}
    assert "dpo.reference: precomputed" in _refused(raw)


def test_a_subsampling_weight_is_refused_under_streaming():
    """Found by a bug bash (bb54 RC08): only a weight of 2.0 was tested; a weight 0.5 (subsample) would pass `> 1.0`
    and the stream would read the whole dataset, silently."""
    raw = {"model": {"name_or_path": "unused"},
           "data": {"streaming": True, "datasets": [{"path": "a.jsonl", "weight": 0.5}]}}
    assert "data.datasets[0].weight (0.5): a weight repeats or subsamples" in _refused(raw)


def test_an_output_dir_nested_inside_a_data_folder_is_a_problem(tmp_path):
    """Found by a bug bash (bb54 RC09): the test set output.dir to the data folder itself; a run folder below it
    (`data/run1`, read whole as data by the next launch) passed `out == folder`."""
    data = tmp_path / "dfold"
    write_jsonl(data / "part-0.jsonl", [{"text": "a"}])
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": str(data)}]},
                              "output": {"dir": str(data / "run1")}})
    said = output_in_data_problem(recipe)
    assert said and "is inside data.datasets[0]'s folder" in said
    beside = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": str(data)}]},
                              "output": {"dir": str(tmp_path / "run1")}})
    assert output_in_data_problem(beside) is None


def test_lora_dropout_of_one_is_refused():
    """Found by a bug bash (bb54 SC01): `lora.dropout: 1.0` zeroes every LoRA input, so nothing trains; `le=1` for
    `lt=1` passed."""
    assert "lora.dropout" in _refused({**BASE, "lora": {"dropout": 1.0}})
    assert validate_recipe({**BASE, "lora": {"dropout": 0.99}}).lora.dropout == 0.99


def test_a_warmup_ratio_of_one_is_refused():
    """Found by a bug bash (bb54 SC02, weak): `le=1` for `lt=1` passed (a ratio of 1 would be clamped with a note)."""
    assert "warmup_ratio" in _refused({**BASE, "train": {"warmup_ratio": 1.0}})


def test_a_grpo_completion_as_long_as_max_length_is_refused(tmp_path):
    """Found by a bug bash (bb54 GR01): max_completion_length == data.max_length leaves a prompt budget of 0 (every
    prompt refused or dropped at the data stage, far from the cause); `>` for `>=` passed (the test used 200 vs 128)."""
    raw = {"model": {"name_or_path": "unused"}, "train": {"objective": "grpo", "micro_batch_size": 4},
           "data": {"datasets": [{"path": "p.jsonl", "format": "prompt"}], "max_length": 128},
           "grpo": {"num_generations": 4, "max_completion_length": 128,
                    "reward_functions": ["finetune.rewards:exact_match"]}}
    assert "grpo.max_completion_length (128) leaves no prompt budget within data.max_length (128)" in _refused(raw)
    raw["grpo"]["max_completion_length"] = 127
    assert validate_recipe(raw).grpo.max_completion_length == 127


def test_an_override_one_past_the_end_of_a_list_is_a_recipe_error(tmp_path):
    """Found by a bug bash (bb54 OV01): `data.datasets.1.path=x` on a one-dataset recipe: `index <= len(node)` passed
    every test and gave a bare IndexError traceback instead of the message."""
    path = write_recipe(tmp_path / "r.yaml", BASE)
    with pytest.raises(RecipeError, match=r"`1` is not an index of the list \(it has 1 items"):
        load_recipe(path, ["data.datasets.1.path=x"])
    assert load_recipe(path, ["data.datasets.0.path=x"]).data.datasets[0].path == "x"
