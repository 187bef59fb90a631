"""What a tokenizer's chat template is and writes: its text (a named template picked as transformers picks), the
tokenizer's special tokens, and the end of an assistant turn: the special token that closes it (<|im_end|>,
<|eot_id|>), among generation's end tokens, or a marker that is no token of this tokenizer (ChatML's `<|im_end|>` on a
Mistral base), trained as text and stopped on as text by generation (the generation eval, `finetune generate`, GRPO's
sampling: data/prompts.turn_end_stops). Read once per tokenizer and template, said once per tokenizer."""

from __future__ import annotations

import weakref
from dataclasses import dataclass


def chat_template_text(tokenizer, *, tools: bool = False) -> str:
    """The tokenizer's chat template as text. A dict of named templates (Hermes 2 Pro's, Command R's): `tool_use`
    when tools are given and it has one, else `default`, as transformers picks."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        return template.get("tool_use", "") if tools and "tool_use" in template else template.get("default", "")
    return template


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens, longest first (kept per tokenizer: every turn of every row asks)."""
    if tokenizer not in _SPECIALS:
        _SPECIALS[tokenizer] = sorted(set(tokenizer.all_special_tokens) | {token.content for token in getattr(
            tokenizer, "added_tokens_decoder", {}).values() if token.special}, key=len, reverse=True)
    return _SPECIALS[tokenizer]


_END_PROBE = "Z7Q_END_PROBE"  # an assistant answer rendered to read what the template writes after it
_TURN_ENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NOTED: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class TurnEnd:
    """What the chat template writes right after an assistant answer to close the turn. `special_id`: the special
    token it closes with (<|im_end|>, <|eot_id|>), among generation's end tokens. `text`: a marker that is no special
    token of this tokenizer (ChatML's `<|im_end|>` to a Mistral base: 10 ordinary pieces, `ids`), written as text
    and stopped on as text (a stop string)."""

    special_id: int | None
    text: str
    ids: tuple[int, ...]


def turn_end(tokenizer) -> TurnEnd | None:
    """The tokenizer's chat template's end of an assistant turn (kept per tokenizer and template), or None for a
    template that closes no turn (GLM's: the next turn's opener ends it) or a tokenizer without a template."""
    from jinja2 import TemplateError

    template = chat_template_text(tokenizer)
    known = _TURN_ENDS.get(tokenizer)
    if known is not None and known[0] == template:
        return known[1]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": _END_PROBE}], tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError):  # none, or one needing more than this
        text = ""
    found = None
    if isinstance(text, str) and _END_PROBE in text:
        tail = text.split(_END_PROBE, 1)[1]
        special = set(tokenizer.convert_tokens_to_ids(special_tokens(tokenizer)))
        ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        marker = next((line.strip() for line in tail.splitlines() if line.strip()), "")
        if any(i in special for i in ids):
            found = TurnEnd(next(i for i in ids if i in special), "", ())
        elif marker:  # text: the model writes it piece by piece, decoding keeps it
            found = TurnEnd(None, marker, tuple(tokenizer(marker, add_special_tokens=False)["input_ids"]))
    _TURN_ENDS[tokenizer] = (template, found)
    return found


def turn_end_note(tokenizer) -> str | None:
    """A note for a template whose end of turn is not one token of this tokenizer (None otherwise)."""
    end = turn_end(tokenizer)
    if end is None or end.special_id is not None or len(end.ids) < 2:
        return None
    pieces = " ".join(repr(piece) for piece in tokenizer.convert_ids_to_tokens(list(end.ids)))
    eos = f" (its EOS {tokenizer.eos_token}: a .jinja template that closes each assistant turn with " \
          "{{ eos_token }})" if tokenizer.eos_token else ""
    return (f"the chat template closes each assistant turn with `{end.text}`, which is not a token of this tokenizer: "
            f"it is trained as text, {len(end.ids)} pieces ({pieces}), and generation (the generation eval, `finetune "
            "generate`, GRPO's sampling) stops once the model has written them, the marker cut from the answer. To "
            f"have a one-token end of turn, use a template that closes turns with a token this tokenizer has{eos}, "
            "or a base whose tokenizer has the template's tokens (Qwen's bases have <|im_end|>; Llama 3's have "
            "<|eot_id|>: model.chat_template: llama-3.1); finetune does not add tokens to a vocabulary.")


def note_turn_end(tokenizer) -> None:
    """Print turn_end_note once per tokenizer (rank 0): the first row rendered, or GRPO's prompts read, says it."""
    from finetune.distributed import print0

    if tokenizer in _NOTED:
        return
    _NOTED.add(tokenizer)
    note = turn_end_note(tokenizer)
    if note:
        print0(f"[finetune] note: {note}")
