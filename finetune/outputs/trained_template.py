"""The chat template a checkpoint was trained with, kept in the checkpoint (chat_template.json) and given to the adapter
that `finetune export RUN --step N` and `finetune generate RUN --step N` write from it.

Without it, a checkpoint's adapter took the template as it is when the export runs: the recipe's .jinja file (edited
since), a named template (a finetune upgrade changes them: finetune/templates/SOURCES.md), or the base's own (hub
templates are revised after release), and the exported adapter said nothing of it. The template text is small (a few
KB); the tokenizer's vocabulary files are not kept (they are the base's, read as the run read them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

TEMPLATE_FILE = "chat_template.json"  # {"chat_template": the text, a dict of named templates, or null (none)}


def write_trained_template(folder: Path, recipe_yaml: str, tokenizer=None) -> None:
    """Write the run's chat template into checkpoint `folder` (rank 0, before the manifest): the tokenizer's the run
    trained with, or where none is given, the template of the run's recipe (`recipe_yaml`) as training loads it, read
    once per process. A template that cannot be read (the base's tokenizer gone offline) is left out: an export of
    the checkpoint then says that it uses today's."""
    template = tokenizer.chat_template if tokenizer is not None else _recipe_template(recipe_yaml)
    if template is not _UNREADABLE:
        (folder / TEMPLATE_FILE).write_text(json.dumps({"chat_template": template}, indent=1), encoding="utf-8")


_UNREADABLE = object()


@functools.lru_cache(maxsize=4)
def _recipe_template(recipe_yaml: str):
    import yaml

    from finetune.model import load_tokenizer
    from finetune.recipe import validate_recipe

    try:
        return load_tokenizer(validate_recipe(yaml.safe_load(recipe_yaml), trains=False)).chat_template
    except Exception:  # noqa: BLE001  (a checkpoint is never lost to its template's record: any failure leaves it out)
        return _UNREADABLE


def trained_template(checkpoint: Path) -> tuple[bool, str | dict | None]:
    """(whether checkpoint records its template, the template: text, a dict of named templates, or None for none).
    A record of another shape is none (the note of today's template follows)."""
    try:
        template = json.loads((checkpoint / TEMPLATE_FILE).read_text(encoding="utf-8"))["chat_template"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, None
    named = isinstance(template, dict) and all(isinstance(text, str) for text in template.values())
    return (True, template) if template is None or isinstance(template, str) or named else (False, None)


def today_template_note(checkpoint: Path, recipe) -> str:
    """The note of a checkpoint that records no template, exported without a finished run's adapter/ beside it."""
    given, base = recipe.model.chat_template, recipe.model.tokenizer or recipe.model.name_or_path
    named = given and "{" not in given and len(given) < 200  # a name or a file, not the template's own text
    where = f"model.chat_template `{given}` as it is now" if named else "the recipe's model.chat_template" if given \
        else f"the base's ({base}) as it is now"
    return (f"[finetune] note: checkpoint {checkpoint} records no chat template (written by an earlier finetune), and "
            f"the run has no adapter/ with the tokenizer it trained with, so the adapter gets today's template: {where}. "
            "If that file, finetune's named template or the base's template changed since the run, the adapter's "
            "chat_template.jinja is not the one trained with: replace it by the template the run used.")
