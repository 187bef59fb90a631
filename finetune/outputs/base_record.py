"""The base model a checkpoint was trained on, recorded beside its manifest (base.json) and compared when a run resumes
from it, before any weight loads: the base's identity (a content sample of config.json and of every weight file, no
modification times, which a copy changes) and the config.json numbers that size the LoRA tensors.

Without the record, a base replaced in place (a re-download of another revision into the same folder, a `git pull` in
a hub clone) resumed without a word and the LoRA trained on another base; a base of another size was said to make the
run "differ", loaded whole, and only then failed with a bare size mismatch (bb41). A checkpoint written before the
record resumes as it did. Computed once per run: the record is kept while the base folder's files are unchanged, and
each file's sample is shared with the quantized cache (model/quantization/cache.py file_sample).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.files import same_place

RECORD = "base.json"
# config.json's numbers that decide the shapes of the LoRA tensors (and how many layers hold them); a key one
# architecture lacks is not compared. Multimodal configs keep them under text_config.
SIZES = ("hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
         "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "n_embd", "n_layer",
         "n_head", "n_inner", "d_model", "ffn_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
         "qk_nope_head_dim", "v_head_dim")
VOCABULARY = "vocab_size"  # sizes LoRA tensors only where the embeddings or the output layer are targeted
EMBEDDINGS = {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out", "tok_embeddings", "output"}
_RECORDS: dict[tuple, dict | None] = {}  # this process's records, by the base folder's files as they are


@dataclass
class BaseChange:
    """This run's base against the checkpoint's record: `problem` (another size: refused), `note` (other files under
    the same model.name_or_path: the run will differ), `same` (config.json and every weight file as recorded)."""

    problem: str | None = None
    note: str | None = None
    same: bool = False


def base_record(model: dict) -> dict | None:
    """What a checkpoint records of the base of `model` (a resolved recipe's model section): {"name_or_path", "files":
    {file: [bytes, content sample]}, "sizes": {config key: value}}; None where the base is not on this machine (a hub
    id not downloaded yet) or cannot be read. Looked up on this machine only, never on the hub."""
    folder = _local_folder(model)
    if folder is None:
        return None
    key = (json.dumps(model, sort_keys=True, default=str), _signature(folder, model))
    if key not in _RECORDS:
        _RECORDS[key] = _record(model, folder)
    return _RECORDS[key]


def write_base_record(folder: Path, recipe_yaml: str) -> None:
    """base.json into a checkpoint being written (before its manifest, which then covers it); nothing where the base
    cannot be read here."""
    import yaml

    record = base_record((yaml.safe_load(recipe_yaml) or {}).get("model") or {})
    if record is not None:
        (folder / RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")


def compare_base(source: Path, saved: dict, current: dict) -> BaseChange:
    """This run's base (`current`: its resolved recipe) against the record of checkpoint `source` (`saved`: its
    recipe); nothing is said where the checkpoint has no record (written before it) or this base is not on this
    machine yet."""
    try:
        recorded = json.loads((source / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return BaseChange()
    now = base_record(current.get("model") or {})
    if not isinstance(recorded, dict) or now is None:
        return BaseChange()
    then_name, now_name = (saved.get("model") or {}).get("name_or_path"), now["name_or_path"]
    renamed = then_name != now_name and not same_place(then_name, now_name)
    differ = [f"{key} {value} -> {now['sizes'][key]}" for key, value in _table(recorded.get("sizes")).items()
              if key in now["sizes"] and now["sizes"][key] != value
              and (not key.endswith(VOCABULARY) or _embeddings_targeted(saved, current))]
    if differ:
        here = f"the base model here ({now_name})" if renamed else "the base model"
        back = "" if renamed else (f"; {then_name} was replaced by a model of another size since: put the "
                                   "checkpoint's base back there")
        return BaseChange(problem=f"{here} is of another size than the checkpoint's ({then_name}): {', '.join(differ)} "
                                  f"(the saved LoRA tensors have the sizes of the checkpoint's base){back}")
    files = _table(recorded.get("files"))
    changed = sorted(name for name in files.keys() | now["files"].keys() if files.get(name) != now["files"].get(name))
    if not changed:
        return BaseChange(same=True)
    if renamed:  # said by the model.name_or_path note
        return BaseChange()
    return BaseChange(note=f"model.name_or_path {now_name} holds another base than the checkpoint was trained on "
                           f"({_listed(changed)} differ from its record: other files under the same name, e.g. a "
                           "re-download of another revision or a `git pull` into that folder)")


def misfit(path: Path, exc: BaseException) -> str:
    """The paragraph of a checkpoint whose saved LoRA tensors do not load into this run's model (DCP's size mismatch,
    a missing key): the cause and the fix. The checks before loading refuse what they can see (another base size in
    the checkpoint's record, another LoRA layout); this is a checkpoint without the record, or a change they miss."""
    import yaml

    reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    try:
        saved = yaml.safe_load((path / "recipe.yaml").read_text(encoding="utf-8")) or {}
        name = (saved.get("model") or {}).get("name_or_path")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        name = None
    base = f"model.name_or_path={name}" if name else "the model.name_or_path of its recipe.yaml"
    return (f"train.resume: checkpoint {path} does not fit this model ({reason}): its LoRA tensors have the shapes and "
            "names of the base it was trained on and of its lora settings, and this run's model has others (a base "
            "of another size, or one replaced in the same folder since). Nothing was written. Fix: resume on the "
            f"checkpoint's base ({base}, holding the weights it was trained on) with its lora settings (its "
            "recipe.yaml), or start a new run (another output.dir, or output.overwrite=true, without train.resume).")


def _record(model: dict, folder: Path) -> dict | None:
    from finetune.errors import FinetuneError
    from finetune.model.quantization.cache import base_files, file_sample

    try:
        paths = [_gguf_path(model)] if model.get("gguf_file") else base_files(folder)
        files = {}
        for path in paths:
            stat, sample = file_sample(path)
            files[path.name] = [stat.st_size, sample]
    except (OSError, FinetuneError):
        return None
    return {"format": 1, "name_or_path": model.get("name_or_path"), "files": files, "sizes": _sizes(folder)}


def _local_folder(model: dict) -> Path | None:
    """The base's folder on this machine: the recipe's path, the GGUF file's folder, or the hub cache's snapshot of
    model.revision (looked up in the cache alone); None where there is none."""
    from finetune.errors import FinetuneError
    from finetune.model.sources.hub import is_local

    name = model.get("name_or_path")
    if not isinstance(name, str) or not name:
        return None
    try:
        if model.get("gguf_file"):
            from finetune.model.sources.gguf import resolve_folder

            return resolve_folder(name)
        if is_local(name):
            return Path(name).expanduser()
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json", revision=model.get("revision"))
    except (FinetuneError, OSError, ValueError):  # a package not installed, an id the hub's rules refuse
        return None
    return Path(found).parent if isinstance(found, str) else None


def _gguf_path(model: dict) -> Path:
    from finetune.model.sources.gguf import resolve_gguf_path

    return resolve_gguf_path(model["name_or_path"], model["gguf_file"])


def _signature(folder: Path, model: dict) -> tuple:
    """The base's files as they are (inode, size, mtime, ctime: a copy over a file changes its ctime, whatever mtime
    it sets): the folder's, and a GGUF file named by a path of its own."""
    from finetune.errors import FinetuneError

    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        found = [(entry.name, entry.stat()) for entry in entries if entry.is_file()]
        if model.get("gguf_file"):
            found.append(("gguf", _gguf_path(model).stat()))
    except (OSError, FinetuneError):
        return ()
    return tuple((name, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns) for name, stat in found)


def _sizes(folder: Path) -> dict[str, Any]:
    """The SIZES and VOCABULARY of the folder's config.json (text_config's as `text_config.KEY`); {} without one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    sizes = {}
    for prefix, section in (("", config), ("text_config.", config.get("text_config") if isinstance(config, dict)
                                                           else None)):
        if isinstance(section, dict):
            sizes |= {prefix + key: section[key] for key in (*SIZES, VOCABULARY) if isinstance(section.get(key), int)}
    return sizes


def _embeddings_targeted(*recipes: dict) -> bool:
    """LoRA on the embeddings or the output layer, whose tensors the vocabulary sizes (all-linear leaves both out)."""
    for recipe in recipes:
        targets = (recipe.get("lora") or {}).get("target_modules")
        if isinstance(targets, list) and any(str(name).split(".")[-1] in EMBEDDINGS for name in targets):
            return True
    return False


def _table(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
