"""Run-folder messages found by bug bash 38: a train.resume path that does not exist is said so first (not refused as
a destructive continuation of a finished run), and a resume that trains no step says no more than that (no plot
warning leaking `finetune plot`'s error, no best eval of another run's evaluations)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from conftest import RUN_PY, addition_rows, recipe_dict, run_cmd, write_jsonl, write_recipe

from finetune.cli import main as cli_main
from finetune.errors import CheckpointError
from finetune.outputs import claim_output_dir, output_dir_problem
from finetune.recipe import validate_recipe
from finetune.tracking import plot


def _finished_run(folder):
    """A finished run's folder: its adapter, its resolved recipe, checkpoints 2 and 3 kept."""
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"the finished adapter")
    for step in (2, 3):
        (folder / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    return folder


def test_a_resume_path_that_does_not_exist_is_said_so_before_the_finished_run_refusal(tmp_path):
    """Found by a bug bash: train.resume=RUN/checkpoints/step-00000009 (not kept: 2 and 3 are) in a finished run's
    folder was refused as "would continue it in place from that checkpoint: the finished adapter and every later
    checkpoint would be removed", naming a fix (another output.dir) that only then said the path does not exist."""
    run = _finished_run(tmp_path / "run")
    missing = run / "checkpoints" / "step-00000009"
    assert output_dir_problem(run, overwrite=False, resume=str(missing)) is None
    values = {"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "unused.jsonl"}]},
              "train": {"resume": str(missing)}, "output": {"dir": str(run)}}
    with pytest.raises(CheckpointError) as caught, claim_output_dir(validate_recipe(values)):
        pass
    assert str(caught.value).startswith(f"train.resume: {missing} does not exist."), str(caught.value)
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == b"the finished adapter"
    # What was right stays so: an existing checkpoint of the finished run is still refused as a continuation in place
    problem = output_dir_problem(run, overwrite=False, resume=str(run / "checkpoints" / "step-00000003"))
    assert problem and "would continue it in place from that checkpoint" in problem


def test_the_plot_of_a_run_that_logged_no_step_is_not_a_warning(tmp_path, capsys):
    """Found by a bug bash: a resume trained no step into a new folder, and the end of the run warned "no plot.png
    (FinetuneError: RUN: has no metrics.jsonl; `finetune plot` takes run folders ...)", a CLI error inside a
    warning. Nothing was logged there: nothing to draw, nothing to warn about."""
    (tmp_path / "run").mkdir()
    assert plot.plot_run(tmp_path / "run") is None
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 0, "generation_score": 0.5}) + "\n")
    assert plot.plot_run(tmp_path / "run") is None
    assert capsys.readouterr().err == ""
    assert cli_main(["plot", str(tmp_path / "run")]) == 2  # `finetune plot` itself still says why
    assert "holds no loss yet" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resume_that_trains_no_step_into_another_folder_claims_no_evaluation(tiny_llama, tmp_path):
    """Found by a bug bash: the hint of a DeepSpeed run's best eval (train.resume=CKPT train.max_steps=<its step>
    output.dir=NEW) gave a run that trained nothing and said "best eval loss ... at step 4 of 2 evaluations; its
    checkpoint is not kept", about the first run's evaluations, beside the plot warning above. It says that nothing
    was left to train, writes the adapter, and claims no evaluation."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(40))
    first = tmp_path / "first"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, first, train={
        "max_steps": 4, "micro_batch_size": 2, "eval_every": 2, "save_every": 2, "gradient_checkpointing": False},
        data={"eval_fraction": 0.1}))
    done = run_cmd([sys.executable, str(RUN_PY), str(recipe)])
    assert done.returncode == 0 and "best eval loss" in done.stdout + done.stderr, done.stderr[-3000:]
    new = tmp_path / "new"
    done = run_cmd([sys.executable, str(RUN_PY), str(recipe), f"train.resume={first / 'checkpoints' / 'step-00000004'}",
                    "train.max_steps=4", f"output.dir={new}"])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "nothing left to train; its adapter is written" in output, output[-3000:]
    assert "best eval loss" not in output and "warning: no plot.png" not in output, output[-3000:]
    summary = json.loads(output.split("[finetune] done: ")[1].splitlines()[0])
    assert summary["eval_loss"] is None and summary["best_eval_step"] is None, summary
    assert summary["tokens_per_s"] is None, summary  # no token trained: not a speed of 0.0
    assert (new / "adapter" / "adapter_model.safetensors").is_file()
    assert yaml.safe_load((new / "recipe.yaml").read_text())["output"]["dir"] == str(new)


def test_a_chat_template_file_gone_since_the_run_is_read_from_what_the_checkpoint_kept(tmp_path, capsys):
    """Found by a bug bash: with the run's model.chat_template .jinja file moved, `export --step` / `generate --step`
    were refused with a fix (edit the checkpoint's recipe.yaml) that damaged the checkpoint, and `generate RUN` dropped
    the whole recipe. The template the run trained with, which each checkpoint keeps, is read instead, with a note."""
    from finetune.outputs.run_folder import saved_recipe

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "chat_template.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    recipe = {"model": {"name_or_path": str(tmp_path / "base"), "chat_template": str(tmp_path / "gone.jinja")},
              "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}]}}
    for folder in (checkpoint, tmp_path / "run"):  # a checkpoint's recipe.yaml, and the run folder's
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
        assert template in str(saved_recipe(folder / "recipe.yaml").model.chat_template)
        assert f"model.chat_template {tmp_path / 'gone.jinja'} is gone; the template the run was trained with, kept " \
               f"in {checkpoint}, is used" in capsys.readouterr().out
