"""Chat rows as public datasets bring them, which two bug bashes (bb37, bb42) found trained wrong or refused wrongly.

Each test reproduces a finding on the code before this file: a per-row `chat_template_kwargs` column was dropped;
Parquet's null-filled keys were trained into tool calls and schemas; OpenAI's legacy `function_call` and `functions`
were ignored; a tool's `parameters` as JSON text reached the template as a string; Hermes rows were told to merge
turns; a blank system turn beat the dataset's system_prompt; `developer` was refused; `tools: []` and `tools: "[]"`
disagreed; flat (Responses API) tools kept an inner `type`.
"""

from __future__ import annotations

import json

import pytest
from chat_families import WEATHER_TOOL, family_tokenizer

from finetune import data
from finetune.data.conversations import normalize_tools
from finetune.data.sources import open_source, row_chunks
from finetune.data.tokenize import tokenize_chunk
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

SPEC = DatasetSpec(path="rows.jsonl", format="chat")
HELLO = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]
STOCK_TOOL = {"type": "function", "function": {"name": "get_stock", "description": "A stock's price.", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}}}


def _examples(row: dict, family: str, spec: DatasetSpec = SPEC, system_prompt: str | None = None):
    return data.render_examples(row, spec, family_tokenizer(family), system_prompt, "rows.jsonl line 1")


def _text(row: dict, family: str, **keys) -> str:
    return "".join(text for text, _ in _examples(row, family, **keys)[-1])


def _trained(row: dict, family: str, **keys) -> list[str]:
    return [text for example in _examples(row, family, **keys) for text, trained in example if trained]


def _weather_row(arguments, *, answer: str = "It is 21 C in Paris.") -> dict:
    return {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "name": "get_weather", "content": "21 C"},
        {"role": "assistant", "content": answer}], "tools": [WEATHER_TOOL]}


# ------------------------------------------------------------------------------------- 1. chat_template_kwargs
@pytest.mark.parametrize("family,arguments,shown", [
    ("gpt-oss", {"reasoning_effort": "high"}, "Reasoning: high"),
    ("glm-4.5", {"enable_thinking": False}, "/nothink"),
    ("qwen3", '{"enable_thinking": false, "unused": null}', "<think>\n\n</think>\n\nTeal."),
], ids=["gpt-oss", "glm-4.5", "qwen3-json-text"])
def test_a_rows_chat_template_kwargs_reach_every_rendering_as_trl_passes_them(family, arguments, shown):
    """Found by a bug bash (bb42 #1): the column TRL 1.16 reads per row was dropped, so gpt-oss rows asking for
    high reasoning rendered `Reasoning: medium`, and GLM's `/nothink` switch was never in the user's text. The
    oracle: apply_chat_template(messages, **arguments), as TRL's SFTTrainer calls it."""
    row = {"messages": HELLO, "chat_template_kwargs": arguments}
    text = _text(row, family)
    assert shown in text
    given = json.loads(arguments) if isinstance(arguments, str) else arguments
    oracle = family_tokenizer(family).apply_chat_template(HELLO, tokenize=False, **{
        key: value for key, value in given.items() if value is not None})
    assert text.startswith(oracle.rstrip("\n"))  # (GLM's turn: the next message's token added, as documented)
    assert _examples(row, family) != _examples({"messages": HELLO}, family)  # (Qwen3: the context ends otherwise)


def test_a_preference_rows_chat_template_kwargs_head_both_answers():
    """Found by a bug bash (bb42 #1): preference rows rendered with the template's defaults too."""
    row = {"prompt": HELLO[:1], "chosen": HELLO[1:], "rejected": [{"role": "assistant", "content": "No."}],
           "chat_template_kwargs": {"reasoning_effort": "low"}}
    chosen, rejected = data.render_segments(row, DatasetSpec(path="pairs.jsonl", format="preference"),
                                            family_tokenizer("gpt-oss"), None, "pairs.jsonl line 1")
    assert "Reasoning: low" in chosen[0][0] and chosen[0] == rejected[0]


