"""The faults a cluster throws, on real 2-rank runs through the shipped accelerate configs with the library's settings
(bf16, LoRA dropout 0.05 on all linear layers, checkpointing on):

  * one worker SIGKILLed at a random step (not the launcher): the job ends within seconds, non-zero, a survivor names
    the dead rank, the newest checkpoint is intact and `train.resume=auto` gives the uninterrupted adapter bitwise;
  * one worker SIGSTOPped: the others fail after parallel.collective_timeout_s, naming the collective and the stopped
    rank; nothing on disk is damaged;
  * the disk fills during a checkpoint (output.dir on a small tmpfs): one paragraph, the previous checkpoint intact, no
    partial files; once there is space again the resume is bitwise;
  * the disk fills during the adapter write: the earlier adapter stays as it was.
The whole-job kill trials (single, DDP, FSDP2, FSDP1) are in test_checkpoint.py, ZeRO-3's in test_deepspeed.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    LIBRARY_LORA,
    REPO,
    RUN_PY,
    addition_rows,
    child_env,
    free_port,
    recipe_dict,
    write_jsonl,
    write_recipe,
)
from processes import finish, kill_plan, outline, start, wait_for_step, worker_pids
from shipped import CPU_SWITCH

from finetune.outputs import checkpoint, step_folders

MAX_STEPS, SAVE_EVERY = 9, 3


def launch(config: str, recipe: Path, out_dir: Path, *overrides: str) -> list[str]:
    """The command a user runs: `accelerate launch --config_file accelerate_configs/<config>.yaml finetune/run.py ...`."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / f"{config}.yaml"),
            "--num_processes", "2", "--main_process_port", str(free_port()), str(RUN_PY), str(recipe),
            f"output.dir={out_dir}", *overrides]


def run(args: list[str], log: Path) -> tuple[int, str]:
    return finish(start(args, log, env=child_env(**CPU_SWITCH)), log)


