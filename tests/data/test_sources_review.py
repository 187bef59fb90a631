"""How local data files are read (finetune/data/sources.py), cached and streamed alike: a file edited in place is read
anew, CSV values train as written, a folder reads every data file, and read errors name the file, the line and the
cause. Found by a bug bash; each test failed before its fix."""

from __future__ import annotations

import json
import os

import pytest
from conftest import addition_rows, write_jsonl

from finetune import data
from finetune.data import IGNORE_INDEX
from finetune.data.sources import check_local_files
from finetune.data.streaming import dataset_rows
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """finetune's token cache and `datasets`' own cache (where a local file's table was kept by path and mtime)."""
    import datasets

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def make_recipe(*datasets: dict, **data_keys):
    section = {"datasets": list(datasets), "max_length": 128, "eval_fraction": 0, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"micro_batch_size": 4}})


def trained_answers(path, tokenizer) -> list[str]:
    train, _, _ = data.build_examples(make_recipe({"path": str(path)}), tokenizer)
    return [tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX],
                             skip_special_tokens=True) for example in train]


def streamed(path, **spec) -> list:
    return [item for _, item, _ in dataset_rows(DatasetSpec(path=str(path), **spec))]


def rewrite_keeping_mtime(path, write) -> None:
    """Rewrite a file and give it back its modification time (a restored backup, `cp -p`, two writes in a second)."""
    stat = path.stat()
    write()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# --------------------------------------------------------------------------------- 1. a file edited in place
def test_a_csv_edited_in_place_with_its_mtime_kept_trains_on_the_new_rows(tmp_path, tokenizer):
    path = tmp_path / "colours.csv"
    path.write_text("instruction,output\nSay a colour.,red\n")
    assert trained_answers(path, tokenizer) == ["red"]
    rewrite_keeping_mtime(path, lambda: path.write_text("instruction,output\nSay a colour.,teal\n"))
    assert trained_answers(path, tokenizer) == ["teal"]  # was `red`, stored in the token cache under teal's hash


def test_parquet_and_a_folder_edited_in_place_are_read_anew(tmp_path):
    import datasets

    parquet = tmp_path / "colours.parquet"
    datasets.Dataset.from_list([{"instruction": "Say a colour.", "output": "red"}]).to_parquet(str(parquet))
    folder = tmp_path / "folder"
    write_jsonl(folder / "a.jsonl", [{"instruction": "Say a colour.", "output": "red"}])
    assert [row["output"] for row in data.load_rows(DatasetSpec(path=str(parquet)))] == ["red"]
    assert [row["output"] for row in data.load_rows(DatasetSpec(path=str(folder)))] == ["red"]
    rewrite_keeping_mtime(parquet, lambda: datasets.Dataset.from_list(
        [{"instruction": "Say a colour.", "output": "tan"}]).to_parquet(str(parquet)))
    rewrite_keeping_mtime(folder / "a.jsonl", lambda: write_jsonl(folder / "a.jsonl",
                                                                  [{"instruction": "Say a colour.", "output": "tan"}]))
    assert [row["output"] for row in data.load_rows(DatasetSpec(path=str(parquet)))] == ["tan"]
    assert [row["output"] for row in data.load_rows(DatasetSpec(path=str(folder)))] == ["tan"]


# -------------------------------------------------------------------------------- 2. CSV values as written
CODES = ("instruction,input,output\n"
         "Give the agent code.,,007\n"
         "Give the zip code.,,02134\n"
         "Give the phone.,,+4915112345678\n"
         "Give the price.,,1.50\n"
         "Give the count.,,7\n"
         "Give the answer.,NA,None\n"
         "Give the other answer.,n/a,null\n"
         "Give the last answer.,,NA\n"
         "Give the empty answer.,x,\n")
WRITTEN = ["007", "02134", "+4915112345678", "1.50", "7", "None", "null", "NA", None]


def test_csv_values_are_the_text_written_cached_and_streamed(tmp_path, tokenizer):
    """No type inference (leading zeros, a plus sign, 1.50, an int column made float by an empty cell) and no
    missing-value words: every value is the text in the file, an empty cell missing (None), as pandas read it."""
    path = tmp_path / "codes.csv"
    path.write_text(CODES)
    rows = data.load_rows(DatasetSpec(path=str(path)))
    assert [row["output"] for row in rows] == WRITTEN
    assert [row["input"] for row in rows] == [None, None, None, None, None, "NA", "n/a", None, "x"]
    assert streamed(path) == rows
    with pytest.raises(DataError, match=r"codes\.csv row 9: missing or empty `output`"):  # the empty cell: missing
        trained_answers(path, tokenizer)
    path.write_text(CODES.rsplit("Give the empty", 1)[0])
    assert trained_answers(path, tokenizer) == WRITTEN[:-1]


