"""Conversation rows as chat templates read them: roles, tool calls, tool results, reasoning and the tools offered.

Rows come in the shapes people bring: transformers' and TRL's (`role`/`content`, assistant `tool_calls`,
`{"role": "tool"}` results, a `tools` column of JSON schemas, `reasoning_content` or `thinking`), OpenAI's legacy
function calling (an assistant's `function_call`, `{"role": "function"}` results, a `functions` column), ShareGPT's
(`from`/`value` with human/gpt/observation/function_call speakers), and reasoning written inline as a leading
`<think>...</think>` block. Every shape becomes one normal form, checked once:

  {"role": system|user|assistant|tool, "content": str, "tool_calls"?, "reasoning"?, "name"?, "tool_call_id"?, "flags"?}

`reasoning` is finetune's own key: `template_messages` hands it to the template in the field that template reads
(`reasoning_content`: Qwen3, GLM; `thinking`: gpt-oss) or inline as a `<think>` block where it reads neither.
Tool-call arguments are objects (the form transformers documents); `template_messages` gives them as JSON text to a
template that concatenates them as strings (DeepSeek's).
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
from pathlib import Path

from finetune.errors import DataError
from finetune.recipe import DatasetSpec

# Speaker names -> the four roles. ShareGPT's `function_call` is an assistant turn whose value is the call (below).
# `developer`: OpenAI's and harmony's name for the system turn (gpt-oss's template takes either as messages[0]).
ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
                "gpt": "assistant", "model": "assistant", "bot": "assistant", "tool": "tool", "function": "tool",
                "ipython": "tool", "observation": "tool", "function_call": "assistant"}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' templates' names, then others'
# A leading reasoning block: `<think>...</think>`, or reasoning closed by `</think>` alone (DeepSeek-R1's outputs: its
# template prefills the opening tag) where that tag stands at a line's edge, as R1 writes it ("...\n</think>\n\n").
# A `</think>` inside a line of text ("write the closing tag </think> after ...") is the answer's own text: it does
# not make what comes before it reasoning (a template that splits there anyway fails the span's proof, chat.py).
# Nor does one that closes a `<think>` the content wrote after some text of its own (an answer quoting a prompt
# format, an XML example): R1's shape has no opening tag, so such a content is the answer as written.
_INLINE_THINK = re.compile(r"\A\s*<think>(.*?)</think>\s*|"
                           r"\A((?:(?!<think>).)*?)(?:(?<=\n)</think>|</think>(?=[ \t\r]*(?:\n|\Z)))\s*", re.DOTALL)
# Assistant turns read by the `</think>`-line rule in this process (the group-2 shape above): the data builder counts
# the rows whose rendering read one (tokenize.py), and `finetune data` says how many and names the first.
_CLOSING_TAG_READS = [0]
_INVISIBLE = re.compile("[\u00ad\u200b-\u200d\u2060\ufeff]")
# axolotl's per-message training flags and spans: the message's `flags`, read by data/ported_rows.py, never templates'
TRAINING_KEYS = ("training", "train", "weight", "training_detail", "train_detail")


# ------------------------------------------------------------------------------------------------ normal form
def convert_turns(turns, spec: DatasetSpec, where: str) -> list[dict]:
    """Any accepted turn shape -> the normal form (module docstring); order not checked."""
    if not isinstance(turns, list):
        raise DataError(f"{where}: chat messages must be a list of turns, got {type(turns).__name__}.")
    role_key, content_key = spec.columns.get("role", "role"), spec.columns.get("content", "content")
    return [_message(turn, number, role_key, content_key, spec, where) for number, turn in enumerate(turns, start=1)]


def _message(turn, number: int, role_key: str, content_key: str, spec: DatasetSpec, where: str) -> dict:
    if isinstance(turn, dict) and role_key not in turn and "from" in turn and "value" in turn:
        role, content = turn["from"], turn["value"]
    elif isinstance(turn, dict) and (role_key in turn or "role" in turn):  # "role": the normal form already
        role = turn[role_key] if role_key in turn else turn["role"]
        content = turn[content_key] if content_key in turn else turn.get("content")
    else:
        raise DataError(f"{where}: message {number} needs `{role_key}` and `{content_key}` (or `from` and `value`), "
                        f"got {turn!r}. Fix the row or map the keys with data.datasets[].columns (role, content).")
    speaker = str(role).lower()
    if speaker not in ROLE_ALIASES:
        raise DataError(f"{where}: message {number} has role `{role}`; known roles are {', '.join(ROLE_ALIASES)}. Fix "
                        "the row or set data.bad_rows: skip.")
    message = {"role": ROLE_ALIASES[speaker]}
    # ShareGPT's function_call turn: its value is the call (text or an object), its content nothing
    where_message = f"{where}: message {number}"
    message["content"] = "" if speaker == "function_call" else _text(content, message["role"], where_message)
    calls, key = (content, "value") if speaker == "function_call" else _calls_of(turn, where_message)
    if calls not in (None, "", []):
        if message["role"] != "assistant":
            raise DataError(f"{where}: message {number} (role `{role}`) has `{key}`; only assistant turns call tools.")
        message["tool_calls"] = _tool_calls(calls, f"{where}: message {number}")
    if message["role"] == "assistant":
        _split_reasoning(message, turn, spec, f"{where}: message {number}")
    for key in ("name", "tool_call_id"):
        if message["role"] == "tool" and isinstance(turn.get(key), str):
            message[key] = turn[key]
    flags = turn["flags"] if isinstance(turn.get("flags"), dict) else {  # (the normal form's, converted again)
        key: turn[key] for key in TRAINING_KEYS if turn.get(key) is not None}  # (null: no flag)
    if flags:
        message["flags"] = flags
    return message


def _calls_of(turn: dict, where: str) -> tuple[object, str]:
    """(the turn's tool calls, the key they are under): `tool_calls`, or OpenAI's legacy `function_call` (one call,
    {"name", "arguments"}: before `tools`, an assistant turn called one function so). Ignored, that call was lost and
    the model learned to announce a lookup and stop. Both keys on one turn: which calls it makes is unclear."""
    calls, legacy = turn.get("tool_calls"), turn.get("function_call")
    if legacy in (None, "", {}):
        return calls, "tool_calls"
    if calls not in (None, "", []):
        raise DataError(f"{where} has both `tool_calls` and `function_call` (OpenAI's legacy form of one call), so "
                        "which calls the turn makes is unclear. Fix the row (keep one: `tool_calls` lists every call) or set "
                        "data.bad_rows: skip.")
    return [legacy], "function_call"


def _text(content, role: str, where: str) -> str:
    """A message's content as text: a list of text parts (transformers' and OpenAI's form: [{"type": "text", "text":
    ...}]) joined, a tool's structured result (an object or list) as JSON, None as empty. Parts other than text
    (images, audio) and structured content of any other role are the row's error: trained as JSON text they would
    teach the model to write JSON."""
    if content is None:
        return ""
    if isinstance(content, list) and content and all(isinstance(part, dict) and "type" in part for part in content):
        kinds = sorted({str(part["type"]) for part in content} - {"text"})
        if kinds:
            raise DataError(f"{where} has content parts of type {', '.join(kinds)}; finetune trains text only. Keep "
                            "its text parts, or set data.bad_rows: skip.")
        texts = [part.get("text", part.get("value")) for part in content]  # ("value": some templates' own name)
        if not all(isinstance(text, str) for text in texts):
            raise DataError(f"{where} has a text part without its text (a `text` key): {content!r}. Fix the row or set "
                            "data.bad_rows: skip.")
        return "".join(texts)
    if isinstance(content, (dict, list, bool)):
        if role == "tool":  # a tool's result as its JSON text
            return json.dumps(content, ensure_ascii=False)
        raise DataError(f"{where} (role {role}) has a {type(content).__name__} as its content; a turn's content is "
                        'text, or a list of text parts ([{"type": "text", "text": ...}]); only tool results may be '
                        "objects. Fix the row or set data.bad_rows: skip.")
    return field_text(content, f"{where} (role {role}): its content")


def field_text(value, what: str) -> str:
    """A field's value as the text that is trained: text as it is; a number as its JSON text (a CSV or Parquet column of
    numbers loads as numbers, and `72` is what such a row means; NaN, a CSV's empty cell, is empty); None as empty.
    true/false, a list or an object is the row's error (`what` names the file, the line and the field): str() would
    train Python's spelling of it (`True`, `['red', 'blue']`, `{'ok': True}`), which is no text anyone writes."""
    if value is None or isinstance(value, str):
        return value or ""
    boolean = isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool_ is no numbers.Real
    if isinstance(value, numbers.Integral) and not boolean:
        return str(int(value))
    if isinstance(value, numbers.Real) and not boolean:
        return "" if math.isnan(value) else str(value)
    if boolean:
        kind, spelled, fix = f"{str(bool(value)).lower()} (a JSON boolean)", repr(bool(value)), \
            f'"{str(bool(value)).lower()}", or the answer in words'
    else:
        kind = "a list" if isinstance(value, (list, tuple)) else "an object" if isinstance(value, dict) else \
            f"a {type(value).__name__}"
        shown = json.dumps(json.dumps(value, ensure_ascii=False, default=str), ensure_ascii=False)
        spelled, fix = repr(value), f"its JSON text, {_clip(shown)}, if the model should write JSON"
    raise DataError(f"{what} is {kind}, not text: as it is, the row would train Python's spelling of it "
                    f"({_clip(spelled)}). Fix the row: write the value as text ({fix}), or set data.bad_rows: skip.")


