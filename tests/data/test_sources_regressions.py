"""Regressions of finetune's own readers of local data (finetune/data/sources.py, readers.py, csv_files.py,
folders.py) against `datasets.load_dataset`, which read these before: a hub README's `configs:`, a download's
metadata files, short CSV rows and duplicate headers, empty CSV cells, folders of .txt and .arrow files. Each test
failed on the readers as first written (commit 0fbebe7)."""

from __future__ import annotations

import pytest
from conftest import write_jsonl

from finetune import data, rewards
from finetune.data.sources import check_local_files
from finetune.data.streaming import dataset_rows
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """finetune's token cache and `datasets`' own cache, so that nothing read here comes from a cache."""
    import datasets

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def rows(path, **spec) -> list:
    return data.load_rows(DatasetSpec(path=str(path), **spec))


def streamed(path, **spec) -> list:
    return [item for _, item, _ in dataset_rows(DatasetSpec(path=str(path), **spec))]


def parquet(path, tag: str, count: int = 2) -> None:
    import pyarrow.parquet

    path.parent.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
        [{"instruction": f"{tag}-{i}", "output": "x"} for i in range(count)]), path)


def card(folder, configs: str) -> None:
    (folder / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# A dataset\n")


# ------------------------------------------------------------------------------ 1. a hub README's configs
def gsm8k_like(folder):
    """gsm8k's layout: main/ and socratic/, each with a train and a test file, no default config."""
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            parquet(folder / config / f"{split}-00000-of-00001.parquet", f"{config}-{split}")
    card(folder, "".join(f"- config_name: {config}\n  data_files:\n" + "".join(
        f"  - split: {split}\n    path: {config}/{split}-*\n" for split in ("train", "test"))
        for config in ("main", "socratic")))
    return folder


def test_a_readme_config_and_split_pick_the_files_as_datasets_did(tmp_path):
    folder = gsm8k_like(tmp_path / "gsm")
    assert {row["instruction"].rsplit("-", 1)[0] for row in rows(folder, subset="main")} == {"main-train"}
    assert [row["instruction"] for row in rows(folder, subset="socratic", split="test")] == ["socratic-test-0",
                                                                                           "socratic-test-1"]
    assert streamed(folder, subset="socratic", split="test") == rows(folder, subset="socratic", split="test")
    # the whole folder was read as one (all four files), and `subset` was refused
    with pytest.raises(DataError, match=r"lists the configs main, socratic and marks none as the default\. Set "
                                        r"data\.datasets\[\]\.subset"):
        rows(folder)
    with pytest.raises(DataError, match=r"subset `nope` not found: its README\.md lists the configs main, socratic"):
        rows(folder, subset="nope")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 1},
                              "data": {"datasets": [{"path": str(folder), "subset": "main"}], "eval_fraction": 0}})
    check_local_files(recipe)  # the pre-flight check resolves the config too


def test_a_readme_config_with_named_splits_reads_only_the_split_asked(tmp_path):
    """ultrafeedback_binarized: one default config whose splits are train_prefs, test_prefs, train_sft, ..."""
    folder = tmp_path / "ufb"
    splits = ("train_prefs", "test_prefs", "train_sft", "test_sft")
    for split in splits:
        parquet(folder / "data" / f"{split}.parquet", split)
    card(folder, "- config_name: default\n  data_files:\n" + "".join(
        f"  - split: {split}\n    path: data/{split}.parquet\n" for split in splits))
    assert {row["instruction"].rsplit("-", 1)[0] for row in rows(folder, split="train_prefs")} == {"train_prefs"}
    with pytest.raises(DataError, match=r"config `default` of its README\.md has no split `train` \(its splits: "
                                        r"train_prefs, test_prefs, train_sft, test_sft\)"):
        rows(folder)


def test_a_readme_config_glob_reads_only_its_files(tmp_path):
    folder = tmp_path / "cfg"
    write_jsonl(folder / "stuff" / "part1.jsonl", [{"instruction": "a", "output": "1"}])
    write_jsonl(folder / "stuff" / "part2.jsonl", [{"instruction": "b", "output": "2"}])
    write_jsonl(folder / "other" / "ignore.jsonl", [{"zzz": 1}])
    card(folder, "- config_name: default\n  data_files:\n  - split: train\n    path: stuff/*.jsonl\n"
                 "- config_name: other\n  data_dir: other\n"
                 "- config_name: tabs\n  sep: \"\\t\"\n  data_files: stuff/*.jsonl\n")
    assert rows(folder) == [{"instruction": "a", "output": "1"}, {"instruction": "b", "output": "2"}]
    assert [place for _, _, place in dataset_rows(DatasetSpec(path=str(folder)))] == ["stuff/part1.jsonl line 1",
                                                                                     "stuff/part2.jsonl line 1"]
    assert rows(folder, subset="other") == [{"zzz": 1}]  # a data_dir: that folder's files
    with pytest.raises(DataError, match=r"config `tabs` of its README\.md sets `sep`, which finetune's readers do "
                                        r"not apply"):
        rows(folder, subset="tabs")


