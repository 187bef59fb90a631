"""Architecture numbers of the recipe library's models, stored in the repo because the hub may be unreachable.

Each `<org>--<name>.json` is a copy of the fields of the model's config.json on the hub (the `_source` key
says where it came from and is dropped when the config is built). The planner and `finetune validate` need
only these numbers, never the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def stored_file(name_or_path: str) -> Path | None:
    """The stored JSON for a hub id (`meta-llama/Llama-3.1-8B-Instruct`), matched case-insensitively, or None."""
    wanted = name_or_path.strip().rstrip("/").replace("/", "--").lower() + ".json"
    for path in _HERE.glob("*.json"):
        if path.name.lower() == wanted:
            return path
    return None


def stored_names() -> list[str]:
    """Hub ids that have stored architecture numbers."""
    return sorted(path.stem.replace("--", "/", 1) for path in _HERE.glob("*.json"))


def stored_config_dict(name_or_path: str) -> dict | None:
    """The stored config.json fields (without `_source`) for a hub id, or None."""
    path = stored_file(name_or_path)
    if path is None:
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {key: value for key, value in raw.items() if not key.startswith("_")}


def stored_config(name_or_path: str):
    """A `transformers.PretrainedConfig` built from the stored numbers, or None when none are stored."""
    fields = stored_config_dict(name_or_path)
    if fields is None:
        return None
    from transformers import AutoConfig

    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)
