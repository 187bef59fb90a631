"""Conversations of 2026 under the templates their models ship: tool calls, reasoning, multi-turn rows.

The oracle is TRL's generation-tagged training templates (trl/chat_templates/*_training.jinja) with transformers'
`return_assistant_tokens_mask`: for every assistant turn, the tokens finetune trains equal the tokens TRL's mask marks
on the row cut after that turn (where TRL's template renders the turn as the last one, its inference context), up to
the two differences docs/data.md names as chosen: TRL's mask may start with text the generation prompt holds (the
`<|start|>assistant` of gpt-oss, DeepSeek's `<｜Assistant｜><think>\\n`, Qwen3.5's prefilled `<think>\\n`), which
finetune leaves as context because the model is given it at inference; and it may end with the newline after the
end-of-turn token, which the model never generates.
"""

from __future__ import annotations

import json

import pytest
from chat_families import FAMILIES, ROWS, WEATHER_TOOL, family_tokenizer, trl_template

from finetune import data
from finetune.chat_templates import named_templates
from finetune.data import IGNORE_INDEX
from finetune.data.conversations import convert_turns, template_messages
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytest.importorskip("trl")  # the oracle's templates (trl is a dev dependency)
SPEC = DatasetSpec(path="rows.jsonl", format="chat")


