"""Formats and chat templates: a row rendered to (text, trained) segments, tokenized with exact labels."""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import numpy as np

from finetune.data.chat import chat_examples, prompt_part, row_template_kwargs
from finetune.data.conversations import (
    ROLE_ALIASES,
    check_order,
    convert_turns,
    dataset_tools,
    field_text,
    json_value,
    normalize_tools,
    prompt_completion_turns,
    refuse_empty_answer,
    refuse_turns_as_text,
    visible,
    without_nulls,
)
from finetune.data.folders import saved_folder
from finetune.data.ported_rows import (
    ALPACA_FIELDS,
    alpaca_turns,
    kto_column,
    refuse_history,
    refuse_unscored,
    split_completion,
    with_input,
)
from finetune.data.readers import data_suffix, looks_local
from finetune.data.tokens import _labels, adds_bos, answer_starts, tokenize_many, tokenize_segments
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

# Re-exported: the speaker names live with the conversations (data/conversations.py), the tokenizing of rendered rows
# in data/tokens.py.
__all__ = ["ROLE_ALIASES", "_labels", "adds_bos", "answer_starts", "tokenize_many", "tokenize_segments"]

# Field names each format needs, and optional ones (the recipe's `columns` maps them to other column names). `history`
# and `input` (LLaMA-Factory's), and chat's alpaca fields and a KTO row's `messages`: data/ported_rows.py.
FORMAT_FIELDS = {
    "alpaca": (("instruction", "output"), ("input", "system", "history")),
    "chat": (("messages",), ("system", "tools", "prompt", "completion", *ALPACA_FIELDS)),  # or TRL's prompt-completion
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
    "preference": (("chosen", "rejected"), ("prompt", "input", "system", "tools")),  # prompt optional: implicit-prompt form
    "unpaired_preference": (("prompt", "completion", "label"), ("input", "system", "tools", "messages")),  # TRL's KTO rows
    "prompt": (("prompt",), ("system", "tools")),  # GRPO: prompts only; the other columns go to the reward functions
}
# The fields rendered as text (the others: messages, answers that may be turns, tools, labels). A number is taken as
# its JSON text; true/false, a list or an object is the row's error (conversations.field_text).
TEXT_FIELDS = {"alpaca": ("instruction", "input", "output", "system"), "completion": ("prompt", "completion"),
               "text": ("text",), "chat": ("system",), "preference": ("system", "input"),
               "unpaired_preference": ("system", "input")}
_SURROGATE = re.compile("[\ud800-\udfff]")
_TEXT_FILE_LINE = re.compile(r"\.txt(\.\w+)? line \d+$")  # where a .txt file's row is (readers.text_rows: `a.txt line 3`)
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_TURN_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected")  # fields that may hold chat turns
_NULLS_DROPPED = [0]  # rows of this process whose tool calls or tools lost Arrow's null-filled keys (arrow_cleaned)
# --------------------------------------------------------------------------------------------------- rendering
def _column(spec: DatasetSpec, name: str, row: dict | None = None) -> str:
    """The data column holding field `name`. Chat data without `messages` may use ShareGPT's `conversations`
    unmapped, or be TRL's conversational prompt-completion rows: their messages start in the `prompt` column; or
    LLaMA-Factory's alpaca rows: in the `instruction` column. A KTO row may be one conversation (ported_rows)."""
    if name in spec.columns:
        return spec.columns[name]
    if name == "messages" and row is not None and "messages" not in row:
        if "conversations" in row:
            return "conversations"
        for first, other in (("prompt", "completion"), ("instruction", "output")):
            if _column(spec, first) in row and _column(spec, other) in row:
                return _column(spec, first)
    return kto_column(spec, name, row) or name


def _field(row: dict, spec: DatasetSpec, name: str):
    return row.get(_column(spec, name, row))


def row_system(row: dict, spec: DatasetSpec, system_prompt: str | None) -> str | None:
    """A row's system prompt: its own `system` column (LLaMA-Factory's exports carry one per row, for chat, pairs and
    alpaca rows alike) when it holds text, else the dataset's system_prompt, else data.system_prompt."""
    own = _field(row, spec, "system") if isinstance(row, dict) else None
    if isinstance(own, str) and own.strip():
        return own
    return spec.system_prompt if spec.system_prompt is not None else system_prompt


