"""model.chat_template: the template chat rows are rendered with, by name (finetune/templates), file or text (a leaf:
the recipe checks the value at load, the tokenizer loader applies it)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from finetune.errors import RecipeError


def named_templates() -> dict[str, str]:
    """name -> template text of the templates finetune ships (finetune/templates/SOURCES.md says whose)."""
    folder = resources.files("finetune") / "templates"
    # UTF-8 whatever the locale: deepseek-r1's and gpt-oss's tokens are not ASCII (`<｜User｜>`), and were read as
    # mojibake (ISO-8859-x) or a UnicodeDecodeError (C) where the locale's encoding is another
    return {entry.name.removesuffix(".jinja"): entry.read_text(encoding="utf-8") for entry in folder.iterdir()
            if entry.name.endswith(".jinja")}


def resolve_chat_template(value: str, *, key: str = "model.chat_template") -> str:
    """The template text a recipe's value names: a template's own text (it has Jinja tags), a named template, or a
    file. Anything else is a RecipeError naming the key and the choices."""
    if "{%" in value or "{{" in value:
        return value
    named = named_templates()
    if value in named:
        return named[value]
    path = Path(value).expanduser()
    if path.is_file():  # UTF-8, a byte-order mark dropped (Windows editors write one: U+FEFF began every example)
        return _template_file(path, key)
    raise RecipeError(f"{key}: `{value}` is not a named template, a file, or template text. Named templates: "
                      f"{', '.join(sorted(named))}; or give the path of a .jinja file, or the Jinja text itself.")


def _template_file(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{key}: `{path}` is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at byte "
                          f"{exc.start}). Fix: save the template as UTF-8 (in most editors: Save As, encoding "
                          "UTF-8).") from None


def checked_chat_template(value: str | None) -> str | None:
    """The recipe's value, kept as written, once it names a template (pydantic's error for one that does not)."""
    if value is not None:
        try:
            _compiles(resolve_chat_template(value), value)
        except RecipeError as exc:
            raise ValueError(str(exc).removeprefix("model.chat_template: ")) from None
    return value


def _compiles(template: str, value: str) -> None:
    """A template that is not valid Jinja fails every row alike: refused here, before any weight or row loads, by
    transformers' own compiler (its sandbox, loop controls and the {% generation %} tag of training templates)."""
    from jinja2 import TemplateSyntaxError

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (a private name: where it moved, the first row says the same)
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        source = "template text" if template == value else f"file `{value}`"
        raise RecipeError(f"model.chat_template: the {source} is not valid Jinja: line {exc.lineno}: {exc.message}. "
                          "Fix the template, or name one of finetune's: "
                          f"{', '.join(sorted(named_templates()))}.") from None