def test_a_grpo_prompt_is_rendered_with_its_rows_chat_template_kwargs():
    """Found by a bug bash (bb42 #1): GRPO's prompts ignored the row's template arguments."""
    from finetune.data.prompts import dataset_prompt_ids

    tokenizer = family_tokenizer("glm-4.5")
    row = {"prompt": HELLO[:1], "chat_template_kwargs": {"enable_thinking": False}}
    ids = dataset_prompt_ids(HELLO[:1], DatasetSpec(path="p.jsonl", format="prompt"), tokenizer, None, row=row)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(HELLO[:1], tokenize=False, add_generation_prompt=True,
                                                                  enable_thinking=False)


@pytest.mark.parametrize("arguments,message", [
    (["enable_thinking"], r"`chat_template_kwargs` must be an object of chat template arguments"),
    ("{enable_thinking: false}", r"`chat_template_kwargs` is text that is not valid JSON"),
    ({"tools": []}, r"`chat_template_kwargs` sets `tools`, an argument of apply_chat_template itself"),
], ids=["a-list", "not-json", "sets-tools"])
def test_chat_template_kwargs_that_are_no_arguments_object_are_the_rows_error(arguments, message):
    """Found by a bug bash (bb42 #1): whatever the column held, it was ignored without a word."""
    with pytest.raises(DataError, match=r"rows.jsonl line 1: " + message):
        _examples({"messages": HELLO, "chat_template_kwargs": arguments}, "qwen3")


# ---------------------------------------------------------------------------- 2. Arrow's null-filled keys
def _rows_read(path) -> tuple[list, list[str], DatasetSpec, object]:
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": str(path), "format": "chat"}], "max_length": 1024}})
    spec, rows, places = recipe.data.datasets[0], [], []
    for items, found, raw in row_chunks(open_source(spec)):
        rows += [json.loads(item) for item in items] if raw else items
        places += found
    return rows, places, spec, recipe


def _tokenized_texts(path, tokenizer) -> list[str]:
    rows, places, spec, recipe = _rows_read(path)
    result = tokenize_chunk(rows, places, [], spec, recipe, tokenizer)
    assert result.fatal is None, result.fatal
    return [tokenizer.decode(example.input_ids) for example in result.examples]


def test_parquet_rows_train_their_tool_calls_and_schemas_without_the_keys_of_other_rows(tmp_path):
    """Found by bug bashes (bb37 #2, bb42 #2): Arrow gives every row every key of every row, null where it had none,
    and those were trained: `{"city": "Paris", "ticker": null}` as a call, `"ticker": null` as a property."""
    import pyarrow
    import pyarrow.parquet

    from finetune.data.templates import arrow_null_rows

    stock = {"messages": [{"role": "user", "content": "AAPL price?"}, {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_stock", "arguments": {"ticker": "AAPL"}}}]},
        {"role": "tool", "name": "get_stock", "content": "190"}, {"role": "assistant", "content": "190 USD."}],
        "tools": [STOCK_TOOL]}
    rows = [_weather_row({"city": "Paris"}), stock]
    (tmp_path / "pq").mkdir()
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "pq" / "part.parquet")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert _rows_read(tmp_path / "rows.parquet")[0][0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris", "ticker": None}  # what Arrow hands over
    tokenizer = family_tokenizer("qwen3")
    before = arrow_null_rows()
    written = _tokenized_texts(tmp_path / "rows.jsonl", tokenizer)
    assert arrow_null_rows() == before  # (counted for a note: rows whose tools or calls lost such keys)
    assert _tokenized_texts(tmp_path / "rows.parquet", tokenizer) == written
    assert arrow_null_rows() == before + 2
    assert _tokenized_texts(tmp_path / "pq", tokenizer) == written  # a folder: the row's file is named in its place
    assert not any("null" in text for text in written)


def test_rows_whose_tools_lost_arrows_null_keys_are_counted_in_a_note(tmp_path):
    """The dropped keys are said (a note in `finetune data` and the run's data line), with the first row."""
    import pyarrow
    import pyarrow.parquet

    from finetune.data import build_examples
    from finetune.data.build import prompt_notes

    stock = {"messages": [{"role": "user", "content": "AAPL price?"}, {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_stock", "arguments": {"ticker": "AAPL"}}}]},
        {"role": "tool", "name": "get_stock", "content": "190"}, {"role": "assistant", "content": "190 USD."}],
        "tools": [STOCK_TOOL]}
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([_weather_row({"city": "Paris"}), stock]),
                                tmp_path / "rows.parquet")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": str(tmp_path / "rows.parquet"), "format": "chat"}], "max_length": 1024,
        "cache": False, "eval_fraction": 0}})
    _, _, stats = build_examples(recipe, family_tokenizer("qwen3"))
    notes = [note for note in prompt_notes(stats) if "read through Arrow" in note]
    assert len(notes) == 1 and notes[0].startswith("2 rows (the first: ") and "rows.parquet row 1" in notes[0], notes