def with_system(messages: list[dict], system_prompt: str | None) -> tuple[list[dict], int]:
    """(messages headed by `system_prompt` where the row has no system turn, or one with nothing in it; how many
    messages were added in front). A blank system turn (OpenHermes' {"from": "system", "value": ""}) yields to the
    system prompt as a blank `system` column does; without a system prompt it stays as the row has it."""
    if not system_prompt or messages and messages[0]["role"] == "system" and visible(messages[0]["content"]):
        return messages, 0
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": system_prompt}, *messages[1:]], 0
    return [{"role": "system", "content": system_prompt}, *messages], 1


def read_through_arrow(spec: DatasetSpec, where: str) -> bool:
    """Whether the row at `where` was read through Arrow, whose struct types give every row of a table each key any
    row's object has, null where the row had none: a Parquet or Arrow file (given alone, or named in the row's place
    within a folder), a save_to_disk folder, a hub dataset. JSON Lines, JSON and CSV rows are read as written: a
    null there is the row's own."""
    path = Path(spec.path).expanduser()
    if data_suffix(path) is not None:
        return data_suffix(path) in (".parquet", ".arrow")
    if path.is_dir() and not saved_folder(path):  # a folder of data files: the place names the row's file
        return re.search(r"\.(?:parquet|arrow) row \d+$", where) is not None
    return path.is_dir() or not looks_local(spec.path)


def arrow_cleaned(row, spec: DatasetSpec, where: str):
    """The row with Arrow's null-filled keys dropped (conversations.without_nulls) from its tools (`tools`, legacy
    `functions`) and its turns' tool calls (`tool_calls`, legacy `function_call`), where it was read through Arrow;
    else the row as it is. Before, Parquet rows trained calls such as {"city": "Paris", "ticker": null}."""
    if not isinstance(row, dict) or not read_through_arrow(spec, where):
        return row
    cleaned = dict(row)
    for column in {_column(spec, "tools"), "functions"} & row.keys():
        cleaned[column] = without_nulls(row[column])
    for column in {*_TURN_FIELDS, *(_column(spec, name, row) for name in _TURN_FIELDS)} & row.keys():
        turns = row[column]
        cleaned[column] = [_calls_cleaned(turn) for turn in turns] if isinstance(turns, list) else _calls_cleaned(turns)
    _NULLS_DROPPED[0] += int(cleaned != row)
    return cleaned


def _calls_cleaned(turn):
    if not isinstance(turn, dict):
        return turn
    return {**turn, **{key: without_nulls(turn[key]) for key in ("tool_calls", "function_call") if key in turn}}


def arrow_null_rows() -> int:
    """How many rows this process has read with null-filled keys dropped from their tools or tool calls."""
    return _NULLS_DROPPED[0]


