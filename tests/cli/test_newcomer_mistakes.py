"""A newcomer's mistakes that a review (2026-12-06) found ending in a traceback, passing `validate` and failing `train`,
given the wrong fix, or silently changing what the user had. Each was reproduced on the code before this file.

In-process through `finetune.cli.main` (exit code 2, one paragraph, no traceback), but for the launch through
`finetune train --accelerate-config` (real processes: the exit code and the launcher's output are the subject).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import addition_rows, child_env, recipe_dict, write_jsonl, write_recipe

from finetune import cli, outputs
from finetune.errors import RecipeError
from finetune.recipe.text import read_yaml

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "accelerate_configs"


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    return write_recipe(tmp_path / "recipe.yaml",
                        recipe_dict(tiny_llama, write_jsonl(tmp_path / "rows.jsonl", addition_rows(16)), tmp_path / "out"))


def refused(capsys, *argv: str) -> str:
    """The paragraph a mistake gets: exit 2 and no traceback."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return " ".join(err.split())


def test_a_checkpoint_of_another_run_never_writes_over_a_finished_one(tmp_path, recipe, capsys):
    """train.resume=PATH skipped the output folder's check: a finished run's adapter and checkpoints were replaced."""
    finished, other = tmp_path / "out", tmp_path / "other"
    (finished / "adapter").mkdir(parents=True)
    adapter = finished / "adapter" / outputs.ADAPTER_WEIGHTS
    adapter.write_bytes(b"the user's adapter")
    from finetune.recipe import load_recipe, recipe_to_yaml

    (finished / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(str(recipe), [f"output.dir={finished}"])))
    (other / "checkpoints" / "step-00000002").mkdir(parents=True)
    foreign = str(other / "checkpoints" / "step-00000002")
    problem = outputs.output_dir_problem(finished, overwrite=False, resume=foreign)
    assert "already holds a finished run" in problem and "another folder's checkpoint" in problem
    assert outputs.output_dir_problem(finished, overwrite=False, resume="auto") is None  # its own run: continued
    # An earlier checkpoint of its own, explicitly (the Fix of a too-short max_steps): the finished adapter and later
    # checkpoints would go. Found by a bug bash of destructive writes: it replaced them without a word.
    (finished / "checkpoints" / "step-00000001").mkdir(parents=True)  # (one that is there: bb38's F3)
    in_place = outputs.output_dir_problem(finished, overwrite=False,
                                          resume=str(finished / "checkpoints" / "step-00000001"))
    assert "would continue it in place" in in_place and "another output.dir" in in_place, in_place
    assert outputs.output_dir_problem(finished, overwrite=True, resume=foreign) is None
    before = hashlib.sha256(adapter.read_bytes()).hexdigest()
    assert "Nothing was changed" in refused(capsys, "train", str(recipe), f"train.resume={foreign}")
    assert hashlib.sha256(adapter.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("name,text,expected", [
    ("empty.jsonl", "", "no rows"),
    ("blank.jsonl", "\n\n  \n", "no rows"),
    ("empty.json", "[]", "no rows"),
    ("empty.csv", "", "cannot read it as CSV"),
    ("header.csv", "instruction,input,output\n", "cannot read it as CSV"),
], ids=["empty.jsonl", "blank.jsonl", "empty.json", "empty.csv", "header.csv"])
def test_a_dataset_without_rows_is_one_paragraph(name, text, expected, recipe, tmp_path, capsys):
    (tmp_path / name).write_text(text)
    assert expected in refused(capsys, "validate", str(recipe), f"data.datasets.0.path={tmp_path / name}")


def test_bytes_that_are_not_utf8_name_the_line(recipe, tmp_path, capsys):
    rows = [line.encode() for line in (write_jsonl(tmp_path / "ok.jsonl", addition_rows(30)).read_text().splitlines())]
    rows[24] = rows[24].replace(b"Add", b"Add \xff")
    (tmp_path / "latin.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    said = refused(capsys, "validate", str(recipe), f"data.datasets.0.path={tmp_path / 'latin.jsonl'}")
    assert "latin.jsonl line 25: not UTF-8 text (byte 0xff at column" in said and "iconv" in said


def test_a_key_given_twice_in_the_yaml_is_refused(recipe, tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("model: {name_or_path: m}\ntrain:\n  max_steps: 4\n  learning_rate: 1.0e-3\n"
                    "data: {datasets: [{path: rows.jsonl}]}\ntrain:\n  seed: 3\n")
    with pytest.raises(RecipeError, match=r"line 6, column 1: .*`train` is given twice in one mapping \(first at line 2\)"):
        read_yaml(path)
    assert "`max_steps` is given twice" in refused(capsys, "validate", str(recipe), "train={max_steps: 2, max_steps: 3}")


@pytest.mark.parametrize("override,means", [("output.path=x", "`output.dir`"), ("model.path=x", "`model.name_or_path`"),
                                            ("train.lr=0.1", "`train.learning_rate`"), ("lora.rank=4", "`lora.r`"),
                                            ("data.path=x", "`data.datasets[].path`")])
def test_a_name_written_for_a_key_of_its_own_section_says_that_key(override, means, recipe, capsys):
    said = refused(capsys, "validate", str(recipe), override)
    name = override.split("=")[0].split(".")[1]
    assert f"`{name}` is {means}" in said


def test_a_target_module_that_matches_nothing_is_refused_before_weights_load(recipe, capsys):
    """PEFT drops a misspelled name beside good ones without a word (fewer LoRAs), and fails on one alone with a
    traceback."""
    for targets in ("[q_projj]", "[q_proj, nonexist_proj]"):
        said = refused(capsys, "validate", str(recipe), f"lora.target_modules={targets}")
        assert "matches no module of this model" in said and "Its Linear layers: down_proj, gate_proj" in said
    assert cli.main(["validate", str(recipe), "lora.target_modules=[q_proj, v_proj]"]) == 0
    said = refused(capsys, "validate", str(recipe), "lora.target_modules=q_proj")  # one line, not one per union branch
    assert "1 problem" in said and "a list of module names (e.g. [q_proj]" in said and "literal[" not in said


def test_a_model_path_that_is_not_a_model_folder_fails_before_the_hub(recipe, tiny_llama, capsys):
    assert "`./no_such_model`: no such folder" in refused(capsys, "validate", str(recipe), "model.name_or_path=./no_such_model")
    said = refused(capsys, "validate", str(recipe), f"model.name_or_path={tiny_llama / 'config.json'}")
    assert "is a file; give the folder that holds it" in said


def test_validate_checks_the_launch_train_makes_and_what_train_would_refuse(recipe, tmp_path, capsys):
    assert cli.main(["validate", str(recipe), "--accelerate-config", "fsdp2", "--num-processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "launch: 1 process" in out and "parallel: single process" in out  # --num-processes wins, as in accelerate
    assert "not an accelerate config" in refused(capsys, "validate", str(recipe), "--accelerate-config", str(recipe))
    with pytest.raises(SystemExit) as exited:
        cli.main(["validate", str(recipe), "--num-processes", "-2"])
    assert exited.value.code == 2
    assert "train.resume: maybe does not exist" in refused(capsys, "validate", str(recipe), "train.resume=maybe")
    one = write_jsonl(tmp_path / "one.jsonl", addition_rows(1))
    said = refused(capsys, "validate", str(recipe), f"data.datasets.0.path={one}", "train.micro_batch_size=2",
                   "data.eval_fraction=0")
    assert "only 1 training rows for a global micro-batch of 2" in said


def test_cli_numbers_and_file_names_are_checked(recipe, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", str(tmp_path), "--max-new-tokens", "0", "--prompt", "hi"])
    assert exited.value.code == 2 and "must be 1 or more" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert "not an image file name" in refused(capsys, "plot", str(tmp_path / "run"), "--out", "x.yaml")
    assert "must be more than 0" in refused(capsys, "plan", str(recipe), "--gpu-memory", "0")


@pytest.mark.slow
def test_finetune_train_with_a_launcher_exits_2_without_the_launchers_traceback(recipe, tmp_path):
    """accelerate's launcher exits 1 whatever a rank's code, after twenty lines of its own traceback."""
    rows = [line for line in write_jsonl(tmp_path / "r.jsonl", addition_rows(40)).read_text().splitlines()]
    rows[29] = rows[29][:-3]  # line 30 broken: past the 20 lines checked before the launch
    (tmp_path / "bad.jsonl").write_text("\n".join(rows) + "\n")
    result = subprocess.run([sys.executable, "-m", "finetune", "train", str(recipe), f"data.datasets.0.path={tmp_path / 'bad.jsonl'}",
                             "--accelerate-config", "ddp", "--num-processes", "2"],
                            check=False, capture_output=True, text=True, timeout=300,
                            env=child_env(ACCELERATE_USE_CPU="true"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "line 30 is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]


# ------------------------------------------------------------------------------ what a review of the fixes found
def test_lines_ended_by_bare_carriage_returns_are_rows(recipe, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "lf.jsonl", addition_rows(16)).read_text().splitlines()
    (tmp_path / "cr.jsonl").write_bytes(("\r".join(rows) + "\r").encode())
    assert cli.main(["validate", str(recipe), f"data.datasets.0.path={tmp_path / 'cr.jsonl'}"]) == 0
    assert "16 rows" in capsys.readouterr().out


def test_overwrite_with_another_folders_checkpoint_replaces_the_old_run(tmp_path):
    """output.overwrite=true is the fix the refusal names; the start from another folder's checkpoint then clears this
    folder's adapter, checkpoints and metrics, as a fresh start does (they were kept, and a later resume=auto took
    the old run's newest checkpoint)."""
    out, other = tmp_path / "out", tmp_path / "other" / "checkpoints" / "step-00000002"
    for folder in (out / "adapter", out / "checkpoints" / "step-00000500", other):
        folder.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 100, "loss": 1.0}\n')
    outputs.begin_outputs(out, "model: {}\n", other)
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]


def test_quickstart_takes_one_second_stage(tmp_path, capsys):
    """`finetune quickstart --tiny --dpo --grpo` ran GRPO alone without a word (a bug bash)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["quickstart", "--tiny", "--dpo", "--grpo", "--out", str(tmp_path / "qs")])
    assert exited.value.code == 2 and "--grpo: not allowed with argument --dpo" in capsys.readouterr().err
    assert not (tmp_path / "qs").exists()


def test_plan_speaks_of_the_strategy_the_recipe_asks_for(recipe, capsys):
    """`finetune plan r.yaml parallel.strategy=fsdp` concluded "DDP on 2 GPU(s) fits": the planner's choice for auto,
    not the strategy the recipe asks for (a bug bash)."""
    assert cli.main(["plan", str(recipe), "parallel.strategy=fsdp", "--gpus", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("the recipe's parallel.strategy fsdp: FSDP full shard on 2 GPU(s) fits"), lines[-2:]
    assert lines[-1].startswith("parallel.strategy: auto would choose: ") and "DDP on 2 GPU(s) fits" in lines[-1]
    assert cli.main(["plan", str(recipe), "parallel.strategy=ddp"]) == 0
    assert "the recipe's parallel.strategy ddp: not planned on 1 GPU(s)" in capsys.readouterr().out
    assert cli.main(["plan", str(recipe)]) == 0  # auto: the planner's choice alone
    assert "the recipe's" not in capsys.readouterr().out


def test_validate_refuses_what_the_launch_would_hang_or_fail_on(recipe, tmp_path, capsys, monkeypatch):
    """Found by a bug bash of launches: `finetune train --accelerate-config multi_node` on machine 0 with the
    template's placeholder address (10.0.0.1) retried it for 15 minutes with C++ stack traces (now refused; validate,
    which may plan it from a login node, notes it); validate called a read-only output.dir "usable" (train refused it
    in 2 s). A read-only mount is simulated (os.access on the folder, as access(2) answers EROFS even for root):
    mounting needs privileges CI lacks."""
    said = refused(capsys, "train", str(recipe), "--accelerate-config", "multi_node")
    assert "main_process_ip 10.0.0.1 is not an address of this machine" in said and "`hostname -I`" in said, said
    assert cli.main(["validate", str(recipe), "--accelerate-config", "multi_node", "--num-processes", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note: accelerate config" in out and "`finetune train` here refuses it: the launcher would wait" in out, out
    config = read_yaml(REPO_CONFIGS / "multi_node.yaml")
    config.update(main_process_ip="127.0.0.1", num_processes=2)
    local = tmp_path / "two_machines.yaml"
    local.write_text(yaml.safe_dump(config))
    assert cli.main(["validate", str(recipe), "--accelerate-config", str(local)]) == 0
    capsys.readouterr()
    config.update(machine_rank=1, main_process_ip="10.0.0.1")  # another machine: machine 0's address, not ours
    local.write_text(yaml.safe_dump(config))
    assert cli.main(["validate", str(recipe), "--accelerate-config", str(local)]) == 0
    capsys.readouterr()
    config = read_yaml(REPO_CONFIGS / "fsdp2.yaml")  # its free port (main_process_port: 0) on 2 machines: never meet
    config.update(num_machines=2, num_processes=4, main_process_ip="127.0.0.1")
    local.write_text(yaml.safe_dump(config))
    said = refused(capsys, "train", str(recipe), "--accelerate-config", str(local))
    assert "num_machines 2 with main_process_port 0" in said and "main_process_port to one port" in said, said

    locked = tmp_path / "locked"
    locked.mkdir()
    import finetune.cli.validate as validate_module

    real = validate_module.os.access
    monkeypatch.setattr(validate_module.os, "access", lambda path, mode: Path(path) != locked and real(path, mode))
    said = refused(capsys, "validate", str(recipe), f"output.dir={locked / 'run'}")
    assert f"output.dir {locked / 'run'}: cannot write there (Permission denied: {locked})" in said, said


def test_validate_of_a_library_recipe_checks_the_launch_its_comment_names_and_says_hub_data_is_read_later(capsys):
    """`finetune validate llama-3.1-70b` checked 2 processes (fsdp2.yaml's own count) where the recipe says "fsdp2.yaml
    with num_processes: 8", and said "data: 0 local rows have the fields their format needs" of a hub dataset, which
    read like a failure."""
    assert cli.main(["validate", "llama-3.1-70b"]) == 0
    out = capsys.readouterr().out
    assert "launch: 8 processes, as the recipe names it (accelerate_configs/fsdp2.yaml with num_processes: 8)" in out
    assert "parallel: FSDP2 over 8 processes" in out and "0 local rows" not in out, out
    assert "data: HuggingFaceH4/ultrachat_200k: hub dataset, read when the run starts (not here)" in out, out
