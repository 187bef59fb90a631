"""Mistral v0.3's chat template (also Nemo's and Small-2409's): the system message and [AVAILABLE_TOOLS] go into the
LAST user turn only, and its generation prompt adds nothing (the context ends with the user's `[/INST]`).

So once an assistant turn follows, the template renders the history differently (the system message leaves, or
moves to a later user turn): each turn must be trained in its own inference context, C = apply_chat_template(history,
add_generation_prompt=True), followed by the turn as the template writes it when it is the last message. The oracle
here, token by token: C, then T = the turn's rendering as the last message minus its history as that rendering
writes it (for this template: the conversation without the system message, which W never shows).
"""

from __future__ import annotations

import json

import pytest
from chat_families import family_tokenizer

from finetune import data
from finetune.data import IGNORE_INDEX
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

# Mistral-7B-Instruct-v0.3's chat_template (tokenizer_config.json), as the model ships it: the role alternation check,
# the 9-character tool call ids, `loop.last and system_message` and `message == user_messages[-1]`.
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""
MARKERS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]"]
SPEC = DatasetSpec(path="rows.jsonl", format="chat")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "Be brief."}
MULTI_TURN = {"messages": [SYSTEM, {"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": "Teal."}, {"role": "user", "content": "Another?"},
                           {"role": "assistant", "content": "Slate."}]}
TOOLS_TWO_USER_TURNS = {"tools": [WEATHER], "messages": [
    SYSTEM, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call00001", "content": "{\"temp_c\": 10}"},
    {"role": "assistant", "content": "It is 10 C in Paris."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "I cannot tell tomorrow."}]}


@pytest.fixture(scope="module")
def mistral():
    """A tiny byte-level tokenizer with Mistral v0.3's control tokens and none of ChatML's (as Mistral's has none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["Be brief. Name a colour. Teal. Another? Slate. Weather in Paris?"] * 20,
                                trainer=trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", *MARKERS],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                        additional_special_tokens=MARKERS)
    tokenizer.chat_template = MISTRAL_V03
    return tokenizer


def oracle(row: dict, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context tokens, trained tokens) of every assistant turn: C, then the turn as the template writes it last."""
    messages, tools, turns = row["messages"], row.get("tools"), []

    def render(conversation, prompt=False):
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=prompt)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context, whole = render(messages[:i], True), render(messages[: i + 1])
        history = render([m for m in messages[:i] if m["role"] != "system"])  # as W writes it: W shows no system
        assert whole == render([m for m in messages[: i + 1] if m["role"] != "system"]) and whole.startswith(history)
        turns.append((encode(context), encode(context + whole[len(history):])[len(encode(context)):]))
    return turns


def trained(example) -> list[tuple[list[int], list[int]]]:
    """(tokens before, tokens of) each run of trained tokens of an example."""
    runs, labels, i = [], example.labels, 0
    while i < len(labels):
        if labels[i] == IGNORE_INDEX:
            i += 1
            continue
        end = next((k for k in range(i, len(labels)) if labels[k] == IGNORE_INDEX), len(labels))
        runs.append((list(example.input_ids[:i]), list(example.input_ids[i:end])))
        i = end
    return runs


def prepared(tmp_path, rows: list[dict], tokenizer, fmt: str = "chat", **data_keys):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": str(path), "format": fmt}],
                                                      "max_length": 1024, "eval_fraction": 0, **data_keys}}
    if fmt == "preference":
        recipe["train"] = {"objective": "dpo"}
    examples = data.prepare(validate_recipe(recipe), tokenizer).train
    return [examples[i] for i in range(len(examples))]


