"""Checkpoints with real processes: SIGKILL at a random step (seeded and printed: tests/processes.py kill_plan) then
resume gives the same adapter as an uninterrupted run (bitwise, same world size) for single, DDP (one rank killed),
FSDP2 and FSDP1; a damaged newest checkpoint is skipped; a resume with
another world size reshards; SIGTERM to one FSDP1 rank checkpoints and stops every rank; NaN stops without a write.

Each strategy's three runs (reference, killed, resumed) are made once per session and shared by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CHECKPOINT_EVERY, CHECKPOINT_STEPS, CHECKPOINT_STRATEGIES, RUN_PY, checkpoint_command, train_losses
from processes import finish, kill_plan, last_logged_step, outline, start, wait_for_step, worker_pids

from finetune import outputs
from finetune.outputs import step_folders

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_EVERY = CHECKPOINT_STEPS, CHECKPOINT_EVERY
# DDP loses one worker (the launcher must end the job); the others are killed whole (launcher and workers), as a
# preempted or crashed node. Test_faults.py kills one rank of FSDP2 under accelerate launch, test_deepspeed.py ZeRO-3's.
ONE_RANK = {"ddp"}
# Same global batch (4 rows) for one and two processes, so a resharded resume continues the same run.
STRATEGIES = CHECKPOINT_STRATEGIES
command = checkpoint_command  # (recipe, out_dir, strategy, *overrides) -> the launch


# ------------------------------------------------------------------------------------------------- launching
def run_to_end(args: list[str], log: Path) -> str:
    code, output = finish(start(args, log), log)
    assert code == 0, output[-3000:]
    return output


def adapter(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: dict, b: dict, *, exact: bool) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for key, value in a.items():
        if exact:
            assert torch.equal(value, b[key]), f"{key} differs (max {float((value - b[key]).abs().max())})"
        else:
            # 1 vs 2 processes sum in another order; Adam turns that into ~2.5e-5 per step on LoRA values of ~1e-2,
            # and where the kill lands decides how many steps ran with 2 processes. A wrong reshard is off by ~1e-2.
            torch.testing.assert_close(value, b[key], rtol=1e-3, atol=5e-4)


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def base_recipe(checkpoint_recipe) -> Path:
    return checkpoint_recipe  # tests/conftest.py: the recipe of the shared checkpointed runs


_RUNS: dict[str, dict[str, Path]] = {}


def kill_and_resume(strategy: str, recipe: Path, root: Path, reference) -> dict[str, Path]:
    """Reference run (`reference`: the session's checkpointed_run, tests/conftest.py); a run SIGKILLed at a random step
    (one worker, or launcher and workers); that run resumed.

    `killed` keeps a copy of the killed run's folder for the tests that resume it differently.
    """
    if strategy in _RUNS:
        return _RUNS[strategy]
    ref, run, killed = reference(strategy), root / f"{strategy}-run", root / f"{strategy}-killed"
    step, rank, note = kill_plan(f"{strategy}-{'one-rank' if strategy in ONE_RANK else 'whole-job'}", SAVE_EVERY + 1,
                                 MAX_STEPS - 1, ranks=STRATEGIES[strategy][0])
    log = root / f"{strategy}-killed.log"
    process = start(command(recipe, run, strategy), log)
    wait_for_step(process, run, step, log)
    workers = worker_pids(process.pid)
    if strategy in ONE_RANK:
        os.kill(workers[rank], signal.SIGKILL)
        code = process.wait(timeout=40)  # the launcher ends the job by itself
        died = log.read_text()
        assert code != 0 and f"rank {rank} (pid {workers[rank]} on " in died and "lost a peer" in died, (note, outline(died))
    else:
        for pid in [*workers.values(), process.pid]:  # torchrun starts workers in their own sessions
            os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert not (run / "adapter").exists(), f"the run finished before the kill landed ({note})"
    shutil.copytree(run, killed)
    output = run_to_end(command(recipe, run, strategy, "train.resume=auto"), root / f"{strategy}-resumed.log")
    _RUNS[strategy] = {"ref": ref, "resumed": run, "killed": killed, "resume_log": output, "kill_step": step, "note": note}
    return _RUNS[strategy]


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp2", "fsdp1"])
def test_sigkill_then_resume_gives_the_same_adapter_bitwise(strategy, base_recipe, runs_root, checkpointed_run):
    runs = kill_and_resume(strategy, base_recipe, runs_root, checkpointed_run)
    resumed_step = int(runs["resume_log"].split("at step ")[1].split()[0])
    assert 0 < resumed_step <= runs["kill_step"] and resumed_step % SAVE_EVERY == 0, (runs["note"], runs["resume_log"][-2000:])
    assert_same_adapter(adapter(runs["ref"]), adapter(runs["resumed"]), exact=True)
    # The killed run's metrics past the checkpoint were trimmed, then the steps were trained again identically.
    assert train_losses(runs["resumed"]) == train_losses(runs["ref"])
    kept = [step for step, _ in step_folders.list_checkpoints(runs["resumed"])]
    assert kept == [9, 12]  # keep_last 2 of the saves at steps 3, 6, 9, 12
    assert all(step_folders.checkpoint_problem(path) is None for _, path in step_folders.list_checkpoints(runs["resumed"]))
    assert not (runs["resumed"] / outputs.LOCK_FILE).exists()


def test_checkpoint_holds_only_trainable_state_and_every_rank_shard(base_recipe, runs_root, checkpointed_run):
    runs = kill_and_resume("fsdp2", base_recipe, runs_root, checkpointed_run)
    _, newest = step_folders.list_checkpoints(runs["resumed"])[-1]
    manifest = json.loads((newest / step_folders.MANIFEST).read_text())
    assert {"trainable/__0_0.distcp", "trainable/__1_0.distcp", "rng/rank0.pt", "rng/rank1.pt",
            "trainer_state.json", "recipe.yaml", "trainable/.metadata"} <= set(manifest["files"])
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["step"] == MAX_STEPS and state["world_size"] == 2 and state["data"]["cursor"] > 0
    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = FileSystemReader(str(newest / "trainable")).read_metadata().state_dict_metadata
    model_keys = {key.removeprefix("model.") for key in saved_keys if key.startswith("model.")}
    assert len(model_keys) == len(adapter(runs["ref"])) and all(".lora_" in key for key in model_keys)  # no base weight
    assert any(key.endswith(".exp_avg_sq") for key in saved_keys)  # the optimizer's moments are there


def test_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(base_recipe, runs_root, checkpointed_run, tmp_path):
    # The finished reference run, not the killed one: where the kill lands (a random step) decides whether the killed
    # run has two checkpoints yet; under load a kill at step 4-6 leaves only step 3's (seen on a busy machine).
    runs = kill_and_resume("single", base_recipe, runs_root, checkpointed_run)
    run = tmp_path / "run"
    shutil.copytree(runs["ref"], run)
    shutil.rmtree(run / "adapter")  # the resume must write it again
    checkpoints = step_folders.list_checkpoints(run)
    assert len(checkpoints) >= 2, checkpoints
    (_, older), (_, newest) = checkpoints[-2:]
    shard = newest / "trainable" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated, as by a full disk
    half_written = run / "checkpoints" / "step-00000999"
    shutil.copytree(older, half_written)
    (half_written / step_folders.MANIFEST).unlink()  # renamed into place, killed before the manifest
    output = run_to_end(command(base_recipe, run, "single", "train.resume=auto"), tmp_path / "resume.log")
    assert f"checkpoint {half_written} is damaged and skipped: no manifest.json" in output
    assert f"checkpoint {newest} is damaged and skipped: trainable/__0_0.distcp has" in output
    assert f"resumed from {older} at step" in output
    assert_same_adapter(adapter(runs["ref"]), adapter(run), exact=True)
    assert not half_written.exists()  # a later timeline than the resumed one is removed at the next save


def test_resume_with_another_world_size_reshards_and_says_so(base_recipe, runs_root, checkpointed_run, tmp_path):
    """An FSDP2 checkpoint of 2 processes continued by 1 process ends near the uninterrupted 1-process run (and nearer
    still to the 2-process one, whose first steps it shares)."""
    single = kill_and_resume("single", base_recipe, runs_root, checkpointed_run)
    sharded = kill_and_resume("fsdp2", base_recipe, runs_root, checkpointed_run)
    run = tmp_path / "run"
    shutil.copytree(sharded["killed"], run)
    output = run_to_end(command(base_recipe, run, "single", "train.resume=auto"), tmp_path / "resume.log")
    assert "now single process: adapter and optimizer state resharded" in output, output[-2000:]
    assert_same_adapter(adapter(single["ref"]), adapter(run), exact=False)
    assert_same_adapter(adapter(sharded["ref"]), adapter(run), exact=False)




def test_sigterm_to_one_fsdp1_rank_checkpoints_on_every_rank_then_resumes(base_recipe, runs_root, checkpointed_run, tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "term.log"
    process = start(command(base_recipe, run, "fsdp1", "train.save_every=0"), log)
    wait_for_step(process, run, 4, log)
    workers = worker_pids(process.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGTERM)
    code, output = finish(process, log)
    # Workers exit 143 (128 + SIGTERM); torchrun then prints its own ChildFailedError report, but no frame of ours.
    assert code != 0 and f'File "{RUN_PY.parent}' not in output, output[-3000:]
    assert "stopped by SIGTERM after step" in output and "train.resume=auto" in output, output[-3000:]
    # Every rank stopped after the same step, and rank 0 says so once, naming the signal rank 1 got (each rank printed
    # its own line before: "stopped by a signal to another rank" beside rank 1's)
    assert output.count("stopped by SIGTERM after step") == 1 and "a signal to another rank" not in output
    [(step, path)] = step_folders.list_checkpoints(run)  # save_every=0: only the preemption checkpoint
    assert 4 <= step < MAX_STEPS and step_folders.checkpoint_problem(path) is None
    assert not (run / "adapter").exists()
    output = run_to_end(command(base_recipe, run, "fsdp1", "train.resume=auto", "train.save_every=0"),
                        tmp_path / "resume.log")
    assert f"resumed from {path} at step {step}" in output
    assert_same_adapter(adapter(kill_and_resume("fsdp1", base_recipe, runs_root, checkpointed_run)["ref"]), adapter(run), exact=True)


def test_a_launcher_killed_outright_stops_its_ranks_with_a_checkpoint_not_orphans(base_recipe, tmp_path):
    """SIGKILL to torchrun (or a signal it does not handle: SLURM's SIGUSR1) ended the launcher alone: torch elastic
    starts each rank in a session of its own, so the ranks trained on as orphans to the last step, writing the run
    where nobody looked. Now each rank gets SIGTERM when its launcher dies (PR_SET_PDEATHSIG) and takes the preemption
    path: every rank checkpoints after the same step and exits. A real torchrun (a warm launch's ranks are forked from
    the suite's servers, not from the launcher)."""
    from finetune.distributed import peer_state

    run = tmp_path / "run"
    log = tmp_path / "orphans.log"
    process = start(command(base_recipe, run, "ddp", "train.save_every=0"), log, warm=False)
    wait_for_step(process, run, 3, log)
    workers = worker_pids(process.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 120
    while any(peer_state(socket.gethostname(), pid) == "alive" for pid in workers.values()):
        assert time.monotonic() < deadline, f"ranks still training after their launcher died:\n{outline(log.read_text())}"
        time.sleep(0.1)
    output = log.read_text()
    assert "stopped by SIGTERM after step" in output, output[-3000:]
    [(step, path)] = step_folders.list_checkpoints(run)
    assert 3 <= step < MAX_STEPS and step_folders.checkpoint_problem(path) is None, outline(output)
    assert not (run / "adapter").exists() and last_logged_step(run) == step


def test_sigterm_to_finetune_train_reaches_the_ranks_which_checkpoint_and_stop(base_recipe, tmp_path):
    """`finetune train --accelerate-config ddp`, SIGTERMed alone (kill, `timeout`, a container's stop): it exited 143
    at once and passed nothing on, so the launcher and both ranks trained on as orphans and no preemption checkpoint
    was written. Now it passes SIGTERM to the launcher, which passes it to the ranks: both checkpoint after the same
    step and stop, and the command exits with the ranks' 143."""
    from finetune.distributed import peer_state

    run = tmp_path / "run"
    log = tmp_path / "train.log"
    process = start([sys.executable, "-m", "finetune", "train", str(base_recipe), f"output.dir={run}",
                     "train.save_every=0", "--accelerate-config", "ddp"], log, warm=False)
    wait_for_step(process, run, 3, log)
    ranks = [int(line.split()[0]) for line in subprocess.run(["pgrep", "-f", "-a", "finetune/run.py"], text=True,
             capture_output=True, check=False).stdout.splitlines() if str(base_recipe) in line]
    os.kill(process.pid, signal.SIGTERM)
    code, output = finish(process, log)
    assert code == 143 and "stopped by SIGTERM after step" in output, outline(output)
    [(step, path)] = step_folders.list_checkpoints(run)
    assert 3 <= step < MAX_STEPS and step_folders.checkpoint_problem(path) is None
    assert ranks and not any(peer_state(socket.gethostname(), pid) == "alive" for pid in ranks), ranks


def test_nan_loss_stops_with_a_message_and_writes_no_nan(base_recipe, tmp_path):
    run = tmp_path / "run"
    code, output = finish(start(command(base_recipe, run, "single", "train.learning_rate=1e30", "train.save_every=1"),
                                tmp_path / "nan.log"), tmp_path / "nan.log")
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert "is not finite; stopped before the optimizer step" in output and "train.learning_rate" in output
    assert not (run / "adapter").exists()
    checkpoints = step_folders.list_checkpoints(run)
    assert checkpoints and f"the newest checkpoint, {checkpoints[-1][1]} (step {checkpoints[-1][0]}), is intact" in output
    assert all(step_folders.checkpoint_problem(path) is None for _, path in checkpoints)


def test_nan_policy_skip_goes_on_and_the_summary_counts_the_steps_run_and_skipped(base_recipe, tmp_path):
    """Found by a bug bash of the numbers a run reports: with nan_policy: skip the summary said `steps` 1 (the last
    good step's number) after every step ran, and tokens/s divided the good steps' tokens by every step's time."""
    from conftest import read_metrics

    run = tmp_path / "run"
    code, output = finish(start(command(base_recipe, run, "single", "train.learning_rate=1e30", "train.nan_policy=skip",
                                        "train.save_every=0"), tmp_path / "skip.log"), tmp_path / "skip.log")
    assert code == 0 and "Traceback" not in output, output[-3000:]
    done = output.split("[finetune] done: ")[1].splitlines()[0]  # JSON (its losses may read NaN, which json reads)
    summary = json.loads(done)
    skipped = [r for r in read_metrics(run) if "skipped" in r]  # step 1 trains at lr 1e30; every later step is NaN
    assert skipped and summary["steps"] == MAX_STEPS and summary["skipped_steps"] == len(skipped)
    assert summary["tokens_per_s"] > 0
