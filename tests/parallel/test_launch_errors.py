"""A mistake every rank finds reaches the terminal once, whole, whichever rank gets there first, under each real
launcher (accelerate launch with the shipped ddp.yaml, torchrun, the DeepSpeed launcher), before the process group
exists (the recipe) and after (the parallel plan).

The race is made to go each way every time, not left to luck: a sitecustomize that the launched processes import
holds one rank for 3 s before it starts. Before the fix, rank 1 winning printed "(rank 1) r.yaml: 1 problem in the
recipe:" with nothing under it and exited, and the launcher SIGTERMed rank 0 before it printed the paragraph.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import RUN_PY, addition_rows, child_env, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe
from shipped import CONFIG_DIR, CPU_SWITCH, launch

MISTAKES = {  # the recipe's train keys -> the lines the paragraph must hold
    "recipe": ({"learning_rat": 0.001, "gradient_accumulation_steps": 4},
               ["2 problems in the recipe:", "  train.learning_rat: unknown key. Did you mean `learning_rate`?",
                ("  train.gradient_accumulation_steps: unknown key. `gradient_accumulation_steps` is `train.grad_accum` "
                 "here.")]),
    "plan": ({}, ["the parallel setup cannot work:", ("  - parallel.strategy is `layer_split` but 2 processes were "
                  "started")]),
}
PARALLEL = {"recipe": {}, "plan": {"strategy": "layer_split"}}


def _launched(launcher: str, recipe, overrides: list[str]):
    if launcher == "accelerate":
        return launch("ddp.yaml", recipe, *overrides, timeout=240)
    if launcher == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(RUN_PY), str(recipe), *overrides]
    else:
        args = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                str(free_port()), str(RUN_PY), str(recipe), *overrides]
    return run_cmd(args, env=child_env(ACCELERATE_USE_CPU="true"), timeout=240, warm=False)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(MISTAKES))
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun", "deepspeed"])
def test_the_paragraph_reaches_the_terminal_once_whole_whichever_rank_is_first(launcher, mistake, tiny_qwen2,
                                                                                 tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == os.environ.get('SLOW_RANK'):\n"
        "    time.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    train_keys, lines = MISTAKES[mistake]
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_qwen2, data, tmp_path / "out", train=train_keys,
                                                           parallel=PARALLEL[mistake]))
    overrides: list[str] = []
    for slow in ("0", "1"):  # rank 1 first (the case that lost the paragraph), then rank 0 first
        monkeypatch.setenv("SLOW_RANK", slow)
        result = _launched(launcher, recipe, overrides)
        err = result.stderr
        assert result.returncode != 0
        assert err.count(lines[0]) == 1, f"slow rank {slow}:\n{err[-3000:]}"  # once
        start = err.index(lines[0])
        assert all(line in err[start:] for line in lines[1:]), f"slow rank {slow}:\n{err[-3000:]}"  # whole
        assert "(rank 1)" not in err  # no header of another rank, with or without its problems
        assert f'File "{RUN_PY.parent}' not in err  # no traceback of ours (the launcher's own may follow)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_refusal_rank_0_decides_for_every_rank_is_printed_once(tiny_qwen2, tmp_path):
    """output.dir holding a finished run: rank 0 decides (files.on_main) and every rank raises the same error, which
    every rank printed, "(rank 1) output.dir ... already holds a finished run" beside rank 0's (4 times with 4
    processes, found in a bug bash; so were the resume refusals and the stop by a signal)."""
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"the user's adapter")
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_qwen2, data, out))
    result = _launched("accelerate", recipe, [])
    assert result.returncode != 0, result.stderr[-3000:]
    assert result.stderr.count("already holds a finished run") == 1 and "(rank 1)" not in result.stderr, result.stderr
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == b"the user's adapter"


@pytest.mark.slow
def test_a_disagreement_with_the_accelerate_config_names_the_file_and_both_fixes(tiny_qwen2, tmp_path):
    """The user's own copy of fsdp2.yaml (activation checkpointing on) named relative to their folder, and a recipe
    with checkpointing off: the refusal said "the accelerate config has fsdp_activation_checkpointing" without saying
    which file (found in a bug bash). `accelerate launch` itself, not the suite's warm launch: the file is read from
    the launcher's command line."""
    from shipped import CONFIG_DIR

    (tmp_path / "my_fsdp.yaml").write_text((CONFIG_DIR / "fsdp2.yaml").read_text())
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_qwen2, data, tmp_path / "out",
                                                           train={"gradient_checkpointing": False}))
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "my_fsdp.yaml", "--num_processes",
            "2", "--main_process_port", str(free_port()), str(RUN_PY), str(recipe)]
    result = run_cmd(args, env=child_env(ACCELERATE_USE_CPU="true"), timeout=240, warm=False, cwd=tmp_path)
    err = result.stderr
    assert result.returncode != 0
    assert err.count(f"the parallel setup cannot work (the accelerate config: {tmp_path / 'my_fsdp.yaml'}):") == 1, err
    assert ("Fix: set train.gradient_checkpointing: true in the recipe, or fsdp_activation_checkpointing: false in "
            "the accelerate config.") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # ~10 s: a plain python start whose process group waits out a 4 s timeout
