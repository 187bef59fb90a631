"""GRPO runs (slow): real processes under every shipped accelerate config, a failing reward that stops the run
with its last checkpoint intact, kill -9 then resume bitwise, and the plot of a GRPO run. The recipe, data, rewards
and sampling are checked in-process in test_grpo.py."""

from __future__ import annotations

import math
import os
import signal
import sys
import textwrap

import pytest
import torch
from conftest import RUN_PY, free_port, read_metrics, write_jsonl, write_recipe
from test_grpo import grpo_recipe, sums

REWARDS_MODULE = textwrap.dedent('''
    import os

    CALLS = [0]


    def digits(prompts, completions, **columns):
        """The share of digit characters: a reward a tiny random model can learn in a few steps."""
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


    def flaky(prompts, completions, **columns):
        """Raises from its call number FAIL_AT on (a run's step, one micro-batch per step)."""
        CALLS[0] += 1
        if CALLS[0] >= int(os.environ.get("FAIL_AT", "1000000")):
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)
    ''')


@pytest.fixture
def rewards_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS_MODULE)
    return tmp_path


def _run(recipe, *overrides, rewards_dir, env: dict | None = None, nproc: int = 1, log=None):
    from conftest import child_env
    from processes import start

    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    environment = child_env(PYTHONPATH=os.pathsep.join([str(rewards_dir), os.environ.get("PYTHONPATH", "")]),
                            **(env or {}))
    log = log or rewards_dir / "run.log"
    return start([*launcher, str(RUN_PY), str(recipe), *overrides], log, env=environment), log


def _untimed(folder) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in ("tokens_per_s", "elapsed_s", "generation_s")}
            for m in read_metrics(folder)]