def trained_runs(example, tokenizer) -> list[tuple[str, str]]:
    """(untrained text before the run, the run's text) for each maximal run of trained tokens."""
    runs, before, current = [], [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE_INDEX:
            current.append(token)
            continue
        if current:
            runs.append((tokenizer.decode(before), tokenizer.decode(current)))
            before, current = [], []
        before.append(token)
    if current:
        runs.append((tokenizer.decode(before), tokenizer.decode(current)))
    return runs


def finetune_turns(row: dict, tokenizer, **keys) -> list[tuple[str, str]]:
    """(context, trained text) of each trained run, over all the examples the row gives, in turn order."""
    examples = data.tokenize_many(data.render_examples(row, SPEC, tokenizer, None, "row 1", **keys), tokenizer)
    return [run for example in examples for run in trained_runs(example, tokenizer)]


def trl_last_turn(row: dict, upto: int, tokenizer, training: str) -> str:
    """TRL's assistant mask of the last assistant turn of the row cut after message `upto`."""
    template = trl_template(training)
    messages = template_messages(convert_turns(row["messages"][: upto + 1], SPEC, "row"), template)
    out = tokenizer.apply_chat_template(messages, tools=row.get("tools"), chat_template=template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    last = max(i for i, m in enumerate(mask) if m)
    first = last
    while first > 0 and mask[first - 1]:
        first -= 1
    return tokenizer.decode(ids[first : last + 1])


ORACLE_CASES = [(family, kind) for family, (_, training, *_) in FAMILIES.items() if training for kind in ROWS
                if not (family == "deepseek-r1" and kind == "tool_call")]  # R1's template renders no tools (below)


@pytest.mark.parametrize("family,kind", ORACLE_CASES, ids=lambda v: str(v))
def test_every_turn_trains_what_trls_mask_marks(family, kind):
    """Each assistant turn of each row kind, under each family's template as shipped (DeepSeek-R1: finetune's named
    copy, which keeps the trained turn's reasoning; the shipped one refuses reasoning rows, below)."""
    template = named_templates()["deepseek-r1"] if family == "deepseek-r1" else None
    tokenizer = family_tokenizer(family, template=template)
    row = ROWS[kind]
    ours = finetune_turns(row, tokenizer)
    assistant_turns = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    assert len(ours) == len(assistant_turns), ours  # every assistant turn is trained, once
    for (context, trained), index in zip(ours, assistant_turns):
        theirs = trl_last_turn(row, index, tokenizer, FAMILIES[family][1])
        marked = theirs.rstrip("\n")  # the newline after the end-of-turn token: TRL's, not generated
        assert marked.endswith(trained), (trained, theirs)
        prompt_part = marked[: len(marked) - len(trained)]  # TRL's mask of what the generation prompt holds
        assert context.endswith(prompt_part), f"{prompt_part!r} is not the generation prompt's end: {context[-60:]!r}"
        message = row["messages"][index]
        assert message["content"].strip() in trained  # the turn's own answer, whole
        assert message.get("reasoning_content", "") in trained


@pytest.mark.parametrize("kind", list(ROWS))
def test_llama_3_1_trains_each_turn_with_its_end_of_turn(kind):
    """Llama 3.1 has no training template in TRL: its turns are exact prefixes, so a row is one example and each turn
    is its own rendering through <|eot_id|> (tool calls as Llama's JSON with `parameters`, results as ipython)."""
    tokenizer = family_tokenizer("llama-3.1")
    row = ROWS[kind]
    examples = data.render_examples(row, SPEC, tokenizer, None, "row 1")
    assert len(examples) == 1
    trained = [text for _, text in finetune_turns(row, tokenizer)]
    expected = {
        "tool_call": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                      "It is 21 C and clear in Paris.<|eot_id|>"],
        "reasoning": ["<think>\nCalm suggests cool, muted tones.\n</think>\n\nTeal.<|eot_id|>",
                      "<think>\nGrey is neutral and quiet.\n</think>\n\nSlate grey.<|eot_id|>"],
        "multi_turn": ["Teal.<|eot_id|>", "Slate grey.<|eot_id|>", "Amber.<|eot_id|>"],
    }[kind]
    assert trained == expected


def test_deepseek_r1_shipped_template_trains_whole_answers():
    """The template's generation prompt prefills `<think>\\n`, which the rendered turn lacks: the span starts where the
    two part (after <｜Assistant｜>), so every answer is trained whole (it used to lose its first 8 characters, and the
    first turn was not trained at all)."""
    tokenizer = family_tokenizer("deepseek-r1")
    trained = [text for _, text in finetune_turns(ROWS["multi_turn"], tokenizer)]
    assert trained == ["Teal.<｜end▁of▁sentence｜>", "Slate grey.<｜end▁of▁sentence｜>", "Amber.<｜end▁of▁sentence｜>"]


def test_deepseek_r1_shipped_template_refuses_reasoning_and_tools_with_the_fix():
    tokenizer = family_tokenizer("deepseek-r1")
    with pytest.raises(DataError, match=r"drops the reasoning of message 2.*model.chat_template: deepseek-r1"):
        data.render_examples(ROWS["reasoning"], SPEC, tokenizer, None, "row 1")
    with pytest.raises(DataError, match=r"does not render `tools`.*model.chat_template"):
        data.render_examples(ROWS["tool_call"], SPEC, tokenizer, None, "row 1")
    # data.reasoning: drop trains the answers alone under the shipped template
    trained = [text for _, text in finetune_turns(ROWS["reasoning"], tokenizer, reasoning="drop")]
    assert trained == ["Teal.<｜end▁of▁sentence｜>", "Slate grey.<｜end▁of▁sentence｜>"]


@pytest.mark.parametrize("family,examples", [("qwen2.5", 1), ("qwen3", 3), ("gpt-oss", 3), ("glm-4.5", 1),
                                             ("llama-3.1", 1), ("deepseek-r1", 1)])
def test_a_turn_rewritten_by_later_turns_gets_its_own_example(family, examples):
    """Three plain turns: one example where the template renders history as it renders a last turn, one per turn
    where it does not (Qwen3 gives the last turn an empty <think> block, gpt-oss ends it with <|return|>), and each
    example's history is the template's own (earlier turns as the template renders them there, untrained)."""
    tokenizer = family_tokenizer(family)
    rendered = data.render_examples(ROWS["multi_turn"], SPEC, tokenizer, None, "row 1")
    assert len(rendered) == examples
    full = tokenizer.apply_chat_template(ROWS["multi_turn"]["messages"], tokenize=False)
    last = "".join(text for text, _ in rendered[-1]).rstrip()
    assert last == full.rstrip() or (family == "glm-4.5" and last == full.rstrip() + "<|user|>")  # GLM's stop token


def test_reasoning_as_context_or_dropped():
    tokenizer = family_tokenizer("qwen3")
    context = [text for _, text in finetune_turns(ROWS["reasoning"], tokenizer, reasoning="context")]
    assert context == ["<think>\n", "\n</think>\n\nTeal.<|im_end|>", "<think>\n", "\n</think>\n\nSlate grey.<|im_end|>"]
    dropped = [text for _, text in finetune_turns(ROWS["reasoning"], tokenizer, reasoning="drop")]
    assert dropped == ["<think>\n\n</think>\n\nTeal.<|im_end|>", "<think>\n\n</think>\n\nSlate grey.<|im_end|>"]


SHAPES = {
    "arguments as JSON text": lambda row: {**row, "messages": [
        {**m, "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                               "arguments": "{\"city\": \"Paris\"}"}}]}
        if m.get("tool_calls") else m for m in row["messages"]]},
    "bare calls, tools as JSON text": lambda row: {"tools": json.dumps(row["tools"]), "messages": [
        {**m, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]} if m.get("tool_calls") else m
        for m in row["messages"]]},
    "sharegpt function_call and observation": lambda row: {"tools": row["tools"], "conversations": [
        {"from": "human", "value": "What is the weather in Paris?"},
        {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"},
        {"from": "observation", "value": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
        {"from": "gpt", "value": "It is 21 C and clear in Paris."}]},
    "tool result as an object": lambda row: {**row, "messages": [
        {**m, "content": {"temp_c": 21, "sky": "clear"}} if m["role"] == "tool" else m for m in row["messages"]]},
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tool_rows_in_every_shape_render_alike(shape):
    tokenizer = family_tokenizer("qwen3")
    expected = data.render_examples(ROWS["tool_call"], SPEC, tokenizer, None, "row 1")
    assert data.render_examples(SHAPES[shape](ROWS["tool_call"]), SPEC, tokenizer, None, "row 1") == expected


def test_dataset_tools_inline_or_from_a_file(tmp_path):
    tokenizer = family_tokenizer("qwen2.5")
    row = {"messages": ROWS["tool_call"]["messages"]}
    expected = data.render_examples(ROWS["tool_call"], SPEC, tokenizer, None, "row 1")
    inline = DatasetSpec(path="rows.jsonl", format="chat", tools=[WEATHER_TOOL["function"]])
    assert data.render_examples(row, inline, tokenizer, None, "row 1") == expected
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER_TOOL]))
    from_file = DatasetSpec(path="rows.jsonl", format="chat", tools=str(tmp_path / "tools.json"))
    assert data.render_examples(row, from_file, tokenizer, None, "row 1") == expected
    mapped = DatasetSpec(path="rows.jsonl", format="chat", columns={"tools": "functions"})
    assert data.render_examples({**row, "functions": ROWS["tool_call"]["tools"]}, mapped, tokenizer, None, "r") == expected