def check_row(row: dict, spec: DatasetSpec, where: str) -> None:
    """The row is an object with every field its format needs, its text fields hold text, no string holds half a
    character, and chat turns are well formed (no tokenizer needed)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object with fields, got {type(row).__name__}.")
    required, _ = FORMAT_FIELDS[spec.format]
    missing = [_column(spec, name, row) for name in required if _blank(_field(row, spec, name))]
    if missing:
        raise DataError(_missing_message(row, spec, where, missing))
    for name in TEXT_FIELDS.get(spec.format, ()):
        if spec.format == "completion":  # a message list: format chat's row, not JSON text to train
            refuse_turns_as_text(_field(row, spec, name), spec, f"{where}: `{_column(spec, name)}`")
        field_text(_field(row, spec, name), f"{where}: `{_column(spec, name)}`")
    broken = next((found for name in (*required, *FORMAT_FIELDS[spec.format][1])  # what is rendered, nothing else
                   if (found := _surrogate(_field(row, spec, name), _column(spec, name, row))) is not None), None)
    if broken is not None:
        path, text = broken
        raise DataError(
            f"{where}: `{path}` holds a lone surrogate ({text!r}: half of a UTF-16 pair, as when an emoji is cut in "
            "two), which is not text a tokenizer can encode. Fix the row (write the whole character, or delete the "
            "half), or set data.bad_rows: skip.")
    if spec.format == "chat":
        chat_messages(row, spec, where)
        row_tools(row, spec, where)
        row_template_kwargs(row, where)


def _missing_message(row: dict, spec: DatasetSpec, where: str, missing: list[str]) -> str:
    """Why a row lacks a field its format needs, and the fix that fits: a column the row does not have may be named
    otherwise (data.datasets[].columns maps it); one it has holds nothing, which no mapping changes; a .txt file's
    row is one line, so a blank line is an empty row."""
    if spec.format == "text" and missing == ["text"] and _TEXT_FILE_LINE.search(where):
        return (f"{where}: an empty line of a .txt file. A .txt file is read one row per line (as `datasets`' text "
                "builder reads it: each line a document, ended with EOS), so an empty line is a row with no text to "
                "train. Fix: read paragraphs or whole files as rows (data.datasets[].sample_by: paragraph or "
                "document), give the documents as JSON Lines with a `text` field, or set data.bad_rows: skip.")
    present = [f"{key}: null" if row[key] is None else str(key) for key in sorted(row, key=str)]
    absent = [column for column in missing if column not in row]
    fix = ("Fix the row, map the columns with data.datasets[].columns, or set data.bad_rows: skip." if absent else
           f"The column{'s are' if len(missing) > 1 else ' is'} there and empty in this row: fix the row (give it its "
           "value), or set data.bad_rows: skip.")
    return (f"{where}: missing or empty {', '.join(f'`{m}`' for m in missing)} (absent, null or only whitespace) "
            f"needed by format `{spec.format}` (row has: {', '.join(present) or 'nothing'}). {fix}")


def _blank(value) -> bool:
    """A required field with nothing to train: absent, null, empty or only whitespace, an empty list, NaN (a CSV's
    empty cell in a column of numbers)."""
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, float):
        return math.isnan(value)
    return value is None or (isinstance(value, list) and not value)


def _surrogate(value, path: str = "") -> tuple[str, str] | None:
    """(where in the row, the text around it) of the first lone surrogate: JSON's "\\ud83d" without its other half
    parses to a str that no tokenizer takes (the Rust tokenizer raises a TypeError naming no row)."""
    if isinstance(value, str):
        found = None if value.isascii() else _SURROGATE.search(value)
        return (path, value[max(found.start() - 20, 0) : found.end() + 20]) if found else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if not isinstance(item, (str, dict, list)) or isinstance(item, str) and item.isascii():
            continue  # (numbers and ASCII text: nothing to find, and no path built)
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if (found := _surrogate(item, inner)) is not None:
            return found
    return None


def chat_messages(row: dict, spec: DatasetSpec, where: str) -> tuple[list[dict], int]:
    """A chat row's conversation in the normal form and the index of its first trained message: every assistant turn
    of a `messages` row is trained (0); of TRL's conversational prompt-completion row, the completion's."""
    column = _column(spec, "messages", row)
    if "messages" not in spec.columns and column == _column(spec, "instruction"):  # LLaMA-Factory's alpaca row
        turns = alpaca_turns({name: _field(row, spec, name) for name in ALPACA_FIELDS},
                             {name: _column(spec, name) for name in ALPACA_FIELDS}, where)
        return normalize_messages(turns, spec, where), 0
    if "messages" in spec.columns or column != _column(spec, "prompt"):
        return normalize_messages(row.get(column), spec, where), 0
    return prompt_completion_turns(row[column], _field(row, spec, "completion"), spec, where,
                                   names=(column, _column(spec, "completion")))


def normalize_messages(turns, spec: DatasetSpec, where: str) -> list[dict]:
    """Any accepted turn shape -> the normal form (data/conversations.py), in an order a conversation can have."""
    messages = convert_turns(turns, spec, where)
    check_order(messages, where)
    return messages


def row_tools(row: dict, spec: DatasetSpec, where: str) -> list[dict] | None:
    """The tools a row offers: its `tools` column (data.datasets[].columns maps it), else its `functions` column
    (OpenAI's legacy name), else the dataset's `tools`. A column that is null, empty or `[]` (as a list or as JSON
    text alike: the text was read as "no tools") is none."""
    for column in (_column(spec, "tools"), "functions"):
        value = row.get(column) if isinstance(row, dict) else None
        if isinstance(value, str):  # JSON text; empty or only whitespace: none
            value = json_value(value, f"{where}: `{column}`") if value.strip() else None
        if value not in (None, []):
            return normalize_tools(value, where)
    return normalize_tools(dataset_tools(spec), where)


def render_examples(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str, *,
                    reasoning: str = "train") -> list[list[tuple[str, bool]]]:
    """Row -> its examples as [(text, trained)] segments: one, except a conversation whose chat template rewrites
    history, which gives one per inference context (data/chat.py)."""
    if spec.format != "chat":
        return [render_segments(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)]
    row = arrow_cleaned(row, spec, where)
    check_row(row, spec, where)
    messages, trained_from = chat_messages(row, spec, where)
    messages, added = with_system(messages, row_system(row, spec, system_prompt))
    return chat_examples(messages, tokenizer, where, tools=row_tools(row, spec, where),
                         trained_from=trained_from + added, reasoning=reasoning,
                         template_kwargs=row_template_kwargs(row, where))


def render_segments(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str, *,
                    reasoning: str = "train") -> list[tuple[str, bool]]:
    """Row -> [(text, trained)] for the dataset's format (a conversation: its last example, the one holding its last
    assistant turn; render_examples gives all)."""
    if spec.format == "chat":
        return render_examples(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)[-1]
    row = arrow_cleaned(row, spec, where)
    check_row(row, spec, where)
    eos = tokenizer.eos_token or ""
    system_prompt = spec.system_prompt if spec.system_prompt is not None else system_prompt
    text = functools.partial(_text, row, spec, where=where)
    if spec.format == "text":
        return [(_ended(text("text"), eos), True)]
    if spec.format == "completion":
        return [(text("prompt"), False), (_ended(_answer(row, spec, "completion", eos, where), eos), True)]
    if spec.format == "preference":
        return render_pair(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)
    if spec.format == "unpaired_preference":
        return render_unpaired(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)
    refuse_history(_field(row, spec, "history"), f"{where}: `{_column(spec, 'history')}`")  # (ported_rows)
    instruction, extra = text("instruction"), text("input")
    template = ALPACA_PROMPT_WITH_INPUT if extra.strip() else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    system = row_system(row, spec, system_prompt)
    if system:
        prompt = f"{system}\n\n{prompt}"
    return [(prompt, False), (_ended(_answer(row, spec, "output", eos, where), eos), True)]


def _ended(text: str, eos: str) -> str:
    """`text` followed by the tokenizer's eos, unless it ends with it already (exported datasets often carry it
    literally: `</s>`, `<|endoftext|>`): TRL's add_eos rule, so that no row trains "after EOS comes EOS"."""
    return text if eos and text.endswith(eos) else text + eos


