"""grpo.reward_functions' `module:function` names, imported as a fresh process imports them: from PYTHONPATH or the
folder the run starts from. In a process that goes on (a notebook, a sweep script), a module imported by an earlier
run is imported afresh when a fresh lookup now finds another file (the run starts from another folder) or the same
file changed since (edited in place): Python's import returns the module it has, and a run scored with the old
function, silently (bb39). Installed packages' modules and finetune's own are left as they are.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_ADDED: list[str] = []  # the working folder put on sys.path here: one at a time (the folder run from now)
_IMPORTED: dict[str, tuple[str, str]] = {}  # module name -> (its file, its contents' digest) as imported here


def import_reward_function(name: str):
    """The callable named `module:function` (a dotted attribute path after the colon is allowed); ValueError with
    the fix when it cannot be found."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"`{name}` is not `module:function`. Fix: name the module and the function, e.g. "
                         "`finetune.rewards:exact_match` or `my_rewards:format_reward` (a my_rewards.py on PYTHONPATH "
                         "or beside where you run).")
    _search_working_folder()
    try:
        found: Any = _imported(module_name)
    except Exception as exc:  # noqa: BLE001  (an ImportError, or anything the user's module raises on import)
        if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:  # a file's path, not a module
            raise ValueError(_file_not_module(name, module_name, attribute)) from None
        missing = isinstance(exc, ModuleNotFoundError) and module_name.startswith(str(exc.name))
        where = (f"that {module_name.replace('.', '/')}.py is in the folder you run from or on PYTHONPATH" if missing
                 else f"that {module_name} imports without error")
        raise ValueError(f"`{name}` cannot be imported ({type(exc).__name__}: {exc}). Fix: check the spelling, and "
                         f"{where}.") from None
    owner = module_name
    for part in attribute.split("."):
        if not hasattr(found, part):
            own = sorted(n for n, v in vars(found).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == getattr(found, "__name__", None))
            raise ValueError(f"`{name}`: {owner} has no `{part}`. Fix: check the spelling (its functions: "
                             f"{', '.join(own) or 'none'}).")
        found, owner = getattr(found, part), f"{owner}.{part}"
    if not callable(found):
        # a ValueError (not TypeError): collected with the other recipe problems
        raise ValueError(f"`{name}` is a {type(found).__name__}, not a function. Fix: name a function "  # noqa: TRY004
                         "f(prompts, completions, **columns) -> list[float | None].")
    return found


def _search_working_folder() -> None:
    """Modules beside where the command runs are found as `python -m` finds them: the `finetune` console script and
    `accelerate launch finetune/run.py` put their own folders first on sys.path, not the working folder. Appended, so
    an installed package of the same name still wins; one such folder at a time, the one run from now (a process that
    changed folder between runs searched every folder it had run from, the first one first)."""
    here = os.getcwd()
    for folder in [folder for folder in _ADDED if folder != here]:
        _ADDED.remove(folder)
        if folder in sys.path:
            sys.path.remove(folder)
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
        _ADDED.append(here)


def _imported(module_name: str):
    """The module, imported afresh where the one imported before is not what a fresh process would import now; said
    in a note, as what a run scores with differs from what the process held."""
    stale = _stale(module_name)
    if stale is None:
        module = importlib.import_module(module_name)
    else:
        level, why = stale
        for loaded in [loaded for loaded in sys.modules if loaded == level or loaded.startswith(level + ".")]:
            del sys.modules[loaded]
        with _compiled_from_source():  # an edit within the second, of the same size, reads as the old bytecode
            module = importlib.import_module(module_name)
        print(f"[finetune] note: reloaded {module_name} from {getattr(module, '__file__', '?')} ({why}).",
              file=sys.stderr, flush=True)
    _remember(module_name)
    return module


