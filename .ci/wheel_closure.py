"""Print `name==version` for the runtime dependency closure of a built wheel, as installed in this environment.

The wheel check installs exactly these into a fresh venv with `pip install --no-deps`: the same versions the test
suite ran against, resolved once already (no second resolution, no downloads beyond local wheels), and only what
the wheel declares, so an undeclared import fails there. Extras (dev, trackers) are left out on purpose.

    python .ci/wheel_closure.py dist/finetune-0.1.0-py3-none-any.whl > requirements.txt
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement


def wheel_requirements(path: str) -> list[Requirement]:
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(wheel.read(name).decode())
    return [Requirement(text) for text in message.get_all("Requires-Dist") or []]


def applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras or {""})


def closure(requirements: list[Requirement]) -> dict[str, str]:
    pinned: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, set()) for r in requirements]
    while todo:
        requirement, extras = todo.pop()
        if not applies(requirement, extras):
            continue
        dist = metadata.distribution(requirement.name)  # PackageNotFoundError: the dev venv lacks a declared dependency
        key = (dist.metadata["Name"].lower(), frozenset(requirement.extras))
        if key in visited:
            continue
        visited.add(key)
        pinned[key[0]] = dist.version
        todo += [(Requirement(text), set(requirement.extras)) for text in dist.requires or []]
    return pinned


if __name__ == "__main__":
    for name, version in sorted(closure(wheel_requirements(sys.argv[1])).items()):
        print(f"{name}=={version}")
