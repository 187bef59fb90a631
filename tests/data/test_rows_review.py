"""How single rows are checked and rendered (the review of data rows): a `columns:` mapping to a column the data
lacks, values that are not text, half a character, and what row errors say (with data.bad_rows: skip too)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import write_jsonl

from finetune import data
from finetune.data.tokenize import parse_lines
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

CHAT = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
        for i in range(4)]
ALPACA = [{"instruction": f"Add {i} and {i}.", "context": f"{i} {i}", "output": str(2 * i)} for i in range(4)]


def make_recipe(*datasets: dict, **data_keys):
    section = {"datasets": list(datasets), "max_length": 128, "eval_fraction": 0, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"micro_batch_size": 4}})


def trained_and_context(example, tokenizer) -> tuple[str, str]:
    trained = [t for t, label in zip(example.input_ids, example.labels) if label != -100]
    return tokenizer.decode(trained), tokenizer.decode(example.input_ids)


# ------------------------------------------------------------------------------ columns: a mapping the data lacks
@pytest.mark.parametrize("rows, spec, message", [
    (ALPACA, {"format": "alpaca", "columns": {"input": "ctx"}},
     r"maps `input` to `ctx`, but no row has that column \(the first 4 rows' columns: context, instruction, output\)"),
    (ALPACA, {"format": "alpaca", "columns": {"system": "sys_prompt"}}, r"maps `system` to `sys_prompt`, but no row"),
    (CHAT, {"format": "chat", "columns": {"tools": "functions"}},
     r"maps `tools` to `functions`, but no row has that column \(the first 4 rows' columns: messages\)"),
    (CHAT, {"format": "chat", "columns": {"content": "txt"}},
     r"maps `content` to `txt`, but no message has that key \(the first 4 rows' message keys: content, role\)"),
], ids=["alpaca-input", "alpaca-system", "chat-tools", "chat-content"])
def test_mapping_to_a_missing_column_stops_the_run(tmp_path, tokenizer, rows, spec, message):
    """An optional field mapped to a column no row has was ignored: the rows trained without their context."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"rows\.jsonl: data\.datasets\[\]\.columns " + message + r".*Fix: map"):
        data.build_examples(make_recipe({"path": str(path), **spec}, bad_rows="skip"), tokenizer)  # no skip fixes it


def test_mapping_to_a_present_optional_column_renders_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "rows.jsonl", ALPACA)
    examples, _, _ = data.build_examples(make_recipe({"path": str(path), "columns": {"input": "context"}}), tokenizer)
    assert "### Input:\n0 0" in trained_and_context(examples[0], tokenizer)[1]


def test_mapping_to_a_missing_parquet_column_stops_the_run(tmp_path, tokenizer):
    """Parquet rows carry every column of the file, so the check reads the file's columns."""
    import datasets

    path = tmp_path / "qa.parquet"
    datasets.Dataset.from_list([{"q": "Say hi", "a": "hi"}] * 3).to_parquet(str(path))
    spec = {"path": str(path), "columns": {"instruction": "q", "output": "a", "system": "sys_prompt"}}
    with pytest.raises(DataError, match=r"qa\.parquet: .*maps `system` to `sys_prompt`, but no row has that column "
                                        r"\(the first 3 rows' columns: a, q\)"):
        data.build_examples(make_recipe(spec), tokenizer)


# ------------------------------------------------------------------------------------------ values that are not text
MIXED = [
    {"instruction": "List two colours.", "output": ["red", "blue"]},
    {"instruction": "Give a JSON object.", "output": {"name": "x", "ok": True}},
    {"instruction": "Is it true?", "output": True},
    {"instruction": 5, "output": 72},
    {"instruction": "Nothing here.", "output": "   "},
    {"instruction": "Input list.", "input": ["a", "b"], "output": "ab"},
    {"instruction": "Half.", "output": 2.5},
]


