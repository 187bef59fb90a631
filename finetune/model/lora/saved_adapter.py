"""A saved adapter folder's two files checked before anything reads them, each damage said in words that name the
file: adapter_config.json cut short, not JSON, or with a field PEFT reads of another type; adapter_model.safetensors
missing, empty, or not a whole safetensors file. One place for every reader: `finetune export` and `generate` (through
outputs/export_source.py) and model.adapter (model/lora/adapter.py). Before, each was a traceback from json, PEFT
(`'<=' not supported between 'str' and 'int'`) or safetensors (`incomplete metadata, file not fully covered`) (bb30).
"""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_CUT = "a truncated download or an interrupted copy leaves such a file"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _names(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))


# The LoraConfig fields PEFT computes with at load, and what each must be (None, where allowed, is PEFT's default).
_FIELDS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a whole number above 0 (the rank)"),
    "lora_alpha": (_number, "a number (the scaling is lora_alpha / r)"),
    "lora_dropout": (lambda v: v is None or _number(v), "a number"),
    "target_modules": (lambda v: v is None or _names(v), "a module name or a list of them"),
    "modules_to_save": (lambda v: v is None or _names(v), "a list of module names"),
    "bias": (lambda v: v is None or isinstance(v, str), "one of none, all, lora_only"),
    "use_rslora": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "rank_pattern": (lambda v: v is None or isinstance(v, dict), "a table of module name -> rank"),
    "alpha_pattern": (lambda v: v is None or isinstance(v, dict), "a table of module name -> alpha"),
    "base_model_name_or_path": (lambda v: v is None or isinstance(v, str), "a folder or hub id"),
    "task_type": (lambda v: v is None or isinstance(v, str), "a task name such as CAUSAL_LM"),
}


def config_problem(folder: Path) -> str | None:
    """Why `folder`'s adapter_config.json cannot be used (missing, unreadable, a field of another type), or None."""
    path = Path(folder) / ADAPTER_CONFIG
    try:
        text = path.read_bytes()
        config = json.loads(text) if text.strip() else None
    except FileNotFoundError:
        return f"{ADAPTER_CONFIG} is missing"
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        return f"{ADAPTER_CONFIG} is unreadable ({exc}): cut short or not JSON; {_CUT}"
    if not isinstance(config, dict):
        said = "empty" if config is None else f"a JSON {type(config).__name__}, not an object of settings"
        return f"{ADAPTER_CONFIG} is {said}; {_CUT}"
    for field, (fits, wanted) in _FIELDS.items():
        if field in config and not fits(config[field]):
            return (f"{ADAPTER_CONFIG} says {field}: {json.dumps(config[field])[:60]}, where PEFT needs {wanted} "
                    "(edited by hand, or written by other code)")
    return None


def weights_problem(folder: Path, *, header: bool = True) -> str | None:
    """Why `folder`'s adapter_model.safetensors cannot be read (missing, empty, not a whole safetensors file), or
    None. `header`: also read its header (safetensors checks that the tensors it lists cover the file exactly), where
    the weights are about to be read; without it, only whether the file is there and not empty."""
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        return f"{ADAPTER_WEIGHTS} is missing"
    if path.stat().st_size == 0:
        return f"{ADAPTER_WEIGHTS} is empty (0 bytes); {_CUT}, or a full disk"
    if not header:
        return None
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        reason = str(exc).removeprefix("Error while deserializing header: ")
        return f"{ADAPTER_WEIGHTS} is not a readable safetensors file ({reason}); {_CUT}"
    return None
