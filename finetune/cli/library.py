"""The recipe library: ready-made recipes and accelerate configs, listed, shown and copied out by `finetune recipes`.

    finetune recipes                      one line per recipe: name, model, accelerate config, purpose
    finetune recipes show NAME            the recipe file as it is (comments included)
    finetune recipes copy NAME DEST       copy it to DEST (a file, a folder, or `DIR/`: a new folder) to edit; never
                                          overwrites

Each recipe's first comment lines name its launch (`# accelerate config: ...`: the first config named, with the
process count written for it; `named_launch`, read alike by validate and data; `train_launch`: the launch `finetune
train` makes from it, which validate checks), and its `description` key is the one-line purpose. `recipes show` prints
a recipe's launch lines by library name where the checkout's paths it names are not there (an installed wheel).

Where the files are, and a recipe name -> its file: finetune/recipe_library.py (a leaf: finetune/run.py resolves
names with it too). Accelerate config names resolve here, for the verbs.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FinetuneError, in_checkout
from finetune.files import destination_problem
from finetune.recipe_library import data_dir, library_dir, recipe_path, resolve_recipe_path  # noqa: F401 (the verbs')

_ACCELERATE_CONFIG = re.compile(r"accelerate_configs/[\w.\-]+\.ya?ml")
DEFAULT_LAUNCH_CONFIG = "ddp"  # the library config of `finetune train --num-processes N` without --accelerate-config


class LibraryError(FinetuneError):
    """A library recipe name or copy destination is wrong."""


def accelerate_configs_dir() -> Path:
    return data_dir("accelerate_configs")


def accelerate_config_names() -> list[str]:
    folder = accelerate_configs_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_names() -> list[str]:
    folder = library_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


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


@dataclass(frozen=True)
class NamedLaunch:
    """The launch a recipe's leading comment names: its first accelerate config, with the process count written for
    that config (None: the config's own num_processes)."""

    config: str  # as written: accelerate_configs/fsdp2.yaml
    num_processes: int | None

    def describe(self) -> str:
        return f"{self.config}{f' with num_processes: {self.num_processes}' if self.num_processes else ''}"


def named_launch(path: str | os.PathLike) -> NamedLaunch | None:
    """The launch the recipe's leading comment lines name (`# accelerate config: accelerate_configs/fsdp2.yaml with
    num_processes: 8`), else None. The first config named is the launch; a process count counts only when it is
    written for that config, before the line names another config or a `;` starts another clause: in
    `single_gpu.yaml (1x24 GB); fsdp2.yaml with num_processes: 2` the 2 is fsdp2's, and the launch is single_gpu's one
    process. `finetune validate` and `finetune data` both take the launch from here."""
    from finetune.recipe.text import leading_comments  # (as the loader decodes it: a BOM, UTF-16; not at import)
    from finetune.recipe_library import streamed

    path = Path(path)
    if not (path.is_file() or streamed(path)):  # a pipe's comment names its launch too (its bytes are kept)
        return None
    for line in leading_comments(path):  # comments only: the recipe's own reader judges the rest
        if match := _ACCELERATE_CONFIG.search(line):
            own = re.split(r";|\b[\w.\-]+\.ya?ml\b", line[match.end():], maxsplit=1)[0]
            count = re.search(r"num_processes:?\s*(\d+)", own)
            return NamedLaunch(match.group(0), int(count.group(1)) if count else None)
    return None


@dataclass(frozen=True)
class TrainLaunch:
    """The launch `finetune train` makes and `finetune validate` checks: accelerate's launcher with `config` (a file;
    `num_processes` None: the config's own count), or, with neither, one process: the run in this process."""

    config: str | None
    num_processes: int | None
    how: str  # how it was chosen, for the report: "as given", "as the recipe names it (...)", "one process (...)"

    @property
    def launches(self) -> bool:
        return self.config is not None or (self.num_processes or 1) > 1


def train_launch(recipe: str, accelerate_config: str | None, num_processes: int | None) -> TrainLaunch:
    """The launch as given (either flag: an explicit flag always wins; `--num-processes N` alone is the config the
    recipe's leading comment names for several processes, else the library's ddp.yaml, with N processes), else the
    one the recipe's leading comment names when it has more than one process (`fsdp2.yaml with num_processes: 2`),
    else one process in this process: a named launch of one process (single_gpu.yaml) runs here too, as `finetune
    quickstart` runs its recipe."""
    named = named_launch(recipe)
    if accelerate_config is None and (num_processes or 1) > 1 and named and _several(named):
        return TrainLaunch(resolve_accelerate_config(named.config), num_processes,
                           f"as given, with the config the recipe names ({named.config}; --accelerate-config NAME for "
                           "another)")  # a multi-process launch of the recipe's own config, at another count
    if accelerate_config is None and (num_processes or 1) > 1:
        # Never accelerate's own default config (~/.cache/huggingface/accelerate/default_config.yaml, which `accelerate
        # launch` reads when given no --config_file): an FSDP one there trained FSDP2 where this check said DDP, and a
        # machine without one (CPU) started N processes without a group. The library's ddp.yaml is the launch checked.
        return TrainLaunch(resolve_accelerate_config(DEFAULT_LAUNCH_CONFIG), num_processes,
                           f"as given, with the library's {DEFAULT_LAUNCH_CONFIG} config (--num-processes without "
                           "--accelerate-config: accelerate's default config is not read; --accelerate-config NAME "
                           "for another)")
    if accelerate_config is not None or num_processes is not None:
        config = resolve_accelerate_config(accelerate_config) if accelerate_config else None
        return TrainLaunch(config, num_processes, "as given")
    if not named:
        return TrainLaunch(None, None, "one process (the recipe names no accelerate config; --num-processes N or "
                                       "--accelerate-config to check another)")
    config = resolve_accelerate_config(named.config)
    count = named.num_processes or _config_processes(config)
    if count is None or count > 1:  # (a config whose count cannot be read: its own checks say why, at the launch)
        return TrainLaunch(config, count, f"as the recipe names it ({named.describe()})")
    return TrainLaunch(None, None, f"as the recipe names it ({named.describe()}: one process, run in this process)")


def _several(named: NamedLaunch) -> bool:
    """The recipe names a launch of several processes (a config for one, single_gpu.yaml, cannot take N)."""
    return (named.num_processes or _config_processes(resolve_accelerate_config(named.config)) or 1) > 1


def _config_processes(path: str) -> int | None:
    """An accelerate config's num_processes (1 where it has none), or None where the file cannot be read as one."""
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8-sig")) or {}
        return int(config.get("num_processes", 1) or 1)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):  # (UnicodeDecodeError: a ValueError)
        return None


