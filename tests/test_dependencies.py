"""Every third-party package finetune imports at module level is a declared dependency (numpy was imported by 7
modules and declared nowhere: an environment without it broke at import); one imported inside a function only is an
optional extra, guarded where it is used."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            for requirement in project["dependencies"]}


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported by the module's own statements (not inside functions or classes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_import_is_a_declared_dependency():
    distributions = packages_distributions()
    missing = {}
    for path in sorted((REPO / "finetune").rglob("*.py")):
        for name in module_level_imports(path):
            if name in sys.stdlib_module_names or name in ("finetune", "__future__"):
                continue
            for dist in distributions.get(name, [name]):
                if dist.lower().replace("_", "-") not in declared():
                    missing.setdefault(dist, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported at module level but not in pyproject's dependencies: {missing}"
