"""Mutation testing round 6 (bb72): gaps in finetune/recipe/overrides.py. The oracle is the recipe file: an override
`key=value` sets what `key: value` in the file sets (docs/recipes.md), and a number is read as the decimal written."""

from __future__ import annotations

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import load_recipe

BASE = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "data.jsonl"}]}}


def write(tmp_path, recipe: dict, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("null", ["null", "Null", "NULL", "~"])
def test_a_null_at_a_text_key_clears_it_as_the_file_does(tmp_path, null):
    """A text key takes its override as written, but YAML's nulls still mean "not set" there, as in the file: the
    system prompt was the literal text `null` (trained into every row) had the null words not been read as None."""
    set_in_file = {**BASE, "data": {**BASE["data"], "system_prompt": "Be brief."}, "train": {"run_name": "x"}}
    recipe = load_recipe(write(tmp_path, set_in_file), [f"data.system_prompt={null}", f"train.run_name={null}"])
    cleared = yaml.safe_load(f"system_prompt: {null}")["system_prompt"]  # the file's reading of the same word
    assert cleared is None
    assert (recipe.data.system_prompt, recipe.train.run_name) == (cleared, cleared)


def test_a_negative_number_with_a_leading_zero_is_read_as_the_decimal_written(tmp_path):
    """`0042` is 42 (not YAML 1.1's octal 34), and so is the sign's case: `-0042` is -42, which the refusal names; the
    octal reading (-34) named a number the user never wrote."""
    said = str(pytest.raises(RecipeError, load_recipe, write(tmp_path, BASE), ["train.max_steps=-0042"]).value)
    assert str(int("-0042", 10)) in said and "-34" not in said, said
