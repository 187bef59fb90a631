"""Where the recipe library is, and a recipe name -> its file: a leaf, so finetune/run.py (as launched, `accelerate
launch finetune/run.py qwen2.5-7b`) and the `finetune` verbs resolve a name alike; and a recipe's bytes, a pipe's
(`finetune validate <(...)`) read once. Standard library (and finetune.errors) only: the command line imports it at
its start.

The repository keeps the recipes and accelerate configs at the top (recipes/, accelerate_configs/); a wheel carries
them as package data inside the package (finetune/recipes/, finetune/accelerate_configs/, mapped in pyproject.toml),
found through importlib.resources. A checkout (editable install, or PYTHONPATH) has no such folders inside the
package, so the lookup falls back to the checkout's top-level folders. Listing, showing and copying recipes is
`finetune recipes` (finetune/cli/library.py).
"""

from __future__ import annotations

import importlib.resources
import os
import stat
from pathlib import Path

from finetune.errors import RecipeError


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
    if (Path(name).exists() and not Path(name).is_dir()) or name.endswith((".yaml", ".yml")):
        return name  # a file, or a pipe (`<(...)`, /dev/stdin): a FIFO named `quickstart` is not the library's
    found = recipe_path(name)
    return str(found) if found else name


# The bytes of the recipes read from a pipe, a FIFO or /dev/stdin (`finetune validate <(...)`), by the pipe's device
# and inode: such a file is read once, and the reader of its leading comments (the launch it names) reads it again.
_STREAMED: dict[tuple[int, int], bytes] = {}
MAX_STREAMED_BYTES = 16 * 2**20  # a recipe is a few kB: /dev/zero or a wrong process substitution stops here


def file_bytes(path: Path) -> bytes:
    """The bytes of `path`: a regular file's as they are now; a pipe's (not a regular file) read once and kept."""
    status = path.stat()
    if stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode):
        return path.read_bytes()  # (a folder: IsADirectoryError, an OSError as its readers expect)
    key = (status.st_dev, status.st_ino)
    if key not in _STREAMED:
        try:
            with open(path, "rb") as stream:
                data = stream.read(MAX_STREAMED_BYTES + 1)
        except OSError as exc:  # a socket, a device that refuses reads
            raise RecipeError(f"{path}: not a regular file, and it cannot be read ({exc.strerror or exc}). Fix: pass "
                              "the recipe's own file.") from None
        if len(data) > MAX_STREAMED_BYTES:
            raise RecipeError(f"{path}: not a regular file, and it gave more than {MAX_STREAMED_BYTES // 2**20} MiB "
                              "(a recipe is a few kB). Fix: pass the recipe's own file.")
        _STREAMED[key] = data
    return _STREAMED[key]


def streamed(path: str | os.PathLike) -> bool:
    """Whether `path` is a pipe, a FIFO or a device, read once (file_bytes), not a file a launched process can read."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not Path(path).is_dir()
    except OSError:
        return False
