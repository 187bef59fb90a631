"""The recipe library's names and comments as every verb reads them: the launch a recipe's comment names, a library
name beside a folder of that name, and a `$FINETUNE_RECIPES` folder holding a broken file. Found by a bug bash
(bb9, findings 4, 11 and 12); each test failed on the code before its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune import cli
from finetune.cli.library import library_dir, recipe_names, resolve_recipe_path

GEMMA_COMMENT = "# accelerate config: accelerate_configs/single_gpu.yaml (1x24 GB); fsdp2.yaml with num_processes: 2 to shard\n"
LLAMA_70B_COMMENT = "# accelerate config: accelerate_configs/fsdp2.yaml with num_processes: 8 (8x80 GB); multi_node.yaml for 2 machines\n"


def _launch_counts(path: Path) -> tuple[int, int]:
    """The processes `finetune validate` checks and those `finetune data` counts steps per epoch at, for a recipe file
    launched as its comment names (no --num-processes, no --accelerate-config)."""
    from finetune.cli.preview import launch_processes
    from finetune.cli.validate import _launch_checked
    from finetune.parallel import accelerate_config_env

    config, processes, _ = _launch_checked(str(path), None, None)
    validated = processes or (int(accelerate_config_env(config)["ACCELERATE_NUM_PROCESSES"]) if config else 1)
    return validated, launch_processes(str(path), None)[0]


def _documented_launches() -> dict[str, int]:
    """docs/recipes.md's table: recipe -> processes of the first accelerate config in its last column (`fsdp2.yaml
    x8` -> 8; a config without `xN`, single_gpu.yaml, is one process)."""
    found = {}
    for line in (REPO / "docs" / "recipes.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (first := re.search(r"(\w+)\.yaml( x(\d+))?", cells[3])):
            found[cells[0]] = int(first.group(3)) if first.group(3) else 1
    return found


def test_every_library_recipe_is_validated_and_counted_at_the_launch_its_comment_names_first():
    """Found by a bug bash: `finetune validate gemma-2-9b` checked "single_gpu.yaml with num_processes: 2" (DDP x2),
    taking the 2 that the comment writes for fsdp2.yaml, so validate said 4 steps per epoch where `finetune data` and
    `finetune train` used 9 (8 shipped recipes); and `finetune data llama-3.1-70b` counted fsdp2.yaml's own 2 processes
    where validate checked the comment's 8."""
    documented = _documented_launches()
    assert {"gemma-2-9b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-14b"} <= set(documented), documented
    wrong = []
    for name in recipe_names():
        validated, counted = _launch_counts(library_dir() / f"{name}.yaml")
        expected = documented.get(name, counted)
        if not validated == counted == expected:
            wrong.append(f"{name}: validate {validated}, data {counted}, docs/recipes.md {documented.get(name)}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(("comment", "processes", "parallel"), [(GEMMA_COMMENT, 1, "single process\n"),
                                                                  (LLAMA_70B_COMMENT, 8, "FSDP2 over 8 processes (full")],
                         ids=["single_gpu-then-fsdp2-x2", "fsdp2-x8"])
def test_validate_and_data_say_the_same_launch_and_steps_per_epoch(comment, processes, parallel, tiny_llama, tmp_path,
                                                                   capsys, monkeypatch):
    """Found by a bug bash: with gemma-2-9b's comment line, `finetune validate` said "DDP over 2 processes ... 4 steps
    per epoch" while `finetune data` said 9 steps at 1 process and `finetune train` ran 9 steps on one process."""
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "rows.jsonl", addition_rows(40))
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, data, tmp_path / "out", data={"eval_fraction": 0}))
    path.write_text(comment + path.read_text())
    assert cli.main(["validate", str(path)]) == 0
    validated = capsys.readouterr().out
    assert f"launch: {processes} process{'es' if processes > 1 else ''}, as the recipe names it" in validated, validated
    assert f"parallel: {parallel}" in validated, validated
    assert cli.main(["data", str(path), "--rows", "0"]) == 0
    counted = capsys.readouterr().out
    steps = 40 // (4 * processes)  # 40 rows, micro_batch_size 4, no eval split
    assert f"{steps} steps per epoch" in validated, validated
    assert f"steps per epoch: {steps} at {processes} process" in counted, counted


def test_a_folder_of_the_same_name_does_not_hide_a_library_recipe(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: beside a model downloaded to ./qwen2.5-7b, `finetune validate qwen2.5-7b` said "recipe file
    not found (it is a folder)": a folder is never a recipe, and the library has one of that name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-7b").mkdir()
    (tmp_path / "my-model").mkdir()
    assert resolve_recipe_path("qwen2.5-7b") == str(library_dir() / "qwen2.5-7b.yaml")
    assert resolve_recipe_path("my-model") == "my-model"  # no library recipe: the loader says it is a folder
    (tmp_path / "own").write_text("a file is a recipe path as given")
    assert resolve_recipe_path("own") == "own"
    assert cli.main(["plan", "qwen2.5-7b"]) == 0
    assert "Qwen" in capsys.readouterr().out


def test_a_broken_file_in_finetune_recipes_is_named_and_the_rest_are_listed(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: one file of a $FINETUNE_RECIPES folder that does not parse made `finetune recipes` print
    only that file's error and list none of the others (a file that is not UTF-8 gave a traceback)."""
    (tmp_path / "good.yaml").write_text((REPO / "recipes" / "quickstart.yaml").read_text())
    (tmp_path / "broken.yaml").write_text("model: {name_or_path: x\n")
    (tmp_path / "latin1.yaml").write_bytes("description: caf\u00e9\n".encode("latin-1"))
    (tmp_path / "folder.yaml").mkdir()  # matches *.yaml and cannot be read as a file
    (tmp_path / "list.yaml").write_text("- a list\n")
    (tmp_path / "odd-model.yaml").write_text("model: just-a-name\ndescription: odd but readable\n")
    monkeypatch.setenv("FINETUNE_RECIPES", str(tmp_path))
    assert cli.main(["recipes"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    listed = {line.split()[0] for line in out.splitlines() if line and not line.startswith(("finetune", "accelerate",
                                                                                            "not listed"))}
    assert listed == {"good", "odd-model"}, out
    problems = {line.split(":")[1].strip(): line for line in out.splitlines() if line.startswith("not listed: ")}
    assert set(problems) == {str(tmp_path / name) for name in ("broken.yaml", "latin1.yaml", "folder.yaml", "list.yaml")}
    assert "YAML syntax error" in problems[str(tmp_path / "broken.yaml")]
    assert "not UTF-8" in problems[str(tmp_path / "latin1.yaml")]
    assert "cannot be read" in problems[str(tmp_path / "folder.yaml")]
    assert "must be a YAML mapping" in problems[str(tmp_path / "list.yaml")]
    assert cli.main(["recipes", "show", "latin1"]) == 2
    assert "latin1.yaml: not UTF-8 text" in capsys.readouterr().err


def test_run_py_takes_a_library_name_as_finetune_train_does(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: `python finetune/run.py quickstart` (so `accelerate launch ... finetune/run.py qwen2.5-7b`)
    said "quickstart: recipe file not found ... `finetune recipes` lists the library", though docs/recipes.md says a
    library name works wherever a recipe path does; and a folder ./qwen2.5-7b hid the library recipe."""
    from finetune.run import main as run_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-7b").mkdir()  # a model downloaded there
    assert run_main(["qwen2.5-7b", "train.max_stepz=3"]) == 2  # refused at its override: the library recipe was read
    err = " ".join(capsys.readouterr().err.split())
    assert "train.max_stepz" in err and "not found" not in err and "Traceback" not in err, err
