"""What a user of the installed wheel is told and given: launch lines that work from where they are (no
finetune/run.py, accelerate_configs/ or recipes/ outside a checkout), `finetune train NAME` making the launch that
`finetune validate NAME` checked, `finetune --version`, and a README wheel build without a stale build/ folder. Found by
a bug bash (bb18, findings 2, 3, 4 and 6); each test failed on the code before its fix."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, addition_rows, recipe_dict, write_jsonl, write_recipe

import finetune
from finetune import cli, errors, quiet, rendezvous

MULTI = "# accelerate config: accelerate_configs/fsdp2.yaml (num_processes: 2, 2x24 GB); single_gpu.yaml on one GPU\n"
CHECKOUT_ONLY = ("finetune/run.py", "--config_file accelerate_configs/", "recipes/quickstart.yaml")


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "out",
                                                         parallel={"strategy": "fsdp"}))


def _announced(text: str) -> str:
    return re.search(r"launch: (.*?)(;|\n|$)", text).group(1)


def test_train_makes_the_launch_validate_checked(recipe, launches, capsys):
    """Found by a bug bash: `finetune validate NAME` checked the launch the recipe's comment names (fsdp2 x2: "recipe
    OK") while `finetune train NAME` ran one process in place and refused (every library recipe with
    parallel.strategy: fsdp). Now train follows a named launch of several processes and says so in one line; a recipe
    naming none, or an explicit flag, runs as before."""
    plain = recipe.read_text()
    recipe.write_text(MULTI + plain)
    assert cli.main(["validate", str(recipe)]) == 0
    checked = _announced(capsys.readouterr().out)
    assert checked == "2 processes, as the recipe names it (accelerate_configs/fsdp2.yaml with num_processes: 2)"
    assert cli.main(["train", str(recipe)]) == 0
    said = capsys.readouterr().out
    assert f"[finetune] launch: {checked}; --num-processes 1 to run in this process" in said, said
    (argv,) = launches["launched"]
    assert argv[argv.index("--config_file") + 1].endswith("fsdp2.yaml") and argv[argv.index("--num_processes") + 1] == "2"
    assert launches["in_process"] == []
    # an explicit flag wins: one process in this process (and the plan refuses fsdp there, naming the launch)
    assert cli.main(["train", str(recipe), "--num-processes", "1"]) == 0 and len(launches["in_process"]) == 1
    recipe.write_text(plain)  # no launch named: validate checks one process, train runs in this process
    assert cli.main(["validate", str(recipe), "parallel.strategy=auto"]) == 0
    assert _announced(capsys.readouterr().out).startswith("1 process, one process (the recipe names no accelerate config")
    assert cli.main(["train", str(recipe), "parallel.strategy=auto"]) == 0
    assert len(launches["in_process"]) == 2 and len(launches["launched"]) == 1
    assert "launch:" not in capsys.readouterr().out


def test_the_fsdp_refusal_of_one_process_names_finetune_train(recipe, capsys):
    """Found by a bug bash: "parallel.strategy is `fsdp` but only 1 process was started. Fix: launch N processes
    (`accelerate launch --config_file accelerate_configs/fsdp2.yaml ...`" named neither `--accelerate-config fsdp2`
    nor a command that works from a wheel."""
    assert cli.main(["validate", str(recipe), "--num-processes", "1"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "parallel.strategy is `fsdp` but only 1 process was started" in said, said
    assert "`finetune train RECIPE.yaml --accelerate-config fsdp2 --num-processes N`" in said, said


def _messages() -> dict[str, str]:
    """Every message that tells the user how to launch a run, as this process would print it from here."""
    import torch

    from finetune import distributed
    from finetune.parallel.launcher import accelerate_config_env
    from finetune.recipe.text import read_yaml
    from finetune.run import usage

    said = {"run --help": usage(), "missing address": rendezvous.missing_address(2),
            "dp": errors.data_parallel_refusal("r.yaml"), "torchrun": errors.torchrun_line()}
    one = distributed.DistInfo(0, 1, 0, 1, torch.device("cpu"), None)
    for name, call in (("not split", lambda: distributed._check_not_silently_split(one)),
                       ("no recipe", lambda: read_yaml("no-such.yaml")),
                       ("no config", lambda: accelerate_config_env("no-such.yaml"))):
        with pytest.raises(errors.FinetuneError) as raised:
            call()
        said[name] = str(raised.value)
    return said


def test_launch_lines_work_from_where_the_user_is(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: outside a checkout (a wheel), `finetune plan`, the refusals, `python -m finetune.run
    --help` and `finetune recipes show` named finetune/run.py, accelerate_configs/X.yaml and recipes/X.yaml, which a
    wheel user does not have. From a checkout they still name its files."""
    monkeypatch.setenv("FINETUNE_EXPECT_WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)  # no finetune/run.py here: the installed forms
    away = _messages()
    assert cli.main(["plan", "llama-3.1-70b", "--gpus", "1"]) == 0  # (plain: the recipe's 8)
    away["plan"] = capsys.readouterr().out
    assert cli.main(["recipes", "show", "llama-3.1-70b-2x24gb"]) == 0
    away["show"] = capsys.readouterr().out
    wrong = {name: path for name, text in away.items() for path in CHECKOUT_ONLY if path in text}
    assert wrong == {}, wrong
    assert "torchrun --standalone --nproc_per_node 2 -m finetune.run RECIPE.yaml" in away["run --help"]
    assert "deepspeed --num_gpus 2 --module finetune.run" in away["run --help"]
    assert "`finetune train RECIPE.yaml --accelerate-config fsdp2 --num-processes 1` (or `torchrun --standalone " \
           "--nproc_per_node 1 -m finetune.run RECIPE.yaml`)" in " ".join(away["plan"].split())
    assert "finetune train r.yaml --accelerate-config ddp --num-processes N" in away["dp"]
    assert "# Launch: finetune train llama-3.1-70b-2x24gb --accelerate-config fsdp2\n" in away["show"]
    assert "`finetune plan llama-3.1-70b-2x24gb --gpus 2" in away["show"]
    monkeypatch.chdir(REPO)  # a checkout: its own files, as before
    here = _messages()
    assert here["torchrun"] == "torchrun --standalone --nproc_per_node N finetune/run.py RECIPE.yaml"
    assert "`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 finetune/run.py" \
           in " ".join(here["not split"].split())
    assert cli.main(["recipes", "show", "llama-3.1-70b-2x24gb"]) == 0
    assert capsys.readouterr().out == (REPO / "recipes" / "llama-3.1-70b-2x24gb.yaml").read_text()


def test_version_prints_finetune_and_its_libraries(monkeypatch, capsys):
    """Found by a bug bash: `finetune --version` (and `python -m finetune --version`, the same main) was "unrecognized
    arguments"; a wheel user had no command to see which finetune a checkpoint's manifest will name."""
    from importlib import metadata

    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)  # (restored after: -v below sets it)
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"finetune {finetune.__version__}",
                     *(f"{name} {metadata.version(name)}" for name in ("torch", "transformers", "peft", "bitsandbytes"))]
    assert cli.main(["-v"]) == 2 and "a verb is needed" in capsys.readouterr().err  # -v stays verbose (no verb: usage)


def test_the_docs_give_an_installed_user_commands_that_exist():
    """Found by a bug bash: README's wheel build (`pip wheel .`) reused a stale build/lib and shipped deleted modules
    and recipes; the docs named only finetune/run.py launches (the module form was documented nowhere), and said the
    one-process FSDP launch of accelerate has no process group."""
    readme = (REPO / "README.md").read_text()
    builds = [line for line in readme.splitlines() if "pip wheel" in line]
    assert builds and all(re.search(r"rm -rf build\b.*pip wheel", line) for line in builds), builds
    distributed = (REPO / "docs" / "distributed.md").read_text()
    for text in (readme, distributed):
        assert "accelerate launch -m finetune.run" in text and "-m finetune.run" in text
    assert "deepspeed --num_gpus 4 --module finetune.run" in distributed
    assert "--accelerate-config fsdp2 --num-processes 1" in distributed
    assert "--accelerate-config fsdp2 --num-processes 1" in (REPO / "docs" / "planner.md").read_text()
    assert "(accelerate's one CPU process) is refused" not in distributed
