"""TRL's conversational prompt-completion rows: `{"prompt": [messages], "completion": [messages]}`.

Found by a bug bash (bb19 F3): no format took them. Format completion refused them with "`prompt` is a list, not
text ... write the value as text (its JSON text ...)", advice that would train the model to write JSON, and format
chat said no row had `messages`. TRL 1.16's SFTTrainer renders the prompt's turns then the completion's through the
chat template and trains the completion. Now format chat reads such rows (a row with `prompt` and `completion` and no
`messages`) as TRL does, and a chat row's machinery applies to them: the system prompt, tools, reasoning fields,
`columns:`, the generation prompts of `finetune generate`, GRPO and the generation eval. Format completion refuses
message lists naming format chat, and a file mixing text rows with message rows is refused row by row.

The oracle: TRL 1.16's SFTTrainer._prepare_dataset (test_trained_token_edges.trl_sft), up to the one difference that
docs/data.md names for every chat row: the newline after the end-of-turn token, which the model never generates, is
not trained.
"""

from __future__ import annotations

import re

import pytest
from chat_families import WEATHER_TOOL, family_tokenizer
from conftest import write_jsonl
from test_trained_token_edges import bos_adding_chatml, tokenized, trl_sft

from finetune.cli.tiny import build_tokenizer
from finetune.data import IGNORE_INDEX, check_local_files
from finetune.data.prompts import dataset_prompt_ids
from finetune.data.tokenize import tokenize_chunk
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytest.importorskip("trl")  # the oracle (trl is a dev dependency)

SKY = {"prompt": [{"role": "user", "content": "What color is the sky?"}],
       "completion": [{"role": "assistant", "content": "It is blue."}]}
SUN = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the sun?"}],
       "completion": [{"role": "assistant", "content": "In the sky."}]}
HISTORY = {"prompt": [{"role": "user", "content": "Pick a colour for a calm room."},
                      {"role": "assistant", "content": "Teal.", "reasoning_content": "Calm suggests cool tones."},
                      {"role": "user", "content": "Another one?"}],
           "completion": [{"role": "assistant", "content": "Slate grey.", "reasoning_content": "Grey is quiet."}]}
TOOL_CALL = {"prompt": [{"role": "user", "content": "What is the weather in Paris?"}],
             "completion": [{"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 21}"},
                 {"role": "assistant", "content": "It is 21 C in Paris."}],
             "tools": [WEATHER_TOOL]}


def trained(example, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


def assert_trains_as_trl(ours, theirs: tuple[list[int], list[int]], tokenizer) -> None:
    """The same tokens; the same labels but for TRL's trailing newline after the end-of-turn token."""
    ids, labels = theirs
    assert ours.input_ids == ids
    differ = [i for i, (a, b) in enumerate(zip(ours.labels, labels)) if a != b]
    assert differ == list(range(len(ids) - len(differ), len(ids))) and len(differ) <= 1, differ
    assert all(ours.labels[i] == IGNORE_INDEX for i in differ)
    assert tokenizer.decode([ids[i] for i in differ]).strip() == ""


@pytest.mark.parametrize("case", ["chatml", "chatml_adding_bos", "qwen3_history_reasoning"])
def test_conversational_prompt_completion_rows_train_as_trls_sft_trainer(case):
    """Format chat on TRL's conversational prompt-completion rows: TRL's tokens (no BOS the template does not write),
    the completion trained, the prompt (its system turn, its history with an assistant turn) context."""
    tokenizer, rows = {"chatml": (build_tokenizer(), [SKY, SUN]), "chatml_adding_bos": (bos_adding_chatml(), [SKY]),
                       "qwen3_history_reasoning": (family_tokenizer("qwen3"), [HISTORY])}[case]
    result = tokenized(rows, "chat", tokenizer)
    assert result.fatal is None and len(result.examples) == len(rows), result.reasons
    for ours, theirs, row in zip(result.examples, trl_sft(rows, tokenizer), rows):
        assert_trains_as_trl(ours, theirs, tokenizer)
        assert row["completion"][-1]["content"] in trained(ours, tokenizer)
    assert trained(result.examples[0], tokenizer) == {"chatml": "It is blue.<|im_end|>",
                                                      "chatml_adding_bos": "It is blue.<|im_end|>",
                                                      "qwen3_history_reasoning":
                                                          "<think>\nGrey is quiet.\n</think>\n\nSlate grey.<|im_end|>"}[case]


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_a_prompt_completion_row_trains_as_its_messages_row(family):
    """Mapped columns (prompt, completion, tools), a row's `system`, tool calls and results, reasoning: the row trains
    what the chat row of its messages trains (tool results context), with data.system_prompt heading it alike."""
    tokenizer = family_tokenizer(family)
    row = {**TOOL_CALL, "completion": [*TOOL_CALL["completion"][:2],
                                       {**TOOL_CALL["completion"][2], "reasoning_content": "The tool said 21."}]}
    mapped = {"question": row["prompt"], "answer": row["completion"], "functions": row["tools"], "system": "Be kind."}
    as_messages = {"messages": row["prompt"] + row["completion"], "tools": row["tools"], "system": "Be kind."}
    columns = {"prompt": "question", "completion": "answer", "tools": "functions"}
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": "rows.jsonl", "format": "chat", "columns": columns}], "max_length": 4096}})
    ours = tokenize_chunk([mapped], ["line 1"], [], recipe.data.datasets[0], recipe, tokenizer)
    theirs = tokenized([as_messages], "chat", tokenizer, max_length=4096)
    assert ours.fatal is None and ours.reasons == [], ours.reasons
    assert [(e.input_ids, e.labels) for e in ours.examples] == [(e.input_ids, e.labels) for e in theirs.examples]
    text = "".join(trained(e, tokenizer) for e in ours.examples)
    assert "get_weather" in text and "It is 21 C in Paris." in text and "temp_c" not in text
    assert "Be kind." in tokenizer.decode(ours.examples[0].input_ids)
    (plain,) = tokenized([SKY], "chat", tokenizer, system_prompt="You are terse.").examples
    (chat,) = tokenized([{"messages": SKY["prompt"] + SKY["completion"]}], "chat", tokenizer,
                        system_prompt="You are terse.").examples
    assert (plain.input_ids, plain.labels) == (chat.input_ids, chat.labels)
    assert "You are terse." in tokenizer.decode(plain.input_ids)


def test_generation_prompts_of_such_rows_are_the_trained_context():
    """`finetune generate`, the generation eval and GRPO (format: prompt on the same file) give the model the context
    its completion was trained in."""
    from finetune.cli.generate import prompt_style, render
    from finetune.training.evals import prompt_and_reference

    tokenizer = build_tokenizer()
    (example,) = tokenized([SUN], "chat", tokenizer).examples
    context = example.input_ids[: next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)]
    recipe = validate_recipe({"model": {"name_or_path": "unused"},
                              "data": {"datasets": [{"path": "rows.jsonl", "format": "chat"}]}})
    assert render(tokenizer, SUN["prompt"], style=prompt_style(recipe, tokenizer)) == context
    assert prompt_and_reference(example, tokenizer) == (context, "In the sky.")
    grpo = DatasetSpec(path="rows.jsonl", format="prompt")
    assert dataset_prompt_ids(SUN["prompt"], grpo, tokenizer, None, row=SUN) == context