def test_tool_results_are_never_trained():
    tokenizer = family_tokenizer("qwen2.5")
    for _, trained in finetune_turns(ROWS["tool_call"], tokenizer):
        assert "temp_c" not in trained and "tool_response" not in trained


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}], r"message 2 has role `tool` where `assistant`"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": {}}]}, {"role": "user", "content": "?"}], r"message 3 has role `user` where `tool`"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": [{"arguments": {}}]}],
     r"message 2: a tool call needs a function `name`"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": "{not json"}]}], r"message 2 tool call arguments is text that is not valid JSON"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>half a thought"}],
     r"message 2: its content has an unbalanced <think> block"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>a</think>b",
                                          "reasoning_content": "c"}], r"message 2 has reasoning twice"),
])
def test_malformed_conversations_name_the_message_and_the_fix(messages, match):
    with pytest.raises(DataError, match=match):
        data.render_examples({"messages": messages}, SPEC, family_tokenizer("qwen3"), None, "rows.jsonl line 7")


def test_no_template_can_make_a_span_silently_wrong():
    """Templates built to break each step of the proof are refused naming the row, never trained wrong: one whose
    generation prompt eats into the answer, one that drops the answer, one whose generation prompt never appears once
    the turn is rendered and that rewrites the history then. A template that only rewrites the history when a turn
    follows is trained the way the model meets it: the context it is given, then the turn."""
    base = family_tokenizer("qwen2.5")
    row = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]}
    eats = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\nTe{% endif %}")
    drops = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.role != 'assistant' else 'ok' }}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    lost = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if not (m.role == 'user' and "
            "messages[-1].role == 'assistant') else 'X' }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>bot\n{% endif %}")
    for template, match in ((eats, "answer is not whole"), (drops, "answer is not whole"),
                            (lost, "renders the conversation before message 2 differently")):
        base.chat_template = template
        with pytest.raises(DataError, match=rf"line 3: .*{match}"):
            data.render_examples(row, SPEC, base, None, "rows.jsonl line 3")
    base.chat_template = lost.replace("bot", "assistant")
    (example,) = data.render_examples(row, SPEC, base, None, "rows.jsonl line 3")
    assert example == [("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", False),
                       ("Teal.<|im_end|>", True), ("\n", False)]


