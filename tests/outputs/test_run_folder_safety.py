"""Nothing the user had is lost: found by a bug bash of destructive writes. A fresh run cleared every entry of the
names a run writes (adapter/, checkpoints/, tensorboard/, metrics.jsonl, ...) in output.dir whoever made them, and
replaced recipe.yaml: a project folder's own TensorBoard history and PEFT adapter, or the recipe being run itself
(`output.dir: .`), were gone without a word. Now such a folder is refused before anything loads (validate says it
too) unless its recipe.yaml is the resolved recipe a run wrote for it; a file named like a run's folder is refused
at once, not at the first checkpoint; a symlinked checkpoints/ no longer keeps a replaced run's steps."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune import cli, outputs
from finetune.outputs.run_folder import begin_outputs
from finetune.outputs.step_folders import list_checkpoints
from finetune.recipe import load_recipe, recipe_to_yaml


def _tree(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, rows, tmp_path / "proj"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_project_folders_own_entries_are_refused_not_cleared(recipe, tmp_path, capsys, overwrite):
    project = tmp_path / "proj"
    for name, text in {"README.txt": "mine", "adapter/adapter_model.bin": "peft", "metrics.jsonl": "{}\n",
                       "tensorboard/exp1/events.out.tfevents.1.host": "events"}.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    before = _tree(project)
    assert cli.main(["train", str(recipe), f"output.overwrite={str(overwrite).lower()}"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "holds adapter/, tensorboard/, metrics.jsonl, which no finetune run wrote there" in said, said
    assert "it has no recipe.yaml" in said and "Nothing was changed" in said
    assert cli.main(["validate", str(recipe)]) == 2
    assert _tree(project) == before


def test_the_recipe_being_run_is_never_written_over(tiny_llama, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "proj2"
    folder.mkdir()
    monkeypatch.chdir(folder)  # `output.dir: .` and `./rows.jsonl`, run from the recipe's folder
    rows = write_jsonl(folder / "rows.jsonl", addition_rows(16))
    recipe = write_recipe(folder / "recipe.yaml", recipe_dict(tiny_llama, rows, folder))
    recipe.write_text("# my notes\n" + recipe.read_text().replace(str(folder), "."))  # output.dir: . (and the data)
    before = recipe.read_bytes()
    assert cli.main(["train", str(recipe)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "holds recipe.yaml, which no finetune run wrote there (its recipe.yaml is not the resolved" in said, said
    assert recipe.read_bytes() == before


def test_a_run_folder_of_a_run_that_stopped_early_starts_again(recipe, tmp_path):
    """The folder a failed run left (its resolved recipe.yaml, metrics, no checkpoint) is a run's: a new start clears it."""
    run = tmp_path / "proj"
    run.mkdir()
    (run / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(str(recipe))))
    (run / "metrics.jsonl").write_text("{}\n")
    assert outputs.output_dir_problem(run, overwrite=False, resume=None) is None
    older = (run / "recipe.yaml").read_text().replace(f"dir: {run}\n", f"dir: {run.parent.name}/proj\n")
    (run / "recipe.yaml").write_text(older)  # before a4f6ddb: output.dir as the recipe gave it, relative
    assert f"dir: {run.parent.name}/proj" in older
    assert outputs.output_dir_problem(run, overwrite=False, resume=None) is None
    moved = shutil.copytree(run, tmp_path / "moved")  # copied or moved (another mount): still a run's folder
    assert outputs.output_dir_problem(moved, overwrite=True, resume=None) is None


@pytest.mark.parametrize("name", ["checkpoints", "adapter"])
def test_a_file_named_like_a_runs_folder_is_refused_before_anything_loads(recipe, tmp_path, capsys, name):
    """Before: accepted as usable; the run trained up to its first checkpoint and failed there ("Not a directory.
    Older checkpoints are kept"), or renamed a file named adapter out of the way."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / name).write_text("a file")
    assert cli.main(["train", str(recipe)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"holds {name} as a file, where a run writes a folder" in said, said


def test_a_symlinked_checkpoints_folder_loses_the_replaced_runs_steps_and_stays_a_link(tmp_path):
    """Before: rmtree failed silently on the link, so `output.overwrite` kept the replaced run's step folders, later
    listed, exported and resumed as the new run's."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    (scratch / "step-00000004").mkdir(parents=True)
    (scratch / "notes.txt").write_text("the user's")
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    begin_outputs(run, "recipe: {}\n", resume_from=None)
    assert (run / "checkpoints").is_symlink() and not list_checkpoints(run)
    assert (scratch / "notes.txt").read_text() == "the user's"


def test_an_output_dir_inside_a_data_folder_is_refused(tiny_llama, tmp_path, capsys):
    """Before: accepted; the run wrote metrics.jsonl and recipe.yaml into the dataset folder, and the next launch (a
    resume too) read them as rows ("file metrics.jsonl: no row has the instruction field")."""
    data = tmp_path / "dfold"
    write_jsonl(data / "part-0.jsonl", addition_rows(16))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, data))
    assert cli.main(["validate", str(recipe)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "output.dir" in said and "is inside data.datasets[0]'s folder" in said, said
    assert sorted(p.name for p in data.iterdir()) == ["part-0.jsonl"]
    assert load_recipe(str(recipe)).output.dir  # a run already there is still read back (export --step, generate)