def template_rendered(spec: DatasetSpec, tokenizer) -> bool:
    """Whether the chat template renders the dataset's rows (chat rows; preference and KTO rows when the tokenizer
    has one, as _answered decides): its text is then the whole sequence, BOS where it writes one and nowhere else, as
    transformers' apply_chat_template(tokenize=True), TRL, `finetune generate` and GRPO's chat prompts tokenize it."""
    return spec.format == "chat" or (spec.format in ("preference", "unpaired_preference")
                                     and bool(getattr(tokenizer, "chat_template", None)))


def _text(row: dict, spec: DatasetSpec, name: str, *, where: str) -> str:
    """Field `name` of a row as the text it trains (check_row refused what is not text)."""
    return field_text(_field(row, spec, name), f"{where}: `{_column(spec, name)}`")


def _answer(row: dict, spec: DatasetSpec, name: str, eos: str, where: str) -> str:
    """A completion's or alpaca output's text, unless it is no answer (conversations.refuse_empty_answer)."""
    return refuse_empty_answer(_text(row, spec, name, where=where), eos, f"{where}: `{_column(spec, name)}`")


# ------------------------------------------------------------------------------------------- preference pairs
def _pair_parts(row: dict, spec: DatasetSpec, where: str) -> tuple[list[dict] | str | None, object, object]:
    """(prompt, chosen, rejected) of a pair row. The implicit-prompt form (chosen and rejected whole conversations,
    as UltraFeedback-binarized ships them) becomes its shared opening turns and the two answers."""
    prompt, chosen, rejected = (_field(row, spec, name) for name in ("prompt", "chosen", "rejected"))
    if isinstance(chosen, list) and isinstance(rejected, list) and convert_turns(chosen, spec, where)[0]["role"] != "assistant":
        chosen_turns, rejected_turns = normalize_messages(chosen, spec, where), normalize_messages(rejected, spec, where)
        shared = 0
        while shared < min(len(chosen_turns), len(rejected_turns)) - 1 and chosen_turns[shared] == rejected_turns[shared]:
            shared += 1
        return chosen_turns[:shared], chosen_turns[shared:], rejected_turns[shared:]
    return prompt, chosen, rejected


