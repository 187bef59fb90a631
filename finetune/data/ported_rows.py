"""Rows as LLaMA-Factory and axolotl write them, read with those tools' meaning instead of losing part of it.

- LLaMA-Factory's alpaca rows (`instruction`, `input`, `output`, `system`, `history`: [[instruction, response], ...]).
  Format chat reads them as LLaMA-Factory's AlpacaDatasetConverter does: the history as earlier user and assistant
  turns, `instruction` and `input` joined by a newline as the last user turn, `output` its answer; every response is
  trained (LLaMA-Factory's default, `mask_history: false`), through the model's chat template. Format alpaca renders
  one instruction with the fixed Alpaca prompt, which has no place for earlier turns: a row with a history is
  refused there (before, the history was dropped without a word).
- LLaMA-Factory's ranking and KTO alpaca rows carry an `input` beside the prompt: joined to a text prompt by a newline,
  as LLaMA-Factory joins them (before, it was dropped once `columns` mapped the prompt to `instruction`).
- LLaMA-Factory's KTO rows in one conversation (`messages` / `conversations` with `kto_tag`): the last message is the
  completion, the ones before it the prompt (its converter's `prompt = messages[:-1]`). TRL 1.16 has no such form
  (its KTOTrainer takes prompt, completion and label, or pairs it unpairs); `kto_tag` is read as TRL's `label`.
- axolotl's per-message training flags (`message_field_training`: a message key `training`, `train` or `weight`,
  true/false or 1/0; chat_template.py trains a turn whose flag is set, whatever its role, and leaves one flagged off
  untrained): an assistant turn flagged off is context, not trained. finetune trains assistant turns only, so a
  user, system or tool turn flagged on is refused, as are the character spans of `message_field_training_detail`.
- TRL's pair files under KTO (prompt/chosen/rejected, the implicit-prompt form too, given as `format: preference` or
  `format: unpaired_preference`): unpaired as TRL 1.16's KTOTrainer unpairs them (data_utils.unpair_preference_dataset,
  which it calls on a dataset whose rows have `chosen` and `rejected`): each pair becomes its prompt with the chosen
  completion, label true, and its prompt with the rejected one, label false. TRL maps `_unpair_row` over batches of
  1,000 rows, each batch's chosen rows first, then its rejected rows in the same order: a chunk of rows here is 1,000
  rows (fewer only where they pass readers.CHUNK_CHARS of text), and is unpaired the same way. Before, a pair file was
  refused under kto, with a hint naming SFT formats.
"""

from __future__ import annotations

import numbers

from finetune.data.conversations import TRAINING_KEYS, convert_turns, field_text
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

FLAG_KEYS = TRAINING_KEYS[:3]  # training, train, weight: one flag for the whole turn
ALPACA_FIELDS = ("instruction", "input", "output", "history")
KTO_TAG = "kto_tag"  # LLaMA-Factory's name for TRL's `label`
UNPAIRED_ONLY = ("completion", "label", "messages")  # the fields of an unpaired row that a pair has not


# ------------------------------------------------------------------------------------- LLaMA-Factory's alpaca rows
def refuse_history(history, what: str) -> None:
    """Format alpaca: a row with earlier turns (`what` names the row and the column) is refused (module docstring)."""
    if history in (None, "", []):
        return
    pairs = f"{len(history)} earlier turn{'s' if len(history) != 1 else ''}" if isinstance(history, list) else \
        "earlier turns"
    raise DataError(
        f"{what} holds {pairs} ([instruction, response] pairs: LLaMA-Factory's alpaca history). Format alpaca renders "
        "one instruction with the fixed Alpaca prompt (### Instruction / ### Response), which has no place for them: "
        "the row would train its last answer without the conversation it answers. Fix: set the dataset's format: "
        "chat, which reads LLaMA-Factory's alpaca rows as LLaMA-Factory does (the history as earlier user and "
        "assistant turns, every response trained, the instruction and input joined by a newline as the last user "
        "turn, through the model's chat template), convert the rows to `messages` (docs/data.md, Rows from "
        "LLaMA-Factory and axolotl), or set data.bad_rows: skip.")


