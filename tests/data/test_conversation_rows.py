"""Conversation rows a second review (2026-12-06) found trained wrong without a word, or refused with the wrong fix.

Each was reproduced on the code before this file: two calls to one function under gpt-oss trained as one; a
`</think>` inside a line of the answer made the text before it reasoning; content as a list of text parts trained as
JSON; `data.reasoning: context` left the template's own markup untrained where the reasoning is also one of its words;
an empty assistant turn trained its end-of-turn token alone; DeepSeek-R1's tool-call rows failed with a fix that fails
the same way; a broken `.jinja` file was blamed on the first row.
"""

from __future__ import annotations

import json

import pytest
from chat_families import WEATHER_TOOL, family_tokenizer

from finetune import data
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, load_recipe

SPEC = DatasetSpec(path="rows.jsonl", format="chat")


def _examples(row: dict, family: str, **keys) -> list[list[tuple[str, bool]]]:
    return data.render_examples(row, SPEC, family_tokenizer(family), None, "rows.jsonl line 4", **keys)


def _trained(row: dict, family: str, **keys) -> list[str]:
    return [text for example in _examples(row, family, **keys) for text, trained in example if trained]


def _call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def test_two_calls_to_one_function_that_the_template_renders_once_are_refused():
    """gpt-oss's template renders a turn's first call only; the proof looked for each call's name, which the first
    call's rendering holds for both."""
    row = {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("Paris"), _call("Rome")]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."}]}
    with pytest.raises(DataError, match=r"line 4: the chat template drops message 2's tool call `get_weather` \(the "
                                        r"turn makes 2 call\(s\) to it, the span names it 1 time\(s\).*one call per"):
        _examples(row, "gpt-oss")
    trained = _trained(row, "qwen3")  # a template that renders both trains both
    assert '"Paris"' in trained[0] and '"Rome"' in trained[0]


def test_a_closing_think_tag_inside_a_line_is_the_answers_text():
    answer = "Write the closing tag </think> after your reasoning."
    row = {"messages": [{"role": "user", "content": "How do I close a think tag?"},
                        {"role": "assistant", "content": answer}]}
    assert _trained(row, "llama-3.1", reasoning="drop") == [answer + "<|eot_id|>"]
    # DeepSeek-R1's own form (its template prefills `<think>`): the tag closes a line, the text before it is reasoning
    r1 = {"messages": [row["messages"][0], {"role": "assistant", "content": "Recall the tags.\n</think>\n\nUse </think>."}]}
    assert _trained(r1, "llama-3.1", reasoning="drop") == ["Use </think>.<|eot_id|>"]