def test_a_csv_whose_column_looks_numeric_for_a_whole_block_then_text_reads(tmp_path):
    """11,000 numbers then text: `datasets` typed the column from its first block and failed on the next block."""
    path = tmp_path / "chunky.csv"
    path.write_text("instruction,output\n" + "".join(f"q{i},{i}\n" for i in range(11000)) + "q,eleven thousand\n")
    rows = data.load_rows(DatasetSpec(path=str(path)))
    assert len(rows) == 11001 and rows[0]["output"] == "0" and rows[-1]["output"] == "eleven thousand"
    assert [item["output"] for item in streamed(path)][-2:] == ["10999", "eleven thousand"]


# -------------------------------------------------------------------------- 3. a folder reads every data file
@pytest.mark.parametrize("names", [("train", "batch2", "batch3"), ("questions", "more", "hard_test_cases")])
def test_a_folder_reads_every_data_file_cached_and_streamed(tmp_path, names):
    """`datasets`' split guessing read train.jsonl alone (10 rows of 30, exit 0), and refused the second folder
    (`Unknown split "train". Should be one of ['test']`): hard_test_cases.jsonl was split `test`."""
    folder = tmp_path / "folder"
    for number, name in enumerate(names):
        write_jsonl(folder / f"{name}.jsonl", addition_rows(10, seed=number))
    expected = [row for name in sorted(names) for row in addition_rows(10, seed=names.index(name))]
    assert data.load_rows(DatasetSpec(path=str(folder))) == expected
    assert [json.loads(item) for item in streamed(folder)] == expected
    assert [json.loads(item) for item in streamed(folder)[12:]] == expected[12:]
    assert [json.loads(item) for _, item, _ in dataset_rows(DatasetSpec(path=str(folder)), start=25)] == expected[25:]


def test_a_folder_whose_names_give_splits_leaves_no_file_out_silently(tmp_path):
    folder = tmp_path / "download"
    write_jsonl(folder / "data" / "train-00000-of-00001.jsonl", addition_rows(6))
    write_jsonl(folder / "data" / "test-00000-of-00001.jsonl", addition_rows(2))
    assert len(data.load_rows(DatasetSpec(path=str(folder)))) == 6  # a hub download: the split chosen
    assert len(data.load_rows(DatasetSpec(path=str(folder), split="test"))) == 2
    write_jsonl(folder / "data" / "extra.jsonl", addition_rows(3))
    for read in (data.load_rows, streamed):
        with pytest.raises(DataError, match=r"would leave out the data files named after none: data/extra\.jsonl"):
            read(DatasetSpec(path=str(folder)) if read is data.load_rows else folder)


def test_a_folder_mixing_csv_parquet_and_json_lines_reads_them_all_in_order(tmp_path):
    import datasets

    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.csv").write_text("instruction,output\nq,007\n")
    datasets.Dataset.from_list([{"instruction": "p", "output": "pq"}]).to_parquet(str(folder / "b.parquet"))
    write_jsonl(folder / "sub" / "c.jsonl", [{"instruction": "j", "output": "js"}])
    (folder / "README.md").write_text("not data")
    (folder / ".cache").mkdir()
    write_jsonl(folder / ".cache" / "d.jsonl", [{"instruction": "hidden", "output": "no"}])
    assert [row["output"] for row in data.load_rows(DatasetSpec(path=str(folder)))] == ["007", "pq", "js"]
    assert [place for _, _, place in dataset_rows(DatasetSpec(path=str(folder)))] == ["a.csv row 1", "b.parquet row 1",
                                                                                      "sub/c.jsonl line 1"]


def test_a_row_error_in_a_folder_names_the_file_and_its_line(tmp_path, tokenizer):
    folder = tmp_path / "fold"
    write_jsonl(folder / "a.jsonl", addition_rows(12))
    rows = addition_rows(12)
    rows[10] = {"instruction": "no answer"}
    write_jsonl(folder / "b.jsonl", rows)
    with pytest.raises(DataError, match=r"fold b\.jsonl line 11: missing or empty `output`"):
        data.build_examples(make_recipe({"path": str(folder)}), tokenizer)