def test_preference_and_kto_prompts_with_history_and_tools():
    """DPO pairs and KTO rows whose prompt holds a tool call and its result, with the row's tools: the answers are
    scored in the context the template gives the last turn; the history is never scored."""
    tokenizer = family_tokenizer("qwen3")
    history = ROWS["tool_call"]["messages"][:3]
    pair = {"prompt": history, "chosen": "It is 21 C and clear in Paris.", "rejected": "It is snowing.",
            "tools": ROWS["tool_call"]["tools"]}
    spec = DatasetSpec(path="pairs.jsonl", format="preference")
    chosen, rejected = data.render_segments(pair, spec, tokenizer, None, "row 1")
    assert [text for text, trained in chosen if trained] == ["<think>\n\n</think>\n\nIt is 21 C and clear in Paris.<|im_end|>"]
    assert [text for text, trained in rejected if trained] == ["<think>\n\n</think>\n\nIt is snowing.<|im_end|>"]
    assert "get_weather" in chosen[0][0] and "# Tools" in chosen[0][0]  # the tools and the call are the context
    kto = {"prompt": history, "completion": "It is 21 C.", "label": True, "tools": ROWS["tool_call"]["tools"]}
    segments, desirable = data.render_segments(kto, DatasetSpec(path="k.jsonl", format="unpaired_preference"),
                                               tokenizer, None, "row 1")
    assert desirable and [text for text, trained in segments if trained] == ["<think>\n\n</think>\n\nIt is 21 C.<|im_end|>"]


def test_grpo_prompts_render_their_tools_and_keep_them_for_rewards(tmp_path):
    """A prompt row's `tools` column is rendered into the prompt the policy continues (the template's own tools
    block) and reaches the reward functions with the row, like every other column."""
    from conftest import write_jsonl

    tokenizer = family_tokenizer("qwen3")
    prompt = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = data.prompt_text(prompt, tokenizer, None, tools=[WEATHER_TOOL])
    assert "get_weather" in text and text.endswith("<|im_start|>assistant\n")
    assert "get_weather" not in data.prompt_text(prompt, tokenizer, None)
    rows = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": prompt, "tools": [WEATHER_TOOL], "city": "Paris"},
                                                    {"prompt": prompt, "city": "Lyon"}])
    recipe = validate_recipe({"model": {"name_or_path": "x"}, "train": {"objective": "grpo", "micro_batch_size": 4},
                              "data": {"datasets": [{"path": str(rows), "format": "prompt"}], "max_length": 1024},
                              "grpo": {"num_generations": 4, "reward_functions": ["finetune.rewards:final_number"]}})
    examples, _, _ = data.prompt_examples(recipe, tokenizer)
    with_tools, without = (tokenizer.decode(example.input_ids) for example in examples)
    assert "get_weather" in with_tools and "get_weather" not in without
    assert examples[0].row["tools"] == [WEATHER_TOOL] and examples[0].row["city"] == "Paris"


# --------------------------------------------------------------------------------------------- the recipe's keys
def test_model_chat_template_by_name_file_or_text(tmp_path):
    from finetune.chat_templates import resolve_chat_template

    assert resolve_chat_template("qwen3") == trl_template("qwen3.jinja")  # the template Qwen3 ships
    (tmp_path / "mine.jinja").write_text("{{ messages[0].content }}")
    assert resolve_chat_template(str(tmp_path / "mine.jinja")) == "{{ messages[0].content }}"
    assert resolve_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(Exception, match=r"model.chat_template.*`qwen9` is not a named template.*chatml"):
        validate_recipe({"model": {"name_or_path": "x", "chat_template": "qwen9"},
                         "data": {"datasets": [{"path": "d.jsonl"}]}})


def test_shipped_named_templates_are_the_models_own():
    """Every named template is the one its models ship (TRL's identity-compared copy), but deepseek-r1, which differs
    from DeepSeek's in one place: the `</think>` split spares the last turn (finetune/templates/SOURCES.md)."""
    copies = {"llama-3.1": "llama3_1.jinja", "qwen2.5": "qwen2_5.jinja", "qwen3": "qwen3.jinja",
              "qwen3.5": "qwen3_5_think.jinja", "gpt-oss": "gptoss.jinja", "glm-4.5": "glm4moe.jinja"}
    named = named_templates()
    assert set(named) == {*copies, "chatml", "deepseek-r1"}
    for name, file in copies.items():
        assert named[name] == trl_template(file), name
    shipped = trl_template("deepseek_r1_distill.jinja")
    assert named["deepseek-r1"] == shipped.replace("'</think>' in content %}", "'</think>' in content and not loop.last %}")