def test_content_as_text_parts_is_joined_and_other_parts_are_refused():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]}
    plain = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hello!"}]}
    assert _examples(parts, "qwen2.5") == _examples(plain, "qwen2.5")
    image = {"messages": [{"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "?"}]},
                          {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(DataError, match=r"line 4: message 1 has content parts of type image; finetune trains text only"):
        _examples(image, "qwen2.5")
    an_object = {"messages": [plain["messages"][0], {"role": "assistant", "content": {"answer": "Hello!"}}]}
    with pytest.raises(DataError, match=r"message 2 \(role assistant\) has a dict as its content.*only tool results"):
        _examples(an_object, "qwen2.5")


@pytest.mark.parametrize("family,word", [("gpt-oss", "analysis"), ("gpt-oss", "a"), ("qwen3", "think"),
                                         ("glm-4.5", "k"), ("llama-3.1", "think"), ("qwen3.5", "i")])
def test_reasoning_as_context_leaves_the_reasoning_untrained_not_the_templates_words(family, word):
    """The oracle: the same row with a reasoning no template writes ("QZXJ") has one place to find it; with a
    reasoning that is also a word of the template's markup the segments must be the same, the word put back."""
    def row(reasoning: str) -> dict:
        return {"messages": [{"role": "user", "content": "Pick."},
                             {"role": "assistant", "reasoning_content": reasoning, "content": "Teal."}]}
    unique = _examples(row("QZXJ"), family, reasoning="context")
    expected = [[(text.replace("QZXJ", word), trained) for text, trained in example] for example in unique]
    assert _examples(row(word), family, reasoning="context") == expected
    assert (word, False) in expected[-1]


@pytest.mark.parametrize("content", ["", None, "  "])
def test_an_empty_assistant_turn_is_a_row_error(content):
    row = {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": content}]}
    for family in ("llama-3.1", "deepseek-r1"):
        with pytest.raises(DataError, match=r"line 4: message 2 is an empty assistant turn \(no answer, no tool calls\)"):
            _examples(row, family)


@pytest.mark.parametrize("named", [False, True])
def test_tool_calls_under_deepseek_r1_are_refused_with_the_reason(named):
    """DeepSeek-R1 distills' template renders calls only where content `is none`, a key transformers drops before
    rendering: no call can be rendered, so the fix offered is another template, never finetune's deepseek-r1."""
    from finetune.chat_templates import named_templates

    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [_call("Paris")]},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    tokenizer = family_tokenizer("deepseek-r1", template=named_templates()["deepseek-r1"] if named else None)
    with pytest.raises(DataError, match=r"renders a call only in a turn whose content is None.*Fix: a template that "
                                        r"renders tool calls \(model.chat_template: qwen2.5"):
        data.render_examples(row, SPEC, tokenizer, None, "rows.jsonl line 4")


def test_reasoning_a_template_drops_beside_a_call_names_that_fix():
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "reasoning_content": "Use the tool.", "content": "",
                         "tool_calls": [_call("Paris")]},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    with pytest.raises(DataError, match=r"drops the reasoning of message 2 beside its tool calls.*data.reasoning: drop"):
        _examples(row, "llama-3.1")
    assert _trained(row, "llama-3.1", reasoning="drop")[-1] == "Sunny.<|eot_id|>"


def test_a_chat_template_file_that_is_not_jinja_is_a_recipe_error(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}{% endfor %%}")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: m, chat_template: {broken}}}\ndata: {{datasets: [{{path: rows.jsonl}}]}}\n")
    with pytest.raises(Exception, match=rf"model.chat_template: the file `{broken}` is not valid Jinja: line 1"):
        load_recipe(str(recipe))


# ------------------------------------------------------------------------------ what a review of the fixes found
def test_sharegpt_function_call_values_as_objects_are_calls_and_text_parts_may_say_value():
    row = {"tools": [WEATHER_TOOL], "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
    as_text = {**row, "conversations": [{**turn, "value": json.dumps(turn["value"])} if turn["from"] == "function_call"
                                        else turn for turn in row["conversations"]]}
    assert _examples(row, "qwen3") == _examples(as_text, "qwen3")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "value": "Say hi."}]},
                          {"role": "assistant", "content": "Hello!"}]}
    plain = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hello!"}]}
    assert _examples(parts, "qwen2.5") == _examples(plain, "qwen2.5")
    with pytest.raises(DataError, match="a text part without its text"):
        _examples({"messages": [{"role": "user", "content": [{"type": "text"}]}, plain["messages"][1]]}, "qwen2.5")


def test_only_deepseeks_none_content_rule_refuses_tool_calls_and_crlf_closes_a_think_block():
    from finetune.chat_templates import named_templates
    from finetune.data.conversations import calls_need_none_content

    assert calls_need_none_content(named_templates()["deepseek-r1"])
    guard = "{% for m in messages %}{% if m.content is none %}{% endif %}{{ m.tool_calls }}{% endfor %}"
    assert not calls_need_none_content(guard)  # a guard on content: the calls render either way
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Greet back.</think>\r\n\r\nHi!"}]}
    assert _trained(row, "llama-3.1", reasoning="drop") == ["Hi!<|eot_id|>"]
