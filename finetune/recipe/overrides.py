"""`key.path=value` overrides from the command line: the key checked against the schema, the value taken as written,
then set into the raw recipe before validation (so an override goes through the file's checks).

A value is read as YAML (numbers, true/false, null, `[a, b]`, `{key: value}`), except where YAML would change what
the user typed, which they cannot see on a command line: a key that takes text (`data.system_prompt`, `output.dir`,
`model.chat_template`, `model.revision`) takes the text as written (`Answer format: JSON`, `2024-01-01`, `12:30`,
`yes`, `{% for ... %}` stay text; a value in YAML quotes is unquoted), and elsewhere a value YAML would cut (` #...`
is a YAML comment), fold (a newline) or read as octal (`0042` is 34 in YAML 1.1) is taken as written (`0042` is 42).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from finetune.errors import RecipeError
from finetune.recipe.names import UNSET, section_of
from finetune.recipe.text import UniqueKeyLoader, field_names, schema_at, suggest

_INDEX = re.compile(r"-?\d+")
_NULLS = ("null", "Null", "NULL", "~")

# A whole section set to null on the command line is refused (an empty section means all its defaults, the
# opposite of what `quantization=null` asks); what to write instead, where a section has a way to be off.
SECTION_OFF = {"quantization": "`quantization.method=none` (or `quantization=none`) for plain LoRA without 4-bit"}


def split_override(text: str) -> tuple[list[str], str]:
    """`data.datasets[0].path=x` or `data.datasets.0.path=x` -> (["data", "datasets", "0", "path"], "x")."""
    if "=" not in text:
        raise RecipeError(f"override `{text}`: expected KEY.PATH=VALUE, for example train.max_steps=50.")
    key, _, raw = text.partition("=")
    parts = []
    for part in (p for p in key.strip().split(".") if p):  # a list's item as `datasets.0` or `datasets[0]`
        indexed = re.fullmatch(r"([^\[\]]+)((?:\[-?\d+\])+)", part)
        parts += [indexed.group(1), *re.findall(r"-?\d+", indexed.group(2))] if indexed else [part]
    if not parts:
        raise RecipeError(f"override `{text}`: the key before `=` is empty; write e.g. output.dir=runs/x.")
    return parts, raw


def parse_override(text: str, *, root: type[BaseModel] | None = None) -> tuple[list[str], Any]:
    """`train.max_steps=50` -> (["train", "max_steps"], 50); `datasets[-1]` is the last item. With the schema `root`,
    a key that takes text gets the text as written (`takes_text`); other values are read as YAML (`yaml_value`)."""
    parts, raw = split_override(text)
    if root is not None and takes_text(root, parts):
        return parts, text_value(raw)
    if root is not None and leaf_annotation(root, parts) is None:  # not a key: apply_override says so, first
        try:
            return parts, yaml_value(raw, text)
        except RecipeError:
            return parts, raw.strip()
    return parts, yaml_value(raw, text)


def text_value(raw: str) -> str | None:
    """A text key's value: as written (stripped); empty or null is null; a value in YAML quotes is unquoted
    (`'2024-01-01'`, `"a\\nb"`: the quotes say "exactly this", as in the file)."""
    stripped = raw.strip()
    if not stripped or stripped in _NULLS:
        return None
    if stripped[0] in "'\"" and stripped[-1] == stripped[0] and len(stripped) > 1:
        try:
            node = yaml.compose(stripped, Loader=UniqueKeyLoader)
        except yaml.YAMLError:
            return stripped
        if isinstance(node, yaml.ScalarNode) and node.style == stripped[0] and node.end_mark.index == len(stripped):
            return node.value
    return stripped


def yaml_value(raw: str, text: str) -> Any:
    """A value as YAML reads it, unless YAML would change what was written: a leading-zero integer is decimal
    (`0042` is 42, not octal 34), and a value YAML would cut (` #...`, a comment) or fold (a newline into a space) is
    taken as the text written (validation then says whether the key takes it)."""
    stripped = raw.strip()
    if not stripped:
        return None
    if re.fullmatch(r"[-+]?0[0-9_]*[0-9][0-9_]*", stripped):
        return int(stripped.replace("_", ""), 10)
    try:
        node = yaml.compose(raw, Loader=UniqueKeyLoader)
        value = yaml.load(raw, Loader=UniqueKeyLoader)  # (a SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(
            f"override `{text}`: the value is not valid YAML ({_yaml_problem(exc)}). Fix: write a list as [a, b] and "
            f"a mapping as {{key: value}}; for text, quote it: \"{text.partition('=')[0]}='...'\".") from None
    if value is None and stripped not in _NULLS:  # `---`, `...`: YAML's document markers, read as no value at all
        return stripped
    cut = node.end_mark.index < len(raw.rstrip())  # text after the value: a ` #` comment
    folded = isinstance(node, yaml.ScalarNode) and node.style is None and node.end_mark.line > node.start_mark.line
    return stripped if cut or folded else value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    return f"{context}, {problem}" if context else problem


def _members(annotation) -> list:
    """The types a field's annotation allows (a union's members; Optional's None left out)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_text(annotation) -> bool:
    members = _members(annotation)
    return bool(members) and all(
        member is str or (typing.get_origin(member) is Literal and all(isinstance(v, str) for v in typing.get_args(member)))
        for member in members)


