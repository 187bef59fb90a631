"""What a resume says of a longer run (bug bash bb62, exact resume objective by objective): a changed train.max_steps
or warmup is noted only where the steps already trained had other learning rates, and a GRPO checkpoint that ends
inside a grpo.num_iterations cycle says why the extended run differs (its completions are not saved), as the recipe
says beforehand. Fast: checkpoint folders written by hand, as tests/outputs/test_resume_review.py does."""
from __future__ import annotations

from pathlib import Path

from conftest import recipe_dict, write_recipe
from test_resume_review import changes, fake_checkpoint

from finetune.recipe import load_recipe, validate_recipe


def _recipe(tmp_path: Path, **train) -> Path:
    tmp_path.mkdir(exist_ok=True)
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                         train={"max_steps": 5, "micro_batch_size": 2, "seed": 7, **train})
    return write_recipe(tmp_path / "recipe.yaml", values)


def test_a_constant_schedule_extended_is_no_change(tmp_path):
    """Found by a bug bash: a 5-step run under lr_schedule constant extended to 6 gave the uninterrupted 6-step run's
    adapter bitwise, yet the resume said `train.max_steps 5 -> 6 (it reshapes the learning-rate schedule): the run will
    differ`. The rates of the steps already trained are compared: the same, nothing is said."""
    recipe_file = _recipe(tmp_path, lr_schedule="constant", warmup_steps=2)
    source = fake_checkpoint(load_recipe(recipe_file), 5)
    assert changes(source, recipe_file, "train.max_steps=6") == []
    [note] = changes(source, recipe_file, "train.max_steps=6", "train.warmup_steps=3")  # step 0-4's rates move
    assert "train.warmup_steps 2 -> 3 (it reshapes the learning-rate schedule)" in note, note
    cosine = _recipe(tmp_path / "cosine", lr_schedule="cosine")
    [note] = changes(fake_checkpoint(load_recipe(cosine), 5), cosine, "train.max_steps=6", "train.lr_schedule=cosine")
    assert "train.max_steps 5 -> 6 (it reshapes the learning-rate schedule)" in note, note


def _grpo(tmp_path: Path, max_steps: int) -> Path:
    values = recipe_dict(tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "run",
                         train={"max_steps": max_steps, "micro_batch_size": 2, "objective": "grpo",
                                "lr_schedule": "constant", "save_every": 2},
                         data={"datasets": [{"path": str(tmp_path / "prompts.jsonl"), "format": "prompt"}],
                               "max_length": 128},
                         grpo={"num_generations": 2, "num_iterations": 2, "max_completion_length": 8,
                               "reward_functions": ["finetune.rewards:exact_match"]})
    return write_recipe(tmp_path / "grpo.yaml", values)


def test_a_grpo_run_that_ends_inside_a_cycle_says_so_before_and_on_resume(tmp_path):
    """Found by a bug bash: a GRPO run of max_steps 5 with num_iterations 2 saved its last step inside a cycle; the run
    extended to 6 sampled new completions at step 6 where an uninterrupted run trains step 5's again (adapters 0.0038
    apart), and the resume blamed a reshaped schedule, under a constant one."""
    recipe_file = _grpo(tmp_path, 5)
    recipe = load_recipe(recipe_file)
    assert any("train.max_steps 5 is not a multiple of grpo.num_iterations 2" in note and "train.max_steps 6" in note
               for note in recipe.notes), recipe.notes
    assert not any("num_iterations" in note for note in load_recipe(_grpo(tmp_path, 6)).notes)
    [note] = changes(fake_checkpoint(recipe, 5, micro_batch_size=1), recipe_file, "train.max_steps=6")
    assert "the checkpoint of step 5 ends inside a grpo.num_iterations cycle of 2 steps" in note, note
    assert "samples new completions at step 6" in note and "reshapes" not in note, note
    assert changes(fake_checkpoint(recipe, 4, micro_batch_size=1), recipe_file, "train.max_steps=6") == []  # exact


def test_a_num_epochs_grpo_run_says_its_cut_cycle_once_resolved(tmp_path):
    """train.num_epochs resolves to max_steps at the run's start: the note comes with it."""
    values = {"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "p.jsonl", "format": "prompt"}]},
              "train": {"objective": "grpo", "num_epochs": 1.5, "max_steps": None, "micro_batch_size": 2},
              "grpo": {"num_generations": 2, "num_iterations": 2, "max_completion_length": 8,
                       "reward_functions": ["finetune.rewards:exact_match"]}}
    recipe = validate_recipe(values)
    recipe.resolve_num_epochs(4, launch="1 process")  # ceil(1.5 x 4) = 6: whole cycles
    assert not any("num_iterations" in note for note in recipe.notes)
    recipe = validate_recipe(values)
    recipe.resolve_num_epochs(2, launch="1 process")  # ceil(1.5 x 2) = 3
    assert any("train.max_steps 3 is not a multiple of grpo.num_iterations 2" in note for note in recipe.notes)