# ----------------------------------------------------------------------------- rows a review found breaking it
def test_gpt_oss_agent_row_trains_the_answer_after_the_analysis_it_was_given():
    """gpt-oss drops a tool call's analysis from the history once a final answer follows, but at inference the answer
    is written right after it: the answer's example is its context C followed by the answer (TRL's mask, per turn)."""
    tokenizer = family_tokenizer("gpt-oss")
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    row = {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "I need the weather tool.", "tool_calls": call},
        {"role": "tool", "content": "{\"temp_c\": 21}"}, {"role": "assistant", "content": "It is 21 C."}]}
    (example,) = data.render_examples(row, SPEC, tokenizer, None, "row 1")  # the call and the answer: one context
    assert "I need the weather tool." in "".join(text for text, _ in example)  # the answer is written after it
    turns = finetune_turns(row, tokenizer)
    assert [text for _, text in turns] == [
        ('<|channel|>analysis<|message|>I need the weather tool.<|end|><|start|>assistant to=functions.get_weather'
        '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'),
        "<|channel|>final<|message|>It is 21 C.<|return|>"]
    for (context, trained), index in zip(turns, (1, 3)):
        assert trl_last_turn(row, index, tokenizer, "gptoss_training.jinja") == "<|start|>assistant" + trained


def test_an_answer_ending_like_the_next_header_keeps_its_stop_token():
    tokenizer = family_tokenizer("glm-4.5")
    row = {"messages": [{"role": "user", "content": "Who decides?"}, {"role": "assistant", "content": "Ask the user"}]}
    assert [text for _, text in finetune_turns(row, tokenizer)] == ["\n<think></think>\nAsk the user<|user|>"]


@pytest.mark.parametrize("answer", ["<b>Hi</b>", "<think-tank>"])
def test_a_prefilled_think_never_eats_the_answer(answer):
    """DeepSeek-R1 prefills `<think>\\n`; an answer starting with `<` shares a character with it (an empty one, which
    started the span inside the end-of-sentence token, is a row error now: test_conversation_rows.py)."""
    tokenizer = family_tokenizer("deepseek-r1")
    row = {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": answer}]}
    assert [text for _, text in finetune_turns(row, tokenizer)] == [answer + "<｜end▁of▁sentence｜>"]


def test_a_template_dict_renders_tool_rows_with_its_tool_use_template():
    tokenizer = family_tokenizer("qwen2.5")
    tokenizer.chat_template = {"default": named_templates()["chatml"], "tool_use": named_templates()["qwen2.5"]}
    trained = [text for _, text in finetune_turns(ROWS["tool_call"], tokenizer)]
    assert trained[0].startswith("<tool_call>") and "get_weather" in trained[0]


def test_pair_answers_rendered_after_different_prompts_are_refused():
    tokenizer = family_tokenizer("deepseek-r1", template=named_templates()["deepseek-r1"])
    pair = {"prompt": [{"role": "user", "content": "Colour?"}], "rejected": "Red.",
            "chosen": [{"role": "assistant", "reasoning_content": "Calm.", "content": "Teal."}]}
    with pytest.raises(DataError, match="rendered after different prompts"):
        data.render_segments(pair, DatasetSpec(path="p.jsonl", format="preference"), tokenizer, None, "row 1")


def test_sharegpt_system_column_and_r1_style_reasoning_without_its_opening_tag():
    """LLaMA-Factory's ShareGPT exports keep the system prompt in a `system` column; DeepSeek-R1's outputs close their
    reasoning with `</think>` alone (the template prefilled `<think>`)."""
    tokenizer = family_tokenizer("qwen3")
    row = {"system": "You are a pirate.", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Thinking about pirates.\n</think>\n\nAhoy."}]}
    (example,) = data.render_examples(row, SPEC, tokenizer, None, "row 1")
    text = "".join(piece for piece, _ in example)
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>")
    assert [piece for piece, trained in example if trained] == [
        "<think>\nThinking about pirates.\n</think>\n\nAhoy.<|im_end|>"]