def test_a_json_lines_rows_own_null_argument_stays():
    """A null written in a JSON Lines row is the row's own (bb37 #2's fix drops only Arrow's)."""
    trained = _trained(_weather_row({"city": "Paris", "unit": None}), "qwen3")
    assert '"unit": null' in trained[0]


def test_which_sources_are_read_through_arrow(tmp_path):
    from finetune.data.templates import read_through_arrow

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text("{}")
    folder = tmp_path / "mixed"
    folder.mkdir()
    assert read_through_arrow(DatasetSpec(path="a/b.parquet", format="chat"), "a/b.parquet row 1")
    assert read_through_arrow(DatasetSpec(path=str(saved), format="chat"), f"{saved} row 1")
    assert read_through_arrow(DatasetSpec(path="org/tool-calls", format="chat"), "org/tool-calls row 1")  # a hub name
    assert read_through_arrow(DatasetSpec(path=str(folder), format="chat"), f"{folder} sub/x.arrow row 3")
    assert not read_through_arrow(DatasetSpec(path=str(folder), format="chat"), f"{folder} sub/x.jsonl line 3")
    assert not read_through_arrow(DatasetSpec(path="a/b.json", format="chat"), "a/b.json row 1")
    assert not read_through_arrow(SPEC, "rows.jsonl line 1")


# --------------------------------------------------------------------------- 3. legacy function calling
def _legacy_row(call: dict, **extra) -> dict:
    return {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": call, **extra},
        {"role": "function", "name": "get_weather", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C in Paris."}], "functions": [WEATHER_TOOL["function"]]}


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}], ids=["json-text", "object"])
def test_openai_legacy_function_call_and_functions_train_as_tool_calls_and_tools(arguments):
    """Found by a bug bash (bb37 #3): the `function_call` key was ignored (the call lost: refused as an empty turn,
    or trained as an announcement that stops) and the `functions` column too (no tools in the prompt)."""
    legacy = _legacy_row({"name": "get_weather", "arguments": arguments})
    assert _examples(legacy, "qwen3") == _examples(_weather_row({"city": "Paris"}), "qwen3")
    last = {"messages": [HELLO[0] | {"content": "Weather in Paris?"},
                         {"role": "assistant", "content": "Let me look that up.",
                          "function_call": {"name": "get_weather", "arguments": arguments}}]}
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in _trained(last, "qwen3")[0]


def test_function_call_beside_tool_calls_is_the_rows_error():
    calls = _weather_row({})["messages"][1]["tool_calls"]
    row = _legacy_row({"name": "get_weather", "arguments": "{}"}, tool_calls=calls)
    with pytest.raises(DataError, match=r"message 2 has both `tool_calls` and `function_call`"):
        _examples(row, "qwen3")


# ------------------------------------------------------------------------------ 4. parameters as JSON text
def test_a_tools_parameters_as_json_text_are_parsed():
    """Found by a bug bash (bb37 #4): gpt-oss showed such a tool as `() => any` while its call passed `city`; the
    other templates an escaped string."""
    text_tool = {"type": "function", "function": {**WEATHER_TOOL["function"],
                                                  "parameters": json.dumps(WEATHER_TOOL["function"]["parameters"])}}
    for family in ("gpt-oss", "qwen3"):
        as_text = _text({**_weather_row({"city": "Paris"}), "tools": [text_tool]}, family)
        assert as_text == _text(_weather_row({"city": "Paris"}), family)
    assert "city: string" in _text({**_weather_row({"city": "Paris"}), "tools": [text_tool]}, "gpt-oss")
    broken = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": "{'type': 'object'}"}}
    with pytest.raises(DataError, match=r"line 1: the `parameters` of tool `get_weather` is text that is not valid"):
        _examples({**_weather_row({"city": "Paris"}), "tools": [broken]}, "qwen3")


