"""A folder of .txt documents read a row per paragraph or per file (data.datasets[].sample_by), and what `finetune
data` says of truncation, split rows and blank lines; found by a bug bash (bb34), each reproduced on the code before:
a .txt folder could only be read a row per line (every line trained as a document ending with EOS, no line break
ever trained), and `finetune data` said `2 truncated` of rows whose cut removed 98% of the corpus, or, of a stream,
nothing of the rows its preview skipped or cut."""

from __future__ import annotations

import argparse

import pytest
from conftest import write_jsonl, write_recipe

from finetune import data
from finetune.recipe import validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

WORDS = "the cat sat on the mat and looked at the rain falling on the old stone wall "


def text_folder(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("First paragraph.\nStill it.\n\n\nSecond paragraph.\n")
    (folder / "b.txt").write_text("Doc two, one paragraph.\r\n")
    return folder


def text_recipe(folder, sample_by: str | None, **data_keys):
    spec = {"path": str(folder), "format": "text", **({"sample_by": sample_by} if sample_by else {})}
    return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 2, "max_steps": 2},
                            "data": {"datasets": [spec], "max_length": 64, "eval_fraction": 0.0, **data_keys}})


@pytest.mark.parametrize(("sample_by", "texts"), [
    (None, ["First paragraph.", "Still it.", "Second paragraph.", "Doc two, one paragraph."]),
    ("paragraph", ["First paragraph.\nStill it.", "Second paragraph.", "Doc two, one paragraph."]),
    ("document", ["First paragraph.\nStill it.\n\n\nSecond paragraph.\n", "Doc two, one paragraph.\n"]),
])
def test_a_txt_folder_is_read_a_row_per_line_paragraph_or_document_cached_and_streamed(tmp_path, tokenizer,
                                                                                       sample_by, texts):
    folder = text_folder(tmp_path)
    prepared = data.prepare(text_recipe(folder, sample_by), tokenizer)
    eos = tokenizer.eos_token
    assert [tokenizer.decode(example.input_ids) for example in prepared.examples] == [text + eos for text in texts]
    assert prepared.stats.rows == len(texts)
    rows, _, _ = data.stream_examples(text_recipe(folder, sample_by, streaming=True), tokenizer)
    streamed = [example.input_ids for example, _ in rows.pass_examples(0, 0, 0)]
    assert streamed == [example.input_ids for example in prepared.examples]


def preview(tmp_path, model, datasets: list[dict], capsys, **data_keys) -> str:
    from finetune.cli.preview import cli_data

    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name_or_path": str(model)}, "data": {
        "datasets": datasets, "max_length": 64, "eval_fraction": 0.0, **data_keys}})
    assert cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=1)) == 0
    return capsys.readouterr().out


def test_finetune_data_says_the_tokens_cut_the_rows_split_and_the_blank_lines(tmp_path, tiny_llama, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": (WORDS * n).strip()} for n in (1, 12, 40, 1)])
    out = preview(tmp_path, tiny_llama, [{"path": str(path), "format": "text"}], capsys)
    assert "rows: 4 read, 0 skipped, 2 truncated, 0 dropped" in out
    assert "\nwarning: truncation cut " in out and "Fix: data.overlong: split" in out
    out = preview(tmp_path, tiny_llama, [{"path": str(path), "format": "text"}], capsys, overlong="split")
    assert "\nsplit: the 2 rows longer than max_length 64 cut into " in out and "warning" not in out
    out = preview(tmp_path, tiny_llama, [{"path": str(text_folder(tmp_path)), "format": "text"}], capsys)
    assert "\nblank lines: 2 blank lines of .txt files left out (no rows)" in out


def test_finetune_data_of_a_stream_says_the_counts_of_the_rows_it_read(tmp_path, tiny_llama, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": (WORDS * n).strip()} for n in (1, 12, 40, 1)] + [{"text": ""}])
    out = preview(tmp_path, tiny_llama, [{"path": str(path), "format": "text"}], capsys, streaming=True,
                  bad_rows="skip")
    assert "\nrows read for this preview (the stream's first, not its totals): 5 rows, 1 skipped, 2 truncated: " in out
    assert "\nwarning: truncation cut " in out and "\nskipped: " in out and "docs.jsonl line 5: " in out


def test_load_rows_leaves_a_txt_files_blank_lines_out(tmp_path):
    """`finetune validate` without a local tokenizer checks load_rows' rows: a blank line was a row of empty text,
    refused as `missing text` though training leaves it out."""
    folder = text_folder(tmp_path)
    assert data.load_rows(text_recipe(folder, None).data.datasets[0]) == [
        {"text": "First paragraph."}, {"text": "Still it."}, {"text": "Second paragraph."},
        {"text": "Doc two, one paragraph."}]
