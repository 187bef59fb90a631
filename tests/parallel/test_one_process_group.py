"""One process with a process group: the planner's one-GPU route (FSDP + CPU offload over one rank), started as
`finetune train R --accelerate-config fsdp2 --num-processes 1`. accelerate runs any FSDP, DeepSpeed or multi-GPU config
through torch's elastic launcher, which gives even one process a group; the pre-flight check of `finetune train` and
`finetune validate` simulated every one-process launch without one, and refused the route. Found by a bug bash (bb18,
finding 1); each test failed on the code before its fix."""

from __future__ import annotations

import pytest
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe
from shipped import CONFIG_DIR, CPU_SWITCH

from finetune import cli
from finetune.cli import train

OFFLOAD = "parallel.cpu_offload=true"


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "out", train={"max_steps": 2}))


def test_the_simulated_group_is_the_one_accelerates_own_launcher_choice_gives(monkeypatch):
    """Found by a bug bash: validate simulated every one-process launch without a group, whatever the config. Which
    launcher accelerate picks for each shipped config at --num_processes 1 (its launch_command, launchers stubbed) is
    the simulation's answer: torch's elastic launcher (a group) for FSDP, DeepSpeed and DDP, the simple one for
    single_gpu."""
    from accelerate.commands import launch as accelerate

    from finetune.parallel.launcher import accelerate_launch_forms_group

    chosen: list[str] = []
    for name in ("simple_launcher", "multi_gpu_launcher", "deepspeed_launcher"):
        monkeypatch.setattr(accelerate, name, lambda args, name=name: chosen.append(name))
    answers = {}
    for config in sorted(CONFIG_DIR.glob("*.yaml")):
        args = accelerate.launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", "1",
                                                             "run.py"])
        accelerate.launch_command(args)
        answers[config.stem] = (chosen.pop() != "simple_launcher", accelerate_launch_forms_group(str(config)))
    assert all(launched == simulated for launched, simulated in answers.values()), answers
    assert answers["fsdp2"] == (True, True) and answers["single_gpu"] == (False, False), answers


def test_fsdp_with_cpu_offload_over_one_process_is_accepted_where_the_launch_forms_a_group(recipe, monkeypatch, capsys):
    """Found by a bug bash: `finetune train/validate R --accelerate-config fsdp2 --num-processes 1` with CPU offload (the
    planner's one-GPU route) was refused ("this single process has none"), though that launch trains; and the fix it
    named was `torchrun ... finetune/run.py`, which a wheel user does not have."""
    one = ["--accelerate-config", "fsdp2", "--num-processes", "1"]
    assert cli.main(["validate", str(recipe), *one, OFFLOAD]) == 0
    out = capsys.readouterr().out
    assert "launch: 1 process, as given" in out and "parallel: FSDP2 over 1 process (full shard, params offloaded" in out
    assert cli.main(["validate", str(recipe), *one, "parallel.strategy=fsdp"]) == 0  # (was: "only 1 process was started")
    assert "parallel: FSDP2 over 1 process" in capsys.readouterr().out
    launched: list[list[str]] = []
    monkeypatch.setattr(train, "_launch", lambda args, drop=(): launched.append(args) or 0)
    assert cli.main(["train", str(recipe), *one, OFFLOAD]) == 0  # the pre-flight passes: accelerate is started
    assert launched and launched[0][launched[0].index("--num_processes") + 1] == "1"
    assert launched[0][launched[0].index("--config_file") + 1].endswith("fsdp2.yaml")
    # Where the process really has no group (single_gpu's simple launcher, a run in this process), refused, naming
    # the route that works installed or not.
    for no_group in (["--accelerate-config", "single_gpu", "--num-processes", "1"], []):
        assert cli.main(["validate", str(recipe), *no_group, OFFLOAD]) == 2
        said = capsys.readouterr().err
        assert "asks for CPU offload" in said, said
        assert "`finetune train RECIPE.yaml --accelerate-config fsdp2 --num-processes 1`" in said, said


@pytest.mark.slow
def test_the_one_gpu_offload_route_trains_through_finetune_train(recipe, tmp_path, monkeypatch, capfd):
    """Found by a bug bash: the route the planner recommends for a model larger than one GPU exited 2 before launching.
    Here it is launched as a user starts it (CPU: ACCELERATE_USE_CPU, as every shipped config runs in the suite)."""
    for name, value in CPU_SWITCH.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["train", str(recipe), "--accelerate-config", "fsdp2", "--num-processes", "1", OFFLOAD])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "parallel: FSDP2 over 1 process (full shard, params offloaded to CPU)" in out + err, (out + err)[-3000:]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
