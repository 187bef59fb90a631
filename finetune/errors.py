"""User-facing errors.

Anything the user can fix (a recipe, a data file, a launcher setting, a folder) raises a subclass of
`FinetuneError`. The entry points (`run.py`, `finetune` CLI) print its message as one paragraph and exit
with code 2, without a traceback. Programming errors stay ordinary exceptions with tracebacks.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class FinetuneError(Exception):
    """A problem in the user's input; the message names the culprit and the fix."""


class RecipeError(FinetuneError):
    """The recipe (file, key or override) is invalid."""


class DataError(FinetuneError):
    """A data file, row or column is invalid."""


class LaunchError(FinetuneError):
    """The launcher, process group or parallel strategy is inconsistent."""


class CheckpointError(FinetuneError):
    """A checkpoint or output folder cannot be used as asked."""


class ModelLoadError(FinetuneError):
    """The model or tokenizer cannot be found or loaded (offline hub, missing folder...)."""