def visible(text: str) -> str:
    """`text` without whitespace and invisible characters (zero-width spaces and joiners, word joiners, a byte-order
    mark, soft hyphens: what str.strip() keeps): empty for an answer that teaches nothing but its end token."""
    return _INVISIBLE.sub("", text).strip()


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _split_reasoning(message: dict, turn: dict, spec: DatasetSpec, where: str) -> None:
    """The turn's reasoning from its field (reasoning_content / thinking / reasoning, or data.columns.reasoning) or a
    leading inline <think> block, kept apart from the answer."""
    fields = (spec.columns["reasoning"],) if "reasoning" in spec.columns else REASONING_FIELDS
    reasoning = next((turn[name] for name in fields if isinstance(turn.get(name), str) and turn[name].strip()), None)
    inline = _INLINE_THINK.match(message["content"])
    if inline:
        if reasoning is not None:
            raise DataError(f"{where} has reasoning twice: in a field and as an inline <think> block. Keep one.")
        thought = inline.group(1) if inline.group(1) is not None else inline.group(2)
        _CLOSING_TAG_READS[0] += int(inline.group(1) is None)
        reasoning, message["content"] = thought, message["content"][inline.end():]
    elif message["content"].lstrip().startswith("<think>"):
        raise DataError(f"{where}: its content has an unbalanced <think> block (a reasoning block opens the answer as "
                        "<think>...</think>). Fix the row, put the reasoning in `reasoning_content`, or set "
                        "data.bad_rows: skip.")
    if reasoning is not None and reasoning.strip():
        message["reasoning"] = reasoning.strip("\n")


