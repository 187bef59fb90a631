"""Continued pretraining on raw text (format: text), found by a bug bash (bb34), each reproduced on the code before:
long documents kept only their first max_length tokens and the run said "2 truncated", never that 98% of the corpus
was cut (and nothing could keep it: data.overlong: split); a folder of .txt files stopped at every blank line (a
paragraph break: "missing text"); a text row of one token (`<|im_end|>` alone) has no target and was kept, training
steps of loss 0; and a stream (data.streaming) never said what it skipped, truncated or dropped."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import RUN_PY, child_env, recipe_dict, write_jsonl, write_recipe

from finetune import data
from finetune.cli.tiny import build_tokenizer
from finetune.data import IGNORE_INDEX, build, collate, readers
from finetune.data.build import data_line
from finetune.data.tokenize import tokenize_chunk
from finetune.errors import DataError, RecipeError
from finetune.recipe import validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

WORDS = "the cat sat on the mat and looked at the rain falling on the old stone wall "


def text_recipe(datasets: list[dict], **data_keys):
    section = {"datasets": datasets, "max_length": 64, "eval_fraction": 0.0, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section,
                            "train": {"micro_batch_size": 2, "max_steps": 3}})


def documents(tmp_path, words: list[int]):
    """A JSON Lines file of text rows of WORDS repeated `words[i]` times (51 tokens each: 1 fits max_length 64, 2 and
    more are cut): its path."""
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": (WORDS * n).strip()} for n in words])


def chunk(rows: list[dict], tokenizer, **data_keys):
    """tokenize_chunk of `rows` (format text), as the cache builder and a stream run it."""
    recipe = text_recipe([{"path": "rows.jsonl", "format": "text"}], **data_keys)
    return tokenize_chunk(rows, [f"line {i + 1}" for i in range(len(rows))], [], recipe.data.datasets[0], recipe,
                          tokenizer)


def bos_tokenizer():
    """The tiny tokenizer with a BOS put first by its post-processor (Llama 3's way)."""
    from tokenizers import processors

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<|im_start|>"})
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_token_id)])
    assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id  # the premise
    return tokenizer


# ------------------------------------------------------------------------------------------ truncation's count
def test_the_data_line_says_how_many_tokens_truncation_cut_and_warns_when_that_is_much(tmp_path, tokenizer):
    """Found by a bug bash (bb34 F1): the data line said `2 truncated` when truncation had cut 98% of the corpus."""
    path = documents(tmp_path, [1, 12, 40, 1])
    whole = data.prepare(text_recipe([{"path": str(path), "format": "text"}], max_length=4096), tokenizer)
    lengths = [len(example.input_ids) for example in whole.examples]
    cut = sum(length - 64 for length in lengths if length > 64)
    _, _, stats = data.build_examples(text_recipe([{"path": str(path), "format": "text"}]), tokenizer)
    line = data_line(stats, text_recipe([{"path": str(path), "format": "text"}]))
    assert f"2 truncated: {cut:,} of {sum(lengths):,} tokens ({cut / sum(lengths):.0%}) cut, 0 dropped" in line, line
    assert "[finetune] warning: truncation cut" in line and "Fix: data.overlong: split" in line
    small = documents(tmp_path, [2, 2, 2, 2])  # 102 tokens, 6 past max_length 96 each: a small share, no warning
    _, _, stats = data.build_examples(text_recipe([{"path": str(small), "format": "text"}], max_length=96), tokenizer)
    line = data_line(stats, text_recipe([{"path": str(small), "format": "text"}], max_length=96))
    assert "4 truncated: 24 of 408 tokens (6%) cut" in line and "warning" not in line, line