def test_a_downloads_metadata_files_are_not_rows(tmp_path):
    """dataset_infos.json was read as a data file (a JSON object: refused), and dataset_info.json alone made the
    folder a save_to_disk one (load_from_disk failed). A README without `configs:` changes nothing."""
    folder = tmp_path / "meta"
    write_jsonl(folder / "train.jsonl", [{"instruction": "q", "output": "a"}])
    (folder / "dataset_infos.json").write_text('{"default": {"x": 1}}')
    (folder / "dataset_info.json").write_text('{"description": ""}')
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# Rows\n")
    assert rows(folder) == [{"instruction": "q", "output": "a"}]
    assert streamed(folder) == ['{"instruction": "q", "output": "a"}']


# ------------------------------------------------------------------------------------ 2. CSV rows and header
def test_a_csv_row_shorter_than_the_header_reads_with_its_last_cells_missing(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("instruction,input,output\nq1,,a1\nq2,x\n q3 ,y,a3\n")
    expected = [{"instruction": "q1", "input": None, "output": "a1"},
                {"instruction": "q2", "input": "x", "output": None},
                {"instruction": " q3 ", "input": "y", "output": "a3"}]
    assert rows(path) == expected
    assert streamed(path) == expected
    assert [item for _, item, _ in dataset_rows(DatasetSpec(path=str(path)), start=2)] == expected[2:]  # a resume


def test_a_short_row_after_arrows_first_block_continues_where_arrow_stopped(tmp_path):
    """Arrow gives the rows of its first blocks before it meets the short row: they are neither lost nor repeated."""
    path = tmp_path / "long.csv"
    count = 40_000  # ~1.3 MB: more than one of Arrow's 1 MB blocks
    path.write_text("instruction,output\n" + "".join(f"question {i:06d},answer {i:06d}\n" for i in range(count))
                    + "last question\n")
    read = rows(path)
    assert len(read) == count + 1 and read[-1] == {"instruction": "last question", "output": None}
    assert [row["instruction"] for row in read[:count]] == [f"question {i:06d}" for i in range(count)]
    resumed = list(dataset_rows(DatasetSpec(path=str(path)), start=count - 1))
    assert [(number, place) for number, _, place in resumed] == [(count - 1, f"row {count}"), (count, f"row {count + 1}")]


def test_a_csv_row_longer_than_the_header_and_a_duplicate_column_are_refused_by_line(tmp_path):
    long = tmp_path / "extra.csv"
    long.write_text("instruction,input,output\nq1,,a1\nq2,,a2,zzz\n")
    with pytest.raises(DataError, match=r"extra\.csv: cannot read it as CSV \(line 3: Expected 3 columns, got 4: "
                                        r"q2,,a2,zzz\)\. Line 3 has more cells .* Fix: quote"):
        rows(long)
    duplicate = tmp_path / "dup.csv"
    duplicate.write_text("instruction,input,output,output\nq1,,a1,b1\n")
    with pytest.raises(DataError, match=r"dup\.csv line 1: the header names column `output` twice \(columns 3 and "
                                        r"4\).* Fix: give each column its own name"):
        rows(duplicate)


# ------------------------------------------------------------------------------------ 3. an empty CSV cell
def test_an_empty_csv_cell_is_missing_not_the_empty_string(tmp_path):
    """A GRPO reward function gets the row's other columns: an empty `answer` read as "" scored every completion 1.0
    (`"" in text`); missing, the row has no reward, as with `datasets`. Other cells stay the text written."""
    path = tmp_path / "grpo.csv"
    path.write_text('prompt,answer\nWhat is 2+2?,4\nWrite a poem,\nSay nothing.,""\nCode?,007\nWhich?,NA\n')
    read = rows(path, format="prompt")
    answers = [row["answer"] for row in read]
    assert answers == ["4", None, None, "007", "NA"]
    assert streamed(path, format="prompt") == read
    assert rewards.contains_answer(None, ["5", "roses are red", "", "007", "NA"], answer=answers) == [
        0.0, None, None, 1.0, 1.0]


# ------------------------------------------------------------------------------ 4. folders of .txt and .arrow
def test_a_folder_of_text_files_reads_a_row_per_line(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("hello\r\n\nworld\n")
    (folder / "b.txt").write_text("again")
    # as datasets' text builder, but a blank line is no row (bb34: it was one of empty text, refused as `missing text`)
    assert rows(folder, format="text") == [{"text": "hello"}, {"text": "world"}, {"text": "again"}]
    assert [place for _, _, place in dataset_rows(DatasetSpec(path=str(folder), format="text"))] == [
        "a.txt line 1", "a.txt line 2", "a.txt line 3", "b.txt line 1"]
    write_jsonl(folder / "rows.jsonl", [{"text": "from json"}])  # beside other data files, a .txt is notes
    assert rows(folder, format="text") == [{"text": "from json"}]


def test_a_folder_of_arrow_files_reads_their_rows(tmp_path):
    import pyarrow.ipc

    folder = tmp_path / "arrow"
    folder.mkdir()
    table = pyarrow.Table.from_pylist([{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)])
    with pyarrow.ipc.new_stream(folder / "data-00000.arrow", table.schema) as writer:  # as datasets writes them
        writer.write_table(table)
    with pyarrow.ipc.new_file(folder / "data-00001.arrow", table.schema) as writer:
        writer.write_table(table.slice(0, 1))
    expected = table.to_pylist() + table.to_pylist()[:1]
    assert rows(folder) == expected
    assert streamed(folder) == expected
    assert [item for _, item, _ in dataset_rows(DatasetSpec(path=str(folder)), start=2)] == expected[2:]


# ---------------------------------------------------------------------- 5. TSV files, compressed files alone
def test_a_tsv_file_reads_as_datasets_read_it_and_a_tab_in_a_value_is_named(tmp_path):
    """`.tsv` was refused as a file and left out of folders; `datasets` reads it as CSV with tabs (its oracle here)."""
    import datasets

    path = tmp_path / "qa.tsv"
    path.write_text('instruction\tinput\toutput\nq1, with a comma\tx\ta1\n"q2\ttabbed"\ty\ta2\n')
    expected = datasets.load_dataset("csv", data_files=str(path), sep="\t", split="train",
                                     cache_dir=str(tmp_path / "oracle")).to_list()
    assert expected == [{"instruction": "q1, with a comma", "input": "x", "output": "a1"},
                        {"instruction": "q2\ttabbed", "input": "y", "output": "a2"}]
    assert rows(path) == expected
    assert streamed(path) == expected
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part.tsv").write_bytes(path.read_bytes())
    assert rows(folder) == expected
    long = tmp_path / "extra.tsv"
    long.write_text("instruction\toutput\nq1\ta1\nq2\ta2\tz\n")
    with pytest.raises(DataError, match=r"extra\.tsv: cannot read it as TSV \(line 3: Expected 2 columns, got 3: "
                                        r"q2\\ta2\\tz\)\. .*a tab in a value that is not quoted"):
        rows(long)


def test_a_compressed_data_file_given_alone_reads_and_a_missing_one_is_not_a_hub_name(tmp_path):
    """`train.jsonl.gz` read inside a folder but was refused alone (`unsupported file type .gz`), and a missing one was
    looked up on the hub."""
    import gzip

    plain = tmp_path / "train.jsonl"
    write_jsonl(plain, [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)])
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert rows(packed) == rows(plain) and streamed(packed) == streamed(plain)
    check_local_files(validate_recipe({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": str(packed)}]}}))
    missing = validate_recipe({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "data/gone.jsonl.gz"}]}})
    with pytest.raises(DataError, match=r"data\.datasets\[0\] path `data/gone\.jsonl\.gz`: file not found"):
        check_local_files(missing)
    text = tmp_path / "lines.txt"
    text.write_text("hello\n")
    with pytest.raises(DataError, match=r"unsupported file type `\.txt`.* A \.txt file is read as rows inside a folder "
                                        r"of them: point the path at its folder"):
        rows(text)  # (it said only "use .jsonl, ..." while docs/data.md reads .txt in folders)
    notes = tmp_path / "notes.md.gz"
    notes.write_bytes(gzip.compress(b"hello"))
    with pytest.raises(DataError, match=r"unsupported file type `\.gz`; use \.jsonl, \.json, \.csv, \.tsv or \.parquet"):
        rows(notes)