# ------------------------------------------------------------------------------------ 5. Hermes rows
def test_a_tool_result_after_an_assistant_turn_without_calls_says_so():
    """Found by a bug bash (bb37 #5): Hermes function-calling rows (calls as `<tool_call>` text) were told to
    "merge consecutive turns of one speaker", which they do not have."""
    row = {"conversations": [
        {"from": "system", "value": "You may call tools. <tools>[...]</tools>"},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"from": "tool", "value": "<tool_response>21 C</tool_response>"},
        {"from": "gpt", "value": "It is 21 C."}]}
    with pytest.raises(DataError) as raised:
        _examples(row, "qwen3")
    said = str(raised.value)
    assert "message 4 is a tool result (role `tool`), but the assistant turn before it (message 3) has no tool " \
           "calls" in said and "converted to `tool_calls`" in said and "merge" not in said
    row["conversations"][2]["value"] = "Let me check."
    with pytest.raises(DataError, match=r"message 3\) has no tool calls \(`tool_calls`\)\. A tool result") as raised:
        _examples(row, "qwen3")


# ------------------------------------------------------------------------- 6. and 7. system turns
def test_a_blank_system_turn_yields_to_the_datasets_system_prompt_as_a_blank_system_column_does():
    """Found by a bug bash (bb37 #6): OpenHermes' `{"from": "system", "value": ""}` rendered an empty system turn
    while the dataset's system_prompt was left out."""
    spec = DatasetSpec(path="rows.jsonl", format="chat", system_prompt="DS prompt.")
    blank_turn = {"messages": [{"role": "system", "content": ""}, *HELLO]}
    assert _examples(blank_turn, "qwen2.5", spec=spec) == _examples({"messages": HELLO, "system": " "}, "qwen2.5",
                                                                    spec=spec)
    assert "DS prompt." in _text(blank_turn, "qwen2.5", spec=spec)
    own = {"messages": [{"role": "system", "content": "Own prompt."}, *HELLO]}
    assert "DS prompt." not in _text(own, "qwen2.5", spec=spec)  # a system turn with text is the row's own
    pair = {"prompt": [{"role": "system", "content": ""}, HELLO[0]], "chosen": "Teal.", "rejected": "No."}
    chosen, _ = data.render_segments(pair, DatasetSpec(path="p.jsonl", format="preference", system_prompt="DS prompt."),
                                     family_tokenizer("qwen2.5"), None, "p.jsonl line 1")
    assert "DS prompt." in chosen[0][0]


def test_the_developer_role_is_the_system_turn():
    """Found by a bug bash (bb42 #4): OpenAI's and harmony's `developer` turn was refused as an unknown role."""
    developer = {"messages": [{"role": "developer", "content": "Answer in French."}, *HELLO]}
    system = {"messages": [{"role": "system", "content": "Answer in French."}, *HELLO]}
    for family in ("gpt-oss", "qwen3"):
        assert _examples(developer, family) == _examples(system, family)


# ---------------------------------------------------------------------------------------- 8. and 9. tools
@pytest.mark.parametrize("empty", [[], "[]", None, "", " "], ids=["list", "json-text", "null", "empty", "blank"])
def test_a_rows_empty_tools_fall_back_to_the_datasets_tools_as_list_or_as_json_text(empty):
    """Found by a bug bash (bb42 #5): `tools: []` fell back to the dataset's tools while `tools: "[]"` gave none."""
    spec = DatasetSpec(path="rows.jsonl", format="chat", tools=[WEATHER_TOOL])
    text = _text({"messages": HELLO, "tools": empty}, "qwen3", spec=spec)
    assert "get_weather" in text and text == _text({"messages": HELLO}, "qwen3", spec=spec)


def test_flat_tool_definitions_are_wrapped_without_their_own_type():
    """Found by a bug bash (bb42 #6): a Responses API tool ({"type": "function", "name": ...}) was wrapped whole,
    showing `"function": {"type": "function", ...}` in the prompt."""
    flat = {"type": "function", **WEATHER_TOOL["function"]}
    assert normalize_tools([flat], "row") == [WEATHER_TOOL]
    assert _text({**_weather_row({"city": "Paris"}), "tools": [flat]}, "qwen3") == \
        _text(_weather_row({"city": "Paris"}), "qwen3")


