"""The wording both config files users bring share (accelerate's YAML, DeepSpeed's JSON): a key that is not known,
with the known one it is probably a typo of, and a value of the wrong shape, named as the file holds it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """` (did you mean X?)` for the known key closest to `key` (a typo's distance), else an empty string."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def found(value) -> str:
    """A value as a sentence names it: `the string 'cpu'`, `true`, `the number 3`, `a list`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"
