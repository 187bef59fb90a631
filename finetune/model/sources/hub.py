"""Where the base comes from when it is named by the recipe: a local folder or a hub id; the hub arguments
(revision, trust_remote_code), the offline guard (fail fast when the hub cannot be reached, finetune/hub.py), and the
one-paragraph error when it cannot load (naming the recipe key that fixes it where the folder shows the case)."""

from __future__ import annotations

import json
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
    """The one-paragraph error when the config, tokenizer or model of `name` cannot be loaded: the fix names the
    recipe key that solves the case where the folder shows which it is (custom code, a LoRA adapter given as the base,
    missing tokenizer files, no weights), else what to check."""
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    local = is_local(name) or looks_local(name)
    if what == "model" and local and (missing := missing_weights_error(name)) is not None:
        return missing
    fix = _known_fix(what, name, str(exc)) if local or _custom_code(str(exc)) else None
    if fix is None and local:
        fix = f"check that {name} is a saved transformers folder (config.json, weights, tokenizer files)."
    elif fix is None and offline_because_unreachable():  # finetune went offline itself: the user set nothing
        return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what}: {unreachable_fix(name)}")
    elif fix is None:
        fix = (
            "this looks like a hub id and it is neither in the local cache nor fetchable now (offline, gated or "
            "misspelled). Download it where the hub "
            f"is reachable (`hf download {name} --local-dir DIR`) and set model.name_or_path to DIR"
            + (" (HF_HUB_OFFLINE is set: only the local cache is read, and it does not hold it)."
               if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") else
               ", or set HF_HUB_OFFLINE=1 to use only the local cache.")
        )
    return ModelLoadError(f"model.name_or_path `{name}`: cannot load the {what} ({reason}). Fix: {fix}")


def _known_fix(what: str, name: str, text: str) -> str | None:
    """The fix of a load failure that the folder (or transformers' message) identifies, naming its recipe key."""
    if _custom_code(text):
        return (f"{name} holds its own model code (auto_map in config.json). Set model.trust_remote_code: true to "
                "run it, only if you trust that code (it runs the Python files beside config.json).")
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return None
    adapter = next((f for f in (folder, folder / "adapter") if (f / ADAPTER_CONFIG).is_file()), None)
    if adapter is not None and not (folder / "config.json").is_file():
        try:
            base = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            base = None
        what_it_is = (f"a LoRA adapter ({adapter / ADAPTER_CONFIG})" if adapter == folder else
                      f"a finetune run folder (its LoRA adapter: {adapter})")
        return (f"{name} is {what_it_is}, not a base model. To go on training the adapter, set "
                f"model.name_or_path to its base ({base or 'base_model_name_or_path in ' + ADAPTER_CONFIG}) and "
                f"model.adapter: {adapter}; to train a new adapter on base + this one, merge them first (`finetune "
                f"export --merge {name} OUT`) and set model.name_or_path: OUT.")
    if (damaged := damaged_json(folder, _JSON_FILES.get(what, ()))) is not None:
        return (f"{folder / damaged[0]} is cut short or not what transformers reads ({damaged[1]}). Copy or download "
                "that file again (from where the model came from), or fix the value it names.")
    if what == "tokenizer":
        return (f"{name} holds no tokenizer files finetune can load (tokenizer.json, or tokenizer_config.json with its "
                "vocabulary files). Set model.tokenizer to the folder or hub id that has this model's tokenizer "
                "(e.g. the model it was fine-tuned from), or copy those files into the folder.")
    return None


# the JSON files a config or tokenizer load reads from a local folder, first the ones a damaged copy cuts short
_JSON_FILES = {"config": ("config.json",),
               "tokenizer": ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")}


def damaged_json(folder: Path, names) -> tuple[str, str] | None:
    """(file, why) of the first of the JSON files `names` in `folder` that does not parse, or whose special tokens
    (tokenizer_config.json's bos/eos/pad/unk token) are not text; None when each there is whole."""
    for name in names:
        if not (folder / name).is_file():
            continue
        try:
            value = json.loads((folder / name).read_bytes())
        except ValueError as exc:  # (UnicodeDecodeError too: a file cut inside a character)
            return name, str(exc)[:120]
        if name == "tokenizer_config.json" and isinstance(value, dict):
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                if key in value and not isinstance(value[key], (str, dict, type(None))):
                    return name, f"{key} is {value[key]!r}, not a token's text"
    return None


def _custom_code(text: str) -> bool:
    """transformers' refusal of a model whose code is in its folder (auto_map) without trust_remote_code."""
    return "custom code" in text and "trust_remote_code" in text


ADAPTER_CONFIG = "adapter_config.json"
# The weight files transformers' from_pretrained reads (files.py's SINGLE_FILE and INDEX_FILE first; named here, as
# files.py asks this module for the hub folder).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def missing_weights_error(name: str) -> ModelLoadError | None:
    """For a local folder with a config.json and none of the weight files transformers reads: the error a load gives
    (asked by `finetune validate` too, so that it fails where the run would); None otherwise."""
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file() or any((folder / file).is_file() for file in WEIGHT_FILES):
        return None
    held = sorted(path.name for path in folder.iterdir())
    gguf = [file for file in held if file.lower().endswith(".gguf")]
    fix = (f"set model.gguf_file to the GGUF file to train from ({', '.join(gguf[:3])})" if gguf else
           f"copy the model's weight files (with their index, if sharded) into {name}, or point model.name_or_path at "
           "the folder that has them")
    return ModelLoadError(
        f"model.name_or_path `{name}`: the folder holds no model weights (none of {', '.join(WEIGHT_FILES)}; it holds "
        f"{', '.join(held[:6])}{', ...' if len(held) > 6 else ''}). Fix: {fix}.")


def cached_hub_config(recipe: Recipe) -> dict | None:
    """A hub model's config.json as the local hub cache holds it (no network), or None (not cached, unreadable)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(recipe.model.name_or_path, "config.json", revision=recipe.model.revision)
        config = json.loads(Path(path).read_text(encoding="utf-8")) if isinstance(path, str) else None
    except Exception:  # noqa: BLE001 - an id the hub library refuses, an unreadable file: nothing cached to check
        return None
    return config if isinstance(config, dict) else None


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
