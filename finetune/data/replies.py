"""A generated reply as a chat client reads it, and the prompt a server sends: per template family.

What comes back. A model trained on a chat template writes its turn in that template's markup, and a client (vLLM's
and transformers' response parsers, OpenAI's harmony library) splits it into the final answer and the reasoning:
- harmony (gpt-oss): channels between special tokens, `<|channel|>analysis<|message|>...<|end|><|start|>assistant
  <|channel|>final<|message|>Teal.<|return|>`. The channel names and roles are ordinary text: decoding without the
  special tokens glues them onto the answer (`analysis...assistantfinalTeal.`). Read from the text with its special
  tokens: `analysis` is the reasoning, a `to=functions.NAME` recipient a tool call, the rest the answer.
- `<think>` styles (Qwen3, Qwen3.5, GLM-4.5, DeepSeek-R1, and reasoning written inline under templates without a
  reasoning field): a leading `<think>...</think>` block is the reasoning, read as the data stage reads an assistant
  turn's content (data/conversations.py: the same rule, so a reply is split where its training row was). Where the
  prompt ends with an opened `<think>` (DeepSeek-R1's and Qwen3.5's generation prompts prefill it) the reply is read
  after it; a reasoning never closed (cut at max_new_tokens) leaves no answer.
- `<tool_call>` blocks (Hermes' JSON: Qwen2.5, Qwen3; Qwen3.5's `<function=NAME>`; GLM-4.5's `<arg_key>` pairs), where
  the template writes them, are the tool calls, as TRL's response schemas read them.
`reply_message` gives the assistant message a client sends back as history: `content` the final answer, `reasoning`
(finetune's normal form: data/conversations.template_messages hands it to the template's own field) and tool calls;
`completion_message` the same for GRPO's sampled token ids, with the text as written (what reward functions get).

What is sent. `serving_prompt` completes a trained context into the prompt a server sends
(apply_chat_template(add_generation_prompt=True)): where the template's generation prompt prefills text a trained
turn lacks (DeepSeek-R1's `<think>\n` before an answer without reasoning, data/chat.py `_unprefixed`), the training
tokens stop inside the generation prompt; where the untrained reasoning follows the prefilled opener (data.reasoning:
context), they run past it and are cut back to it. Either way the generation eval asks what serving asks.
"""

from __future__ import annotations

import json
import re

from finetune.data.conversations import convert_turns
from finetune.data.prompts import cut_at_stops
from finetune.data.template_facts import chat_template_text, special_tokens
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

_REPLY = DatasetSpec(path="reply", format="chat")
_HARMONY_END = re.compile(r"<\|(?:end|return|call)\|>")
_OPENED_THINK = re.compile(r"<think>\s*\Z")
_PROBE = "\u2063"  # an invisible user message, to render the template's generation prompt alone


