"""The rows an epoch leaves out past its last whole step are said where the run's length is (bb23)."""
from __future__ import annotations

from finetune.cli.preview import length_lines
from finetune.recipe import Recipe
from finetune.training.loop import resolve_max_steps


def _recipe(tmp_path, **train) -> Recipe:
    return Recipe.model_validate({"model": {"name_or_path": "tiny"}, "train": {"micro_batch_size": 3, **train},
                                  "data": {"datasets": [{"path": str(tmp_path / "a.jsonl"), "format": "alpaca"}]}})


def test_the_rows_past_an_epochs_last_whole_step_are_counted_at_the_start(tmp_path, capsys):
    """Found by a bug bash (bb23): 16 rows in steps of 6 (micro_batch_size 3 x grad_accum 2) trained 2 steps an epoch
    and never rows 1, 4, 11 and 13 (39% of the tokens), while validate said "0 dropped", the length line "16 rows //
    (...)" and the metrics `epoch: 1.0`; only docs/data.md said it. The length line, `finetune data` and validate now
    count them; a whole number of steps adds nothing."""
    resolve_max_steps(_recipe(tmp_path, grad_accum=2, num_epochs=1), 16, 1)
    out = capsys.readouterr().out
    assert "train.max_steps 2 = ceil(train.num_epochs 1 x 2 steps per epoch" in out
    assert "; 4 of the 16 rows left out of each epoch (past its last whole step of 6 rows; a different 4 each epoch)" in out
    resolve_max_steps(_recipe(tmp_path, grad_accum=2, max_steps=5), 16, 2)  # steps of 12 rows
    assert "4 of the 16 rows left out" in capsys.readouterr().out
    resolve_max_steps(_recipe(tmp_path, grad_accum=2, num_epochs=1), 12, 1)
    assert "left out" not in capsys.readouterr().out
    [steps, _] = length_lines(16, _recipe(tmp_path, grad_accum=2, num_epochs=1).train, processes=1, launch="as given")
    assert steps.startswith("steps per epoch: 2 at 1 process") and steps.endswith("a different 4 each epoch)")


def test_validate_counts_the_rows_an_epoch_leaves_out(tiny_llama, tmp_path, capsys):
    """The same count in `finetune validate`'s data line (bb23): it said "0 dropped; ...; 2 steps per epoch" alone."""
    from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

    from finetune.cli import main

    data = write_jsonl(tmp_path / "a.jsonl", addition_rows(16))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", data={"eval_fraction": 0},
                                                           train={"micro_batch_size": 3, "grad_accum": 2, "num_epochs": 1,
                                                                  "max_steps": None}))
    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "2 steps per epoch; 4 of the 16 rows left out of each epoch" in out, out


def test_a_grpo_micro_batch_is_said_as_prompts_of_the_recipes_completions(tmp_path):
    """Found by a bug bash: `finetune data` on a GRPO recipe with micro_batch_size 2 and num_generations 2 said
    `2 rows // (micro_batch_size 1 x ...)`, a value the recipe key does not have (1 is its prompts per micro-batch)."""
    from types import SimpleNamespace

    train = SimpleNamespace(micro_batch_size=2, grad_accum=1, num_epochs=None, max_steps=3)
    [line, *_] = length_lines(2, train, processes=1, launch="as given", rows_per_micro_batch=1)
    assert "2 rows // (1 prompt per micro-batch = micro_batch_size 2 completions / grpo.num_generations 2 x 1" in line


def test_a_grpo_lines_general_formula_counts_prompts(tmp_path):
    """Found by a bug bash (bb64): the same line's `in general rows // (micro_batch_size x processes x grad_accum)`
    gave 40 // (4 x 4 x 1) = 2 steps at 4 processes where the line's own count (and the run) said 10: GRPO's
    micro_batch_size counts completions, the formula takes prompts."""
    from types import SimpleNamespace

    train = SimpleNamespace(micro_batch_size=4, grad_accum=1, num_epochs=None, max_steps=3)
    [line, *_] = length_lines(40, train, processes=2, launch="as given", rows_per_micro_batch=1)
    assert "; 10 at 4 processes; in general rows // (prompts per micro-batch x processes x grad_accum)" in line, line


def test_fewer_rows_than_a_global_micro_batch_are_refused_before_the_length_line(tmp_path, capsys):
    """Found by a bug bash (bb51 #10): with data.packing's 2 rows for a micro-batch of 4, `finetune train` said its
    length line ("each step takes rows of more than one epoch", as if it would go on), loaded the model, and only then
    refused; `finetune validate` refused at once. The run now refuses where its length is resolved, before any weight
    loads, with validate's paragraph."""
    import pytest

    from finetune.errors import DataError

    with pytest.raises(DataError, match=r"only 2 training rows for a global micro-batch of 6 \(train.micro_batch_size=3"):
        resolve_max_steps(_recipe(tmp_path, max_steps=4), 2, 2)
    assert "length" not in capsys.readouterr().out
    resolve_max_steps(_recipe(tmp_path, max_steps=4), 6, 2)  # one global micro-batch: runs
    assert "fewer rows than one step takes" not in capsys.readouterr().out