def test_the_rendering_modules_are_hashed_into_the_cache_key():
    """The cache key changes with the rendering code (data/cache.py hashes its modules): every module the rendering
    of rows imports from finetune/data is among them, so a change to any misses the old entries."""
    import ast
    from pathlib import Path

    from finetune.data import cache

    folder = Path(cache.__file__).parent
    rendering = {"templates.py", "chat.py", "conversations.py"}
    imported = {f"{node.module.rsplit('.', 1)[-1]}.py" for name in rendering
                for node in ast.walk(ast.parse((folder / name).read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune.data.")}
    assert rendering | imported <= set(cache._RENDERING_CODE)


def test_rows_with_their_own_template_arguments_are_said_with_what_serving_must_pass(tmp_path):
    """Found by a bug bash: a row's chat_template_kwargs left no trace in `finetune data` or the run, and serving
    (and `finetune generate`, which renders with none) must pass the same arguments."""
    from finetune.data import build_examples
    from finetune.data.build import prompt_notes

    rows = [{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}],
             "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Fig."}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": str(path), "format": "chat"}], "max_length": 256, "cache": False, "eval_fraction": 0}})
    _, _, stats = build_examples(recipe, family_tokenizer("qwen3"))
    notes = [note for note in prompt_notes(stats) if "chat_template_kwargs" in note]
    assert len(notes) == 1 and notes[0].startswith("1 row (the first: ") and "enable_thinking" in notes[0], notes
    assert "`finetune generate` and the generation eval render with none" in notes[0]


def test_a_long_conversations_examples_are_tokenized_a_group_at_a_time_to_the_same_tokens(tmp_path, monkeypatch):
    """Found by a bug bash: under Qwen3 an agent trajectory without reasoning is one example per assistant turn, each
    its whole history, and all of a chunk's examples were tokenized and held before the length rule dropped those
    past max_length (8 rows of 40 turns: 8.1 GB in `finetune data`; 1.2 GB now). They are tokenized a group of at
    most CHUNK_CHARS characters at a time; the tokens kept are the same however they are grouped."""
    from finetune.data import tokenize as tokenize_module

    turns = [{"role": "user", "content": "Fix the bug."}]
    for step in range(6):
        turns += [{"role": "assistant", "content": f"Step {step}.", "tool_calls": [
                      {"type": "function", "function": {"name": "run", "arguments": {"cmd": f"ls {step}"}}}]},
                  {"role": "tool", "name": "run", "content": "file " * 40}]
    turns.append({"role": "assistant", "content": "Done."})
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    tokenizer = family_tokenizer("qwen3")
    whole = _tokenized_texts(path, tokenizer)
    assert len(whole) > 3  # one example per turn (the template drops history's think blocks)
    groups, grouped = [], tokenize_module._text_groups
    assert [len(group) for group in grouped([([("a" * 5, False)], "r")] * 5, chars=10)] == [2, 2, 1]
    monkeypatch.setattr(tokenize_module, "_text_groups",
                        lambda flat: groups.append(len(flat)) or [[item] for item in flat])  # one example a group
    assert _tokenized_texts(path, tokenizer) == whole and groups and groups[0] >= len(whole)


def test_dropped_examples_are_not_counted_as_more_rows(tmp_path):
    """Found by a bug bash: a 3-row file of agent trajectories under Qwen3 said "dropped for length: line 1, line 2,
    line 3 (and 24 more)": 27 examples (one per turn), not 27 more rows."""
    from finetune.cli.preview import format_stats
    from finetune.data import prepare

    long = [{"role": "user", "content": "Go."}]
    for step in range(5):
        long += [{"role": "assistant", "content": f"Step {step}: " + "word " * 60}, {"role": "user", "content": "On."}]
    long.append({"role": "assistant", "content": "Done."})
    short = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (short, long)), encoding="utf-8")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": str(path), "format": "chat"}], "max_length": 100, "cache": False, "eval_fraction": 0},
        "train": {"micro_batch_size": 1}})
    prepared = prepare(recipe, family_tokenizer("qwen3"))
    assert prepared.stats.dropped > 1  # several examples of the one long row
    [line] = [line for line in format_stats(prepared, recipe).splitlines() if "dropped for length" in line]
    assert "rows.jsonl line 2 (" in line and "more)" not in line, line
    assert f"({prepared.stats.dropped} examples dropped in all" in line, line