def render_pair(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None,
                where: str, *, reasoning: str = "train") -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """A preference row -> (chosen segments, rejected segments), the same prompt untrained in both, the responses trained.

    Text prompts go through the tokenizer's chat template as a user turn when it has one, else stay raw text (a
    base model); message-list prompts must end with a user turn, and the responses are assistant turn(s).
    """
    prompt, chosen, rejected = _pair_parts(row, spec, where)
    if chosen == rejected:
        raise DataError(f"{where}: `chosen` and `rejected` are identical, so the pair says nothing. Fix the row or set "
                        "data.bad_rows: skip to skip such pairs with a count.")
    chosen_segments, rejected_segments = _answered(prompt, (("chosen", chosen), ("rejected", rejected)), spec,
                                                   tokenizer, system_prompt, where, row=row, reasoning=reasoning)
    if chosen_segments == rejected_segments:  # alike once rendered: a message list against its text, say
        raise DataError(f"{where}: `chosen` and `rejected` render identically, so the pair says nothing. Fix the row or "
                        "set data.bad_rows: skip to skip such pairs with a count.")
    return chosen_segments, rejected_segments


def render_unpaired(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None,
                    where: str, *, reasoning: str = "train") -> tuple[list[tuple[str, bool]], bool]:
    """An unpaired preference row (TRL's KTO format: prompt, completion, label) -> (segments, desirable): the prompt
    untrained, the completion trained, rendered as a pair's response is (render_pair)."""
    label = _field(row, spec, "label")
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # a CSV cell (read as its text)
        label = label.strip().lower() == "true"
    if not isinstance(label, (bool, np.bool_)):
        raise DataError(f"{where}: `{_column(spec, 'label', row)}` must be true (a desirable completion) or false (an "
                        f"undesirable one), got {label!r}. Fix the row (true/false, not a number or another word) or "
                        "set data.bad_rows: skip.")
    prompt, completion = _field(row, spec, "prompt"), _field(row, spec, "completion")
    if (column := _column(spec, "prompt", row)) == _column(spec, "completion", row):  # one conversation (ported_rows)
        prompt, completion = split_completion(prompt, spec, column, where)
    (segments,) = _answered(prompt, (("completion", completion),), spec, tokenizer, system_prompt, where, row=row,
                            reasoning=reasoning)
    return segments, bool(label)