@pytest.mark.slow
def test_a_failing_reward_stops_the_run_with_its_last_checkpoint_intact(tiny_llama, rewards_dir):
    """Step 3's reward call raises: one paragraph naming the function, the prompt row and the exception, exit 2, no
    update and no checkpoint of step 3; checkpoints 1 and 2 stay, and the run resumes from step 2 to its end."""
    from processes import finish

    prompts = write_jsonl(rewards_dir / "prompts.jsonl", sums())
    values = grpo_recipe(tiny_llama, prompts, rewards_dir / "run", {"reward_functions": ["my_rewards:flaky"]},
                         train={"max_steps": 3, "save_every": 1})
    recipe = write_recipe(rewards_dir / "grpo.yaml", values)
    code, output = finish(*_run(recipe, rewards_dir=rewards_dir, env={"FAIL_AT": "3"}))
    assert code == 2, output[-3000:]
    assert "`flaky` raised ZeroDivisionError: division by zero (on prompt row " in output, output[-3000:]
    assert "Traceback" not in output
    steps = sorted(p.name for p in (rewards_dir / "run" / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000001", "step-00000002"]
    assert [m["step"] for m in read_metrics(rewards_dir / "run") if "loss" in m] == [1, 2]
    code, output = finish(*_run(recipe, "train.resume=auto", rewards_dir=rewards_dir, log=rewards_dir / "resumed.log"))
    assert code == 0 and "resumed from" in output and "step-00000002" in output, output[-3000:]
    assert (rewards_dir / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_kill_then_resume_is_bitwise_with_the_sampling_seeded_by_step(tiny_llama, rewards_dir):
    """kill -9 inside a num_iterations cycle, resume from the checkpoint at the cycle's start: the same completions
    (the sampling seeds are functions of the step), rewards, KL, losses and adapter, bitwise, as the uninterrupted run.
    beta > 0: the reference forward (adapter off) is in the resumed steps too; the completions are trained in chunks
    (grpo.train_chunk_size 3 of 4)."""
    from processes import finish, wait_for_step
    from safetensors.torch import load_file

    prompts = write_jsonl(rewards_dir / "prompts.jsonl", sums())
    values = grpo_recipe(tiny_llama, prompts, rewards_dir / "unused",
                         {"reward_functions": ["my_rewards:digits"], "num_iterations": 2, "beta": 0.1,
                          "temperature": 0.9, "top_p": 0.95, "train_chunk_size": 3},  # 4 completions: 3 + 1
                         train={"max_steps": 6, "save_every": 2, "learning_rate": 3e-2})
    recipe = write_recipe(rewards_dir / "grpo.yaml", values)
    reference = rewards_dir / "reference"
    code, output = finish(*_run(recipe, f"output.dir={reference}", rewards_dir=rewards_dir))
    assert code == 0, output[-3000:]
    run = rewards_dir / "killed"
    process, log = _run(recipe, f"output.dir={run}", rewards_dir=rewards_dir, log=rewards_dir / "killed.log")
    wait_for_step(process, run, 3, log)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert not (run / "adapter").exists()
    code, output = finish(*_run(recipe, f"output.dir={run}", "train.resume=auto", rewards_dir=rewards_dir,
                                log=rewards_dir / "resumed.log"))
    assert code == 0 and "resumed from" in output, output[-3000:]
    assert _untimed(run) == _untimed(reference)  # rewards, lengths, kl, clip ratios, losses, grad norms
    assert max(m.get("kl", 0) for m in read_metrics(reference)) > 0
    expected, resumed = (load_file(str(folder / "adapter" / "adapter_model.safetensors")) for folder in (reference, run))
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)


# The shipped configs, as shipped (bf16): every strategy samples with the policy it trains (DDP, ZeRO-2: the inner
# model; FSDP2, ZeRO-3: gathered once per generate call; FSDP1: gathered by its own hooks at every decoding step).
# Comparable because the sampling is shared: a completion's seed is (train.seed, step,
# prompt row, number in its group), so step 1, whose weights are the same everywhere, samples the same completions on
# 1 process x 2 prompts as on 2 x 1: same rewards and lengths, bitwise, and the same gradient within bf16. After step 1
# the bf16 weights differ in their last bits between strategies, which flips an occasional sampled token, so later
# steps are compared for their health (finite, the KL term live), not their values.
# Every file in accelerate_configs/: deepspeed_zero2 generates with its whole (unpartitioned) parameters, as DDP;
# multi_node is fsdp2 launched as 2 machines of 1 process (tests/shipped.py).
SHIPPED = ("single_gpu", "ddp", "fsdp2", "fsdp1", "deepspeed_zero2", "deepspeed_zero3", "multi_node")
# Measured (3 steps, 2 CPU processes): step-1 grad norm 0.457772 single, 0.457701 DDP/FSDP2/FSDP1, 0.457812 ZeRO-3.
GRAD_NORM_TOLERANCE = 1e-3



def test_every_accelerate_config_is_trained_with_grpo():
    """The GRPO shipped-config test launches every file in accelerate_configs/ (a new file must be added there)."""
    from shipped import CONFIG_DIR

    assert set(SHIPPED) == {path.stem for path in CONFIG_DIR.glob("*.yaml")}

@pytest.mark.slow
def test_every_shipped_config_trains_grpo_on_the_same_completions(tiny_llama, tmp_path, monkeypatch):
    from conftest import accelerate_launch
    from shipped import ACCELERATE_CONFIG_RUNS, recipe_dtype

    prompts = write_jsonl(tmp_path / "prompts.jsonl", sums())
    # FSDP2 and ZeRO-3 sample with the model gathered once per generate call (the default); ZeRO-3 also per_forward
    # (DeepSpeed's own hooks at every decoding step). FSDP2's per_forward (its own hooks, as in training) is trained
    # by the llama-3.1-70b-2x24gb-grpo recipe's two-step run in tests/parallel/test_shipped.py.
    runs = [(config, config, "once") for config in SHIPPED]
    runs.append(("deepspeed_zero3-per_forward", "deepspeed_zero3", "per_forward"))
    logged, seconds = {}, {}
    for name, config, gather in runs:
        processes = ACCELERATE_CONFIG_RUNS[f"{config}.yaml"].processes
        values = grpo_recipe(tiny_llama, prompts, tmp_path / name,
                             {"max_completion_length": 6, "beta": 0.1,
                              "reward_functions": ["finetune.rewards:length_penalty"]},
                             model={"dtype": recipe_dtype(f"{config}.yaml")},
                             train={"max_steps": 3, "micro_batch_size": 8 // processes, "learning_rate": 2e-2})
        monkeypatch.setenv("FINETUNE_GENERATION_GATHER", gather)
        result = accelerate_launch(config, write_recipe(tmp_path / f"{name}.yaml", values))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        logged[name] = [m for m in read_metrics(tmp_path / name) if "loss" in m]
        seconds[name] = [m["generation_s"] for m in logged[name]]
    print("seconds per generate call:", seconds)
    first = logged["single_gpu"][0]
    for name, steps in logged.items():
        assert len(steps) == 3 and all(math.isfinite(m["loss"]) and m["kl"] > 0 for m in steps[1:]), (name, steps)
        for key in ("reward", "reward_std", "rewards/length_penalty/mean", "completions/mean_length"):
            assert steps[0][key] == first[key], (name, key)  # the same completions
        assert steps[0]["grad_norm"] == pytest.approx(first["grad_norm"], abs=GRAD_NORM_TOLERANCE), name


def test_the_plot_reads_the_reward_of_a_grpo_run(tmp_path):
    from finetune.tracking.plot import read_run

    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 0.0, "learning_rate": 1e-3, "reward": 0.25},
                                             {"step": 2, "loss": 0.01, "learning_rate": 1e-3, "reward": 0.5}])
    assert read_run(tmp_path)["reward"] == [(1, 0.25), (2, 0.5)]
