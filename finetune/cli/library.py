"""The recipe library: ready-made recipes and accelerate configs, listed, shown and copied out by `finetune recipes`.

    finetune recipes                      one line per recipe: name, model, accelerate config, purpose
    finetune recipes show NAME            the recipe file as it is (comments included)
    finetune recipes copy NAME DEST       copy it to DEST (a file, a folder, or `DIR/`: a new folder) to edit; never
                                          overwrites

Each recipe's first comment line names the accelerate config it expects (`# accelerate config: ...`), and its
`description` key is the one-line purpose.

Where the files are: the repository keeps them at the top (recipes/, accelerate_configs/); a wheel carries them as
package data inside the package (finetune/recipes/, finetune/accelerate_configs/, mapped in pyproject.toml), found
through importlib.resources. A checkout (editable install, or PYTHONPATH) has no such folders inside the package, so
the lookup falls back to the checkout's top-level folders. Recipe and config names resolve here, below the CLI and
the stages, so any module may turn `quickstart` or `fsdp2` into a file.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import re
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.files import destination_problem

_ACCELERATE_CONFIG = re.compile(r"accelerate_configs/[\w.\-]+\.ya?ml")


class LibraryError(FinetuneError):
    """A library recipe name or copy destination is wrong."""


def data_dir(name: str) -> Path:
    """The library folder `name` (recipes, accelerate_configs): package data in a wheel, else the checkout's folder."""
    packaged = importlib.resources.files("finetune") / name
    if packaged.is_dir():
        # pip installs wheels unpacked, so the package data is a real folder (accelerate needs real file paths).
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / name  # finetune/cli/library.py -> the checkout


def library_dir() -> Path:
    """The recipe library folder; $FINETUNE_RECIPES overrides it."""
    if os.environ.get("FINETUNE_RECIPES"):
        return Path(os.environ["FINETUNE_RECIPES"]).expanduser()
    return data_dir("recipes")


def accelerate_configs_dir() -> Path:
    return data_dir("accelerate_configs")


def accelerate_config_names() -> list[str]:
    folder = accelerate_configs_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_names() -> list[str]:
    folder = library_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_path(name: str) -> Path | None:
    """The library file of recipe `name` (`quickstart` or `quickstart.yaml`), or None when there is none."""
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    path = library_dir() / f"{stem}.yaml"
    return path if stem and path.is_file() else None


def resolve_recipe_path(name: str) -> str:
    """A path as given, or a library recipe by name (`quickstart` -> the library's quickstart.yaml)."""
    if Path(name).exists() or name.endswith((".yaml", ".yml")):
        return name
    found = recipe_path(name)
    return str(found) if found else name


def resolve_accelerate_config(name: str) -> str:
    """An accelerate config file as given, or a library config by name (`fsdp2`, `fsdp2.yaml`,
    `accelerate_configs/fsdp2.yaml` from outside a checkout); unknown names raise with the list of known ones."""
    if Path(name).is_file():
        return name
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    path = accelerate_configs_dir() / f"{stem}.yaml"
    if stem and path.is_file():
        return str(path)
    known = ", ".join(accelerate_config_names()) or f"none found in {accelerate_configs_dir()}"
    raise LibraryError(f"--accelerate-config {name}: no such file, and no library config of that name. "
                       f"Give a file path or one of the library's configs: {known}.")


def expected_accelerate_config(path: Path) -> str | None:
    """The accelerate config named in the recipe's leading comment lines, e.g. accelerate_configs/fsdp2.yaml."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        match = _ACCELERATE_CONFIG.search(line)
        if match:
            return match.group(0)
    return None


def expected_num_processes(path: Path) -> int | None:
    """The process count named beside the accelerate config in the recipe's leading comment (`fsdp2.yaml with
    num_processes: 8`), else None (the config's own)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if _ACCELERATE_CONFIG.search(line) and (match := re.search(r"num_processes:? (\d+)", line)):
            return int(match.group(1))
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
    configs = accelerate_config_names()
    if configs:
        lines.append(f"accelerate configs (finetune train NAME --accelerate-config CONFIG): {', '.join(configs)}")
    return "\n".join(lines)


def copy_recipe(name: str | None, dest: str | None) -> Path:
    """Copy a library recipe to `dest` (a file path, an existing folder, or `DIR/`: a folder made for it); refuse to
    overwrite anything."""
    source = _require(name)
    if not dest:
        raise LibraryError(f"copy needs a destination: `finetune recipes copy {source.stem} my-recipe.yaml`.")
    target = Path(dest).expanduser()
    if target.is_dir() or (dest.endswith(("/", os.sep)) and not os.path.lexists(target)):
        target = target / source.name  # `nd/`: a folder, as the slash says (not a file named nd)
    if os.path.lexists(target):  # a link to nothing too: open(..., "x") would fail on it with a traceback
        link = f" (a symbolic link to {os.readlink(target)})" if target.is_symlink() else ""
        raise LibraryError(
            f"{target} already exists{link}; nothing was overwritten. Choose another destination or remove it."
        )
    if problem := destination_problem(target):
        raise LibraryError(f"recipes copy: {problem}; nothing was written. Fix: choose another destination.")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "x") as handle:  # "x": fails instead of overwriting a file created meanwhile
        handle.write(_copied(source, target))
    return target


def _copied(source: Path, target: Path) -> str:
    """The recipe's text with its comments naming the copy, and `# Launch:` the accelerate config by name (the paths
    recipes/NAME.yaml, accelerate_configs/X.yaml and finetune/run.py exist in the repository, not beside a copy of an
    installed package). The `# accelerate config:` line stays: validate reads it."""
    lines = []
    for line in source.read_text().splitlines(keepends=True):
        if line.startswith("#"):
            line = line.replace(f"recipes/{source.name}", str(target))
        if line.startswith(("# Launch:", "#     or:")):
            config = re.search(r"accelerate_configs/([\w.<>-]+?)\.ya?ml", line)
            line = f"# Launch: finetune train {target} --accelerate-config {config.group(1)}\n" if config else line
            if line in lines:
                continue
        lines.append(line)
    return "".join(lines)


def cli_recipes(args: argparse.Namespace) -> int:
    if args.action == "list":
        print(list_recipes())
    elif args.action == "show":
        print(_require(args.name).read_text(), end="")
    else:
        target = copy_recipe(args.name, args.dest)
        print(f"copied {args.name} to {target}; edit it, then `finetune train {target}`")
    return 0
