"""Checkpoint and resume checks that mutation testing (bug bash bb54) found unguarded: each test fails when its check
is weakened (the manifest's checksum, the rows of a resume, the rows it skips, the best step, resume=auto with
output.overwrite). The checkpoint folders are written in-process: by save_checkpoint, or by hand as
test_resume_review.py does (the checks read nothing else)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import recipe_dict, write_recipe

from finetune.data.examples import Example
from finetune.data.loader import BatchStream
from finetune.errors import CheckpointError
from finetune.outputs import begin_outputs, checkpoint, claim_output_dir, resume_changes, step_folders
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import load_recipe, recipe_to_yaml, validate_recipe

SINGLE = ParallelPlan(strategy="single", world_size=1)


def _written(run: Path, step: int) -> Path:
    """A checkpoint folder with a tensor file and its manifest (as a save lists them), written by hand: fast."""
    folder = checkpoint.checkpoint_dir(run, step)
    (folder / "trainable").mkdir(parents=True)
    (folder / "trainable" / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    state = {"step": step, "world_size": 1, "strategy": "single process"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    checkpoint._write_manifest(folder, step, state)
    return folder


def test_a_byte_changed_in_place_is_a_checksum_mismatch_and_resume_auto_skips_the_checkpoint(tmp_path, capsys):
    """Found by a bug bash (bb54 SF03): every damaged-checkpoint test changed a file's size, so the size check always
    answered first; with the SHA-256 comparison gone (`if False:`) they all passed, and bytes flipped in place (bit
    rot, zeroed blocks after a power cut) would be resumed or exported as intact."""
    run = tmp_path / "run"
    _written(run, 1)
    damaged = _written(run, 2)
    assert step_folders.checkpoint_problem(damaged) is None
    tensor = damaged / "trainable" / "__0_0.distcp"
    data = bytearray(tensor.read_bytes())
    data[500] ^= 0xFF
    tensor.write_bytes(bytes(data))
    assert tensor.stat().st_size == 1024  # the size alone says nothing
    said = step_folders.checkpoint_problem(damaged)
    assert said == "trainable/__0_0.distcp does not match its checksum (corrupted or changed)", said
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                              "train": {"resume": "auto"}, "output": {"dir": str(run)}})
    assert step_folders.resume_source(recipe).name == "step-00000001"
    assert "does not match its checksum" in capsys.readouterr().out


# -------------------------------------------------------------------------------- resume onto other rows (fake)
@pytest.fixture
def recipe_file(tmp_path) -> Path:
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                         train={"max_steps": 12, "micro_batch_size": 2, "seed": 7})
    return write_recipe(tmp_path / "recipe.yaml", values)


def fake_checkpoint(recipe, step: int, *, micro_batch_size: int = 2, rows: int = 61) -> Path:
    """A checkpoint folder of `recipe`'s run as a save writes it, without tensors (test_resume_review.py's)."""
    folder = checkpoint.checkpoint_dir(Path(recipe.output.dir), step)
    (folder / "trainable").mkdir(parents=True)
    (folder / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    data = {"epoch": 0, "cursor": step, "world_size": 1, "micro_batch_size": micro_batch_size, "rows": rows,
            "seed": recipe.train.seed}
    state = {"step": step, "data": data, "losses": [], "eval_losses": [], "tokens": 0, "world_size": 1,
             "strategy": "single process"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    checkpoint._write_manifest(folder, step, state)
    return folder


def test_a_resume_onto_more_rows_than_the_checkpoints_is_refused(recipe_file):
    """Found by a bug bash (bb54 RS05): both refusal tests shrank the data (50 or 60 rows vs 61); rows appended to the
    data file (the usual change) went unchecked, and `<=` for `==` passed."""
    source = fake_checkpoint(load_recipe(recipe_file), 3)
    with pytest.raises(CheckpointError, match="the training rows are 70 here, 61 in the checkpoint"):
        resume_changes(source, load_recipe(recipe_file, ["train.resume=auto"]), SINGLE, train_rows=70)
    assert resume_changes(source, load_recipe(recipe_file, ["train.resume=auto"]), SINGLE, train_rows=61) == []


def test_the_rows_a_resume_skips_are_the_loaders_where_the_sign_matters(recipe_file):
    """Found by a bug bash (bb54 RS06): the note's count was tested only where `-x % m == x % m` (9 rows at 2, 6 at 4).
    9 rows seen in micro-batches of 3, resumed in micro-batches of 4: the loader goes on at row 12, so 3 rows are
    skipped (`seen % 4` says 1)."""
    source = fake_checkpoint(load_recipe(recipe_file, ["train.micro_batch_size=3"]), 3, micro_batch_size=3)
    [note] = resume_changes(source, load_recipe(recipe_file, ["train.resume=auto", "train.micro_batch_size=4"]),
                            SINGLE, train_rows=61)
    stream = BatchStream([Example([i, i + 1], [i, i + 1]) for i in range(40)], micro_batch_size=4, rank=0,
                         world_size=1, seed=7, pad_id=0)
    stream.load_state_dict({"epoch": 0, "cursor": 3, "world_size": 1, "micro_batch_size": 3, "rows": 40, "seed": 7})
    skipped = stream.cursor * 4 - 3 * 3
    assert skipped == 3
    assert f"so {skipped} row(s) of this epoch are not trained" in note, note


# ------------------------------------------------------------------------------------------------ the best step
def test_a_nan_eval_loss_is_never_the_best_step():
    """Found by a bug bash (bb54 SF02): with the isfinite() filter dropped every test passed, and min() over
    {2: nan, 4: 1.0} returns 2: keep_best pruning would keep the NaN checkpoint as the best."""
    assert step_folders.best_step([(2, math.nan), (4, 1.0)], {2, 4}) == 4
    assert step_folders.best_step([(2, 1.0), (4, math.inf)], {2, 4}) == 2
    assert step_folders.best_step([(2, math.nan)], {2}) is None


def test_the_earliest_of_equal_eval_losses_is_the_best_step():
    """Found by a bug bash (bb54 SF01, weak): a tie going to the newest step instead of the earliest passed."""
    assert step_folders.best_step([(2, 1.0), (4, 1.0), (6, 2.0)], {2, 4, 6}) == 2


# --------------------------------------------------------------------- resume=auto with output.overwrite (finished)
def test_resume_auto_with_overwrite_on_a_finished_run_without_checkpoints_starts_afresh(tmp_path):
    """Found by a bug bash (bb54 SF04): `train.resume=auto` on a finished run with no checkpoint is refused with the
    Fix "pass output.overwrite=true to start over"; no test passed that fix, and dropping the `not overwrite` term
    (so the fix is refused again) passed. Here the fix is taken: no checkpoint to resume, and the old run's files go."""
    run = tmp_path / "run"
    values = {"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "unused.jsonl"}]},
              "train": {"resume": "auto"}, "output": {"dir": str(run)}}
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"the finished adapter")
    (run / "recipe.yaml").write_text(recipe_to_yaml(validate_recipe(values)))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(CheckpointError, match="pass output.overwrite=true to start over"), \
            claim_output_dir(validate_recipe(values)):
        pass
    values["output"]["overwrite"] = True
    recipe = validate_recipe(values)
    with claim_output_dir(recipe) as folder:
        assert folder.resume_from is None  # a fresh start
        begin_outputs(run, recipe_to_yaml(recipe), folder.resume_from)
    assert not (run / "adapter").exists() and not (run / "metrics.jsonl").exists()
