"""Bug bash bb69 #5: a run whose recipe sets train.warmup_ratio, resumed with a longer train.max_steps, was noted as
"train.warmup_steps 1 -> 2", a key the recipe never set (the ratio is resolved to steps, and the ratio set to null,
before the comparison). The note now names the ratio and the steps it resolves to, before and after."""
from __future__ import annotations

from conftest import recipe_dict, write_recipe
from test_resume_review import changes, fake_checkpoint  # helpers (a checkpoint folder without tensors)

from finetune.recipe import load_recipe


def test_a_resolved_warmup_ratio_is_noted_as_the_ratio(tmp_path):
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                         train={"max_steps": 4, "warmup_ratio": 0.25, "micro_batch_size": 2, "seed": 7})
    recipe_file = write_recipe(tmp_path / "recipe.yaml", values)
    source = fake_checkpoint(load_recipe(recipe_file), 4)
    said = " ".join(changes(source, recipe_file, "train.max_steps=8"))
    assert "train.warmup_ratio 0.25 (= 1 -> 2 warmup steps over the new length)" in said, said
    assert "train.warmup_steps" not in said, said
