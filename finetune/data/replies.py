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
`reply_message` gives the assistant message a client sends back as history: `content` the final answer, `reasoning`
(finetune's normal form: data/conversations.template_messages hands it to the template's own field) and tool calls.

What is sent. `serving_prompt` completes a trained context into the prompt a server sends
(apply_chat_template(add_generation_prompt=True)): where the template's generation prompt prefills text a trained
turn lacks (DeepSeek-R1's `<think>\n` before an answer without reasoning, data/chat.py `_unprefixed`), the training
tokens stop inside the generation prompt, and the generation eval asks what serving asks.
"""

from __future__ import annotations

import json
import re

from finetune.data.chat import chat_template_text, special_tokens
from finetune.data.conversations import convert_turns
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
    return {**message, "content": message["content"].strip()}


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
    """(the prompt a server sends, the text added) for a trained context `ids`: the context itself, or, where it
    ends inside the template's generation prompt (after its opening special token, before the rest: DeepSeek-R1's
    `<｜Assistant｜>` without `<think>\\n`), the context and the rest of the generation prompt."""
    wanted = generation_prompt(tokenizer)
    opener = next((token for token in special_tokens(tokenizer) if wanted.startswith(token)), "") if wanted else ""
    if not opener:
        return list(ids), ""
    tail = tokenizer.decode(list(ids)[-32:], skip_special_tokens=False)
    if tail.endswith(wanted):
        return list(ids), ""
    for cut in range(len(wanted) - 1, len(opener) - 1, -1):
        if tail.endswith(wanted[:cut]):
            rest = wanted[cut:]
            return list(ids) + list(tokenizer(rest, add_special_tokens=False)["input_ids"]), rest
    return list(ids), ""
