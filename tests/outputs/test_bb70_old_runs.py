"""Runs an older finetune wrote, read by this one (bug bash bb70): a run trained with `train.seed: -1` (accepted before
60aa010) resumes and exports with the seed it trained with; no refusal tells the user to edit a file a checkpoint's
manifest checks; and a resume=auto onto a checkpoint whose recipe.yaml alone was edited stops with the reason instead
of starting over from step 0 over the folder. Checkpoints are written by hand (the manifest by the save's own writer);
no process is launched. The same seed -1 run of be3059b, cut at step 3 and resumed by this finetune, was checked by
hand to end bitwise on that finetune's uninterrupted run (/work/bb70/repro/f2_seed_minus_one.sh)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import recipe_dict, write_recipe

from finetune.errors import CheckpointError, RecipeError
from finetune.outputs import checkpoint, claim_output_dir, resume_changes
from finetune.outputs.checkpoint_adapter import checkpoint_recipe
from finetune.outputs.step_folders import checkpoint_problem
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import load_recipe

SINGLE = ParallelPlan(strategy="single", world_size=1)


def _old_run(tmp_path: Path, *, seed: int = -1) -> tuple[Path, Path]:
    """(run folder, its step-3 checkpoint) as a finetune before 60aa010 left a run of `seed` killed after step 3: the
    resolved recipe.yaml in the folder and in the checkpoint, the checkpoint's files under its manifest."""
    run = tmp_path / "run"
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", run, train={"seed": seed, "resume": "auto"})
    values["output"]["overwrite"] = False
    text = yaml.safe_dump(values, sort_keys=False)  # no validation: this finetune refuses the seed of a new run
    folder = checkpoint.checkpoint_dir(run, 3)
    (folder / "trainable").mkdir(parents=True)
    (folder / "trainable" / "__0_0.distcp").write_bytes(b"lora tensors")
    for path in (run / "recipe.yaml", folder / "recipe.yaml"):
        path.write_text(text)
    data = {"epoch": 0, "cursor": 3, "world_size": 1, "micro_batch_size": 4, "rows": 48, "seed": seed}
    state = {"step": 3, "data": data, "losses": [], "eval_losses": [], "tokens": 0, "world_size": 1,
             "strategy": "single process"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    checkpoint._write_manifest(folder, 3, state)
    return run, folder


def test_a_seed_below_zero_of_an_old_run_is_read_as_written_and_refused_for_a_new_run(tmp_path):
    """bb70 F2: export --step of a seed -1 run was refused by the seed bound of 60aa010, with a fix that damaged the
    checkpoint. Its recipe is read with the seed it trained with (-1 is no seed of today's range: torch takes it as
    2**64 - 1, Python's random as 1); a new recipe is still refused it, naming the resume."""
    _, folder = _old_run(tmp_path)
    assert checkpoint_recipe(folder).train.seed == -1
    path = write_recipe(tmp_path / "new.yaml", recipe_dict(tmp_path / "model", tmp_path / "train.jsonl",
                                                           tmp_path / "new", train={"seed": -1}))
    with pytest.raises(RecipeError, match=r"train.seed -1 is outside 0 .. 2\*\*63 - 1.*add train.resume=auto"):
        load_recipe(path)
    assert load_recipe(path, ["train.resume=auto"]).train.seed == -1


def test_a_seed_minus_one_run_resumes_with_its_own_seed(tmp_path):
    """bb70 F2: the resume with the run's seed was refused by the bound, and with any other seed the refusal's fix was
    the run's seed: the two pointed at each other. Now the run's own seed continues it, with no refusal or note."""
    run, folder = _old_run(tmp_path)
    recipe = load_recipe(write_recipe(tmp_path / "resume.yaml", recipe_dict(
        tmp_path / "model", tmp_path / "train.jsonl", run, train={"seed": -1, "resume": "auto"})))
    assert resume_changes(folder, recipe, SINGLE, train_rows=48) == []
    other = load_recipe(tmp_path / "resume.yaml", ["train.seed=0"])
    with pytest.raises(CheckpointError, match=r"train.seed is 0 here, -1 in the checkpoint.*train.seed=-1"):
        resume_changes(folder, other, SINGLE, train_rows=48)


def test_an_unreadable_checkpoint_recipe_names_a_way_out_not_an_edit(tmp_path):
    """bb70 F2: the refusal of a checkpoint recipe this finetune cannot read said "correct those keys in
    .../recipe.yaml", which the manifest checks: followed, the checkpoint was damaged for every later resume."""
    _, folder = _old_run(tmp_path)
    raw = yaml.safe_load((folder / "recipe.yaml").read_text())
    raw["train"]["learning_rat"] = 1.0
    (folder / "recipe.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_recipe(folder)
    said = str(caught.value)
    assert "train.learning_rat: unknown key" in said and "the finetune that wrote the checkpoint" in said
    assert "correct those keys" not in said and "Do not edit that recipe.yaml" in said


def test_resume_auto_stops_at_a_checkpoint_whose_recipe_alone_was_edited(tmp_path):
    """bb70 F2: following the old fix (the seed edited in the checkpoint's recipe.yaml), resume=auto skipped the
    checkpoint as damaged and started from step 0, writing a new step 3 over it. Now it stops, says why, and its fix
    (a copy of the run's recipe.yaml) makes the checkpoint match its manifest again."""
    run, folder = _old_run(tmp_path)
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    (folder / "recipe.yaml").write_text((folder / "recipe.yaml").read_text().replace("seed: -1", "seed: 0"))
    assert checkpoint_problem(folder) is not None  # damaged: the manifest checks recipe.yaml
    recipe = load_recipe(write_recipe(tmp_path / "resume.yaml", recipe_dict(
        tmp_path / "model", tmp_path / "train.jsonl", run, train={"seed": 0, "resume": "auto"})))
    with pytest.raises(CheckpointError) as caught, claim_output_dir(recipe):
        pass
    said = str(caught.value)
    assert f"checkpoint {folder} matches its manifest in every file but recipe.yaml" in said
    assert "Nothing was loaded or written" in said and not (run / ".finetune.lock").exists()
    [copy] = [part for part in said.split("`") if part.startswith("cp ")]
    subprocess.run(shlex.split(copy), check=True)
    assert checkpoint_problem(folder) is None
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before
    # A checkpoint damaged elsewhere too (its tensors) is skipped as before: nothing to put back
    (folder / "recipe.yaml").write_text("edited")
    (folder / "trainable" / "__0_0.distcp").write_bytes(b"other")
    with claim_output_dir(recipe) as claimed:
        assert claimed.resume_from is None