# ------------------------------------------------------------------------------------------------ overlong: split
def test_overlong_split_cuts_a_long_text_row_into_pieces_and_loses_no_token(tokenizer):
    """Found by a bug bash (bb34 F1): a long document could only be truncated (its tail never trained) or dropped."""
    whole = chunk([{"text": (WORDS * 20).strip()}], tokenizer, max_length=4096).examples[0]
    result = chunk([{"text": (WORDS * 20).strip()}, {"text": "short"}], tokenizer, overlong="split")
    *pieces, short = result.examples
    assert [token for piece in pieces for token in piece.input_ids] == whole.input_ids  # consecutive, every token
    assert all(len(piece.input_ids) <= 64 for piece in pieces) and len(pieces) == -(-len(whole.input_ids) // 64)
    assert all(piece.labels == piece.input_ids for piece in pieces)  # text: every token labelled (the first: no target)
    assert short.input_ids == chunk([{"text": "short"}], tokenizer).examples[0].input_ids
    assert (result.counts["split_rows"], result.counts["split_pieces"], result.counts["truncated"]) == (1, len(pieces), 0)
    assert result.origins == ["line 1"] * len(pieces) + ["line 2"]
    # a last piece of one token has nothing to predict: left out
    one_over = chunk([{"text": (WORDS * 20).strip()}], tokenizer, overlong="split", max_length=len(whole.input_ids) - 1)
    assert [len(piece.input_ids) for piece in one_over.examples] == [len(whole.input_ids) - 1]


def test_split_pieces_after_the_first_get_no_bos():
    """A BOS marks a document's start: the pieces that continue a document get none (as run_clm's blocks)."""
    tokenizer = bos_tokenizer()
    text = (WORDS * 20).strip()
    pieces = chunk([{"text": text}], tokenizer, overlong="split").examples
    bos = tokenizer.bos_token_id
    assert len(pieces) > 2 and pieces[0].input_ids[0] == bos and pieces[0].labels[0] == IGNORE_INDEX
    assert not any(bos in piece.input_ids for piece in pieces[1:])
    assert [token for piece in pieces for token in piece.input_ids] == [bos, *tokenizer(text)["input_ids"][1:],
                                                                         tokenizer.eos_token_id]


def test_overlong_split_is_refused_for_formats_other_than_text():
    with pytest.raises(RecipeError) as caught:
        validate_recipe({"model": {"name_or_path": "unused"}, "data": {
            "overlong": "split", "datasets": [{"path": "a.jsonl", "format": "text"}, {"path": "b.jsonl"}],
            "eval_datasets": [{"path": "c.jsonl", "format": "chat"}]}})
    text = str(caught.value)
    assert "only format `text` rows allow" in text and "data.datasets[1] (format alpaca)" in text
    assert "data.eval_datasets[0] (format chat)" in text and "data.datasets[0]" not in text


def test_split_examples_are_what_epochs_count_and_the_cache_keys_on_overlong_and_sample_by(tmp_path, tokenizer):
    path = documents(tmp_path, [1, 12, 40, 1])
    spec = {"path": str(path), "format": "text"}
    split = text_recipe([spec], overlong="split")
    train, _, stats = data.build_examples(split, tokenizer)
    pieces = chunk([json.loads(line) for line in path.read_text().splitlines()], tokenizer, overlong="split")
    assert (stats.rows, stats.train_examples, len(train)) == (4, len(pieces.examples), len(pieces.examples))
    assert data.steps_per_epoch(len(train), micro_batch_size=2, world_size=1, grad_accum=1) == len(train) // 2
    line = data_line(stats, split)
    assert f"0 truncated, 2 split into {len(pieces.examples) - 2} pieces of <= max_length, 0 dropped" in line, line
    _, _, cached = data.build_examples(split, tokenizer)
    assert cached.cached_datasets == 1 and data_line(cached, split) == line  # a cached run says the same
    truncate = text_recipe([spec])
    source = data.open_source(truncate.data.datasets[0])
    keys = {data.cache_key(recipe.data.datasets[0], source, recipe, tokenizer)
            for recipe in (truncate, split, text_recipe([{**spec, "sample_by": "paragraph"}]))}
    assert len(keys) == 3


def test_a_streamed_split_row_resumes_inside_the_row(tmp_path, tokenizer):
    """The pieces of a row are its examples: a checkpoint between two of them resumes at the next (Position.part)."""
    path = documents(tmp_path, [1, 12, 2])
    recipe = text_recipe([{"path": str(path), "format": "text"}], overlong="split", streaming=True)
    cached = recipe.model_copy(deep=True)
    cached.data.streaming = False
    expected = list(data.prepare(cached, tokenizer).examples) * 2
    parts = []
    for consumed in range(1, len(expected) // 2 + 2):
        rows, _, _ = data.stream_examples(recipe, tokenizer)
        stream = data.batch_stream(rows, micro_batch_size=1, rank=0, world_size=1, seed=0, pad_id=0)
        batches = iter(stream)
        for _ in range(consumed):
            next(batches)
        state = json.loads(json.dumps(stream.state_dict()))
        parts.append(state["part"])
        rows, _, _ = data.stream_examples(recipe, tokenizer)
        resumed = data.batch_stream(rows, micro_batch_size=1, rank=0, world_size=1, seed=0, pad_id=0)
        resumed.load_state_dict(state)
        batch = next(iter(resumed))
        assert batch["input_ids"].tolist() == collate([expected[consumed]], 0)["input_ids"].tolist()
    assert max(parts) > 1  # positions inside the long row


# ------------------------------------------------------------------------------------------------ .txt files
def test_txt_reader_reads_a_row_per_line_paragraph_or_document(tmp_path):
    """Found by a bug bash (bb34 F2): a .txt file was read a row per line only, its blank lines rows of no text."""
    path = tmp_path / "a.txt"
    path.write_text("One.\nStill one.\n\n  \nTwo.\r\n\nThree.")

    def read(sample_by, skip=0):
        return [(dict(row), place, type(row) is readers.BlankLine) for row, place, _ in
                readers.text_rows(path, "a.txt ", skip, sample_by=sample_by)]

    assert read(None) == [({"text": "One."}, "a.txt line 1", False), ({"text": "Still one."}, "a.txt line 2", False),
                          ({"text": ""}, "a.txt line 3", True), ({"text": ""}, "a.txt line 4", True),
                          ({"text": "Two."}, "a.txt line 5", False), ({"text": ""}, "a.txt line 6", True),
                          ({"text": "Three."}, "a.txt line 7", False)]
    assert read("paragraph") == [({"text": "One.\nStill one."}, "a.txt lines 1-2", False),
                                 ({"text": "Two."}, "a.txt line 5", False), ({"text": "Three."}, "a.txt line 7", False)]
    assert read("paragraph", skip=2) == [({"text": "Three."}, "a.txt line 7", False)]  # a resume skips paragraphs
    assert read("document") == [({"text": "One.\nStill one.\n\n  \nTwo.\n\nThree."}, "a.txt lines 1-7", False)]
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert list(readers.text_rows(tmp_path / "blank.txt", "", 0, sample_by="document")) == []


def test_blank_lines_of_a_txt_folder_are_left_out_and_counted_under_bad_rows_error(tmp_path, tokenizer):
    """Found by a bug bash (bb34 F2): a paragraph break (a blank line) stopped the run as a row with "missing text"."""
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("First paragraph.\nStill it.\n\nSecond paragraph.\n")
    (folder / "b.txt").write_text("Doc two.\n   \n")
    recipe = text_recipe([{"path": str(folder), "format": "text"}])
    assert recipe.data.bad_rows == "error"
    train, _, stats = data.build_examples(recipe, tokenizer)
    assert (stats.rows, stats.skipped, len(train)) == (4, 0, 4)
    assert "4 rows (2 blank .txt lines left out), 0 skipped" in data_line(stats, recipe)
    rows, _, _ = data.stream_examples(text_recipe([{"path": str(folder), "format": "text"}], streaming=True), tokenizer)
    assert len(list(rows.pass_examples(0, 0, 0))) == 4 and rows.counts["blank_lines"] == 2


def test_sample_by_on_a_source_without_txt_files_is_refused(tmp_path, tokenizer):
    path = documents(tmp_path, [1, 1])
    with pytest.raises(DataError, match=r"sample_by: document says how a \.txt file is cut into rows.*not a folder"):
        data.build_examples(text_recipe([{"path": str(path), "format": "text", "sample_by": "document"}]), tokenizer)
    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "rows.jsonl", [{"text": "a row"}])
    (mixed / "notes.txt").write_text("notes\n")
    with pytest.raises(DataError, match="a folder whose data files are not .txt"):
        data.stream_examples(text_recipe([{"path": str(mixed), "format": "text", "sample_by": "paragraph"}],
                                         streaming=True), tokenizer)


# ------------------------------------------------------------------------------------------------ one token
def test_a_text_row_of_one_token_has_no_target_and_bad_rows_decides(tokenizer):
    """Found by a bug bash (bb34 F3): `{"text": "<|im_end|>"}` (one token, which nothing predicts) was kept under
    bad_rows: error, and a batch of such rows trained steps of loss 0.0000."""
    alone = [{"text": tokenizer.eos_token}]
    refused = chunk(alone, tokenizer)
    assert refused.examples == [] and "line 1: no trained token" in refused.fatal
    skipped = chunk(alone, tokenizer, bad_rows="skip")
    assert (skipped.examples, skipped.counts["skipped"], skipped.fatal) == ([], 1, None)
    (word,) = chunk([{"text": "a"}], tokenizer).examples  # `a` and its EOS: one target
    assert word.num_trained == 1
    (after_bos,) = chunk(alone, bos_tokenizer()).examples  # BOS, EOS: the EOS is a target
    assert after_bos.num_trained == 1


# ------------------------------------------------------------------------------------------------ streaming
def stream_of(recipe, tokenizer, micro_batch_size: int = 1):
    rows, _, _ = data.stream_examples(recipe, tokenizer)
    return data.batch_stream(rows, micro_batch_size=micro_batch_size, rank=0, world_size=1, seed=0, pad_id=0)


def passes_said(output: str, state: str = "") -> list[str]:
    """The run's lines about a pass's counts (`state`: done, so far; "": both)."""
    return [line for line in output.splitlines() if f"over the stream {state}" in line]


def test_a_stream_says_its_counts_when_a_pass_ends_and_at_the_last_step(tmp_path, tokenizer, capsys):
    """Found by a bug bash (bb34 F4): a stream counted skipped, truncated and dropped rows and never said them."""
    path = documents(tmp_path, [1, 12, 1, 40, 1])
    with open(path, "a") as handle:
        handle.write('{"text": ""}\n')  # skipped (bad_rows: skip)
    spec = {"path": str(path), "format": "text"}
    cached = data.prepare(text_recipe([spec], bad_rows="skip"), tokenizer)
    expected = build.row_counts(build.stats_counts(cached.stats))
    assert "2 truncated: " in expected and "1 skipped" in expected
    stream = stream_of(text_recipe([spec], bad_rows="skip", streaming=True), tokenizer)
    batches = iter(stream)
    capsys.readouterr()
    for _ in range(3):  # max_steps 3: the last step's rows said as they are taken
        next(batches)
    assert passes_said(capsys.readouterr().out) == [f"[finetune] data: pass 1 over the stream so far: {expected}"]
    for _ in range(3):  # into the second pass
        next(batches)
    said = passes_said(capsys.readouterr().out)
    assert said == [f"[finetune] data: pass 1 over the stream done: {expected}"]
    assert stream.state_dict()["counts"]["epoch"] == 1


def test_a_resumed_pass_counts_each_row_once(tmp_path, tokenizer, capsys, monkeypatch):
    """Rows are read a chunk ahead of the position: a checkpoint keeps the counts with the row they reach, and the
    resume counts only the rows past it, so the pass's counts are the uninterrupted pass's."""
    from finetune.data import streaming

    monkeypatch.setattr(streaming, "STREAM_CHUNK_ROWS", 3)
    path = documents(tmp_path, [1, 12, 1, 40, 1, 2, 30, 1, 1, 2])
    recipe = text_recipe([{"path": str(path), "format": "text"}], streaming=True)
    uninterrupted = iter(stream_of(recipe, tokenizer))
    capsys.readouterr()
    for _ in range(11):
        next(uninterrupted)
    (done,) = passes_said(capsys.readouterr().out, "done")
    assert "10 rows, 0 skipped, 5 truncated: " in done
    for consumed in (1, 2, 4, 7, 9, 10):
        stream = stream_of(recipe, tokenizer)
        batches = iter(stream)
        for _ in range(consumed):
            next(batches)
        state = json.loads(json.dumps(stream.state_dict()))
        resumed = stream_of(recipe, tokenizer)
        resumed.load_state_dict({**state, "step": 100})
        capsys.readouterr()
        batches = iter(resumed)
        for _ in range(11 - consumed):
            next(batches)
        assert passes_said(capsys.readouterr().out, "done") == [done], consumed


@pytest.mark.slow
def test_a_streaming_run_says_what_it_skipped_and_cut_and_keeps_it_in_its_checkpoint(tmp_path, tiny_llama):
    import subprocess

    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("First paragraph of doc one.\nStill paragraph one.\n\nSecond paragraph.\n")
    (folder / "b.txt").write_text(f"{WORDS * 3}\n\n{WORDS}\n")
    values = recipe_dict(tiny_llama, folder, tmp_path / "out",
                         data={"datasets": [{"path": str(folder), "format": "text"}], "streaming": True,
                               "max_length": 10, "eval_fraction": 0.0},
                         train={"max_steps": 4, "micro_batch_size": 2})
    recipe = write_recipe(tmp_path / "recipe.yaml", values)
    done = subprocess.run([sys.executable, str(RUN_PY), str(recipe)], env=child_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = passes_said(done.stdout)
    assert said[0].startswith("[finetune] data: pass 1 over the stream done: 5 rows (2 blank .txt lines left out), "
                              "0 skipped, "), said
    assert " truncated: " in said[0] and said[0].endswith(" cut, 0 dropped"), said
    assert said[-1].startswith("[finetune] data: pass 2 over the stream so far: "), said
    assert "[finetune] warning: truncation cut" in done.stdout
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    kept = state["data"]["counts"]
    assert kept["epoch"] == 1 and kept["counts"]["rows"] == 5 and kept["counts"]["blank_lines"] == 2