def leaf_annotation(root: type[BaseModel], parts: list[str]):
    """The annotation of the value an override's key sets (a list's item type under an index, a dict's value type under
    a key); None where the schema does not say."""
    annotation: Any = root
    for part in parts:
        members = _members(annotation)
        model = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
        if model is not None and not _INDEX.fullmatch(part):
            field = model.model_fields.get(part)
            annotation = field.annotation if field is not None else None
            continue
        container = next((m for m in members if typing.get_origin(m) in (list, dict)), None)
        if container is None:
            return None
        if typing.get_origin(container) is list and not _INDEX.fullmatch(part):
            return None
        annotation = typing.get_args(container)[-1] if typing.get_args(container) else None
    return annotation


def takes_text(root: type[BaseModel], parts: list[str]) -> bool:
    """Whether the key an override sets holds text (str, or a choice of strings): its value is then taken as
    written, never as YAML's number, date, boolean or mapping."""
    annotation = leaf_annotation(root, parts)
    return annotation is not None and _is_text(annotation)


def _key(parts: list[str]) -> str:
    """["data", "datasets", "0", "path"] -> data.datasets[0].path"""
    return "".join(f"[{p}]" if _INDEX.fullmatch(p) else f".{p}" for p in parts).lstrip(".")


def _inline(parts: list[str], raw: str) -> str:
    """How the value `raw` at the key path `parts` is written inline: `{path: x}` for ["path"], `x` for []."""
    value = raw.strip() or "..."
    for part in reversed(parts):
        value = f"[{value}]" if _INDEX.fullmatch(part) else f"{{{part}: {value}}}"
    return value


def apply_override(raw: dict, parts: list[str], value: Any, text: str, *, root: type[BaseModel]) -> None:
    """Set a dotted key in the raw recipe dict; the key must exist in the schema `root` (typos are caught here too)."""
    node: Any = raw
    schema: type[BaseModel] | None = root
    written = text.partition("=")[2]
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            index = int(part) if _INDEX.fullmatch(part) else None
            if index is None or not -len(node) <= index < len(node):
                items = f"0 to {len(node) - 1}, or -1 for the last" if node else "none"
                raise RecipeError(f"override `{text}`: `{part}` is not an index of the list (it has {len(node)} items: "
                                  f"{items}). To add or remove items, set the whole list: "
                                  f"`{_key(parts[:depth])}=[...]`.")
        elif schema is not None and part not in schema.model_fields:
            where = ".".join(parts[:depth]) or "the top level"
            hint = suggest(part, field_names(schema), root=root, section=section_of(parts[:depth]),
                           top_level=depth == 0, value=value if last else UNSET)
            raise RecipeError(f"override `{text}`: `{_key(parts[: depth + 1])}` is not a recipe key.{hint} "
                              f"(keys under {where})")
        key = int(part) if isinstance(node, list) else part
        if last:
            if value is None and not isinstance(node, list) and _is_section(leaf_annotation(root, parts)):
                _refuse_null_section(parts, text)
            node[key] = value
            return
        child = node[key] if isinstance(node, list) else node.get(key)
        if _INDEX.fullmatch(parts[depth + 1]) and not isinstance(child, (list, dict)):
            _refuse_missing_list(parts, depth, child, written, text, schema)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, (dict, list)):
            section = schema_at(root, _names(parts[: depth + 1])) is not None
            fix = (f" Fix: set the section whole: `{_key(parts[: depth + 1])}={_inline(parts[depth + 1:], written)}`."
                   if section else "")  # `quantization: none` is the short form of `quantization: {method: none}`
            raise RecipeError(f"override `{text}`: `{_key(parts[: depth + 1])}` is a value, not a section (here "
                              f"`{child}`).{fix}")
        node = child
        schema = schema_at(root, _names(parts[: depth + 1]))


def _is_section(annotation) -> bool:
    return any(isinstance(member, type) and issubclass(member, BaseModel) for member in _members(annotation))


def _names(parts: list[str]) -> tuple[str, ...]:
    return tuple(p for p in parts if not _INDEX.fullmatch(p))


def _refuse_null_section(parts: list[str], text: str) -> None:
    key = _key(parts)
    fix = SECTION_OFF.get(key, f"set the keys you mean (`{key}.KEY=VALUE`), or `{key}={{}}` for all its defaults")
    raise RecipeError(f"override `{text}`: `{key}` is a section, and null does not switch a section off: an empty "
                      f"section takes all its defaults. Fix: {fix}; leave the override out to keep the recipe's.")


def _refuse_missing_list(parts: list[str], depth: int, child: Any, written: str, text: str, schema) -> None:
    """`data.eval_datasets[0].path=x` where the recipe has no such list (or a value that is not one)."""
    key, index = _key(parts[: depth + 1]), parts[depth + 1]
    whole = f"`{key}=[{_inline(parts[depth + 2:], written)}]`" if index in ("0", "-1") else f"`{key}=[...]`"
    if child is None:
        field = schema.model_fields.get(parts[depth]) if schema is not None else None
        default = field.get_default(call_default_factory=True) if field is not None else None
        unset = f"; its default is `{default}`" if default not in (None, [], {}) else ""
        said = f"the recipe does not set {key}{unset}"
    else:
        said = f"{key} is `{child}` here, not a list"
    raise RecipeError(f"override `{text}`: {key} has no item {index} ({said}). Fix: set the whole list: {whole}.")
