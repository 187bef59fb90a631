"""Checks only a CUDA machine can run (skipped cleanly on CPU-only machines by the `gpu` marker)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import GPU_ENV

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
def test_gpu_smoke_trains_with_4bit_on_cuda():
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "256", "4", "10"], capture_output=True,
                            text=True, timeout=600, check=False, env=GPU_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GPU smoke:" in result.stdout and "peak GPU memory" in result.stdout
