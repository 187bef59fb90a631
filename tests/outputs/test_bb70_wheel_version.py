"""Which finetune wrote a checkpoint, as an installed wheel records it (bug bash bb70 F3): with no git checkout around
the package, every finetune recorded `0.1.0`, so a resume whose rows an upgrade changed (the whole-conversation eval
hold-out of 4573216) blamed the user's data. Two copies of the package, as a wheel installs it (no .git above), one
with a file changed as an upgrade changes it, are each asked in a process of their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import finetune

ASK = """
import json, sys
from pathlib import Path
from finetune.outputs.resume_checks import _upgrade
from finetune.outputs.run_folder import finetune_version
checkpoint = Path(sys.argv[1])
said = {}
for name, written in json.loads(sys.argv[2]).items():
    (checkpoint / "manifest.json").write_text(json.dumps({"finetune": written}))
    said[name] = _upgrade(checkpoint)
print(json.dumps({"version": finetune_version(), "upgrade": said}))
"""


def _installed(root: Path, *, changed: bool) -> Path:
    """The package copied under `root` (its files only, as a wheel holds them); `changed`: the hold-out's module edited."""
    package = Path(finetune.__file__).resolve().parent
    shutil.copytree(package, root / "finetune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if changed:
        with open(root / "finetune" / "data" / "build.py", "a", encoding="utf-8") as file:
            file.write("\n# the eval hold-out by whole conversations\n")
    return root


def _ask(root: Path, checkpoint: Path, written: dict[str, str]) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "RANK")}
    done = subprocess.run([sys.executable, "-c", ASK, str(checkpoint), json.dumps(written)], cwd=root, check=True,
                          capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": str(root)})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two Python processes, each importing finetune from its copy
def test_a_wheel_records_its_code_so_an_upgrade_that_changed_the_rows_is_named(tmp_path):
    before, after = _installed(tmp_path / "before", changed=False), _installed(tmp_path / "after", changed=True)
    checkpoint = tmp_path / "step-00000003"
    checkpoint.mkdir()
    old = _ask(before, checkpoint, {})["version"]
    assert not (before / ".git").exists() and old.startswith(f"{finetune.__version__} (code ")
    new = _ask(after, checkpoint, {"old": old, "same": old, "wheel before bb70": finetune.__version__})
    assert new["version"] != old, "two finetunes of other code recorded as the same"
    assert _ask(after, checkpoint, {})["version"] == new["version"]  # the same files: the same finetune
    said = new["upgrade"]
    assert f"written by finetune {old} and this is {new['version']}" in said["old"]
    assert f"written by finetune {finetune.__version__} and this is {new['version']}" in said["wheel before bb70"]
    same = _ask(after, checkpoint, {"same": new["version"]})["upgrade"]["same"]
    assert same == ""  # a checkpoint this same finetune wrote names no upgrade