def alpaca_turns(fields: dict, names: dict, where: str) -> list[dict]:
    """An alpaca row's conversation (format chat), as LLaMA-Factory's converter builds it: each history pair a user and
    an assistant turn, then the instruction and input joined by a newline, then the output. `fields`: the values of
    ALPACA_FIELDS; `names`: their columns, for the errors."""
    history = fields["history"]
    if history in (None, "", []):
        history = []
    if not isinstance(history, list) or not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in history):
        raise DataError(f"{where}: `{names['history']}` must be a list of [instruction, response] pairs (LLaMA-Factory's "
                        f"alpaca history), got {history!r}. Fix the row, or set data.bad_rows: skip.")
    if not field_text(fields["output"], f"{where}: `{names['output']}`").strip():
        raise DataError(f"{where}: missing or empty `{names['output']}` (absent, null or only whitespace), the answer an "
                        "alpaca row trains. Fix the row, or set data.bad_rows: skip.")
    turns = []
    for number, (asked, answered) in enumerate(history, start=1):
        turns += [{"role": "user", "content": field_text(asked, f"{where}: `{names['history']}` pair {number}")},
                  {"role": "assistant", "content": field_text(answered, f"{where}: `{names['history']}` pair {number}")}]
    question = with_input(field_text(fields["instruction"], f"{where}: `{names['instruction']}`"), fields["input"],
                          f"{where}: `{names['input']}`")
    return turns + [{"role": "user", "content": question}, {"role": "assistant", "content": fields["output"]}]


def with_input(prompt, extra, what: str):
    """`prompt` with an alpaca row's `input` (`extra`; `what` names the row and column) after it, as LLaMA-Factory
    joins them ("instruction\\ninput", either left out when empty): for alpaca rows read as chat, and for ranking and
    KTO rows whose prompt is mapped to `instruction`. A prompt of chat messages (an implicit-prompt pair's shared
    turns too) has no single text to join it to: refused rather than dropped. A missing prompt (None) stays missing,
    for the caller's error: the input is no prompt of its own when the instruction sits in an unmapped column."""
    extra = field_text(extra, what)
    if not extra.strip() or prompt is None:
        return prompt
    if isinstance(prompt, list):
        raise DataError(f"{what} holds text ({extra[:40]!r}), and the row's prompt is chat messages, so where it belongs "
                        "is unclear (LLaMA-Factory joins `input` to a text instruction by a newline). Fix the row (write "
                        "it into the user's turn), or set data.bad_rows: skip.")
    return "\n".join(part for part in (prompt, extra) if part)


# ---------------------------------------------------------------------------------- KTO rows in one conversation
def kto_column(spec: DatasetSpec, name: str, row) -> str | None:
    """The column of an unpaired preference row's field `name` where the row is LLaMA-Factory's KTO conversation (no
    `prompt` nor `completion`, a `messages` or `conversations` list: prompt and completion both come from it) or
    tags it with `kto_tag` (its `label`); None elsewhere. (Mapped fields never get here: templates._column.)"""
    if spec.format != "unpaired_preference" or not isinstance(row, dict):
        return None
    if name == "label":
        return KTO_TAG if "label" not in row and KTO_TAG in row else None
    if name in ("prompt", "completion") and "prompt" not in row and "completion" not in row:
        return next((column for column in (spec.columns.get("messages"), "messages", "conversations")
                     if column is not None and column in row), None)
    return None


def split_completion(turns, spec: DatasetSpec, column: str, where: str) -> tuple[list, list]:
    """(prompt, completion) of a KTO row given as one conversation (kto_column): the last message is the completion
    and must be the assistant's; the messages before it are the prompt (LLaMA-Factory's converter)."""
    if not isinstance(turns, list) or len(turns) < 2:
        raise DataError(f"{where}: `{column}` must be a conversation of at least a user turn and the assistant's "
                        f"completion (LLaMA-Factory's KTO rows), got {turns!r}. Fix the row, or set data.bad_rows: skip.")
    last = convert_turns(turns[-1:], spec, where)[0]["role"]
    if last != "assistant":
        raise DataError(f"{where}: `{column}` ends with a {last} turn. In a KTO row given as one conversation the last "
                        "message is the completion that `label` (or `kto_tag`) judges, so it must be the assistant's; "
                        "the messages before it are the prompt. Fix the row, or set data.bad_rows: skip.")
    return turns[:-1], turns[-1:]


# ------------------------------------------------------------------------------------- pair files under KTO
def kto_spec(spec: DatasetSpec, objective: str) -> DatasetSpec:
    """The dataset as train.objective reads it: under kto, a pair file (`format: preference`) is unpaired preference
    data whose rows are pairs (pair_row), tokenized and cached as KTO rows; any other dataset as it is."""
    if objective == "kto" and spec.format == "preference":
        return spec.model_copy(update={"format": "unpaired_preference"})
    return spec