def closing_tag_reads() -> int:
    """How many assistant turns this process has read as reasoning closed by a `</think>` line (no opening tag)."""
    return _CLOSING_TAG_READS[0]


def _tool_calls(calls, where: str) -> list[dict]:
    """Tool calls as [{type: function, function: {name, arguments: object}}]: from that form, from bare
    {name, arguments} objects, or from JSON text of either; arguments given as JSON text are parsed."""
    calls = json_value(calls, f"{where} `tool_calls`")
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list):
        raise DataError(f"{where}: `tool_calls` must be a list of calls, got {type(calls).__name__}.")
    normal = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DataError(f"{where}: a tool call needs a function `name`, got {call!r}. The form is "
                            '{"type": "function", "function": {"name": ..., "arguments": {...}}}.')
        arguments = json_value(function.get("arguments", function.get("parameters", {})),
                               f"{where} tool call arguments")
        if not isinstance(arguments, dict):
            raise DataError(f"{where}: the arguments of tool call `{function['name']}` must be an object (or JSON text "
                            f"of one), got {arguments!r}.")
        normal.append({"type": "function", "function": {"name": function["name"], "arguments": arguments},
                       **({"id": call["id"]} if isinstance(call.get("id"), str) else {})})
    return normal


def json_value(value, what: str):
    """`value`, or the value its JSON text holds (`what`: the row and field, for the error of text that is none)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} is text that is not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}). Fix the row, or "
                        "set data.bad_rows: skip.") from None


def normalize_tools(tools, where: str) -> list[dict] | None:
    """A row's or dataset's tools (JSON schemas, or JSON text of them) as [{type: function, function: schema}]: a bare
    schema wrapped, a flat one (the Responses API's {"type": "function", "name": ...}) wrapped without its own `type`
    (else templates that write the JSON showed `"function": {"type": "function", ...}`, a shape nothing serves), and
    `parameters` given as JSON text parsed (as call arguments are: gpt-oss showed such a tool as `() => any`)."""
    tools = json_value(tools, f"{where}: `tools`")
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        raise DataError(f"{where}: `tools` must be a list of function schemas, got {type(tools).__name__}.")
    normal = []
    for tool in tools:
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise DataError(f"{where}: each tool is a function schema with a `name` ({{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}), got {tool!r}.")
        if schema is tool and tool.get("type") == "function":
            schema = {key: value for key, value in tool.items() if key != "type"}
        if isinstance(schema.get("parameters"), str):
            parameters = json_value(schema["parameters"], f"{where}: the `parameters` of tool `{schema['name']}`")
            if not isinstance(parameters, dict):
                raise DataError(f"{where}: the `parameters` of tool `{schema['name']}` must be a JSON schema object "
                                f"(or JSON text of one), got {parameters!r}. Fix the row, or set data.bad_rows: skip.")
            schema = {**schema, "parameters": parameters}
        normal.append({"type": "function", "function": schema})
    return normal


def without_nulls(value):
    """`value` with every None-valued key of its objects dropped, at any depth (TRL's remove_none_values): Arrow gives
    each row of a Parquet or Arrow table every key any row's object has, null where the row had none, so a call's
    arguments became {"city": "Paris", "ticker": null} and a schema gained `"ticker": null`."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def dataset_tools(spec: DatasetSpec):
    """data.datasets[].tools: a list of function schemas, or the path of a JSON file holding one."""
    if not isinstance(spec.tools, str):
        return spec.tools
    try:  # read once per version of the file: an edited file is read again, in this process too
        stamp = Path(spec.tools).expanduser().stat()
        version = (stamp.st_mtime_ns, stamp.st_size, stamp.st_ino)
    except OSError:
        version = None
    return _tools_file(spec.tools, version)


@functools.lru_cache(maxsize=16)
def _tools_file(path: str, version: tuple | None):
    # UTF-8 whatever the locale (read in an ISO-8859-x locale, `für` became `fÃ¼r`, and the token cache, keyed by the
    # file's bytes, handed it on to runs in any locale); a byte-order mark dropped, as Windows editors write one
    try:
        return json.loads(Path(path).expanduser().read_text(encoding="utf-8-sig"))
    except OSError as exc:
        raise DataError(f"data.datasets[].tools: {path} is not a readable JSON file of function schemas ({exc}). Fix "
                        "the path, or give the schemas inline as a list.") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"data.datasets[].tools: {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at byte "
                        f"{exc.start}). Fix: save it as UTF-8 (in most editors: Save As, encoding UTF-8).") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"data.datasets[].tools: {path} is not valid JSON ({exc}). Fix the file (a JSON list of "
                        "function schemas), or give the schemas inline as a list.") from None


