"""Built-in reward functions for GRPO (grpo.reward_functions: [finetune.rewards:NAME]), with TRL's signature:
f(prompts, completions, **columns) -> list[float | None], one value per completion.

`completions` are texts, or for chat prompts one-message lists [message]: TRL's {"role": "assistant", "content":
text} (the completion as TRL decodes it), with what a chat client reads beside it (docs/grpo.md): `final` the final
answer, `reasoning` / `reasoning_content` and `tool_calls`. `exact_match`, `contains_answer` and `final_number` score
the final answer (a reply that reasons first is scored on what follows its reasoning; TRL's messages: their
content); `regex_match` and `length_penalty` the content (a format such as `<think>...</think>` is in it, and so is
the reasoning's length). `columns` are the prompt rows' other columns, one value per completion. None means "not
scored" (TRL: the weighted sum skips it, as nansum). Verifiable rewards only: no model is loaded here.
"""

from __future__ import annotations

import re
from fractions import Fraction


def completion_text(completion) -> str:
    """A completion's final answer: a text completion as it is; a message list's `final` (finetune's: after the
    reasoning, without the tool calls), or its `content` where it has none (TRL's messages)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message["final"] if "final" in message else message.get("content") or "")
                   for message in completion)


def written_text(completion) -> str:
    """A completion as the model wrote it: a text completion as it is; a message list's `content`."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def _normalize(text) -> str:
    return " ".join(str(text).strip().split())


def exact_match(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1.0 when the completion equals the row's `answer` column (whitespace-normalized), else 0.0; None for a row
    with no answer."""
    if answer is None:
        raise ValueError("finetune.rewards:exact_match compares with the rows' `answer` column, and the prompt rows "
                         "have none. Fix: add an `answer` column to the data.")
    return [None if target is None else float(_normalize(completion_text(c)) == _normalize(target))
            for c, target in zip(completions, answer)]


def contains_answer(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1.0 when the row's `answer` appears in the completion, else 0.0."""
    if answer is None:
        raise ValueError("finetune.rewards:contains_answer needs the rows' `answer` column. Fix: add one to the data.")
    return [None if target is None else float(_normalize(target) in _normalize(completion_text(c)))
            for c, target in zip(completions, answer)]


def regex_match(prompts, completions, pattern=None, **columns) -> list[float]:
    """1.0 when the whole completion as written (written_text: reasoning and markup included) matches the row's
    `pattern` column (a regular expression; e.g. a format such as `<think>.*</think>\\s*<answer>.*</answer>`), else
    0.0."""
    if pattern is None:
        raise ValueError("finetune.rewards:regex_match reads the rows' `pattern` column (a regular expression), and "
                         "the rows have none. Fix: add it, or write your own reward with the pattern inside.")
    return [float(re.fullmatch(p, written_text(c).strip(), flags=re.DOTALL) is not None)
            for c, p in zip(completions, pattern)]


def length_penalty(prompts, completions, **columns) -> list[float]:
    """Minus the completion's length as written (reasoning included) in characters / 1000: prefers short answers
    when weighted in beside another reward (e.g. reward_weights: [1.0, 0.1])."""
    return [-len(written_text(c)) / 1000 for c in completions]


_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,000 or 12,345.5; not a list such as 1,2
_FRACTION = re.compile(r"(-?)\\[dt]?frac(?:\{(-?\d+)\}|(\d))(?:\{(-?\d+)\}|(\d))")  # \frac{1}{2}, \dfrac12
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WORDS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")  # \text{ cm}, \text{(A)}
_DECORATION = re.compile(r"\^\{?\\circ\}?|\\%|%|\\\$|°|\\left|\\right")  # degrees, percent, dollars


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in a text, nested braces kept; None without one."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start:end]
    return None


def _value(text: str, *, any_commas: bool = True) -> str | None:
    """A number's canonical form, as an exact fraction (`0.5`, `.5`, `1/2` and `\\frac{1}{2}` alike: `1/2`;
    `1,000.0`: `1000`); None when the text is no number. Without `any_commas` a comma is a thousands separator only
    (`1,000`), so that a list (`1, 2`) is no number."""
    text = text.replace(" ", "")
    if "," in text and not any_commas and not _THOUSANDS.fullmatch(text):
        return None
    text = text.replace(",", "")
    fraction = _FRACTION.fullmatch(text)
    try:
        if fraction:
            sign, top, top_digit, bottom, bottom_digit = fraction.groups()
            value = Fraction(int(top or top_digit), int(bottom or bottom_digit)) * (-1 if sign else 1)
        elif _NUMBER.fullmatch(text) or re.fullmatch(r"-?\d+/\d+", text):
            value = Fraction(text)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return str(value)


def _boxed_answer(boxed: str) -> str | None:
    """A boxed answer: its number where it is one once units and signs around it are left out (`\\$5`, `10\\%`,
    `90^\\circ`, `5 \\text{ cm}`: 5, 10, 90, 5), else its text without spaces, `$` and the `\\text{}` around words
    (`\\text{(A)}`: `A`)."""
    content = re.sub(r"\\\$|[\s$]|\\[,;!]|\{,\}", "", boxed)  # dollars, math mode, LaTeX spacing, `1{,}000`
    number = _value(_DECORATION.sub("", _WORDS.sub("", content)), any_commas=False)
    if number is not None:
        return number
    text = _WORDS.sub(r"\1", content)
    choice = re.fullmatch(r"\(([A-Za-z])\)", text)  # a multiple choice's letter, with or without its parentheses
    return (choice.group(1) if choice else text) or None


def _final_number(text: str) -> str | None:
    """The answer a text ends on: the last `\\boxed{}` when it writes one (MATH, NuminaMath: _boxed_answer), else the
    number after GSM8K's `####` marker when there is one, else the last number in it. Numbers compare as exact
    values: commas and zero fractions ignored, `.5` = `0.5` = `1/2` = `\\frac{1}{2}`."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _boxed_answer(boxed)
    text = text.rsplit("####", 1)[-1] if "####" in text else text
    found = _NUMBER.findall(text)
    return _value(found[-1].rstrip(",")) if found else None


def final_number(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1.0 when the completion's final answer (its last `\\boxed{}`, else the number after `####` if it writes one,
    else its last number) equals the final answer of the row's `answer` column, else 0.0: GSM8K (openai/gsm8k), whose
    `answer` is a worked solution ending `#### 72`, and MATH / NuminaMath, whose `solution` ends in `\\boxed{...}`.
    None for a row whose answer has no number and no `\\boxed{}`."""
    if answer is None:
        raise ValueError("finetune.rewards:final_number compares with the rows' `answer` column, and the prompt rows "
                         "have none. Fix: add an `answer` column to the data.")
    scores: list[float | None] = []
    for completion, target in zip(completions, answer):
        expected = None if target is None else _final_number(str(target))
        scores.append(None if expected is None else float(_final_number(completion_text(completion)) == expected))
    return scores