def test_non_text_values_are_row_errors(tmp_path, tokenizer):
    """Lists, objects and true/false were trained as Python's repr; a blank answer was trained as whitespace."""
    path = write_jsonl(tmp_path / "mixed.jsonl", MIXED)
    with pytest.raises(DataError, match=r"mixed\.jsonl line 1: `output` is a list, not text.*\['red', 'blue'\].*"
                                        r'its JSON text, "\[\\"red\\", \\"blue\\"\]".*or set data\.bad_rows: skip'):
        data.build_examples(make_recipe({"path": str(path)}), tokenizer)
    examples, _, stats = data.build_examples(make_recipe({"path": str(path)}, bad_rows="skip"), tokenizer)
    assert (stats.rows, stats.skipped) == (7, 5)
    reasons = "\n".join(stats.skipped_reasons)
    for expected in (r"line 2: `output` is an object, not text", r"line 3: `output` is true \(a JSON boolean\)",
                     r"line 5: missing or empty `output` \(absent, null or only whitespace\)",
                     r"line 6: `input` is a list, not text"):
        assert re.search(expected, reasons), expected
    # numbers are taken as their JSON text: a CSV or Parquet column of numbers loads as numbers
    assert trained_and_context(examples[0], tokenizer) == ("72<|im_end|>", "### Instruction:\n5\n\n### Response:\n72<|im_end|>")
    assert trained_and_context(examples[1], tokenizer)[0] == "2.5<|im_end|>"


