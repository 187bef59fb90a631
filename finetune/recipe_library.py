"""Where the recipe library is, and a recipe name -> its file: a leaf, so finetune/run.py (as launched, `accelerate
launch finetune/run.py qwen2.5-7b`) and the `finetune` verbs resolve a name alike. Standard library only: the command
line imports it at its start.

The repository keeps the recipes and accelerate configs at the top (recipes/, accelerate_configs/); a wheel carries
them as package data inside the package (finetune/recipes/, finetune/accelerate_configs/, mapped in pyproject.toml),
found through importlib.resources. A checkout (editable install, or PYTHONPATH) has no such folders inside the
package, so the lookup falls back to the checkout's top-level folders. Listing, showing and copying recipes is
`finetune recipes` (finetune/cli/library.py).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path


def data_dir(name: str) -> Path:
    """The library folder `name` (recipes, accelerate_configs): package data in a wheel, else the checkout's folder."""
    packaged = importlib.resources.files("finetune") / name
    if packaged.is_dir():
        # pip installs wheels unpacked, so the package data is a real folder (accelerate needs real file paths).
        return Path(str(packaged))
    return Path(__file__).resolve().parents[1] / name  # finetune/recipe_library.py -> the checkout


def library_dir() -> Path:
    """The recipe library folder; $FINETUNE_RECIPES overrides it."""
    if os.environ.get("FINETUNE_RECIPES"):
        return Path(os.environ["FINETUNE_RECIPES"]).expanduser()
    return data_dir("recipes")


def recipe_path(name: str) -> Path | None:
    """The library file of recipe `name` (`quickstart` or `quickstart.yaml`), or None when there is none."""
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    path = library_dir() / f"{stem}.yaml"
    return path if stem and path.is_file() else None


def resolve_recipe_path(name: str) -> str:
    """A path as given, or a library recipe by name (`quickstart` -> the library's quickstart.yaml). A folder is never a
    recipe: a model downloaded to ./qwen2.5-7b does not hide the library's qwen2.5-7b (without one of that name, the
    loader's "recipe file not found (it is a folder)" stays the answer)."""
    if Path(name).is_file() or name.endswith((".yaml", ".yml")):
        return name
    found = recipe_path(name)
    return str(found) if found else name
