"""Data errors found by bug bash 38: a data error every rank finds alike is marked so (rank 0 prints it, once: the
launches are in tests/parallel/test_bb38_errors_once.py), a file with no usable rows names its fix, and a missing
file's "Did you mean" never offers another split."""

from __future__ import annotations

import pytest
from conftest import addition_rows, write_jsonl

from finetune import data
from finetune.data import sources
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")


def _recipe(path, **data_keys):
    section = {"datasets": [{"path": str(path), "format": "alpaca"}], "max_length": 16, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"micro_batch_size": 2}})


def _long_rows(n: int) -> list[dict]:
    """Rows whose answer starts past 16 tokens: nothing of them is left to learn within data.max_length 16."""
    return [{"instruction": "Add these numbers, carefully, one digit at a time: " + " + ".join(["1"] * 30),
             "output": "30"} for _ in range(n)]


def test_no_usable_rows_names_the_fix_and_is_alike_on_every_rank(tmp_path, tokenizer):
    """Found by a bug bash: "data.datasets[0] (...long.jsonl): no usable rows (20 read, 0 skipped, 20 dropped as too
    long)." named no fix, unlike every other data error; and under 2 processes every rank printed it (rank 1's
    first), as build_examples' errors were not marked as the same on every rank."""
    path = write_jsonl(tmp_path / "long.jsonl", _long_rows(3))
    with pytest.raises(DataError) as caught:
        data.build_examples(_recipe(path), tokenizer)
    message = str(caught.value)
    assert "no usable rows (3 read, 0 skipped, 3 dropped as too long)" in message, message
    assert "Fix: raise data.max_length (now 16; rows past it: " in message and "long.jsonl line 1" in message, message
    assert "or shorten the rows' prompts" in message, message
    assert caught.value.alike_on_every_rank is True
    with pytest.raises(DataError) as caught:
        data.build_examples(_recipe(path, overlong="drop"), tokenizer)
    assert "or data.overlong: truncate" in str(caught.value), str(caught.value)


def test_a_bad_row_and_too_few_rows_are_alike_on_every_rank(tmp_path, tokenizer):
    """Found by a bug bash: a bad row (found while building the data every rank reads alike) and too few rows for
    the global micro-batch were printed by every rank, `(rank 1) ...` first, under every 2-process launcher."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"\n')
    with pytest.raises(DataError) as caught:
        data.build_examples(_recipe(path), tokenizer)
    assert "line 2" in str(caught.value) and caught.value.alike_on_every_rank is True
    with pytest.raises(DataError, match="only 3 training rows for a global micro-batch of 4") as caught:
        data.check_enough_rows(3, micro_batch_size=2, world_size=2)
    assert caught.value.alike_on_every_rank is True
    with pytest.raises(DataError, match="an epoch holds no step") as caught:
        data.checked_steps_per_epoch(3, micro_batch_size=2, world_size=2, grad_accum=1)
    assert caught.value.alike_on_every_rank is True


def test_a_missing_file_is_never_offered_another_split(tmp_path, monkeypatch):
    """Found by a bug bash: a missing data/train.jsonl was met with "Did you mean data/test.jsonl?": difflib's 0.6
    cutoff was met by the shared `.jsonl` alone (train.jsonl vs test.jsonl 0.67), and following it trains on the test
    split. The stems are compared now, another split or a numbered sibling is never offered, and where nothing is
    near, a folder of a few data files lists them."""
    monkeypatch.chdir(tmp_path)
    for name in ("test.jsonl", "eval.jsonl", "valid.jsonl"):
        write_jsonl(tmp_path / "data" / name, addition_rows(2))
    with pytest.raises(DataError) as caught:
        data.load_rows(DatasetSpec(path="data/train.jsonl"))
    message = str(caught.value)
    assert "Did you mean" not in message and "holds: eval.jsonl, test.jsonl, valid.jsonl." in message, message
    write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows(2))
    with pytest.raises(DataError, match=r"Did you mean \S*data/train.jsonl\?"):
        data.load_rows(DatasetSpec(path="data/trian.jsonl"))  # a typo is still offered its file
    assert sources.nearest_name("sft_train.jsonl", ["sft_eval.jsonl", "sft_valid.jsonl"]) is None
    assert sources.nearest_name("my_big_dataset_train.jsonl", ["my_big_dataset_valid.jsonl"]) is None  # ratio 0.8, a split
    assert sources.nearest_name("part-1.jsonl", ["part-2.jsonl"]) is None  # a numbered sibling: another file on purpose
    assert sources.nearest_name("nonexist.jsonl", ["one.jsonl"]) is None  # (bb38's other case: `.jsonl` alone)
    assert sources.nearest_name("train.jsonl", ["train.json"]) == "train.json"
    assert sources.nearest_name("evl.jsonl", ["eval.jsonl", "test.jsonl"]) == "eval.jsonl"
    # one split spelled two ways is one split (a review: train_data was no longer offered training_data)
    assert sources.nearest_name("train_data.jsonl", ["training_data.jsonl", "test_data.jsonl"]) == "training_data.jsonl"
    assert sources.nearest_name("val.jsonl", ["eval.jsonl", "test.jsonl"]) == "eval.jsonl"


def test_a_streams_data_errors_are_alike_on_every_rank_too(tmp_path, tokenizer):
    """data.streaming's checks of the first rows (data.stream_examples) are made by every rank on the same files, as
    build_examples' are: printed once, by rank 0."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"\n')
    recipe = _recipe(path, streaming=True, eval_fraction=0)
    with pytest.raises(DataError) as caught:
        data.stream_examples(recipe, tokenizer)
    assert "line 2" in str(caught.value) and caught.value.alike_on_every_rank is True


def test_an_error_one_rank_meets_alone_is_not_held_for_rank_0s_paragraph(tmp_path, tokenizer, monkeypatch):
    """Found by a review: every data-build error was marked alike on every rank, so a rank whose hub download failed
    (or whose tokenizing process was killed) alone waited 30 s for a paragraph rank 0 never prints. Such errors say
    so where they are raised; the rows' errors stay alike."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("the hub did not answer")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    import finetune.hub

    monkeypatch.setattr(finetune.hub, "use_cache_only_if_unreachable", lambda: None)
    with pytest.raises(DataError, match="could not be loaded as a `datasets` name") as caught:
        data.build_examples(_recipe("someorg/somedata"), tokenizer)
    assert caught.value.alike_on_every_rank is False
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"\n')
    with pytest.raises(DataError) as caught:
        data.build_examples(_recipe(path), tokenizer)
    assert caught.value.alike_on_every_rank is True
