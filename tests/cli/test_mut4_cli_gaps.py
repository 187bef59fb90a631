"""Mutation testing round 4 (mut4): rules of the CLI (plan, generate, validate, export) and of the launch checks
(distributed.py, rendezvous.py) that no test read.

Found by a bug bash: each test below is the one check that a surviving mutant broke without any test failing. All
in-process: the launcher's command line, other ranks and other machines are stood in for with monkeypatch.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from finetune import distributed, rendezvous
from finetune.cli import main as cli_main
from finetune.cli.export import local_base
from finetune.cli.generate import prompt_style
from finetune.cli.plan import _asked_key
from finetune.cli.validate import _main_machine_problem
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.recipe import validate_recipe

ONE_PROCESS = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                       backend=None)


# ------------------------------------------------------------------------------------------------ finetune plan
def test_deepspeed_without_a_zero_stage_is_planned_as_zero3():
    """Found by a bug bash (mut4 CL01): parallel.strategy deepspeed without zero_stage runs ZeRO-3 (parallel/zero.py's
    default), so `finetune plan` judges the recipe's strategy by the ZeRO-3 row; `"zero3" if stage == 3 else "zero2"`
    judged it by ZeRO-2's and no test noticed."""
    recipe = validate_recipe({"model": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "x.jsonl"}]}, "parallel": {"strategy": "deepspeed"}},
                             dtype_device="gpu")
    assert recipe.parallel.zero_stage is None
    assert _asked_key(recipe.parallel) == "zero3"  # the planner's row recipe_strategy_verdict judges it by
    assert _asked_key(recipe.parallel.model_copy(update={"zero_stage": 2})) == "zero2"


# -------------------------------------------------------------------------------------------- finetune generate
def test_generate_names_the_dataset_that_renders_otherwise_by_its_index(tokenizer):
    """Found by a bug bash (mut4 CL05): with a second dataset of another format, generate's first line names it
    data.datasets[1]; counted from 0 over datasets[1:], it named datasets[0] (the one the prompts follow)."""
    recipe = validate_recipe({"model": {"name_or_path": "some/model"},
                              "data": {"datasets": [{"path": "a.jsonl", "format": "chat"},
                                                    {"path": "b.jsonl", "format": "alpaca"}]}})
    assert "; data.datasets[1] rendered its rows otherwise" in prompt_style(recipe, tokenizer).said


# -------------------------------------------------------------------------------------------- finetune validate
def test_a_machine_other_than_the_main_one_does_not_check_the_main_address(tmp_path):
    """Found by a bug bash (mut4 CL06): only machine 0 must own main_process_ip; on machine 1 (or 2, ...) it is the
    main machine's address, never this one's. `machine_rank != 0` -> `> 1` refused machine 1's config."""
    def config(rank: int) -> str:
        path = tmp_path / f"rank{rank}.yaml"
        path.write_text(yaml.safe_dump({"num_machines": 2, "machine_rank": rank, "main_process_ip": "203.0.113.7",
                                        "main_process_port": 29500}), encoding="utf-8")
        return str(path)

    assert _main_machine_problem(config(1), launching=False) is None
    assert "is not an address of this machine" in _main_machine_problem(config(0), launching=False)


# ---------------------------------------------------------------------------------------------- finetune export
def test_a_relative_base_folder_is_written_as_its_absolute_path(tmp_path, monkeypatch):
    """Found by a bug bash (mut4 CL07): export --base ./base writes the folder's absolute path into
    adapter_config.json (a relative one failed to load from any other folder); without resolve() it stayed `base`."""
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    assert local_base("./base") == str(tmp_path / "base")
    assert local_base("org/hub-model") == "org/hub-model"


def test_an_occupied_export_folder_is_refused_before_the_source_is_read(tmp_path, capsys):
    """Found by a bug bash (mut4 CL08): export refuses an OUT that exists before any work (the check of
    export_adapter comes after the source is opened and read); without it a bad source was reported instead, and a
    good one was loaded for nothing."""
    (tmp_path / "out").mkdir()
    code = cli_main(["export", str(tmp_path / "no-such-run"), str(tmp_path / "out")])
    text = capsys.readouterr()
    assert code != 0 and "already exists; nothing was overwritten" in text.out + text.err


# ------------------------------------------------------------------------------------- the launch (distributed)
def test_a_launch_asked_for_two_processes_that_formed_no_group_is_refused(monkeypatch):
    """Found by a bug bash (mut4 DI02): two processes asked of the launcher, one seen, is the accelerate-on-CPU trap
    (each process would train its own copy); `asked > 1` -> `> 2` let the two-process case through."""
    monkeypatch.setenv("FINETUNE_EXPECT_WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="asked for 2 processes"):
        distributed._check_not_silently_split(ONE_PROCESS)
    monkeypatch.setenv("FINETUNE_EXPECT_WORLD_SIZE", "1")
    monkeypatch.setattr(rendezvous, "launcher_asked_processes", lambda: 0)
    distributed._check_not_silently_split(ONE_PROCESS)


def test_any_rank_is_true_when_another_rank_says_true(monkeypatch):
    """Found by a bug bash (mut4 DI01): a NaN or a stop signal on any rank stops every rank (all_reduce MAX); MIN asked
    every rank to agree and no in-process test saw it. The other rank is a stand-in for all_reduce."""
    dist = distributed.dist
    other_rank = {"flag": 1.0}

    def all_reduce(tensor, op):
        other = torch.tensor([other_rank["flag"]], device=tensor.device)
        tensor.copy_(torch.maximum(tensor, other) if op == dist.ReduceOp.MAX else torch.minimum(tensor, other))

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed, "info", lambda: ONE_PROCESS)
    assert distributed.any_rank(False) is True
    assert distributed.any_rank(True) is True
    other_rank["flag"] = 0.0
    assert distributed.any_rank(False) is False


def test_an_unknown_machine_is_never_this_one(monkeypatch):
    """Found by a bug bash (mut4 DI03): where /proc cannot be read both ranks' machine ids are "unknown"; equal
    unknowns say nothing (a peer's pid would be looked up in this host's /proc). Without `!= UNKNOWN_MACHINE` they
    were taken for the same machine."""
    monkeypatch.setattr(rendezvous, "machine_id", lambda: rendezvous.UNKNOWN_MACHINE)
    assert rendezvous.same_machine(rendezvous.UNKNOWN_MACHINE) is False


@pytest.mark.parametrize("flags", [["--num-processes", "2"], ["--nproc-per-node=2"], ["--num_processes", "2"]])
def test_the_launchers_dashed_spellings_of_the_process_count_are_read(monkeypatch, flags):
    """Found by a bug bash (mut4 DI04): accelerate and torchrun take --num-processes and --nproc-per-node as well as
    the underscore spellings; with only the underscore ones read, a silently split launch went unrefused."""
    argv = ["/usr/bin/python", "/usr/bin/accelerate", "launch", *flags, "train.py"]

    class ParentCmdline:
        def __init__(self, path):
            assert str(path).endswith("/cmdline")

        def read_bytes(self):
            return "\0".join(argv).encode()

    monkeypatch.setattr(rendezvous, "Path", ParentCmdline)
    assert rendezvous.launcher_asked_processes() == 2
