"""The recipe library: ready-made recipes under recipes/, listed, shown and copied out by `finetune recipes`.

    finetune recipes                      one line per recipe: name, model, accelerate config, purpose
    finetune recipes show NAME            the recipe file as it is (comments included)
    finetune recipes copy NAME DEST       copy it to DEST (a file or a folder) to edit; never overwrites

Each recipe's first comment line names the accelerate config it expects (`# accelerate config: ...`), and its
`description` key is the one-line purpose.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from finetune.errors import FinetuneError

_ACCELERATE_CONFIG = re.compile(r"accelerate_configs/[\w.\-]+\.ya?ml")


class LibraryError(FinetuneError):
    """A library recipe name or copy destination is wrong."""


def library_dir() -> Path:
    """recipes/ next to the package (a source checkout or an editable install); $FINETUNE_RECIPES overrides it."""
    if os.environ.get("FINETUNE_RECIPES"):
        return Path(os.environ["FINETUNE_RECIPES"]).expanduser()
    return Path(__file__).resolve().parent.parent / "recipes"


def recipe_names() -> list[str]:
    folder = library_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_path(name: str) -> Path | None:
    """The library file of recipe `name` (`quickstart` or `quickstart.yaml`), or None when there is none."""
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    path = library_dir() / f"{stem}.yaml"
    return path if stem and path.is_file() else None


def expected_accelerate_config(path: Path) -> str | None:
    """The accelerate config named in the recipe's leading comment lines, e.g. accelerate_configs/fsdp2.yaml."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        match = _ACCELERATE_CONFIG.search(line)
        if match:
            return match.group(0)
    return None


def describe(path: Path) -> dict:
    """Name, model, accelerate config and one-line purpose of a library recipe (the file is only read, not validated)."""
    from finetune.recipe import read_yaml

    raw = read_yaml(path)
    model = raw.get("model") or {}
    return {
        "name": path.stem,
        "model": str(model.get("name_or_path", "?")),
        "accelerate": expected_accelerate_config(path),
        "description": str(raw.get("description", "")).strip(),
    }


def _require(name: str | None) -> Path:
    if not name:
        raise LibraryError("name a recipe, e.g. `finetune recipes show quickstart`; `finetune recipes` lists them.")
    path = recipe_path(name)
    if path is None:
        known = ", ".join(recipe_names()) or f"none found in {library_dir()}"
        raise LibraryError(f"no recipe `{name}` in the library ({library_dir()}). Known recipes: {known}.")
    return path


def list_recipes() -> str:
    rows = [describe(library_dir() / f"{name}.yaml") for name in recipe_names()]
    if not rows:
        return f"no recipes found in {library_dir()}"
    width = max(len(row["name"]) for row in rows)
    lines = [f"{row['name']:<{width}}  {row['description']}" for row in rows]
    lines.append("")
    lines.append("finetune recipes show NAME   print one (model, accelerate config, data, settings)")
    lines.append("finetune recipes copy NAME DEST   copy one out to edit")
    return "\n".join(lines)


def copy_recipe(name: str | None, dest: str | None) -> Path:
    """Copy a library recipe to `dest` (a file path, or an existing folder); refuse to overwrite anything."""
    source = _require(name)
    if not dest:
        raise LibraryError(f"copy needs a destination: `finetune recipes copy {source.stem} my-recipe.yaml`.")
    target = Path(dest).expanduser()
    if target.is_dir():
        target = target / source.name
    if target.exists():
        raise LibraryError(
            f"{target} already exists; nothing was overwritten. Choose another destination or remove it."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "x") as handle:  # "x": fails instead of overwriting a file created meanwhile
        handle.write(source.read_text())
    return target


def cli_recipes(args: argparse.Namespace) -> int:
    if args.action == "list":
        print(list_recipes())
    elif args.action == "show":
        print(_require(args.name).read_text(), end="")
    else:
        target = copy_recipe(args.name, args.dest)
        print(f"copied {args.name} to {target}; edit it, then `finetune train {target}`")
    return 0
