"""finetune/devices.py: which GPU a process trains on, and the refusal of GPUs torch cannot use.

No GPU here: each test simulates the machine by patching the one op that would tell (torch.cuda.is_available,
torch.cuda.device_count, dist.init_process_group, or a stand-in `nvidia-smi` on PATH printing what a real driver
prints); everything else runs as it does on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from finetune import devices, distributed
from finetune.errors import EXIT_USER_ERROR, FinetuneError, LaunchError

# `nvidia-smi -L` and the head of `nvidia-smi` on a driver of the CUDA 12.2 generation (535), 8 GPUs.
LISTED = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-4d3c-{i:04d})" for i in range(8))
TABLE = """+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.104.05             Driver Version: 535.104.05   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+"""


@pytest.fixture
def launcher_env(monkeypatch):
    """A clean launcher environment and no process-group state from another test."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_INFO", None)
    return monkeypatch


@pytest.fixture
def driver_535(tmp_path, launcher_env):
    """A stand-in `nvidia-smi` first on PATH (a shell script: the real call, the real parsing)."""
    program = tmp_path / "bin" / "nvidia-smi"
    program.parent.mkdir()
    program.write_text(f"#!/bin/sh\nif [ \"$1\" = -L ]; then\ncat <<'EOF'\n{LISTED}\nEOF\nelse\ncat <<'EOF'\n{TABLE}\nEOF\nfi\n")
    program.chmod(0o755)
    launcher_env.setenv("PATH", f"{program.parent}:{__import__('os').environ['PATH']}")
    return launcher_env


def test_a_cuda_torch_on_an_older_driver_is_refused_not_trained_on_the_cpu(driver_535):
    """Simulated: torch.cuda.is_available() patched to False (what a cu130 build says on a 535 driver, with only a
    warning) and torch.version.cuda to 13.0; nvidia-smi is the stand-in above. Before: the run took the CPU."""
    driver_535.setattr(torch.cuda, "is_available", lambda: False)
    driver_535.setattr(torch.version, "cuda", "13.0")
    driver_535.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(LaunchError) as refused:
        distributed.init_distributed()
    message = str(refused.value)
    assert "\n" not in message and isinstance(refused.value, FinetuneError), message  # one paragraph, exit 2
    assert getattr(refused.value, "exit_code", EXIT_USER_ERROR) == EXIT_USER_ERROR
    assert "nvidia-smi lists 8 GPU(s) (NVIDIA driver 535.104.05, CUDA 12.2)" in message, message
    assert "built for CUDA 13.0, newer than NVIDIA driver 535.104.05 supports" in message, message
    assert ("Fix: install the build for this driver: `pip install --force-reinstall torch==2.11.0 --index-url "
            "https://download.pytorch.org/whl/cu126`") in message, message
    assert distributed._INFO is None

    driver_535.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU asked for: trains there
    assert distributed.init_distributed().device == torch.device("cpu")


def test_gpus_torch_cannot_see_are_refused_only_where_nvidia_smi_lists_them(driver_535, tmp_path):
    """Simulated as above. A CPU build of torch on a GPU machine is refused too; `ACCELERATE_USE_CPU` and
    `CUDA_VISIBLE_DEVICES=-1` are CPU asked for; without nvidia-smi (a CPU machine: this one) nothing is refused."""
    driver_535.setattr(torch.cuda, "is_available", lambda: False)
    driver_535.setattr(torch.version, "cuda", None)
    with pytest.raises(LaunchError, match=r"is a CPU-only build, so this run would train on the CPU.*cu126"):
        devices.check_torch_sees_the_gpus()
    for key, value in (("ACCELERATE_USE_CPU", "true"), ("CUDA_VISIBLE_DEVICES", "-1")):
        driver_535.setenv(key, value)
        devices.check_torch_sees_the_gpus()
        driver_535.delenv(key)
    driver_535.setenv("PATH", str(tmp_path / "empty"))
    assert devices.nvidia_smi_facts() == {}
    devices.check_torch_sees_the_gpus()
    old_driver = devices.unusable_gpus_message({"gpus": ["GPU 0: A100"], "driver": "470.57", "driver_cuda": "11.4"},
                                               "2.13.0+cu126", "12.6")
    assert "Fix: upgrade the NVIDIA driver to one for CUDA 12.6" in old_driver and "pip install" not in old_driver


def bound_launch(monkeypatch, *, visible: int, local_rank: int = 5, processes: int = 8) -> dict:
    """LOCAL_RANK `local_rank` of `processes` on this node, each seeing `visible` GPUs; the process group is never
    formed (init_process_group is patched to note its arguments and stop)."""
    seen: dict = {}

    class Formed(Exception):
        pass

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise Formed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set_device", device))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for key, value in {"WORLD_SIZE": str(processes), "RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
                       "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Formed):
        distributed.init_distributed()
    return seen


def test_a_launch_that_binds_one_gpu_per_process_trains_on_cuda_0(launcher_env):
    """Simulated: torch.cuda.device_count() patched to 1 in LOCAL_RANK 5 of 8 (SLURM --gpus-per-task=1 / --gpu-bind),
    init_process_group patched. Before: refused ("8 processes ... sees 1 GPU"), and without that check cuda:5."""
    seen = bound_launch(launcher_env, visible=1)
    assert seen["set_device"] == torch.device("cuda", 0) and seen["device_id"] == torch.device("cuda", 0), seen
    assert bound_launch(launcher_env, visible=8)["device_id"] == torch.device("cuda", 5)  # all visible: LOCAL_RANK
    with pytest.raises(LaunchError, match="8 processes were started on this node but it sees 4 GPU"):
        bound_launch(launcher_env, visible=4)  # some would share one: refused before NCCL


def test_one_gpu_given_to_several_processes_is_refused_with_the_fix(launcher_env):
    """Simulated: NCCL's error where two ranks got the same GPU (its text, raised by the patched init_process_group)
    becomes one paragraph with the fix; any other error passes through unchanged."""
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
            "version 2.27.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
            "Duplicate GPU detected : rank 5 and rank 0 both on CUDA device 1a000")

    def duplicate(**kwargs):
        raise dist.DistBackendError(nccl)

    launcher_env.setattr(torch.cuda, "is_available", lambda: True)
    launcher_env.setattr(torch.cuda, "device_count", lambda: 1)
    launcher_env.setattr(torch.cuda, "set_device", lambda device: None)
    launcher_env.setattr(dist, "init_process_group", duplicate)
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        launcher_env.setenv(key, value)
    with pytest.raises(LaunchError) as refused:
        distributed.init_distributed()
    message = str(refused.value)
    assert "\n" not in message and "Duplicate GPU detected" in message and "Fix: give each process its own GPU" in message
    with pytest.raises(ValueError, match="other"), devices.shared_gpu_refused(2, 1):
        raise ValueError("other")
