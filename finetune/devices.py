"""Which GPU this process trains on, and refusals where the GPUs a machine has cannot be used as launched.

* The launcher's LOCAL_RANK picks the GPU when every process sees all of the node's GPUs (torchrun, accelerate). A
  launch that binds one GPU to each process (SLURM `--gpus-per-task=1`, `--gpu-bind`; CUDA_VISIBLE_DEVICES set per
  rank) leaves each process one visible GPU whatever its LOCAL_RANK (up to 7 on an 8-GPU node): that one is cuda:0.
  Several processes given one and the same GPU are refused by NCCL ("Duplicate GPU detected"): said here with the fix.
* A CUDA build of torch on a driver older than its CUDA (or a CPU build on a GPU machine) sees no GPU, and torch only
  warns: the run would train on the CPU, 100x slower, without an error. Refused when `nvidia-smi` lists GPUs.

A leaf: torch is imported inside the functions.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from finetune.errors import LaunchError

# torch's CUDA builds per driver generation: a build for CUDA 12.x runs on any CUDA 12 driver (>= 525, CUDA's minor
# version compatibility), so the oldest CUDA 12 build torch still publishes is the one for a CUDA 12 driver.
WHEEL_INDEX = {12: "cu126", 13: "cu130"}
INDEX_URL = "https://download.pytorch.org/whl/"


def check_one_gpu_per_process(local_processes: int, visible_gpus: int) -> None:
    """One GPU per process on a node: more processes than visible GPUs would put two ranks on one GPU, which NCCL
    refuses mid-start ("Duplicate GPU detected"); refuse it first, with the counts and the fix."""
    if local_processes > visible_gpus:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={seen}" if seen is not None else "CUDA_VISIBLE_DEVICES unset"
        raise LaunchError(
            f"{local_processes} processes were started on this node but it sees {visible_gpus} GPU(s) ({where}): two "
            "ranks would share a GPU, which NCCL refuses. Fix: start at most one process per visible GPU "
            f"(accelerate's --num_processes / num_processes, torchrun's --nproc_per_node {visible_gpus}), or make "
            "more GPUs visible in CUDA_VISIBLE_DEVICES."
        )


def local_gpu_index(local_rank: int, local_processes: int, visible_gpus: int) -> int:
    """The CUDA index this process trains on: its LOCAL_RANK when it sees the node's GPUs, 0 when the launcher bound
    one GPU to it (one visible, several processes on the node); refused when some processes would share a GPU."""
    if visible_gpus == 1:
        return 0  # bound one per process, or one process on a one-GPU machine; NCCL refuses a shared one at init
    check_one_gpu_per_process(local_processes, visible_gpus)
    return local_rank


@contextmanager
def shared_gpu_refused(local_processes: int, visible_gpus: int) -> Iterator[None]:
    """NCCL's "Duplicate GPU detected" (several processes given one GPU: its cuda:0) as a one-paragraph refusal."""
    try:
        yield
    except Exception as exc:
        if "Duplicate GPU" not in str(exc):
            raise
        raise LaunchError(
            f"two processes on this node train on the same GPU (NCCL: Duplicate GPU detected): each of the "
            f"{local_processes} processes sees {visible_gpus} GPU and takes it as cuda:0, but the launcher gave "
            "several of them the same one. Fix: give each process its own GPU (SLURM: --gpus-per-task=1, or "
            "CUDA_VISIBLE_DEVICES=$LOCAL_RANK per process), or let every process see all GPUs and start one per GPU "
            "(torchrun --standalone --nproc_per_node N)."
        ) from exc


def nvidia_smi_facts() -> dict:
    """What the NVIDIA driver reports: {"gpus": [`nvidia-smi -L` lines], "driver": "535.104.05", "driver_cuda":
    "12.2"}; {} without nvidia-smi or when it fails (no driver loaded)."""
    program = shutil.which("nvidia-smi")
    if program is None:
        return {}
    try:
        listed = subprocess.run([program, "-L"], capture_output=True, text=True, timeout=20, check=False)
        table = subprocess.run([program], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    if listed.returncode != 0:
        return {}
    driver = re.search(r"Driver Version:\s*(\S+)", table.stdout)
    cuda = re.search(r"CUDA Version:\s*(\S+)", table.stdout)
    return {"gpus": [line.strip() for line in listed.stdout.splitlines() if line.startswith("GPU ")],
            "driver": driver.group(1) if driver else None, "driver_cuda": cuda.group(1) if cuda else None}


def gpus_hidden_on_purpose() -> bool:
    """CPU training asked for: ACCELERATE_USE_CPU, or CUDA_VISIBLE_DEVICES set to no device ("", "-1"; CUDA reads
    the list up to its first entry that is not a device)."""
    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("true", "1"):
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or "")[:2])


def check_torch_sees_the_gpus() -> None:
    """Refuse to train on the CPU when `nvidia-smi` lists GPUs that torch cannot use (unless CPU was asked for)."""
    import torch

    if gpus_hidden_on_purpose() or torch.cuda.is_available():
        return
    facts = nvidia_smi_facts()
    if not facts.get("gpus"):
        return
    raise LaunchError(unusable_gpus_message(facts, torch.__version__, torch.version.cuda))


def unusable_gpus_message(facts: dict, torch_version: str, torch_cuda: str | None) -> str:
    """What, why and the wheel to install (or the driver to upgrade), as one paragraph."""
    driver, driver_cuda = facts.get("driver") or "unknown", facts.get("driver_cuda")
    major = (_version(driver_cuda) or (0,))[0]
    release = torch_version.split("+")[0]
    install = (f"install the build for this driver: `pip install --force-reinstall torch=={release} --index-url "
               f"{INDEX_URL}{WHEEL_INDEX[major]}`") if major in WHEEL_INDEX else None
    if torch_cuda is None:
        why = f"torch {torch_version} is a CPU-only build"
        fix = install or "upgrade the NVIDIA driver to one for CUDA 12 or newer, then install torch's CUDA build"
    elif driver_cuda and _version(torch_cuda) > _version(driver_cuda):
        why = (f"torch {torch_version} is built for CUDA {torch_cuda}, newer than NVIDIA driver {driver} supports "
               f"(CUDA {driver_cuda})")
        upgrade = f"upgrade the NVIDIA driver to one for CUDA {torch_cuda}"
        fix = f"{install}, or {upgrade}" if install else upgrade
    else:
        why = f"torch {torch_version} (CUDA {torch_cuda}) could not initialize CUDA with NVIDIA driver {driver}"
        fix = ("make the GPUs usable by this process (torch's warning above says why: e.g. a container started without "
               "the GPU device files, or a driver upgraded without a reboot)")
    return (f"nvidia-smi lists {len(facts['gpus'])} GPU(s) (NVIDIA driver {driver}, CUDA {driver_cuda or 'unknown'}) "
            f"but torch sees none: {why}, so this run would train on the CPU, without an error, orders of magnitude "
            f"slower. Fix: {fix}; to train on the CPU on purpose, set CUDA_VISIBLE_DEVICES= (empty).")
