"""Where the base comes from when it is named by the recipe: a local folder or a hub id; the hub arguments
(revision, trust_remote_code), the offline guard (fail fast when the hub cannot be reached, finetune/hub.py), and the
one-paragraph error when it cannot load."""

from __future__ import annotations

import os
from pathlib import Path

from finetune.errors import ModelLoadError
from finetune.hub import offline_because_unreachable, unreachable_fix
from finetune.recipe import Recipe

FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".yaml", ".yml", ".txt", ".model")


def is_local(name_or_path: str) -> bool:
    return Path(name_or_path).expanduser().exists()


def looks_local(name_or_path: str) -> bool:
    """A path, not a hub id (`org/name`): it starts like one, has more than one slash, or names a file."""
    return (name_or_path.startswith(("./", "../", "/", "~", ".\\")) or name_or_path.count("/") > 1
            or Path(name_or_path).suffix.lower() in FILE_SUFFIXES)


def local_problem(name_or_path: str) -> str | None:
    """Why a local-looking name cannot be the folder of a model (None when it can, or when it is a hub id): it does
    not exist, or it is a file. Asked before the hub is: a path is never looked up there."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return (f"`{name_or_path}` is a file; give the folder that holds it (config.json, the weights and the "
                "tokenizer files), or a GGUF file's folder or hub id with model.gguf_file naming the file.")
    if not path.exists() and looks_local(name_or_path):
        return (f"`{name_or_path}`: no such folder (relative paths are read from {Path.cwd()}). Fix the path, or give "
                "a hub id (`org/name`).")
    return None


def hub_kwargs(recipe: Recipe) -> dict:
    kwargs = {"trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.revision:
        kwargs["revision"] = recipe.model.revision
    return kwargs


def load_error(what: str, name: str, exc: Exception) -> ModelLoadError:
    local = is_local(name) or looks_local(name)
    if local:
        fix = f"check that {name} is a saved transformers folder (config.json, weights, tokenizer files)."
    elif offline_because_unreachable():  # finetune went offline itself: the user set nothing
        return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what}: {unreachable_fix(name)}")
    else:
        fix = (
            "this looks like a hub id and it is neither in the local cache nor fetchable now (offline, gated or "
            "misspelled). Download it where the hub "
            f"is reachable (`hf download {name} --local-dir DIR`) and set model.name_or_path to DIR"
            + (" (HF_HUB_OFFLINE is set: only the local cache is read, and it does not hold it)."
               if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") else
               ", or set HF_HUB_OFFLINE=1 to use only the local cache.")
        )
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what} ({reason}). Fix: {fix}")


def offline_guard(name_or_path: str) -> None:
    """Fail fast (not hang) when a hub id is needed and the hub cannot be reached: use the local cache only. A name
    that is a path (local_problem) fails here, never asked of the hub."""
    problem = local_problem(name_or_path)
    if problem:
        raise ModelLoadError(f"model: {problem}")
    if is_local(name_or_path):
        return
    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()
