"""Bug bash bb70 F4: `data.num_workers`, a key up to e1c0ecd, was refused by `validate` and `train` as a bare unknown
key (with the valid keys listed), though finetune knows it was removed and why (recipe/text.py REMOVED_KEYS, used
until then only when a run's own recipe.yaml is read back). The refusal now says it."""
from __future__ import annotations

import pytest

from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.recipe.text import REMOVED_KEYS


@pytest.mark.parametrize("dotted", sorted(REMOVED_KEYS))
def test_a_removed_key_is_refused_with_why_and_the_fix(dotted):
    section, key = dotted.split(".")
    values = {"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "d.jsonl"}]}}
    values.setdefault(section, {})[key] = 2
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    assert f"{dotted}: unknown key. It is a key of an earlier finetune, {REMOVED_KEYS[dotted]}: delete it." in str(
        caught.value)