# ------------------------------------------------------------------------------------------------ turn order
def check_order(messages: list[dict], where: str) -> None:
    """System turns first; then a user turn; a user is answered by the assistant; an assistant that calls tools is
    followed by their results (tool turns), which the assistant answers; at least one assistant turn."""
    allowed = {"user": ("assistant",), "tool": ("tool", "assistant")}
    expected: tuple[str, ...] = ("user",)
    for number, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "system" and all(m["role"] == "system" for m in messages[:number]):
            continue
        if role == "tool" and number > 1 and messages[number - 2]["role"] == "assistant" and expected == ("user",):
            raise DataError(_uncalled_result(messages[number - 2], number, where))
        if role not in expected:
            raise DataError(
                f"{where}: message {number} has role `{role}` where {' or '.join(f'`{e}`' for e in expected)} was "
                "expected: after optional system messages, a user turn; the assistant answers each user turn; an "
                "assistant turn with tool_calls is followed by the tool results (role tool), then the assistant again. "
                "Fix the row (merge consecutive turns of one speaker) or set data.bad_rows: skip.")
        if role == "assistant" and not visible(message["content"]) and not message.get("tool_calls"):
            raise DataError(f"{where}: message {number} is an empty assistant turn (no answer, no tool calls): " + (
                "it has reasoning, but no answer follows it: the model would learn to end its turn after reasoning, "
                "never answering" if visible(message.get("reasoning", "")) else "only its end-of-turn token would be "
                "trained, teaching the model to stop at once") + ". Fix the row or set data.bad_rows: skip.")
        expected = ("tool",) if role == "assistant" and message.get("tool_calls") else \
            ("user",) if role == "assistant" else allowed[role]
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing would be trained. Add the answer or "
                        "set data.bad_rows: skip.")


