"""Checks only a CUDA machine can run (skipped cleanly on CPU-only machines by the `gpu` marker)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import GPU_ENV

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
def test_gpu_smoke_passes_on_cuda(tmp_path):
    """`make gpu-smoke`'s script, small: every check of benchmarks/gpu_smoke.py passes on this GPU."""
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--hidden", "256", "--layers", "4",
                             "--steps", "10", "--json", str(tmp_path / "smoke.json")], capture_output=True, text=True,
                            timeout=600, check=False, env=GPU_ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAIL" not in result.stdout and "PASS  FSDP2 byte guard" in result.stdout


def test_gpu_smoke_without_a_gpu_says_so_in_one_line(tmp_path):
    """On a CPU-only machine (here: CUDA hidden, no NVIDIA driver on PATH) the script exits 2 with one line."""
    import os
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA driver is present: the script would install and run")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh")], capture_output=True, text=True,
                            timeout=120, check=False, env=env)
    assert result.returncode == 2 and result.stdout.strip().count("\n") == 0, result.stdout + result.stderr
    assert result.stdout.startswith("gpu-smoke: no CUDA GPU on this machine") and not result.stderr
