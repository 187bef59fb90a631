"""Reading recipe text: the YAML file, `key.path=value` overrides, and pydantic's errors as one paragraph.

The schema itself (finetune/recipe/schema.py) passes its root model in, so this leaf knows nothing of the sections: a key is
checked against whatever schema the caller validates with, and an unknown one gets the nearest valid key suggested.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.chat_templates import named_templates
from finetune.errors import DATA_PARALLEL_NAMES, RecipeError, data_parallel_refusal
from finetune.recipe.names import foreign_name


def field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def schema_at(root: type[BaseModel], path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model class under `root` that holds the keys at `path` (for key suggestions)."""
    current: type[BaseModel] | None = root
    for part in path:
        if current is None or isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested and getattr(annotation, "__origin__", None) is list:
            nested = [a for a in annotation.__args__ if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else None
    return current


def section_keys(root: type[BaseModel]) -> dict[str, list[str]]:
    """Every section of the schema -> its keys (data.datasets' keys under `data.datasets[]`)."""
    sections = {}
    for name in root.model_fields:
        schema = schema_at(root, (name,))
        if schema is not None:
            sections[name] = field_names(schema)
            for inner in schema.model_fields:
                nested = schema_at(root, (name, inner))
                if nested is not None:
                    sections[f"{name}.{inner}[]"] = field_names(nested)
    return sections


def suggest(key: str, candidates: list[str], *, root: type[BaseModel] | None = None, section: str | None = None) -> str:
    """What to say of an unknown key: the key it means where it is another tool's name or belongs in another section
    (finetune/recipe/names.py), else a near spelling of a key here (close enough to be a typo, never a key of
    another meaning: `gradient_accumulation_steps` is not `gradient_checkpointing`), else the keys here."""
    known = foreign_name(key, section_keys(root), section) if root is not None else None
    if known:
        return f" {known}"
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
    if close:
        return f" Did you mean `{close[0]}`?"
    return f" Valid keys here: {', '.join(candidates)}."


def format_errors(error: ValidationError, source: str, *, root: type[BaseModel]) -> str:
    """pydantic's errors as one paragraph: the file, then each problem at its dotted key, with the nearest valid key."""
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if p not in ("function-after[_cross_field()]",))
        dotted = ".".join(str(p) for p in loc) or "(recipe)"
        asked = item.get("input")
        if loc == ("parallel", "strategy") and isinstance(asked, str) and asked.strip().lower() in DATA_PARALLEL_NAMES:
            lines.append(f"  {dotted}: {data_parallel_refusal(source, asked)}")
        elif item["type"] == "extra_forbidden":
            parent = schema_at(root, loc[:-1])
            section = str(loc[0]) if len(loc) == 2 else None
            hint = suggest(str(loc[-1]), field_names(parent), root=root, section=section) if parent else ""
            lines.append(f"  {dotted}: unknown key.{hint}")
        elif item["type"] == "missing":
            lines.append(f"  {dotted}: required key is missing.")
        else:
            got = item.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"  {dotted}: {msg}{got_text}")
    plural = "s" if len(lines) > 1 else ""
    return f"{source}: {len(lines)} problem{plural} in the recipe:\n" + "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=50` -> (["train", "max_steps"], 50); `data.datasets[0].path=x` or `data.datasets.0.path=x`
    -> (["data", "datasets", "0", "path"], "x"); `datasets[-1]` is the last item. Values are parsed as YAML
    scalars/lists."""
    if "=" not in text:
        raise RecipeError(f"override `{text}`: expected KEY.PATH=VALUE, for example train.max_steps=50.")
    key, _, raw = text.partition("=")
    parts = []
    for part in (p for p in key.strip().split(".") if p):  # a list's item as `datasets.0` or `datasets[0]`
        indexed = re.fullmatch(r"([^\[\]]+)((?:\[-?\d+\])+)", part)
        parts += [indexed.group(1), *re.findall(r"-?\d+", indexed.group(2))] if indexed else [part]
    if not parts:
        raise RecipeError(f"override `{text}`: the key before `=` is empty; write e.g. output.dir=runs/x.")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None  # (a SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(f"override `{text}`: the value is not valid YAML ({exc.problem}).") from None
    return parts, value


def apply_override(raw: dict, parts: list[str], value: Any, text: str, *, root: type[BaseModel]) -> None:
    """Set a dotted key in the raw recipe dict; the key must exist in the schema `root` (typos are caught here too)."""
    node: Any = raw
    schema: type[BaseModel] | None = root
    for depth, part in enumerate(parts):
        index = int(part) if re.fullmatch(r"-?\d+", part) else None
        if schema is not None and part not in schema.model_fields and not isinstance(node, list):
            where = ".".join(parts[:depth]) or "the top level"
            hint = suggest(part, field_names(schema), root=root, section=parts[0] if depth == 1 else None)
            raise RecipeError(
                f"override `{text}`: `{'.'.join(parts[: depth + 1])}` is not a recipe key.{hint} (keys under {where})")
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if index is None or not -len(node) <= index < len(node):
                items = f"0 to {len(node) - 1}, or -1 for the last" if node else "none"
                raise RecipeError(f"override `{text}`: `{part}` is not an index of the list (it has {len(node)} items: "
                                  f"{items}).")
            if last:
                node[index] = value
                return
            node = node[index]
            schema = schema_at(root, tuple(p for p in parts[: depth + 1] if re.fullmatch(r"-?\d+", p) is None))
            continue
        if last:
            node[part] = value
            return
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {} if node.get(part) is None else node[part]
            if not isinstance(node[part], (dict, list)):
                raise RecipeError(f"override `{text}`: `{'.'.join(parts[: depth + 1])}` is a value, not a section.")
        node = node[part]
        schema = schema_at(root, tuple(p for p in parts[: depth + 1] if re.fullmatch(r"-?\d+", p) is None))


def absolute_local_paths(raw: dict) -> None:
    """The recipe's local paths as absolute ones, where they name something that exists from here (the folder the
    command runs in, as the libraries read them): the model and tokenizer folders, model.adapter, a chat template
    file, data and tools files, reward model folders. The run's recipe.yaml and adapter_config.json
    (base_model_name_or_path) then say which files were trained wherever they are read from: `finetune generate`,
    `export` and a resume from another folder took the relative names for hub ids, or read another folder's files.
    Hub ids, template names and paths not found are left as written (their own checks name them). output.dir, which
    a first run creates, is made absolute whether it exists or not."""
    def absolute(value, *, files_only: bool = False):
        if not isinstance(value, str) or not value or "\n" in value or "{" in value:
            return value
        path = Path(value).expanduser()
        if path.is_absolute() or not (path.is_file() if files_only else path.exists()):
            return value
        return os.path.abspath(path)  # symbolic links kept as the user named them

    def fix(section, key, **options):
        if isinstance(section, dict) and key in section:
            section[key] = absolute(section[key], **options)

    model, data, grpo = (raw.get(name) if isinstance(raw, dict) else None for name in ("model", "data", "grpo"))
    for key in ("name_or_path", "tokenizer", "adapter"):
        fix(model, key)
    template = model.get("chat_template") if isinstance(model, dict) else None
    if isinstance(template, str) and template not in named_templates():
        fix(model, "chat_template", files_only=True)  # a named template wins over a file of its name
    for key in ("datasets", "eval_datasets"):
        for spec in (data.get(key) or []) if isinstance(data, dict) and isinstance(data.get(key), list) else []:
            fix(spec, "path")
            fix(spec, "tools", files_only=True)
    if isinstance(grpo, dict) and isinstance(grpo.get("reward_models"), list):
        grpo["reward_models"] = [absolute(entry) for entry in grpo["reward_models"]]
    output = raw.get("output") if isinstance(raw, dict) else None
    if isinstance(output, dict) and isinstance(output.get("dir"), str) and output["dir"]:
        # made before it exists: a resume from the run's recipe.yaml, launched elsewhere, finds this run's checkpoints
        output["dir"] = os.path.abspath(Path(output["dir"]).expanduser())


# Keys a later finetune removed without a rename, and what removed them. A recipe a run wrote (its recipe.yaml, a
# checkpoint's) is read back without them, with a note (`drop_removed_keys`): it was valid for the finetune that wrote
# it. A recipe the user writes now that sets one is still refused as an unknown key.
REMOVED_KEYS = {
    "data.num_workers": "removed in e1c0ecd: rows are tokenized in data.num_proc processes",
}


def drop_removed_keys(raw: dict) -> list[str]:
    """Remove from `raw` the keys of REMOVED_KEYS it sets; returns them, each with why (`data.num_workers (removed
    in ...)`), for the note the caller prints."""
    dropped = []
    for dotted, why in REMOVED_KEYS.items():
        *sections, key = dotted.split(".")
        node = raw
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            del node[key]
            dropped.append(f"{dotted} ({why})")
    return dropped


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error where PyYAML keeps the last one
    silently (a second `train:` section would replace the whole first one)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                if key is None or key == "<<":
                    continue
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"`{key}` is given twice in one mapping (first at line {first[key]}); YAML would "
                        "keep only the second. Merge the two", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        hint = " (it is a folder)" if path.is_dir() else ""
        raise RecipeError(
            f"{path}: recipe file not found{hint}. Pass the path of a YAML recipe, e.g. recipes/quickstart.yaml; "
            "`finetune recipes` lists the library."
        )
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{path}:{where}: YAML syntax error: {problem}. Fix the YAML at that place.") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with sections model, data, train..., got {type(raw).__name__}.")
    return raw