# ------------------------------------------------------------------------- 4. read errors say the cause
def test_a_read_error_shows_the_underlying_cause(tmp_path, monkeypatch):
    import datasets

    def wrapped(*args, **kwargs):
        try:
            raise ValueError("while reading shard 3:\nCould not convert 'abc' with type str: tried to convert to int64")
        except ValueError as exc:
            raise RuntimeError("An error occurred while generating the dataset") from exc

    monkeypatch.setattr(datasets, "load_dataset", wrapped)
    with pytest.raises(DataError, match=r"generating the dataset: Could not convert 'abc'"):
        data.load_rows(DatasetSpec(path="org/name"))
    bad = tmp_path / "bad.csv"
    bad.write_text("instruction,output\nq,a\nr,b,c\n")
    with pytest.raises(DataError, match=r"bad\.csv: cannot read it as CSV \(.*Expected 2 columns, got 3: r,b,c\)"):
        data.load_rows(DatasetSpec(path=str(bad)))


# ---------------------------------------------------------------------------------------- 5. messages
def test_a_cut_off_json_line_names_its_own_column(tmp_path, tokenizer):
    lines = [json.dumps(row) for row in addition_rows(30)]
    lines[2] = lines[24] = '{"instruction": "broken", "output": '
    path = tmp_path / "trunc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    recipe = make_recipe({"path": str(path)})
    with pytest.raises(DataError, match=r"line 3 is not valid JSON \(Expecting value at column 37\)"):
        check_local_files(recipe)  # was column 1: the line was parsed with its newline
    lines[2] = json.dumps(addition_rows(1)[0])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 25 is not valid JSON \(Expecting value at column 37\)"):
        data.build_examples(recipe, tokenizer)  # past the first lines checked: the tokenizing path


def test_a_json_file_holding_an_object_says_it_must_hold_a_list(tmp_path):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": addition_rows(2)}, indent=1))
    for read in (data.load_rows, streamed):
        with pytest.raises(DataError, match=r"must hold a list of rows .*got an object \(keys: data\).*jq -c '\.data\[\]'"):
            read(DatasetSpec(path=str(path)) if read is data.load_rows else path)
    path.write_text(json.dumps(addition_rows(2), indent=2))  # a pretty-printed array still reads
    assert data.load_rows(DatasetSpec(path=str(path))) == addition_rows(2)


def test_a_json_file_holding_an_object_on_one_line_is_refused_as_the_pretty_printed_one(tmp_path):
    """What `json.dump({"data": rows}, f)` writes was read as one JSON Lines row, then refused for lacking the format's
    columns with a `columns: {instruction: data}` fix that cannot work."""
    path = tmp_path / "dumped.json"
    path.write_text(json.dumps({"data": addition_rows(2)}))
    for read in (data.load_rows, streamed):
        with pytest.raises(DataError, match=r"must hold a list of rows .*got an object \(keys: data\).*jq -c '\.data\[\]'"):
            read(DatasetSpec(path=str(path)) if read is data.load_rows else path)
    path.write_text("".join(json.dumps(row) + "\n" for row in addition_rows(2)))  # JSON Lines in a .json file
    assert data.load_rows(DatasetSpec(path=str(path))) == addition_rows(2)
    path.write_text(json.dumps(addition_rows(1)[0]))  # one row of JSON Lines, no list in it
    assert data.load_rows(DatasetSpec(path=str(path))) == addition_rows(1)
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat))  # a .jsonl file's one object is a row
    assert data.load_rows(DatasetSpec(path=str(tmp_path / "chat.jsonl"))) == [chat]


def test_a_json_file_of_json_lines_with_bytes_that_are_not_utf8_names_the_line(tmp_path):
    """Looking at a .json file's first lines (array, object or JSON Lines?) decoded a whole block of it: a Latin-1
    byte on line 2 was a UnicodeDecodeError traceback, not the line and the fix."""
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "d"}\n')
    with pytest.raises(DataError, match=r"latin1\.json line 2: not UTF-8 text \(byte 0xe9 at column 21\)"):
        data.load_rows(DatasetSpec(path=str(path)))


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.json", "bom.csv"])
def test_a_utf8_byte_order_mark_is_not_part_of_line_1(tmp_path, name):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}]
    text = ("".join(json.dumps(row) + "\n" for row in rows) if name == "bom.jsonl" else json.dumps(rows)
            if name == "bom.json" else "instruction,output\na,b\nc,d\n")
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    check_local_files(make_recipe({"path": str(path)}))
    assert data.load_rows(DatasetSpec(path=str(path))) == rows
    assert [json.loads(item) if isinstance(item, str) else item for item in streamed(path)] == rows