def test_variables_left_in_a_shell_are_one_paragraph_after_a_said_wait_not_a_silent_traceback(tiny_qwen2, tmp_path):
    """`python finetune/run.py` in a shell where WORLD_SIZE/RANK/MASTER_* were left by another job: nothing was
    printed for the whole collective timeout (600 s), then torch's 25-line traceback ("Timed out after 601 seconds
    waiting for clients. 1/2 clients joined."). Now rank 0 says it is waiting, and the end is one paragraph naming
    the address and `unset ...` (the same for a node of a multi-node job that never started, under a launcher)."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_qwen2, data, tmp_path / "out"))
    port = free_port()
    env = child_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_RUN_ID", None)
    result = run_cmd([sys.executable, str(RUN_PY), str(recipe), "parallel.collective_timeout_s=4"], env=env,
                     timeout=120, warm=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert f"waiting for the other 1 rank(s) at 127.0.0.1:{port} (up to parallel.collective_timeout_s = 4 s)" in output
    assert (f"finetune: error: the process group of 2 ranks did not form at 127.0.0.1:{port} within "
            "parallel.collective_timeout_s = 4 s. This process was not started by torchrun or accelerate launch") in output
    assert "`unset WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT` trains in one process" in output


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_runs_started_together_on_one_machine_each_get_a_port(name, tmp_path):
    """Found by a bug bash of launches: two `finetune train --accelerate-config ddp` started together on one machine (a
    sweep's `&`, two jobs on one node): the second died with torch's EADDRINUSE traceback on port 29500. accelerate's
    launcher checks the port only before torch binds it, so the second run's check passed while the first had not yet
    bound. The shipped single-machine configs now say `main_process_port: 0` (accelerate picks a free port). Here the
    launcher runs, as `finetune train` runs it, a script that forms the process group and reports its port. Whether
    the second check comes before the first bind is a matter of timing (here it often does not: the second then falls
    back to a free port itself), so the fixed port is what is checked: neither run takes accelerate's 29500."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os, torch.distributed as dist\n"
                     "dist.init_process_group('gloo'); dist.barrier()\n"
                     "if dist.get_rank() == 0: print('port', os.environ['MASTER_PORT'], flush=True)\n"
                     "dist.destroy_process_group()\n")  # one rank prints: two ranks' unbuffered prints interleaved
    command = [sys.executable, "-m", "finetune.cli.accelerate_launch", "--config_file",
               str(CONFIG_DIR / f"{name}.yaml"), str(probe)]
    runs = [subprocess.Popen(command, env=child_env(**CPU_SWITCH), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(outputs)[-3000:]
    ports = [{line.split()[1] for line in output.splitlines() if line.startswith("port ")} for output in outputs]
    assert all(len(port) == 1 for port in ports) and ports[0] != ports[1] and {"29500"} not in ports, ports



@pytest.mark.slow
def test_a_machine_that_never_joins_is_one_paragraph_naming_the_meeting_point(tmp_path):
    """Found by a bug bash (bb22 #2): machine 0 of a 2-machine launch whose other machine never started waited 900 s
    without a word, then printed torch's DistStoreError traceback. The wait is the launcher's (before any rank runs):
    here shortened with the launcher's own `--rdzv_conf timeout=3`, as docs/distributed.md says; its end is now one
    paragraph naming this machine, the address and port, and the way to shorten the wait."""
    probe = tmp_path / "probe.py"
    probe.write_text("print('a rank ran')\n")
    port = free_port()
    command = [sys.executable, str(RUN_PY.parent / "cli" / "accelerate_launch.py"), "--multi_gpu", "--num_machines", "2",
               "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--rdzv_conf", "timeout=3",
               str(probe)]
    result = subprocess.run(command, env=child_env(**CPU_SWITCH), capture_output=True, text=True, timeout=120,
                            check=False)
    said = " ".join(result.stderr.split())
    assert result.returncode == 1 and "a rank ran" not in result.stdout
    assert f"this is machine 0 of 2, meeting at 127.0.0.1:{port}" in said and "--rdzv_conf timeout=N" in said, said
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