def _answered(prompt, answers: tuple[tuple[str, object], ...], spec: DatasetSpec, tokenizer, system_prompt: str | None,
              where: str, *, row: dict, reasoning: str) -> list[list[tuple[str, bool]]]:
    """Segments of each (name, answer) to the same prompt, the answers trained.

    Text prompts go through the tokenizer's chat template as a user turn when it has one, else stay raw text (a
    base model); message-list prompts (with history, tool calls and results, and the row's tools) must end with a
    user or tool turn, and the answers are assistant turn(s) scored in one sequence each.
    """
    answers = tuple((name, [answer] if isinstance(answer, dict) else answer) for name, answer in answers)  # a message
    system_prompt = row_system(row, spec, system_prompt)
    # LLaMA-Factory's ranking / KTO alpaca rows (the prompt read from `instruction`, or `input` mapped by columns):
    # instruction + "\n" + input; another dataset's `input` column is not the prompt's (a review: it was joined)
    lf_shape = _column(spec, "prompt", row) == "instruction" or "input" in spec.columns
    if lf_shape and _column(spec, "input") != _column(spec, "prompt", row):  # (a prompt mapped to `input` is the prompt)
        prompt = with_input(prompt, _field(row, spec, "input"), f"{where}: `{_column(spec, 'input')}`")
    for name, answer in answers:
        if not isinstance(answer, (str, list)):
            raise DataError(f"{where}: `{_column(spec, name)}` is {answer!r}; an answer is text, an assistant message or a "
                            "list of them. Fix the row or set data.bad_rows: skip.")
    chat = isinstance(prompt, list) or any(isinstance(a, list) for _, a in answers) or \
        bool(getattr(tokenizer, "chat_template", None))
    if not chat:
        if prompt in (None, ""):
            raise DataError(f"{where}: `{_column(spec, 'prompt')}` is missing: a text response needs the prompt it "
                            "answers. Add it, map it with data.datasets[].columns, or give whole conversations.")
        prompt = field_text(prompt, f"{where}: `{_column(spec, 'prompt')}`")
        eos, prompt = tokenizer.eos_token or "", f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        return [[(prompt, False), (_ended(str(answer), eos), True)] for _, answer in answers]
    if prompt in (None, "", []):
        raise DataError(f"{where}: `{_column(spec, 'prompt')}` is missing: the answers need the prompt they answer. Add "
                        "it, map it with data.datasets[].columns, or give `chosen` and `rejected` as whole conversations "
                        "(the implicit-prompt form), or set data.bad_rows: skip.")
    turns = [{"role": "user", "content": str(prompt)}] if isinstance(prompt, str) else convert_turns(prompt, spec, where)
    if not turns or turns[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: the prompt of a conversational row must end with a user turn (or a tool result; it "
                        f"ends with {turns[-1]['role'] if turns else 'nothing'}), so that the answers answer it. Fix the "
                        "row or set data.bad_rows: skip.")
    turns, _ = with_system(turns, system_prompt)
    sequences, tools, arguments = [], row_tools(row, spec, where), row_template_kwargs(row, where)
    for name, answer in answers:
        reply = [{"role": "assistant", "content": str(answer)}] if not isinstance(answer, list) else \
            convert_turns(answer, spec, where)
        messages = normalize_messages(turns + reply, spec, f"{where} ({name})")
        refuse_unscored(messages[len(turns):], name, where)  # (axolotl's per-message flags: SFT's only)
        if messages[len(turns)]["role"] != "assistant" or not any(
                m["content"].strip() or m.get("tool_calls") for m in messages[len(turns):]):
            raise DataError(f"{where}: `{name}` must be a non-empty assistant answer. Fix the row or set data.bad_rows: skip.")
        examples = chat_examples(messages, tokenizer, f"{where} ({name})", tools=tools, trained_from=len(turns),
                                 reasoning=reasoning, template_kwargs=arguments)
        if len(examples) > 1:
            raise DataError(f"{where}: `{name}` has several assistant turns that the chat template renders in different "
                            "contexts, so they cannot be scored as one sequence. Give one assistant answer per "
                            "response (its history in the prompt).")
        sequences.append(examples[0])
    prompts = {prompt_part(segments) for segments in sequences}
    if len(prompts) > 1:
        raise DataError(f"{where}: the answers are rendered after different prompts (the chat template prefills "
                        "`<think>` before an answer with reasoning, not before one without), so they would not answer "
                        "the same prompt. Give every answer reasoning, or none (data.reasoning: drop).")
    return sequences


def _render_or_reason(row, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str, *,
                      reasoning: str = "train") -> list | tuple | str:
    """A row's rendering (render_examples' list for SFT formats, render_pair's or render_unpaired's tuple), or the
    DataError message that rejects it."""
    try:
        if spec.format in ("preference", "unpaired_preference"):
            return render_segments(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)
        return render_examples(row, spec, tokenizer, system_prompt, where, reasoning=reasoning)
    except DataError as exc:
        return str(exc)
