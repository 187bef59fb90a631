"""The recipe's path values as the user wrote them, before they are read: environment variables, which a recipe does
not expand (`output.dir: $HOME/runs` would make a folder literally named `$HOME`), and relative paths that name
something next to the recipe file but not in the folder the command runs in, where relative paths are read from."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from finetune.errors import RecipeError

_VARIABLE = re.compile(r"\$(?:\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")

# The keys whose values are paths (or URIs) of files and folders; `[]`: each item of a list.
PATH_KEYS = ("model.name_or_path", "model.tokenizer", "model.adapter", "model.chat_template", "model.gguf_file",
             "data.datasets[].path", "data.datasets[].tools", "data.eval_datasets[].path", "data.eval_datasets[].tools",
             "train.resume", "train.tensorboard_dir", "train.mlflow_tracking_uri", "parallel.deepspeed_config",
             "output.dir", "grpo.reward_models[]", "grpo.vllm_python")
# Relative paths that a user may have put beside the recipe: named when only the recipe's folder has them.
BESIDE_KEYS = ("model.name_or_path", "model.tokenizer", "model.adapter", "data.datasets[].path",
               "data.eval_datasets[].path")


def path_values(raw: dict, keys: tuple[str, ...] = PATH_KEYS) -> Iterator[tuple[str, str]]:
    """(key as written in an error, value) for every text value at `keys` in the raw recipe (`data.datasets[1].path`)."""
    for dotted in keys:
        found: list[tuple[str, object]] = [("", raw)]
        for part in dotted.split("."):
            name, many = part.removesuffix("[]"), part.endswith("[]")
            found = [(f"{where}.{name}".lstrip("."), node.get(name)) for where, node in found if isinstance(node, dict)]
            if many:
                found = [(f"{where}[{index}]", item) for where, items in found if isinstance(items, list)
                         for index, item in enumerate(items)]
        for where, value in found:
            text_template = where == "model.chat_template" and isinstance(value, str) and ("{" in value or "\n" in value)
            if isinstance(value, str) and value and not text_template:
                yield where, value


def check_no_variables(raw: dict, source: str) -> None:
    """Refuse `$VAR` / `${VAR}` in a path: a recipe is read as written, so the run would use (or create) a path
    literally named `$HOME` in the working folder. A path that exists as written is left alone."""
    found = [(key, value) for key, value in path_values(raw)
             if _VARIABLE.search(value) and not Path(value).expanduser().exists()]
    if not found:
        return
    named = []
    for key, value in found:
        expanded = os.path.expandvars(value)
        meant = f" (here that is `{expanded}`)" if not _VARIABLE.search(expanded) else ""
        named.append(f"{key} `{value}`{meant}")
    raise RecipeError(
        f"{source}: {'; '.join(named)}: environment variables are not expanded in a recipe: the path would hold a "
        f"folder literally named `{_VARIABLE.search(found[0][1]).group(0)}` (relative paths are read from "
        f"{Path.cwd()}). Fix: "
        "write the path out; on the command line, leave the override unquoted or in double quotes "
        "(`output.dir=$HOME/runs`) for the shell to expand it.")


def beside_the_recipe(raw: dict, recipe_path: str | os.PathLike) -> list[str]:
    """Warnings for relative paths that do not exist from the working folder but do next to the recipe file: they are
    read from the working folder (as the libraries read them), so a model name is then taken for a hub id."""
    folder = Path(recipe_path).expanduser().resolve().parent
    here = Path.cwd().resolve()
    moved = moved_run_folder(raw, Path(recipe_path))
    if folder == here:
        return moved
    warnings = moved
    for key, value in path_values(raw, BESIDE_KEYS):
        path = Path(value).expanduser()
        if path.is_absolute() or path.exists() or not (folder / path).exists():
            continue
        then = " It is taken for a hub id." if key.startswith("model.") and key != "model.adapter" else ""
        warnings.append(f"{key} `{value}` does not exist in the working folder {here}, where relative paths are "
                        f"read from, but does beside the recipe ({folder / path}).{then} Fix: give the absolute path "
                        f"(`{key}={folder / path}`), or run from {folder}.")
    return warnings


def moved_run_folder(raw: dict, recipe_path: Path) -> list[str]:
    """A warning when the recipe is a run folder's own recipe.yaml (beside its checkpoints/ or adapter/) whose
    output.dir names another folder: the run folder was moved or copied, and a run of this recipe would write to
    (or resume from) the old place, not this folder (bug bash: `train MOVED/recipe.yaml train.resume=auto` started
    a new run at step 1 at the old path)."""
    folder = recipe_path.expanduser().resolve().parent
    out = (raw.get("output") or {}).get("dir") if isinstance(raw.get("output"), dict) else None
    if recipe_path.name != "recipe.yaml" or not isinstance(out, str) or not (
            (folder / "checkpoints").is_dir() or (folder / "adapter").is_dir()):
        return []
    if Path(out).expanduser().resolve() == folder:
        return []
    return [(f"{recipe_path} is the recipe.yaml of the run folder {folder}, but its output.dir names {out}: the folder "
             f"was moved or copied, and this run writes to (and resumes from) {out}. Fix: to continue or use the run "
             f"here, pass output.dir={folder} (train.resume=auto continues from its checkpoints).")]