def expected_accelerate_config(path: Path) -> str | None:
    """The accelerate config named in the recipe's leading comment lines, e.g. accelerate_configs/fsdp2.yaml."""
    launch = named_launch(path)
    return launch.config if launch else None


def describe(path: Path) -> dict:
    """Name, model, accelerate config and one-line purpose of a library recipe (the file is only read, not validated).
    A file that cannot be read as a recipe raises LibraryError naming it and its problem."""
    from finetune.recipe import read_yaml

    _text(path)  # unreadable or not UTF-8: one paragraph, not the reader's traceback
    try:
        raw = read_yaml(path)
    except FinetuneError as exc:
        raise LibraryError(str(exc)) from None
    model = raw.get("model")
    return {
        "name": path.stem,
        "model": str(model.get("name_or_path", "?")) if isinstance(model, dict) else "?",
        "accelerate": expected_accelerate_config(path),
        "description": str(raw.get("description", "")).strip(),
    }


def _text(path: Path) -> str:
    """The file's text, decoded as the recipe loader decodes it (UTF-8 whatever the locale; a byte-order mark dropped,
    UTF-16 read as such); a file that cannot be read, or is in another encoding, raises LibraryError naming it."""
    from finetune.recipe.text import decoded

    try:
        return decoded(path)
    except OSError as exc:
        raise LibraryError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    except FinetuneError:  # another encoding (the recipe loader's own paragraph names the line)
        try:
            path.read_bytes().decode("utf-8")
            why = "NUL bytes: UTF-16 without a byte-order mark?"
        except UnicodeDecodeError as exc:
            why = f"{exc.reason} at byte {exc.start}"
        raise LibraryError(f"{path}: not UTF-8 text ({why}); save it as UTF-8.") from None


