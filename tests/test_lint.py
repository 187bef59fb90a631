"""The project's lint (`make lint`: ruff with pyproject.toml's settings, line length included) holds on every file the
suite runs: a change that breaks it fails here, in CI, not only when someone runs `make lint`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_passes_with_the_projects_settings():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "finetune", "tests", "benchmarks"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