def adapter(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def assert_nothing_damaged(out_dir: Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder matches its manifest and no temporary folder or file is left behind (a save that a lost
    peer interrupted is removed by the survivors)."""
    kept = step_folders.list_checkpoints(out_dir)
    assert all(step_folders.checkpoint_problem(path) is None for _, path in kept), kept
    leftovers = [p for p in [*out_dir.glob(".*"), *out_dir.glob("checkpoints/.*")] if p.name != ".finetune.lock"]
    assert not leftovers, leftovers
    return kept


@pytest.fixture(scope="module")
def faults(tiny_llama, tmp_path_factory):
    """(recipe, root, uninterrupted FSDP2 run folder): the library's settings, FSDP2 through fsdp2.yaml."""
    root = tmp_path_factory.mktemp("faults")
    data = write_jsonl(root / "train.jsonl", addition_rows())
    values = recipe_dict(tiny_llama, data, root / "unused", lora=LIBRARY_LORA,
                         train={"max_steps": MAX_STEPS, "save_every": SAVE_EVERY, "keep_last": 3, "log_every": 1,
                                "micro_batch_size": 2})
    values["model"]["dtype"] = "bfloat16"
    recipe = write_recipe(root / "recipe.yaml", values)
    code, output = run(launch("fsdp2", recipe, root / "ref"), root / "ref.log")
    assert code == 0, output[-3000:]
    return recipe, root, root / "ref"


@pytest.mark.slow
def test_one_killed_rank_ends_the_job_names_it_and_the_resume_is_bitwise(faults):
    recipe, root, ref = faults
    step, rank, note = kill_plan("fsdp2-accelerate-one-rank", SAVE_EVERY + 1, MAX_STEPS - 1, ranks=2)
    out, log = root / "killed", root / "killed.log"
    process = start(launch("fsdp2", recipe, out), log, env=child_env(**CPU_SWITCH))
    wait_for_step(process, out, step, log)
    workers = worker_pids(process.pid)
    assert sorted(workers) == [0, 1], (workers, note)
    os.kill(workers[rank], signal.SIGKILL)
    killed_at = time.monotonic()
    code = process.wait(timeout=60)
    output = log.read_text()
    assert code != 0 and time.monotonic() - killed_at < 40, (note, output[-3000:])
    assert not (out / "adapter").exists(), f"the run finished before the kill landed ({note})"
    # The survivor's next collective fails (the launcher's SIGTERM only asks it to stop after its step): it names the
    # rank it lost, in one paragraph without a frame of ours (the launcher prints its own report after it).
    assert "lost a peer" in output and f"rank {rank} (pid {workers[rank]} on " in output, (note, outline(output))
    assert f'File "{RUN_PY.parent}' not in output, (note, output[-3000:])
    assert_nothing_damaged(out)
    code, output = run(launch("fsdp2", recipe, out, "train.resume=auto"), root / "resumed.log")
    assert code == 0 and "resumed from" in output, (note, output[-3000:])
    assert_bitwise(adapter(ref), adapter(out))
    assert_nothing_damaged(out)


@pytest.mark.slow
def test_a_stopped_rank_fails_the_others_after_the_collective_timeout(faults):
    recipe, root, _ = faults
    step, rank, note = kill_plan("ddp-accelerate-sigstop", SAVE_EVERY + 1, MAX_STEPS - 1, ranks=2)
    out, log = root / "stopped", root / "stopped.log"
    process = start(launch("ddp", recipe, out, "parallel.collective_timeout_s=5"), log, env=child_env(**CPU_SWITCH))
    try:
        wait_for_step(process, out, step, log)
        workers = worker_pids(process.pid)
        os.kill(workers[rank], signal.SIGSTOP)
        stopped_at = time.monotonic()
        # The collective timeout; then the launcher SIGTERMs the stopped rank, which cannot act on it, and SIGKILLs it
        # 30 s later (torch elastic's fixed grace after a worker failed; TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not used
        # there; measured by hand, docs/checkpoints.md). The test does that SIGKILL itself once the survivor is gone.
        survivor = workers[1 - rank]
        deadline = time.monotonic() + 60
        while _running(survivor) and time.monotonic() < deadline:
            time.sleep(0.1)
        failed_after = time.monotonic() - stopped_at
        os.kill(workers[rank], signal.SIGKILL)
        code = process.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(workers[rank], signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert code != 0 and 5 <= failed_after < 30, (note, failed_after, output[-3000:])
    assert "no answer within parallel.collective_timeout_s = 5 s" in output, (note, output[-3000:])
    assert f"rank {rank} (pid {workers[rank]} on " in output and "is stopped (SIGSTOP" in output, (note, output[-3000:])
    assert "lost a peer during step " in output or "lost a peer during the checkpoint" in output, (note, output[-3000:])
    assert "train.resume=auto" in output and f'File "{RUN_PY.parent}' not in output
    assert not (out / "adapter").exists()
    assert_nothing_damaged(out)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int):
    """A tmpfs of `size_bytes` mounted at `path` (root only); the test is skipped where no filesystem can be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"a size-limited filesystem needs a tmpfs mount, which failed here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _pages(folder: Path) -> int:
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in folder.rglob("*") if f.is_file())


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_paragraph_and_the_resume_after_it_is_bitwise(faults):
    recipe, root, ref = faults
    size = _pages(step_folders.list_checkpoints(ref)[-1][1])
    # Room for the first checkpoint and the small files, not for a second one.
    with small_filesystem(root / "small", int(1.5 * size) + 64 * 4096) as disk:
        out = disk / "run"
        code, output = run(launch("fsdp2", recipe, out), root / "full.log")
        assert code != 0, output[-3000:]  # the workers exit 2; the launcher reports 1
        assert f"step {2 * SAVE_EVERY}'s checkpoint was not written: no space left on the filesystem of {out}" in output
        first = checkpoint.checkpoint_dir(out, SAVE_EVERY)
        assert f"the newest checkpoint, {first} (step {SAVE_EVERY}), is intact" in output, output[-3000:]
        assert "The next checkpoint needs " in output and "train.resume=auto" in output
        assert f'File "{RUN_PY.parent}' not in output, output[-3000:]
        assert [step for step, _ in assert_nothing_damaged(out)] == [SAVE_EVERY]
        subprocess.run(["mount", "-o", f"remount,size={64 * size}", str(disk)], check=True)
        code, output = run(launch("fsdp2", recipe, out, "train.resume=auto"), root / "after.log")
        assert code == 0 and f"resumed from {first} at step {SAVE_EVERY}" in output, output[-3000:]
        assert_bitwise(adapter(ref), adapter(out))


def test_a_full_disk_during_the_adapter_write_keeps_the_earlier_adapter(tmp_path):
    from peft import LoraConfig
    from safetensors.torch import load_file

    from finetune.errors import CheckpointError
    from finetune.outputs import save_adapter

    config = LoraConfig(r=4, target_modules=["q_proj"], base_model_name_or_path="tiny")
    key_map = {"m.q_proj.lora_A.weight": "base_model.model.m.q_proj.lora_A.weight"}
    with small_filesystem(tmp_path / "small", 256 * 1024) as disk:
        earlier = {"m.q_proj.lora_A.weight": torch.full((4, 64), 0.5)}
        save_adapter(config, key_map, earlier, disk / "adapter")
        bigger = {"m.q_proj.lora_A.weight": torch.ones(4, 64 * 1024)}  # 1 MiB: more than the disk holds
        with pytest.raises(CheckpointError) as raised:
            save_adapter(config, key_map, bigger, disk / "adapter")
        message = str(raised.value)
        assert f"the adapter was not written to {disk / 'adapter'}: no space left" in message
        assert "the adapter already there is unchanged" in message and "train.resume=auto" in message
        assert torch.equal(load_file(str(disk / "adapter" / "adapter_model.safetensors"))[
            "base_model.model.m.q_proj.lora_A.weight"], earlier["m.q_proj.lora_A.weight"])
        assert sorted(p.name for p in disk.iterdir()) == ["adapter"]  # no temporary folder left
