"""The tests .ci/compat.sh names exist. When test_grpo.py's runs moved to test_grpo_runs.py, the compat job kept the old
node id; pytest then ran nothing there (exit 5) and failed CI. Checked by reading: each module exists and defines
the named test function (a parametrized id's brackets are not checked)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def compat_tests() -> list[str]:
    text = (REPO / ".ci" / "compat.sh").read_text()
    start = text.index("subset=(")
    subset = re.findall(r'^\s*"([^"]+)"', text[start : text.index("\n)\n", start)], re.MULTILINE)
    oracles = re.search(r"^oracles=\(([^)]*)\)", text, re.MULTILINE).group(1).split()
    return subset + oracles


def test_every_test_the_compat_job_names_exists():
    entries = compat_tests()
    assert len(entries) > 20  # (the lists were found)
    missing = []
    for entry in entries:
        path, _, name = entry.partition("::")
        if not (REPO / path).is_file():
            missing.append(entry)
            continue
        functions = {node.name for node in ast.walk(ast.parse((REPO / path).read_text())) if isinstance(node, ast.FunctionDef)}
        if name and name.split("[")[0] not in functions:
            missing.append(entry)
    assert not missing, f".ci/compat.sh names tests that do not exist (moved or renamed?): {missing}"