def _stale(module_name: str) -> tuple[str, str] | None:
    """(the module name to import afresh, why) when a module on the way to `module_name` (`pkg`, then `pkg.rewards`),
    already imported, is the user's own and not what a fresh lookup finds now; None when each is (or none is loaded)."""
    importlib.invalidate_caches()  # a file written a moment ago (the finders cache their folders' listings)
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        level = ".".join(parts[:depth])
        module = sys.modules.get(level)
        if module is None:
            return None
        file = _users_file(module)
        if file is None:
            continue
        parent = sys.modules.get(level.rpartition(".")[0]) if depth > 1 else None
        found = _fresh_lookup(level, list(getattr(parent, "__path__", None) or []) or None)
        if found != file:
            return level, (f"the {level} imported before was {file}" if found else
                           f"the {level} imported before was {file}, which a fresh lookup no longer finds")
        recorded = _IMPORTED.get(level)
        if recorded is None:
            return level, "imported before, not by a run: a run scores with the file as it is now"
        if recorded != (file, _digest(file)):
            return level, f"{Path(file).name} changed since it was imported"
    return None


def _fresh_lookup(name: str, path: list[str] | None) -> str | None:
    """The file an import of `name` would load in a fresh process: the import system's finders asked in their order
    (sys.path's folders, an editable install's finder), not the module already loaded."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find is not None else None
        if spec is not None:
            return os.path.abspath(spec.origin) if spec.origin and spec.has_location else None
    return None


def _users_file(module) -> str | None:
    """The module's source file when it is the user's own: not finetune's, not an installed package's or the standard
    library's, not the script run (`__main__`), and loaded from a .py file; else None (left as it is)."""
    name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None)
    if not file or not file.endswith(".py") or name == "__main__" or name.split(".")[0] == "finetune":
        return None
    file = os.path.abspath(file)
    if any(file.startswith(os.path.join(os.path.abspath(root), "")) for root in _installed_folders()):
        return None
    return file


def _installed_folders() -> set[str]:
    """Where installed packages and the standard library live (site-packages, the user's too, dist-packages)."""
    folders = {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        folders |= {*site.getsitepackages(), site.getusersitepackages()}
    except AttributeError:  # an old virtualenv's site module
        pass
    return {folder for folder in folders if folder}


def _remember(module_name: str) -> None:
    """The file and digest of each user's module on the way to `module_name`, as imported now."""
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        level = ".".join(parts[:depth])
        file = _users_file(sys.modules[level]) if level in sys.modules else None
        if file is not None and os.path.isfile(file):
            _IMPORTED[level] = (file, _digest(file))


def _digest(file: str) -> str:
    try:
        return hashlib.sha256(Path(file).read_bytes()).hexdigest()
    except OSError:
        return ""


@contextmanager
def _compiled_from_source() -> Iterator[None]:
    """Bytecode neither read nor written while a module is imported afresh: Python's cached bytecode is checked
    against the source's size and mtime in whole seconds, so an edit of the same size within the same second (the
    `+len` -> `-len` of a notebook cell) was run as the old code."""
    prefix, dont_write = sys.pycache_prefix, sys.dont_write_bytecode
    with tempfile.TemporaryDirectory(prefix="finetune-fresh-import-") as empty:
        sys.pycache_prefix, sys.dont_write_bytecode = empty, True
        try:
            yield
        finally:
            sys.pycache_prefix, sys.dont_write_bytecode = prefix, dont_write


def _file_not_module(name: str, path: str, attribute: str) -> str:
    """The paragraph for `myr.py:f`, `./myr.py:f` or `/abs/myr.py:f`: a file's path where the module's name is expected
    (reward functions are imported by module name, on every rank, from PYTHONPATH or the folder run from)."""
    file = Path(path.replace("\\", "/"))
    module = file.name.removesuffix(".py")
    where = (f"with {file.name} in the folder you run from or on PYTHONPATH" if str(file.parent) in ("", ".")
             else f"with {file.parent} on PYTHONPATH, or run from {file.parent}")
    return (f"`{name}` names a file, not a module. Fix: name the module, not the file: `{module}:{attribute}` "
            f"({where}).")