def pair_row(spec: DatasetSpec, row) -> bool:
    """Whether a row of unpaired preference data is a preference pair to unpair (TRL's KTOTrainer unpairs rows with
    `chosen` and `rejected`): both answers there (the columns `columns` maps them to), and no `completion`."""
    if spec.format != "unpaired_preference" or not isinstance(row, dict):
        return False
    column = {name: spec.columns.get(name, name) for name in ("chosen", "rejected", "completion")}
    return column["chosen"] in row and column["rejected"] in row and column["completion"] not in row


def pair_spec(spec: DatasetSpec) -> DatasetSpec:
    """How a pair row of unpaired preference data is read and rendered: as format preference reads a pair (its
    implicit-prompt form too: chosen and rejected whole conversations, the prompt their shared opening turns, as TRL's
    extract_prompt before it unpairs), without the unpaired fields' mappings."""
    columns = {name: column for name, column in spec.columns.items() if name not in UNPAIRED_ONLY}
    return spec.model_copy(update={"format": "preference", "columns": columns})


def checked_spec(spec: DatasetSpec, rows: list) -> DatasetSpec:
    """The spec whose fields a dataset's rows must have: a pair file's (pair_spec) where its rows are pairs."""
    return pair_spec(spec) if any(pair_row(spec, row) for row in rows) else spec


def unpaired(kept: list) -> tuple[list, list[str]]:
    """((segments, desirable), place) of a chunk's rendered rows (`kept`: (rendering, place)), pairs unpaired in TRL's
    order (module docstring): first every row in order (a pair as its chosen completion, desirable), then each pair's
    rejected completion (undesirable), in the same order; and the pairs' places. A rendered pair is (chosen segments,
    rejected segments), a rendered KTO row (segments, label)."""
    pairs = [(item, place) for item, place in kept if isinstance(item[1], list)]
    first = [((item[0], True), f"{place} (chosen)") if isinstance(item[1], list) else (item, place)
             for item, place in kept]
    return first + [((item[1], False), f"{place} (rejected)") for item, place in pairs], [place for _, place in pairs]


def unpaired_note(pairs: int, first: str) -> str:
    """The note of the pairs unpaired (data line, `finetune data`)."""
    return (f"{pairs:,} preference pair{'s' if pairs != 1 else ''} (the first: {first}) unpaired into {2 * pairs:,} "
            "KTO rows, as TRL's KTOTrainer does: each pair's prompt with its chosen completion (desirable) and with "
            "its rejected one (undesirable)")


# --------------------------------------------------------------------------------- axolotl's per-message flags
def training_flag(message: dict) -> bool | None:
    """A message's training flag (conversations.py keeps a turn's `training`, `train` and `weight` as its `flags`):
    true/1 trained, false/0 not, None without one. Only a clear flag counts: a null (Arrow's fill), another value
    (`weight: 0.5`, `train: "yes"`, an object), flags that disagree and axolotl's `*_detail` spans leave the turn as it
    would be without them (a review found rows that trained before refused for keys that meant something else)."""
    flags = message.get("flags") or {}
    values = {_flag_value(flags[key]) for key in FLAG_KEYS if key in flags} - {None}
    return next(iter(values)) if len(values) == 1 else None


def _flag_value(value) -> bool | None:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    if isinstance(value, numbers.Real) and value in (0, 1):
        return bool(value)
    return None


def trained_turns(messages: list[dict], trained_from: int, where: str) -> list[int]:
    """The indexes of the assistant turns of a conversation to train: those from message `trained_from` on, except
    the ones flagged off (axolotl's per-message flags: such a turn is context). A flag on another role's turn changes
    nothing: finetune trains what the model writes at inference, the assistant's turns."""
    indexes = [index for index, message in enumerate(messages) if message["role"] == "assistant"
               and index >= trained_from and training_flag(message) is not False]
    if not indexes:
        raise DataError(f"{where}: every assistant turn to train is flagged not to be trained (`weight: 0`, `train: "
                        "false` or `training: false`: axolotl's per-message training flag, which finetune reads: such "
                        "a turn is context), so the row trains nothing. Fix: flag the turns to train true or 1 (or "
                        "remove their flag), remove the row, or set data.bad_rows: skip.")
    return indexes


def refuse_unscored(messages: list[dict], name: str, where: str) -> None:
    """A preference or KTO answer (`messages`: its turns) may not have a turn flagged off: the loss scores the whole
    answer (axolotl reads these flags in SFT chat_template datasets only)."""
    if any(training_flag(message) is False for message in messages):
        raise DataError(f"{where}: `{name}` has a turn flagged not to be trained (axolotl's per-message training "
                        "flag: `weight: 0`, `train: false` or `training: false`). The answers of a preference or "
                        "KTO row are what the loss scores, so no part of one can be left out. Fix: remove the "
                        "flag from the answer's turns, or set data.bad_rows: skip.")