def test_format_completion_refuses_message_lists_and_a_mixed_file_is_refused_row_by_row():
    """Format completion names format chat (not "write it as JSON text"); under format chat a text row names format
    completion; with bad_rows: skip each kind keeps its own rows. A list that is not messages keeps its refusal."""
    tokenizer = build_tokenizer()
    text_row = {"prompt": "Q: 2+2?\nA:", "completion": " 4"}
    mixed = [text_row, SKY]
    result = tokenized(mixed, "completion", tokenizer)
    assert re.search(r"line 2: `prompt` is a list of chat messages: a conversational prompt-completion row \(TRL's "
                     r"form\).*set the dataset's format: chat.*split it into two datasets", result.fatal), result.fatal
    assert "JSON text" not in result.fatal
    result = tokenized(mixed, "chat", tokenizer)
    assert re.search(r"line 1: `prompt` is text, not chat messages.*A text prompt-completion row is format "
                     r"completion's.*split the file", result.fatal), result.fatal
    for fmt, kept in (("chat", "It is blue.<|im_end|>"), ("completion", " 4<|im_end|>")):
        result = tokenized(mixed, fmt, tokenizer, bad_rows="skip")
        assert [trained(e, tokenizer) for e in result.examples] == [kept] and result.counts["skipped"] == 1
    listed = tokenized([{"prompt": ["a", "b"], "completion": "ab"}], "completion", tokenizer).fatal
    assert "`prompt` is a list, not text" in listed and "JSON text" in listed
    empty = tokenized([{**SKY, "completion": []}], "chat", tokenizer).fatal
    assert "`completion` is missing or empty" in empty
    no_answer = tokenized([{**SKY, "completion": [{"role": "user", "content": "Hm?"}]}], "chat", tokenizer).fatal
    assert "message 2 has role `user`" in no_answer


def test_the_first_lines_check_and_columns_take_them(tmp_path):
    """`finetune validate` / `data` / `train` read the file's first lines before the tokenizer loads: format chat's
    check took only `messages` / `conversations`, and `columns: {prompt: ..., completion: ...}` was no field of chat."""
    rows = write_jsonl(tmp_path / "pc.jsonl", [SKY, SUN])
    mapped = write_jsonl(tmp_path / "mapped.jsonl", [{"question": SKY["prompt"], "answer": SKY["completion"]}])
    for path, columns in ((rows, {}), (mapped, {"prompt": "question", "completion": "answer"})):
        check_local_files(validate_recipe({"model": {"name_or_path": "unused"}, "data": {
            "datasets": [{"path": str(path), "format": "chat", "columns": columns}]}}))
    with pytest.raises(DataError, match=r"no row has the `messages` field that format `chat` needs"):
        check_local_files(validate_recipe({"model": {"name_or_path": "unused"}, "data": {
            "datasets": [{"path": str(mapped), "format": "chat"}]}}))