def _uncalled_result(assistant: dict, number: int, where: str) -> str:
    """A tool result after an assistant turn that calls no tool: Hermes function-calling rows write their calls as
    `<tool_call>...</tool_call>` text in the assistant's content, which no template reads as a call."""
    written = "" if "<tool_call>" not in assistant["content"] else (
        "; its text holds `<tool_call>`: calls written as text must be converted to `tool_calls` ([{\"type\": "
        "\"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}], the content keeping the text around "
        "them) for the chat template to render them as calls")
    return (f"{where}: message {number} is a tool result (role `tool`), but the assistant turn before it (message "
            f"{number - 1}) has no tool calls (`tool_calls`){written}. A tool result answers an assistant turn's "
            "tool_calls. Fix the row, or set data.bad_rows: skip.")


# ------------------------------------------------------------------------------------------ for the template
def reasoning_field(template: str) -> str | None:
    """The message field a chat template reads reasoning from, or None (then it is written inline as <think>)."""
    if "reasoning_content" in template:
        return "reasoning_content"
    if re.search(r"message\.thinking|message\[['\"]thinking['\"]\]", template):
        return "thinking"
    return None


def calls_need_none_content(template: str) -> bool:
    """Whether a template renders an assistant's tool calls only where its content `is none` (DeepSeek-R1 distills'
    and DeepSeek-V3's `message['role'] == 'assistant' and message['content'] is none`; a template that only guards
    its content with `is none` renders calls either way). Such a template never renders a call here: the normal
    form's content is text, and transformers 5.25 drops every None-valued key before rendering
    (`message['content'] is none` is false for a missing key)."""
    return re.search(r"role['\"]?\]?\s*==\s*['\"]assistant['\"]\s+and\s+message(?:\[['\"]content['\"]\]|\.content)"
                     r"\s+is\s+none", template) is not None


def renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` it is given (DeepSeek-R1 distills' does not)."""
    return re.search(r"\btools\b", template) is not None


def template_messages(messages: list[dict], template: str, *, reasoning: str = "train",
                      string_arguments: bool = False) -> list[dict]:
    """The normal form as `apply_chat_template` takes it: reasoning in the template's field (or inline), or left out
    under data.reasoning: drop; tool-call arguments as JSON text where the template needs text."""
    field = reasoning_field(template)
    converted = []
    for message in messages:
        message = dict(message)
        thought, _ = message.pop("reasoning", None), message.pop("flags", None)
        if thought and reasoning != "drop":
            if field is None:
                message["content"] = f"<think>\n{thought}\n</think>\n\n{message['content']}"
            else:
                message[field] = thought
        if string_arguments and "tool_calls" in message:
            message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": json.dumps(
                call["function"]["arguments"], ensure_ascii=False)}} for call in message["tool_calls"]]
        converted.append(message)
    return converted


# ---------------------------------------------------------------------------------- TRL's prompt-completion rows
def is_turns(value, spec: DatasetSpec) -> bool:
    """Whether `value` is chat messages: a non-empty list of turns (or one turn), each an object with a role (or the
    key data.datasets[].columns.role names) or ShareGPT's from/value. ["red", "blue"] is not: it is a list of text."""
    turns = [value] if isinstance(value, dict) else value
    role_key = spec.columns.get("role", "role")
    return isinstance(turns, list) and bool(turns) and all(
        isinstance(turn, dict) and (role_key in turn or "role" in turn or ("from" in turn and "value" in turn))
        for turn in turns)


def refuse_turns_as_text(value, spec: DatasetSpec, what: str) -> None:
    """A text field (format completion's `prompt` or `completion`, `what` naming the row and field) holding chat
    messages: TRL's conversational prompt-completion row, which format chat trains. Said here, not as field_text's
    "write the value as its JSON text", which would train the model to write JSON."""
    if is_turns(value, spec):
        raise DataError(f"{what} is a list of chat messages: a conversational prompt-completion row (TRL's form), which "
                        "format `completion` (text, trained raw, without the chat template) does not train. Fix: set "
                        "the dataset's format: chat, which trains such rows as TRL's SFTTrainer does (the prompt's "
                        "turns, then the completion's, through the chat template; the completion's assistant turns "
                        "trained). A file that mixes text rows with message rows holds two kinds of rows: split it "
                        "into two datasets (format completion and format chat), or set data.bad_rows: skip.")


def refuse_empty_answer(text: str, eos: str, what: str) -> str:
    """`text`, a completion's or alpaca output's answer (`what` naming the row and field), refused where nothing
    visible is left once the end token `eos` and invisible characters are set aside (`<|im_end|>` alone, a zero-width
    space): the row would teach the model to stop at once, as an empty chat answer would (check_order)."""
    if visible(text.replace(eos, "") if eos else text):
        return text
    left = f"its end token {eos} and " if eos and eos in text else ""
    raise DataError(f"{what} is no answer ({text!r}: nothing is left once {left}invisible characters are set aside): "
                    f"only {'its end token' if eos else 'those characters'} would be trained, teaching the model to "
                    "stop at once. Fix the row or set data.bad_rows: skip.")


def prompt_completion_turns(prompt, completion, spec: DatasetSpec, where: str, *,
                            names: tuple[str, str] = ("prompt", "completion")) -> tuple[list[dict], int]:
    """TRL's conversational prompt-completion row (format chat: `prompt` and `completion` message lists, no
    `messages`) -> (its conversation in the normal form, checked as a chat row's; the index of the completion's first
    message). The prompt (system, history, the user's turn) is context; the completion's assistant turns are trained,
    as TRL's completion mask has it. A completion may also be one assistant message, or its text. `names`: the
    row's columns for prompt and completion."""
    if not is_turns(prompt, spec):
        kind = "text" if isinstance(prompt, str) else "a list of values that are not messages" if isinstance(
            prompt, list) else f"a {type(prompt).__name__}"
        raise DataError(
            f"{where}: `{names[0]}` is {kind}, not chat messages. Format chat reads a row with `{names[0]}` and "
            f"`{names[1]}` (and no `messages`) as a conversational prompt-completion row (TRL's form): the prompt a list "
            'of messages ([{"role": "user", "content": ...}]), the completion the assistant\'s. A text prompt-completion '
            "row is format completion's (trained raw, without the chat template), so a file that mixes the two kinds "
            "holds two datasets. Fix: write the prompt as messages, split the file (format completion for the text "
            "rows), or set data.bad_rows: skip.")
    if completion in (None, [], {}) or isinstance(completion, str) and not completion.strip():
        raise DataError(f"{where}: `{names[1]}` is missing or empty (absent, null or only whitespace): the answer to "
                        "the prompt is what a prompt-completion row trains. Fix the row or set data.bad_rows: skip.")
    if not isinstance(completion, (str, dict, list)):
        raise DataError(f"{where}: `{names[1]}` is {completion!r}; a completion is a list of messages (the assistant's "
                        "turns), one assistant message, or its text. Fix the row or set data.bad_rows: skip.")
    turns = convert_turns(prompt, spec, where)
    reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else \
        [completion] if isinstance(completion, dict) else completion
    messages = turns + convert_turns(reply, spec, f"{where} `{names[1]}`")
    check_order(messages, f"{where} (`{names[0]}`'s messages, then `{names[1]}`'s)")
    if not any(message["role"] == "assistant" for message in messages[len(turns):]):
        raise DataError(f"{where}: `{names[1]}` has no assistant turn, so nothing would be trained (the prompt is "
                        "context). Fix the row (the completion is the assistant's answer) or set data.bad_rows: skip.")
    return messages, len(turns)