def test_a_system_message_turn_is_trained_after_the_prompt_serving_sends(mistral, tmp_path):
    """Found by a bug bash: a system + user + assistant row (or a row given data.system_prompt) under Mistral v0.3's
    template was refused ("renders the conversation before message 3 differently ... cannot be found after the
    generation prompt"): the template writes the system message into the last user turn only, and its generation
    prompt is empty, so the turn was looked for after an empty prompt. It is trained after the serving prompt."""
    row = {"messages": [SYSTEM, {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]}
    assert data.render_examples(row, SPEC, mistral, None, "rows.jsonl line 1") == [
        [("<s>[INST] Be brief.\n\nName a colour.[/INST]", False), (" Teal.</s>", True)]]
    bare = {"messages": row["messages"][1:]}
    for rows, keys in (([row], {}), ([bare], {"system_prompt": "Be brief."})):
        (example,) = prepared(tmp_path, rows, mistral, **keys)
        assert trained(example) == oracle(row, mistral)
        assert mistral.decode(example.input_ids) == "<s>[INST] Be brief.\n\nName a colour.[/INST] Teal.</s>"


@pytest.mark.parametrize("row", [MULTI_TURN, TOOLS_TWO_USER_TURNS], ids=["multi_turn", "tools_two_user_turns"])
def test_each_turn_is_trained_in_its_own_context(mistral, tmp_path, row):
    """Found by a bug bash: with a system message (or tools and two user turns), every multi-turn row was refused.
    The system message (and the tools) stand before the LAST user turn of each context, so an earlier turn's context
    is not a prefix of the final rendering: each turn gets the example serving gives it, token by token."""
    examples = prepared(tmp_path, [row], mistral)
    runs = [run for example in examples for run in trained(example)]
    assert runs == oracle(row, mistral)
    assert len(runs) == sum(m["role"] == "assistant" for m in row["messages"])
    if row is MULTI_TURN:  # the system message in each context's last user turn, as serving sends it
        assert [mistral.decode(example.input_ids) for example in examples] == [
            "<s>[INST] Be brief.\n\nName a colour.[/INST] Teal.</s>",
            "<s>[INST] Name a colour.[/INST] Teal.</s>[INST] Be brief.\n\nAnother?[/INST] Slate.</s>"]


def test_a_pair_with_a_system_message_scores_both_answers_after_the_serving_prompt(mistral, tmp_path):
    """Found by a bug bash: a DPO pair whose prompt holds a system message was refused under Mistral v0.3's template
    (`line 1 (chosen)`), as SFT rows were. Both answers are scored after C, the same prompt tokens."""
    pair = {"prompt": [SYSTEM, {"role": "user", "content": "Name a colour."}],
            "chosen": [{"role": "assistant", "content": "Teal."}],
            "rejected": [{"role": "assistant", "content": "I like many colours."}]}
    (example,) = prepared(tmp_path, [pair], mistral, fmt="preference")
    for sequence, answer in ((example, pair["chosen"]), (example.rejected, pair["rejected"])):
        assert trained(sequence) == oracle({"messages": pair["prompt"] + answer}, mistral)
    assert mistral.decode(example.rejected.input_ids) == \
        "<s>[INST] Be brief.\n\nName a colour.[/INST] I like many colours.</s>"


def test_the_refusal_names_only_templates_whose_tokens_the_tokenizer_has(mistral):
    """Found by a bug bash: the refusal told a Mistral user to set one of finetune's named templates (chatml,
    llama-3.1, ...), none of which is written with Mistral's tokens (ChatML's markers would be trained as text). A
    refusal that remains names only templates whose special tokens the tokenizer has, or none."""
    row = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]}
    rewrites = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content if loop.last else "
                "m.content | upper }}[/INST]{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
    mistral.chat_template = rewrites
    try:
        with pytest.raises(DataError, match="cannot be found after the generation prompt") as refused:
            data.render_examples(row, SPEC, mistral, None, "rows.jsonl line 1")
    finally:
        mistral.chat_template = MISTRAL_V03
    fix = str(refused.value).split("Fix: ")[1]
    assert fix.startswith("set model.chat_template to a template that renders it: a .jinja file or the template "
                          "text (none of finetune's named templates, chatml, "), fix
    llama = family_tokenizer("llama-3.1", template=rewrites.replace("[INST]", "<|start_header_id|>"))
    with pytest.raises(DataError, match=r"special tokens \(chatml, llama-3\.1, qwen2\.5, qwen3, qwen3\.5\)"):
        data.render_examples(row, SPEC, llama, None, "rows.jsonl line 1")
