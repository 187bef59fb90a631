"""Fail unless a built wheel holds every library recipe, accelerate config and module of the checkout, and nothing
of the package the checkout lacks (setuptools builds in a build/ folder it reuses: a module or recipe deleted since an
earlier build would still ship, and `finetune recipes` would list it).

The package-dir mapping in pyproject.toml puts recipes/ and accelerate_configs/ inside the package
(finetune/recipes/, finetune/accelerate_configs/); a file left out of it breaks `finetune recipes` or a launch only
for a user of the wheel, never in the checkout. Run by .ci/wheel_smoke.sh on the wheel it builds.

    python .ci/wheel_contents.py dist/finetune-0.1.0-py3-none-any.whl
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def expected_names() -> set[str]:
    names = {f"finetune/recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    names |= {f"finetune/accelerate_configs/{p.name}" for p in (REPO / "accelerate_configs").glob("*.yaml")}
    for pattern in ("*.py", "*.json"):
        names |= {p.relative_to(REPO).as_posix() for p in (REPO / "finetune").rglob(pattern) if "__pycache__" not in p.parts}
    return names


def checkout_path(name: str) -> Path:
    """The checkout's file a wheel entry of the package comes from (package-dir maps recipes and configs in)."""
    for package, folder in (("finetune/recipes/", "recipes/"), ("finetune/accelerate_configs/", "accelerate_configs/")):
        if name.startswith(package):
            return REPO / folder / name[len(package):]
    return REPO / name


def main(wheel: str) -> int:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_names() - names)
    if missing:
        print(f"{wheel} lacks {len(missing)} file(s) of the checkout: {', '.join(missing)}. Fix: map them in "
              "pyproject.toml ([tool.setuptools] package-dir / package-data).", file=sys.stderr)
        return 1
    stale = sorted(n for n in names if n.startswith("finetune/") and not n.endswith("/") and not checkout_path(n).is_file())
    if stale:
        print(f"{wheel} holds {len(stale)} file(s) the checkout lacks: {', '.join(stale)}. Fix: build from a clean "
              "tree (rm -rf build, then build the wheel again).", file=sys.stderr)
        return 1
    print(f"{Path(wheel).name}: every recipe, accelerate config and module of the checkout is in it")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
