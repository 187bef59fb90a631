"""model.chat_template: the template chat rows are rendered with, by name (finetune/templates), file or text (a leaf:
the recipe checks the value at load, the tokenizer loader applies it)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from finetune.errors import RecipeError


def named_templates() -> dict[str, str]:
    """name -> template text of the templates finetune ships (finetune/templates/SOURCES.md says whose)."""
    folder = resources.files("finetune") / "templates"
    return {entry.name.removesuffix(".jinja"): entry.read_text() for entry in folder.iterdir()
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
    if path.is_file():
        return path.read_text()
    raise RecipeError(f"{key}: `{value}` is not a named template, a file, or template text. Named templates: "
                      f"{', '.join(sorted(named))}; or give the path of a .jinja file, or the Jinja text itself.")


def checked_chat_template(value: str | None) -> str | None:
    """The recipe's value, kept as written, once it names a template (pydantic's error for one that does not)."""
    if value is not None:
        try:
            resolve_chat_template(value)
        except RecipeError as exc:
            raise ValueError(str(exc).removeprefix("model.chat_template: ")) from None
    return value