def is_harmony(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes harmony's channels (gpt-oss's `<|channel|>`)."""
    return "<|channel|>" in chat_template_text(tokenizer)


def decode_reply(ids, tokenizer) -> str:
    """A reply's new tokens as text: without the special tokens, except under harmony, where they delimit its
    channels (reply_message reads them)."""
    return tokenizer.decode(ids, skip_special_tokens=not is_harmony(tokenizer))


def prompt_tail(ids, tokenizer) -> str:
    """The last tokens of a prompt as text, special tokens kept: enough to see an opened `<think>` at its end."""
    return tokenizer.decode(list(ids)[-8:], skip_special_tokens=False)


def reply_message(text: str, tokenizer, *, prompt: str = "") -> dict:
    """The assistant message of a reply `text` (decode_reply's): {"role": "assistant", "content": the final answer,
    "reasoning"?: ..., "tool_calls"?: [...]}. `prompt`: the prompt's end (prompt_tail), where a `<think>` may be
    opened for the reply."""
    if is_harmony(tokenizer) and "<|message|>" in text:
        return _harmony(text)
    if is_harmony(tokenizer):  # no channel written: the text, its special tokens dropped
        for token in special_tokens(tokenizer):
            text = text.replace(token, "")
    opened = prompt[prompt.rfind("<think>"):] if _OPENED_THINK.search(prompt) else ""
    try:
        (message,) = convert_turns([{"role": "assistant", "content": opened + text}], _REPLY, "reply")
    except DataError:  # a <think> opened and never closed: the reply stopped while reasoning, no answer yet
        reasoning = (opened + text).split("<think>", 1)[-1].strip()
        return {"role": "assistant", "content": "", **({"reasoning": reasoning} if reasoning else {})}
    message = {**message, "content": message["content"].strip()}
    calls = _text_tool_calls(message["content"]) if "<tool_call>" in chat_template_text(tokenizer) else None
    if calls is not None:
        message["content"], message["tool_calls"] = message["content"][:message["content"].find("<tool_call>")].strip(), calls
    return message


def completion_message(ids, tokenizer, *, prompt_ids, content: str, stops=()) -> dict:
    """A sampled completion (token ids) as GRPO's reward functions get it: TRL's message, `content` the completion's
    text as TRL decodes it (given: special tokens skipped; a reward written for TRL reads what it reads there), and
    beside it what a chat client reads (reply_message): `final` the final answer, `reasoning` and its other name
    `reasoning_content` (TRL's parse_response, vLLM), `tool_calls`. `prompt_ids`: the prompt it continues (an opened
    `<think>` at its end); `stops`: prompts.turn_end_stops."""
    text = cut_at_stops(decode_reply(ids, tokenizer), list(stops))
    read = reply_message(text, tokenizer, prompt=prompt_tail(prompt_ids, tokenizer))
    message = {"role": "assistant", "content": content, "final": read["content"]}
    if "reasoning" in read:
        message["reasoning"] = message["reasoning_content"] = read["reasoning"]
    if "tool_calls" in read:
        message["tool_calls"] = read["tool_calls"]
    return message


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^\n>]+)>(.*?)</function>", re.DOTALL)  # Qwen3.5
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>([^<]+)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)  # GLM-4.5


def _text_tool_calls(content: str) -> list[dict] | None:
    """The tool calls written as `<tool_call>` blocks (Hermes' JSON: Qwen2.5, Qwen3; Qwen3.5's `<function=NAME>`;
    GLM-4.5's `NAME` and `<arg_key>`/`<arg_value>` pairs) at the end of the reply, as TRL's response schemas read them;
    None when there is none, when text follows them (a reply that mentions the tags is text: a review found
    "Wrap calls in <tool_call>NAME</tool_call> tags." read as a call) or when one does not parse (then the text stays
    the content, as TRL's parse_response falls back to it)."""
    start = content.find("<tool_call>")
    if start < 0 or _TOOL_CALL.sub("", content[start:]).strip():
        return None
    blocks = _TOOL_CALL.findall(content[start:])
    calls = [_tool_call(block.strip()) for block in blocks]
    if not calls or any(call is None for call in calls):
        return None
    return calls


def _tool_call(block: str) -> dict | None:
    if block.startswith("{"):
        value = _json_object(block)
        if not value or not isinstance(value.get("name"), str):
            return None
        name, arguments = value["name"], value.get("arguments", {})
        arguments = _json_object(arguments) if isinstance(arguments, str) else arguments
    elif function := _XML_FUNCTION.fullmatch(block):
        name, arguments = function.group(1).strip(), {k.strip(): _json_value(v)
                                                      for k, v in _XML_PARAMETER.findall(function.group(2))}
    elif block and "<" not in block.split("\n", 1)[0]:
        name = block.split("\n", 1)[0].strip()
        arguments = {k.strip(): _json_value(v) for k, v in _GLM_ARGUMENT.findall(block)}
    else:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _json_value(text: str):
    """A written argument's value: JSON where it parses (numbers, objects), else the text (TRL's allow_non_json)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _harmony(text: str) -> dict:
    """Harmony's messages (each after `<|start|>`; the first right after the prompt's `<|start|>assistant`): the
    analysis channel is the reasoning, a `to=functions.NAME` recipient a tool call, the others the answer."""
    reasoning, answer, calls = [], [], []
    for part in text.split("<|start|>"):
        header, found, body = part.partition("<|message|>")
        if not found:
            continue
        body = _HARMONY_END.split(body, maxsplit=1)[0].strip()
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=functions\.([^\s<]+)", header)
        arguments = _json_object(body) if recipient else None
        if arguments is not None:
            calls.append({"type": "function", "function": {"name": recipient.group(1), "arguments": arguments}})
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            answer.append(body)
    message = {"role": "assistant", "content": "\n".join(answer).strip()}
    if any(reasoning):
        message["reasoning"] = "\n".join(part for part in reasoning if part)
    if calls:
        message["tool_calls"] = calls
    return message


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def shown(message: dict) -> str:
    """What a reply says: its final answer, or, for a turn that only calls tools, its calls as JSON text."""
    if message["content"] or not message.get("tool_calls"):
        return message["content"]
    return json.dumps([call["function"] for call in message["tool_calls"]], ensure_ascii=False)


# ------------------------------------------------------------------------------------------- what serving sends
def generation_prompt(tokenizer) -> str:
    """The text the chat template adds for the model's answer (add_generation_prompt=True), "" without a template."""
    if not chat_template_text(tokenizer):
        return ""
    try:
        messages = [{"role": "user", "content": _PROBE}]
        without = tokenizer.apply_chat_template(messages, tokenize=False)
        given = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (a template that needs more than one user message: nothing to complete)
        return ""
    return given[len(without):] if isinstance(given, str) and given.startswith(without) else ""


def serving_prompt(ids: list[int], tokenizer) -> tuple[list[int], str]:
    """(the prompt a server sends, the text added) for a trained context `ids`: the context itself; where it ends
    inside the template's generation prompt (after its opening special token, before the rest: DeepSeek-R1's
    `<｜Assistant｜>` without `<think>\\n`), the context and the rest of the generation prompt; where it runs past the
    generation prompt (data.reasoning: context under templates that prefill `<think>\\n`, Qwen3.5's and DeepSeek-R1's:
    the untrained reasoning follows it), the context cut back to the generation prompt's end."""
    wanted = generation_prompt(tokenizer)
    opener = next((token for token in special_tokens(tokenizer) if wanted.startswith(token)), "") if wanted else ""
    if not opener:
        return list(ids), ""
    cut = _generation_prompt_end(list(ids), tokenizer, wanted, opener)
    if cut is not None:
        return list(ids)[:cut], ""
    tail = tokenizer.decode(list(ids)[-32:], skip_special_tokens=False)
    if tail.endswith(wanted):
        return list(ids), ""
    for cut in range(len(wanted) - 1, len(opener) - 1, -1):
        if tail.endswith(wanted[:cut]):
            rest = wanted[cut:]
            return list(ids) + list(tokenizer(rest, add_special_tokens=False)["input_ids"]), rest
    return list(ids), ""


def _generation_prompt_end(ids: list[int], tokenizer, wanted: str, opener: str) -> int | None:
    """Where the generation prompt `wanted` ends in `ids`, if text follows it there: it starts at the last `opener`
    token (the turn asked; reasoning is text, no special token), and the model writes from its end."""
    opener_id = tokenizer.convert_tokens_to_ids(opener)
    start = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == opener_id), None)
    if start is None:
        return None
    for end in range(start + 1, len(ids)):  # the generation prompt is a few tokens: stop once the text runs past it
        text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        if text == wanted:
            return end
        if not wanted.startswith(text):
            return None
    return None