def _require(name: str | None) -> Path:
    if not name:
        raise LibraryError("name a recipe, e.g. `finetune recipes show quickstart`; `finetune recipes` lists them.")
    path = recipe_path(name)
    if path is None:
        known = ", ".join(recipe_names()) or f"none found in {library_dir()}"
        raise LibraryError(f"no recipe `{name}` in the library ({library_dir()}). Known recipes: {known}.")
    return path


def list_recipes() -> str:
    """One line per recipe; a file of the library that is not a readable recipe (a `$FINETUNE_RECIPES` folder of the
    user's) is named with its problem after the others, which are listed all the same."""
    rows, broken = [], []
    for name in recipe_names():
        try:
            rows.append(describe(library_dir() / f"{name}.yaml"))
        except LibraryError as exc:
            broken.append(f"not listed: {exc}")
    if not rows:
        return "\n".join([f"no recipes found in {library_dir()}", *broken])
    width = max(len(row["name"]) for row in rows)
    lines = [f"{row['name']:<{width}}  {row['description']}" for row in rows]
    lines.append("")
    lines.append("finetune recipes show NAME   print one (model, accelerate config, data, settings)")
    lines.append("finetune recipes copy NAME DEST   copy one out to edit")
    configs = accelerate_config_names()
    if configs:
        lines.append(f"accelerate configs (finetune train NAME --accelerate-config CONFIG): {', '.join(configs)}")
    return "\n".join(lines + ([""] + broken if broken else []))


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
    text = _copied(source, target)  # before anything is made: an unreadable source leaves nothing behind
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "x", encoding="utf-8") as handle:  # "x": fails instead of overwriting a file created meanwhile
        handle.write(text)
    return target


def _copied(source: Path, target: Path | str, *, library_names: bool = False) -> str:
    """The recipe's text with its comments naming the copy, and `# Launch:` the accelerate config by name (the paths
    recipes/NAME.yaml, accelerate_configs/X.yaml and finetune/run.py exist in the repository, not beside a copy of an
    installed package). The `# accelerate config:` line stays: validate reads it. `library_names`: every other library
    recipe a comment names by its path (recipes/gpt-oss-20b.yaml) is named by its library name too."""
    lines = []
    for line in _text(source).splitlines(keepends=True):
        if line.startswith("#"):
            line = line.replace(f"recipes/{source.name}", str(target))
            if library_names:
                line = _LIBRARY_PATH.sub(lambda m: m.group(1) if recipe_path(m.group(1)) else m.group(0), line)
        if line.startswith(("# Launch:", "#     or:")):
            config = re.search(r"accelerate_configs/([\w.<>-]+?)\.ya?ml", line)
            line = f"# Launch: finetune train {target} --accelerate-config {config.group(1)}\n" if config else line
            if line in lines:
                continue
        lines.append(line)
    return "".join(lines)


_LIBRARY_PATH = re.compile(r"\brecipes/([\w.\-]+?)\.ya?ml\b")


def shown(name: str | None) -> str:
    """`finetune recipes show NAME`: the file as it is where its paths work from here (the current folder is the
    checkout that holds it: recipes/NAME.yaml, accelerate_configs/, finetune/run.py), else with the launch lines and
    recipe paths of its comments by library name, as `recipes copy` writes them (`finetune train NAME
    --accelerate-config fsdp2`): an installed package has none of those paths."""
    source = _require(name)
    beside = Path("recipes") / source.name
    if in_checkout() and beside.is_file() and beside.resolve() == source.resolve():
        return _text(source)
    return _copied(source, source.stem, library_names=True)


def cli_recipes(args: argparse.Namespace) -> int:
    if args.action == "list":
        print(list_recipes())
    elif args.action == "show":
        print(shown(args.name), end="")
    else:
        target = copy_recipe(args.name, args.dest)
        print(f"copied {args.name} to {target}; edit it, then `finetune train {target}`")
    return 0
