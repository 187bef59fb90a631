"""A conversation -> trained segments: every assistant turn trained in the context its chat template gives it at
inference, and proven to be that turn's own text.

How a turn is found. For assistant turn i the template renders three texts: the history `N` (messages before i),
the context `C` (the history with the generation prompt, what the model is given at inference) and `W` (the history
and turn i, the turn last). The turn's trained span is W after C, through the turn's end-of-turn token. When the
generation prompt prefills text the rendered turn lacks (DeepSeek-R1 distills' `<think>\n`), the span starts where
W and C part, which must lie inside the generation prompt, never in the history.

Why one example per context. Templates of reasoning and agent models render a turn differently once later turns
follow it (Qwen3 and GLM drop earlier reasoning, gpt-oss ends earlier turns with <|end|> and drops their analysis,
DeepSeek-R1 strips earlier <think> blocks, Mistral v0.3 moves the system message to the last user turn). At inference
the model writes each turn as the last one. So turns whose rendering is a prefix of a later turn's W share that
example; the others get their own: a ChatML conversation is one example, a three-turn Qwen3 one with reasoning three.

A turn ends with its end-of-turn token (<|im_end|>, <|eot_id|>), trained: the model must learn to stop. Where a
template writes none (GLM's; read from its rendering, never from an answer that ends with `<|im_end|>` as text), the
next message's special token (<|user|>) is added and trained, as TRL's GLM training template does (_stop_token). One
that is no token of the tokenizer is trained as text (data/template_facts.py).

The proof, on every row: the span starts after the history (so no earlier message is trained), ends with W (so
no later one is), and holds the turn's answer, each of its tool calls' names and, unless data.reasoning: drop, its
reasoning. A template that drops any of those (DeepSeek-R1's drops the reasoning of the turn it ends with) is a
DataError naming the row and the fix, never a silently wrong mask.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections import Counter
from dataclasses import dataclass

from finetune.chat_templates import named_templates
from finetune.data.conversations import calls_need_none_content, json_value, renders_tools, template_messages
from finetune.data.ported_rows import trained_turns
from finetune.data.template_facts import chat_template_text, note_turn_end, special_tokens
from finetune.errors import DataError

# apply_chat_template's own arguments, which a row's chat_template_kwargs cannot set (TRL fails on `tools` given twice)
_CALL_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "padding",
                   "continue_final_message", "tokenize", "sanitize_control_tokens", "truncation", "max_length",
                   "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
_PROBE = "\u2063"  # an invisible separator: the content of the message rendered after a turn to find its stop token
_MARKERS = re.compile(r"<\|[^|<>\s]+\|>|<｜[^｜<>\s]+｜>")  # a template's special tokens: <|im_start|>, <｜User｜>
_EXCHANGE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]  # by fitting_templates
_FIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> fitting_templates' names


class Opener(int):
    """The trained flag of a reasoning opener the turn writes under data.reasoning: context (Qwen3's `<think>\n`):
    trained (the model must open its reasoning), but not the answer: a cut that keeps an opener and none of the
    answer leaves the row nothing to learn (templates.answer_starts, tokenize.py's length policy)."""


OPENER = Opener(1)  # truthy, and equal to True: every reader of a segment's flag trains it


class Reasoning(int):
    """The flag of a turn's reasoning under data.reasoning: context: untrained (falsy), but the model's own text, so
    no prompt ends before the answer after it (data/tokens.py tokenizes a row in pieces only where a prompt ends)."""


REASONING = Reasoning(0)  # falsy, and equal to False: every reader of a segment's flag leaves it untrained


def prompt_part(segments: list) -> str:
    """The text of a rendered sequence's prompt: its segments before the first trained one or the first reasoning (the
    model's own text, untrained under data.reasoning: context, but no prompt: a pair whose answers both reason under a
    template that prefills `<think>` was refused as answering different prompts)."""
    return "".join(text for text, _ in itertools.takewhile(
        lambda segment: not segment[1] and not isinstance(segment[1], Reasoning), segments))


@dataclass
class _Turn:
    index: int  # the message's index in the conversation
    whole: str  # W: the conversation through this turn, the turn last
    start: int  # the trained span [start, end) in `whole`
    end: int


class _Renderer:
    """apply_chat_template on the normal form, with the row's tools; template errors become the row's DataError."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None, reasoning: str, where: str,
                 template_kwargs: dict | None = None, *, template: str | None = None):
        self.tokenizer, self.tools, self.reasoning, self.where = tokenizer, tools, reasoning, where
        self.template_kwargs = template_kwargs or {}  # the row's chat_template_kwargs, in every rendering of it
        # `template`: another template tried on the row for a fix to offer (_rendering_templates), not the tokenizer's
        self.other = {"chat_template": template} if template is not None else {}
        self.template = template if template is not None else chat_template_text(tokenizer, tools=bool(tools))
        self.string_arguments = False
        if tools and not renders_tools(self.template):
            raise DataError(f"{where}: the row offers tools, but the tokenizer's chat template does not render "
                            f"`tools` (DeepSeek-R1 distills' does not), so the model would never see them. Fix: "
                            f"{named_fix(self.tokenizer, self.template)}, or leave the tools out of the rows.")
        calls = any("tool_calls" in m for m in messages)
        if calls and "tool_calls" not in self.template:
            raise DataError(f"{where}: the row has assistant tool calls, but the tokenizer's chat template does not "
                            f"render `tool_calls`. Fix: {named_fix(self.tokenizer, self.template)}.")
        if calls and calls_need_none_content(self.template):
            raise DataError(f"{where}: the row has assistant tool calls, but the tokenizer's chat template renders a "
                            "call only in a turn whose content is None (DeepSeek-R1 distills' template, finetune's "
                            "deepseek-r1 too), and a turn's content reaches the template as text (finetune's normal "
                            "form; transformers 5.25 also drops None-valued keys), so no call can be trained under it. "
                            "Fix: a template that renders tool calls (model.chat_template: qwen2.5, qwen3, llama-3.1, "
                            "...), or leave tool-call rows out (data.bad_rows: skip).")
        self.messages = messages
        if calls:
            try:
                self.render(len(messages), False)
            except DataError:
                self.string_arguments = True  # DeepSeek's templates concatenate the arguments as text
                self.render(len(messages), False)

    def render(self, count: int, generation_prompt: bool) -> str:
        """The row's first `count` messages rendered."""
        return self.render_messages(self.messages[:count], generation_prompt)

    def render_messages(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """Any messages in the normal form rendered with the row's template, tools and settings (probes too)."""
        from jinja2 import TemplateError, TemplateSyntaxError

        messages = template_messages(messages, self.template, reasoning=self.reasoning,
                                     string_arguments=self.string_arguments)
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False, **self.other,
                                                      add_generation_prompt=generation_prompt, **self.template_kwargs)
        except TemplateSyntaxError as exc:  # the template's own fault (model.chat_template is checked at load)
            raise DataError(f"{self.where}: the tokenizer's chat template is not valid Jinja (its line {exc.lineno}: "
                            f"{exc.message}), so no row can be rendered. "
                            f"Fix: {named_fix(self.tokenizer, self.template)}.") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise DataError(f"{self.where}: the chat template cannot render this conversation: {exc}. Fix the row "
                            "(the template's own words above), or set data.bad_rows: skip.") from None


def row_template_kwargs(row: dict, where: str) -> dict:
    """A row's `chat_template_kwargs`, the template arguments TRL 1.16 reads per row and passes to apply_chat_template
    (gpt-oss's `reasoning_effort`, Qwen3's and GLM's `enable_thinking`): an object, or JSON text of one, its
    None-valued keys dropped (Parquet gives every row each key any row has, null where it had none). {} for none."""
    value = row.get("chat_template_kwargs") if isinstance(row, dict) else None
    if isinstance(value, str):  # JSON text; empty or only whitespace: none
        value = json_value(value, f"{where}: `chat_template_kwargs`") if value.strip() else None
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise DataError(f"{where}: `chat_template_kwargs` must be an object of chat template arguments "
                        '({"enable_thinking": false}, {"reasoning_effort": "high"}) or JSON text of one, got '
                        f"{value!r}. Fix the row, or set data.bad_rows: skip.")
    if taken := sorted(set(value) & _CALL_ARGUMENTS):
        raise DataError(f"{where}: `chat_template_kwargs` sets `{taken[0]}`, an argument of apply_chat_template "
                        "itself, which finetune sets for each rendering (the row's tools come from its `tools` column). "
                        "Fix the row (leave it out), or set data.bad_rows: skip.")
    return {key: item for key, item in value.items() if item is not None}


def chat_examples(messages: list[dict], tokenizer, where: str, *, tools: list[dict] | None = None,
                  trained_from: int = 0, reasoning: str = "train",
                  template_kwargs: dict | None = None) -> list[list[tuple[str, bool]]]:
    """The examples of a conversation as (text, trained) segments: the assistant turns from message `trained_from`
    on trained, each in its inference context (module docstring), except those its per-message flags leave untrained
    (axolotl's `weight: 0`, `train: false`: data/ported_rows.py); earlier turns are context. `template_kwargs`: the
    row's chat template arguments (TRL's per-row chat_template_kwargs), given to every rendering, the proofs' too."""
    note_turn_end(tokenizer)  # a template whose end of turn is text to this tokenizer: said once
    trained = trained_turns(messages, trained_from, where)
    renderer = _Renderer(tokenizer, messages, tools, reasoning, where, template_kwargs)
    turns = [_locate(renderer, messages, index) for index in trained]
    examples, remaining = [], list(turns)
    while remaining:  # the latest turn's W, with every earlier turn it renders exactly as that turn's own W does
        text, members, cursor = remaining[-1].whole, [], len(remaining[-1].whole)
        for turn in reversed(remaining):
            if turn.end <= cursor and text.startswith(turn.whole[: turn.end]):
                members.insert(0, turn)
                cursor = turn.start
        remaining = [turn for turn in remaining if turn not in members]
        examples.insert(0, _segments(text, members, messages, renderer))
    return examples


def _locate(renderer: _Renderer, messages: list[dict], index: int) -> _Turn:
    """Turn `index`'s example text and its trained span, checked (module docstring)."""
    context, whole = renderer.render(index, True), renderer.render(index + 1, False)
    if whole.startswith(context):
        text, start = whole, len(context)
    else:
        text, start = _unprefixed(renderer, messages, index, context, whole)
    end = len(text.rstrip())  # the end-of-turn token is trained (the model must learn to stop); a newline after it not
    _prove(text[start:end], messages[index], index, renderer)
    stop = _stop_token(renderer, messages, index, text[:end])
    return _Turn(index, text[:end] + stop + text[end:] if stop else text, start, end + len(stop))


def _unprefixed(renderer: _Renderer, messages: list[dict], index: int, context: str, whole: str) -> tuple[str, int]:
    """(example text, span start) of a turn whose rendering W does not continue its context C. Where the turn's own
    text opens in W is found by rendering the turn with a probe for its content (the two part right there).
    - The generation prompt prefills text the turn lacks (DeepSeek-R1's `<think>\n` before an answer without
      reasoning): the history is W's own, and the span starts where C and W part, or where the turn's text opens
      if that is sooner (an answer starting with `<` shares a character with `<think>`).
    - The turn makes the template rewrite the history (gpt-oss drops a tool call's analysis, Mistral v0.3 the system
      message): the model is given C and writes the turn, so the example is C and then the turn as W renders it,
      from the end of the generation prompt on, or where that adds nothing (Mistral's), of the last message."""
    history = renderer.render(index, False)
    prompt = context[len(history):] if context.startswith(history) else ""
    probed = renderer.render_messages(messages[:index] + [{"role": "assistant", "content": _PROBE}])
    opening = _common_prefix(whole, probed)
    if prompt and whole.startswith(history):
        start = min(_common_prefix(context, whole), opening)
        if start >= len(history):
            _PREFILL_MISSED[0] += 1  # trained after part of the generation prompt: said by prefill_note
            return whole, start
    elif prompt and (at := whole.rfind(prompt, 0, opening + 1)) >= 0:
        return context + whole[at + len(prompt):], len(context)
    elif index and context == history and (tail := _last_message_on(renderer, messages, index, context)) and (
            at := whole.rfind(tail, 0, opening)) >= 0:
        return context + whole[at + len(tail):], len(context)
    raise DataError(f"{renderer.where}: the chat template renders the conversation before message {index + 1} "
                    "differently once that assistant turn follows it, and the turn cannot be found after the "
                    f"generation prompt. Fix: {named_fix(renderer.tokenizer, renderer.template)}.")


def _last_message_on(renderer: _Renderer, messages: list[dict], index: int, context: str) -> str:
    """C from the last history message's content on, found by a probe for that content ("" where C differs there)."""
    try:
        probed = renderer.render_messages(messages[: index - 1] + [{**messages[index - 1], "content": _PROBE}], True)
    except DataError:
        return ""
    at = probed.find(_PROBE)
    after, content = probed[at + len(_PROBE):], str(messages[index - 1].get("content", "")).strip()
    fits = at >= 0 and context.startswith(probed[:at]) and context.endswith(after)
    return context[at:] if fits and content in context[at : len(context) - len(after)] else ""


def named_fix(tokenizer, in_use: str) -> str:
    """The fix for a template that cannot render a row: finetune's named templates whose special tokens this tokenizer
    has (fitting_templates), never the one in use (`in_use`: its text), or one's own where none is left."""
    named = named_templates()
    fitting = [name for name in fitting_templates(tokenizer) if named[name].strip() != in_use.strip()]
    return "set model.chat_template to a template that renders it: " + (
        f"one of finetune's named templates that use this tokenizer's special tokens ({', '.join(fitting)}), a "
        ".jinja file, or the template text" if fitting else "a .jinja file or the template text (" + (
            "the one named template that uses this tokenizer's special tokens is the one in use)"
            if fitting_templates(tokenizer) else
            f"none of finetune's named templates, {', '.join(sorted(named))}, uses this tokenizer's special tokens)"))


def fitting_templates(tokenizer) -> list[str]:
    """finetune's named templates whose special tokens (as one exchange is written) are tokens of this tokenizer
    (ChatML's are ten ordinary pieces to Mistral's), kept per tokenizer."""
    from jinja2 import TemplateError

    if tokenizer not in _FIXES:
        named, fitting = named_templates(), []
        for name in sorted(named):
            try:
                shown = tokenizer.apply_chat_template(_EXCHANGE, chat_template=named[name], tokenize=False)
            except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
                continue
            if all(len(tokenizer(m, add_special_tokens=False)["input_ids"]) == 1 for m in _MARKERS.findall(shown)):
                fitting.append(name)
        _FIXES[tokenizer] = fitting
    return _FIXES[tokenizer]


def _rendering_templates(renderer: _Renderer, messages: list[dict]) -> list[str]:
    """The fitting named templates, other than the one in use, under which every assistant turn of the row is found
    and proven (each rendered and checked as the row's own template would be): fixes that work for this row."""
    found, missed = [], _PREFILL_MISSED[0]
    for name in fitting_templates(renderer.tokenizer):
        template = named_templates()[name]
        if template.strip() == renderer.template.strip():
            continue
        try:
            other = _Renderer(renderer.tokenizer, messages, renderer.tools, renderer.reasoning, renderer.where,
                              renderer.template_kwargs, template=template)
            for index in (i for i, message in enumerate(messages) if message["role"] == "assistant"):
                _locate(other, messages, index)
        except DataError:
            continue
        found.append(name)
    _PREFILL_MISSED[0] = missed  # trials, not trained turns
    return found


_PREFILL_MISSED = [0]  # turns of this process trained after less than the generation prompt (DeepSeek-R1's)


def prefill_misses() -> int:
    """How many assistant turns this process has trained after less than the generation prompt (DeepSeek-R1's)."""
    return _PREFILL_MISSED[0]


def prefill_note(rows: int, first: str) -> str:
    """The note for the rows whose turns prefill_misses counted (`first`: where the first is), with the fixes."""
    many = rows > 1
    return (f"{rows} row{'s' if many else ''} (the first: {first}) {'have' if many else 'has'} an assistant turn "
            "without reasoning under a chat template whose generation prompt prefills text such a turn lacks "
            "(DeepSeek-R1's `<think>\\n` after `<｜Assistant｜>`): the turn is trained after the prompt without that "
            "text, while every serving prompt, `finetune generate`'s and GRPO's too, ends with it, so the model "
            "never learns to answer after what it is sent. Fix: give those turns a reasoning (a short "
            "one will do; data.reasoning: context keeps it untrained), or a template whose generation prompt "
            "prefills nothing (model.chat_template: a .jinja file, served with it too); docs/data.md, Reasoning")


def _common_prefix(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _stop_token(renderer: _Renderer, messages: list[dict], index: int, through: str) -> str:
    """The token that ends turn `index` when its template writes none (GLM's): the special token opening the next
    message (<|user|>, <|observation|>), where the model stops. "" when it ends with one, or none follows."""
    specials = special_tokens(renderer.tokenizer)
    if not specials or _closes_turn(renderer, messages, index, through, specials):
        return ""
    follower = {"role": "tool" if messages[index].get("tool_calls") else "user", "content": _PROBE}
    after = renderer.render_messages(messages[: index + 1] + [follower])
    # read off just before the follower's content: the follower may make the template rewrite the turn (GLM's)
    head, tail = after[: after.rfind(_PROBE)], through.rstrip()[-4:]
    at = head.rfind(tail)
    while at >= 0:  # the last place the turn's ending stands right before a special token (not inside one: "user")
        rest = head[at + len(tail):].lstrip()
        token = next((token for token in specials if rest.startswith(token)), "")
        if token:
            return token
        at = head.rfind(tail, 0, at + len(tail) - 1)
    return ""


def _closes_turn(renderer: _Renderer, messages: list[dict], index: int, through: str, specials: list[str]) -> bool:
    """Whether the template itself ends turn `index` with a special token (<|im_end|>). The rendering's end says so,
    unless the answer's own text ends with that token's spelling (`ok <|im_end|>` under GLM's, which writes none):
    then the turn is rendered with a probe for its content, and what the template writes after the probe decides."""
    ending = next((token for token in specials if through.endswith(token)), "")
    if not ending or not messages[index]["content"].rstrip().endswith(ending):
        return bool(ending)
    probed = renderer.render_messages(messages[:index] + [{**messages[index], "content": _PROBE}]).rstrip()
    return any(probed.endswith(token) for token in specials)


def _prove(span: str, message: dict, index: int, renderer: _Renderer) -> None:
    """The span holds the turn's own text: its answer, its tool calls' names, its reasoning (unless dropped)."""
    where, number = renderer.where, index + 1
    answer = message["content"].strip()
    if answer and answer not in span and "</think>" in answer and "</think>" in renderer.template:
        raise DataError(f"{where}: message {number}'s answer holds the text `</think>`, which this chat template reads "
                        "as the end of the turn's reasoning (Qwen3's, Qwen3.5's, GLM's and DeepSeek-R1's split an "
                        "assistant's content there: the text before it becomes reasoning or is dropped), so the answer "
                        f"cannot be trained as written (the span: {span[:80]!r}). Fix: rewrite the tag in the answer "
                        "(e.g. `&lt;/think&gt;`); if the text before it is the turn's reasoning, give it in the row's "
                        "`reasoning_content` (or as a leading `<think>...</think>` block); for a Qwen model, "
                        "model.chat_template: chatml (Qwen's turns without their reasoning handling); or set "
                        "data.bad_rows: skip.")
    calls = Counter(call["function"]["name"] for call in message.get("tool_calls", []))
    if answer and answer not in span and calls and _PROBE not in renderer.render_messages(
            renderer.messages[:index] + [{**message, "content": _PROBE}]):  # the template writes no text beside calls
        raise DataError(_text_beside_calls(span, number, renderer))
    if answer and answer not in span:
        raise DataError(f"{where}: message {number}'s answer is not whole in the span the chat template gives that "
                        f"assistant turn (the span: {span[:80]!r}), so it cannot be trained exactly. "
                        f"Fix: {named_fix(renderer.tokenizer, renderer.template)}.")
    for name, count in calls.items():  # a name counted, not only found: two calls to one function, one rendered
        if span.count(name) < count:
            raise DataError(f"{where}: the chat template drops message {number}'s tool call `{name}` (the turn makes "
                            f"{count} call(s) to it, the span names it {span.count(name)} time(s); gpt-oss's template "
                            "renders a turn's first call only). Fix: one call per assistant turn, each followed by its "
                            f"result, or {named_fix(renderer.tokenizer, renderer.template)}.")
    reasoning = message.get("reasoning", "").strip()
    if reasoning and renderer.reasoning != "drop" and reasoning not in span and calls:
        raise DataError(f"{where}: the chat template drops the reasoning of message {number} beside its tool calls "
                        "(Llama 3.1's renders a call alone), so the model would learn to call without it. Fix: "
                        "data.reasoning: drop to train the calls alone, or a template that renders reasoning beside "
                        "calls (model.chat_template: qwen3, qwen3.5, glm-4.5 or gpt-oss).")
    if reasoning and renderer.reasoning != "drop" and reasoning not in span:
        raise DataError(f"{where}: the chat template drops the reasoning of message {number}, the turn being trained "
                        "(DeepSeek-R1 distills' template strips every <think> block, the last turn's too), so the "
                        "model would learn to answer without it. Fix: set model.chat_template: deepseek-r1 (finetune's "
                        "copy that keeps the trained turn's reasoning) or another template that renders it, or "
                        "data.reasoning: drop to train the answers alone.")


def _text_beside_calls(span: str, number: int, renderer: _Renderer) -> str:
    """The refusal of a turn with text and tool calls whose template renders the calls alone (Llama 3.1's), with the
    fixes that work: the named templates that render this row (tried on it: _rendering_templates), never the one in
    use; the text removed; the row skipped."""
    others = [] if renderer.other else _rendering_templates(renderer, renderer.messages)
    fits = (f"model.chat_template: {' or '.join(others)} (finetune's templates that render this row, the text "
            "beside the calls too)" if others else "a .jinja template that renders a turn's text beside its calls "
            "(model.chat_template; none of finetune's named templates for this tokenizer renders this row)")
    return (f"{renderer.where}: message {number} has both text and tool calls, and the chat template drops the text "
            "beside the calls (it renders a tool-call turn's calls alone, as Llama 3.1's does; the span: "
            f"{span[:80]!r}), so the turn cannot be trained as written. Fix: remove the text from that turn (keep its "
            f"tool_calls), or {fits}, or set data.bad_rows: skip.")


def _segments(text: str, members: list[_Turn], messages: list[dict], renderer: _Renderer) -> list[tuple[str, bool]]:
    """(text, trained) segments of one example: its member turns' spans trained (data.reasoning: context leaves
    the reasoning inside a span untrained), the rest context."""
    segments, cursor = [], 0
    for turn in members:
        segments.append((text[cursor : turn.start], False))
        span = text[turn.start : turn.end]
        reasoning = messages[turn.index].get("reasoning", "").strip()
        at = _reasoning_at(renderer, messages, turn, text) if reasoning and renderer.reasoning == "context" else -1
        if at >= 0:
            at -= turn.start
            segments += [(span[:at], OPENER), (reasoning, REASONING), (span[at + len(reasoning):], True)]
        else:
            segments.append((span, True))
        cursor = turn.end
    segments.append((text[cursor:], False))
    return [(piece, trained) for piece, trained in segments if piece]


def _reasoning_at(renderer: _Renderer, messages: list[dict], turn: _Turn, text: str) -> int:
    """Where turn's reasoning starts in `text`, for data.reasoning: context: after what the template writes before a
    probe for it, not its first match (a reasoning "analysis" is a word of gpt-oss's `<|channel|>analysis<|message|>`)."""
    message = messages[turn.index]
    probed = renderer.render_messages(messages[: turn.index] + [{**message, "reasoning": _PROBE}])
    lead = probed[: probed.find(_PROBE)][-48:] if _PROBE in probed else ""
    pattern = re.compile(re.escape(lead) + r"\s*" + re.escape(message["reasoning"].strip()))
    found = pattern.search(text, max(turn.start - len(lead), 0), turn.end) if lead else None
    if found is None or found.end() - len(message["reasoning"].strip()) < turn.start:
        raise DataError(f"{renderer.where}: message {turn.index + 1}'s reasoning cannot be told apart from the chat "
                        "template's own text in its span, so data.reasoning: context cannot leave it untrained. Fix: "
                        "data.reasoning: train or drop, or set data.bad_rows: skip.")
    return found.end() - len(message["reasoning"].strip())
