"""Where the base comes from when it is named by the recipe: a local folder or a hub id; the hub arguments
(revision, trust_remote_code), the offline guard (fail fast when the hub cannot be reached, finetune/hub.py), and the
one-paragraph error when it cannot load."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import ModelLoadError
from finetune.recipe import Recipe


def is_local(name_or_path: str) -> bool:
    return Path(name_or_path).expanduser().exists()


def hub_kwargs(recipe: Recipe) -> dict:
    kwargs = {"trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.revision:
        kwargs["revision"] = recipe.model.revision
    return kwargs


def load_error(what: str, name: str, exc: Exception) -> ModelLoadError:
    local = is_local(name)
    if local:
        fix = f"check that {name} is a saved transformers folder (config.json, weights, tokenizer files)."
    else:
        fix = (
            "this looks like a hub id and it is neither in the local cache nor fetchable now (offline, gated or "
            "misspelled). Download it where the hub "
            f"is reachable (`hf download {name} --local-dir DIR`) and set model.name_or_path to DIR, or set "
            "HF_HUB_OFFLINE=1 to use only the local cache."
        )
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what} ({reason}). Fix: {fix}")


def offline_guard(name_or_path: str) -> None:
    """Fail fast (not hang) when a hub id is needed and the hub cannot be reached: use the local cache only."""
    if is_local(name_or_path):
        return
    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()