@pytest.mark.parametrize("fmt, row, message", [
    ("completion", {"prompt": "Extract:", "completion": {"name": "x", "n": None}}, r"`completion` is an object"),
    ("completion", {"prompt": ["a", "b"], "completion": "ab"}, r"`prompt` is a list"),
    ("text", {"text": False}, r"`text` is false \(a JSON boolean\)"),
    ("alpaca", {"instruction": "x", "output": "y", "system": {"role": "system"}}, r"`system` is an object"),
    ("chat", {"messages": [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": True}]},
     r"message 2 .*true|message 2 .*bool"),
    ("alpaca", {"instruction": "x", "output": float("nan")}, r"missing or empty `output`"),
], ids=["completion-object", "prompt-list", "text-false", "system-object", "chat-content-true", "output-nan"])
def test_non_text_fields_of_every_format(tokenizer, fmt, row, message):
    with pytest.raises(DataError, match=r"f\.jsonl line 3: .*" + message):
        data.render_segments(row, DatasetSpec(path="f.jsonl", format=fmt), tokenizer, None, "f.jsonl line 3")


# ------------------------------------------------------------------------------------------- half a character
def write_lines(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # ensure_ascii: "\ud83d" stays an escape
    return path


@pytest.mark.parametrize("fmt, bad, where", [
    ("chat", {"messages": [{"role": "user", "content": "great day \ud83d"}, {"role": "assistant", "content": "ok"}]},
     r"`messages\[0\]\.content` holds a lone surrogate \('great day \\ud83d'"),
    ("alpaca", {"instruction": "x", "output": "bad \ud800 here"}, r"`output` holds a lone surrogate"),
], ids=["chat", "alpaca"])
@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streaming"])
def test_lone_surrogate_is_a_row_error(tmp_path, tokenizer, fmt, bad, where, streaming):
    """A lone surrogate crashed the Rust tokenizer with a TypeError naming no row, even under bad_rows: skip."""
    good = CHAT if fmt == "chat" else [{"instruction": r["instruction"], "output": r["output"]} for r in ALPACA]
    path = write_lines(tmp_path / "surr.jsonl", [good[0], bad, *good[1:]])
    assert "\\ud8" in path.read_text()
    build = data.stream_examples if streaming else data.build_examples
    with pytest.raises(DataError, match=r"surr\.jsonl line 2: " + where + r".*bad_rows: skip"):
        build(make_recipe({"path": str(path), "format": fmt}, streaming=streaming), tokenizer)
    recipe = make_recipe({"path": str(path), "format": fmt}, bad_rows="skip", streaming=streaming)
    if streaming:
        rows, _, _ = data.stream_examples(recipe, tokenizer)
        batch = next(iter(data.batch_stream(rows, micro_batch_size=4, rank=0, world_size=1, seed=0,
                                            pad_id=tokenizer.pad_token_id)))
        assert batch["input_ids"].shape[0] == 4
        assert rows.counts["skipped"] == 1
    else:
        _, _, stats = data.build_examples(recipe, tokenizer)
        assert (stats.rows, stats.skipped, stats.train_examples) == (len(good) + 1, 1, len(good))


# --------------------------------------------------------------------------------------------- what errors say
def test_cut_off_json_line_names_its_column():
    """The line was parsed with its newline, so a line cut short reported column 1 (of the line after it)."""
    broken = '{"instruction": "broken", "output": \n'
    _, _, reasons = parse_lines([broken], ["line 3"], "t.jsonl", bad_rows="error")
    assert f"(Expecting value at column {len(broken)})" in reasons[0] and "bad_rows: skip" in reasons[0]
    _, _, reasons = parse_lines([broken.replace("\n", "\r\n")], ["line 3"], "t.jsonl", bad_rows="skip")
    assert reasons == [f"t.jsonl: line 3 is not valid JSON (Expecting value at column {len(broken)}). Fix or delete that line."]


SKIPPED = [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "chat", "has role `user`"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}, "chat", "empty assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "b"}]}, "chat",
     "content parts of type image"),
    ({"instruction": "x"}, "alpaca", "missing or empty `output`"),
    ({"instruction": "x", "output": [1]}, "alpaca", "`output` is a list"),
]


@pytest.mark.parametrize("row, fmt, reason", SKIPPED, ids=["order", "empty-turn", "image", "missing", "list"])
def test_skipped_rows_do_not_advise_skipping(tmp_path, tokenizer, row, fmt, reason):
    """Under bad_rows: skip, the reasons kept said to `set data.bad_rows: skip`, which is set."""
    good = CHAT if fmt == "chat" else [{"instruction": "x", "output": "y"}] * 3
    path = write_jsonl(tmp_path / "rows.jsonl", [*good, row])
    with pytest.raises(DataError, match=reason + r".*set data\.bad_rows: skip"):
        data.build_examples(make_recipe({"path": str(path), "format": fmt}), tokenizer)
    _, _, stats = data.build_examples(make_recipe({"path": str(path), "format": fmt}, bad_rows="skip"), tokenizer)
    (kept,) = stats.skipped_reasons
    assert reason in kept and "bad_rows" not in kept and kept.endswith("."), kept


def test_row_has_lists_null_fields_as_null(tokenizer):
    """A folder of files loads as one table: a row's absent field is null, and was listed as a field the row has."""
    row = {"instruction": "x", "output": None, "input": "y"}
    with pytest.raises(DataError, match=r"missing or empty `output` .*\(row has: input, instruction, output: null\)"):
        data.check_row(row, DatasetSpec(path="fold", format="alpaca"), "fold row 11")


def test_validate_without_a_local_tokenizer_checks_the_mapped_columns(tiny_llama, tmp_path, capsys):
    """validate reads the rows without tokenizing them when the tokenizer is not local; a mapping to a column no row
    has passed there."""
    from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

    from finetune.cli import main

    rows = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = recipe_dict(tiny_llama, rows, tmp_path / "out")
    recipe["model"]["tokenizer"] = "some-org/a-hub-tokenizer"
    recipe["data"]["datasets"][0]["columns"] = {"input": "context"}
    assert main(["validate", str(write_recipe(tmp_path / "r.yaml", recipe))]) == 2
    assert "maps `input` to `context`, but no row has that column" in capsys.readouterr().err


def test_kto_labels_in_a_csv_are_read_as_true_and_false(tmp_path, tokenizer):
    """CSV cells are read as their text now (so 007 stays 007): a KTO label column of True/False was refused for
    every row, and KTO could not train from a CSV at all (found in a review); another word stays an error."""
    path = tmp_path / "kto.csv"
    path.write_text("prompt,completion,label\nSay hi.,Hello!,True\nSay hi.,Go away.,false\nSay hi.,Hm.,maybe\n")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"objective": "kto", "micro_batch_size": 2},
                              "data": {"datasets": [{"path": str(path), "format": "unpaired_preference"}],
                                       "max_length": 128, "eval_fraction": 0, "bad_rows": "skip"}})
    train, _, stats = data.build_examples(recipe, tokenizer)
    assert [example.desirable for example in train] == [True, False] and stats.skipped == 1
    assert "got 'maybe'" in stats.skipped_reasons[0]


def test_a_mapped_column_that_first_appears_after_the_sampled_rows_is_a_warning(tmp_path, tokenizer, capsys):
    """The check saw the first 1,000 rows and refused a column only later rows have, saying no row had it (found in
    a review): a sample that is not the whole data warns; the rows that have the column render it."""
    rows = [{"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(1200)]
    rows += [{"instruction": "Add 1 and 1.", "sys": "Answer in words.", "output": "two"}]
    path = write_jsonl(tmp_path / "sparse.jsonl", rows)
    train, _, _ = data.build_examples(make_recipe({"path": str(path), "format": "alpaca",
                                                   "columns": {"system": "sys"}}), tokenizer)
    said = capsys.readouterr().out
    assert "maps `system` to `sys`, and none of the first 1000 rows has that column" in said, said
    assert "Answer in words." in tokenizer.decode(train[len(train) - 1].input_ids)
