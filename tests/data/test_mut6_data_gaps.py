"""Mutation testing round 6 (bb72): gaps in finetune/data/folders.py. The oracle is `datasets.load_dataset` on the same
local folder, which read these folders before finetune's own readers did."""

from __future__ import annotations

import json

import pytest

from finetune import data
from finetune.recipe import DatasetSpec


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """finetune's token cache and `datasets`' own cache, so that nothing read here comes from a cache."""
    import datasets

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def jsonl(path, tag: str, count: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"instruction": f"{tag}-{i}", "output": "x"}) + "\n" for i in range(count)))


def rows(path, **spec) -> list:
    return data.load_rows(DatasetSpec(path=str(path), **spec))


def oracle(folder, tmp_path, **options) -> list:
    import datasets

    return datasets.load_dataset(str(folder), split="train", cache_dir=str(tmp_path / "oracle"), **options).to_list()


def test_a_readme_with_one_config_reads_it_whatever_its_name(tmp_path):
    """A card with one config (not named `default`, no `default: true`) is that dataset's only reading: `datasets`
    reads it without a subset; a reader that wanted a default mark refused the folder."""
    folder = tmp_path / "one"
    jsonl(folder / "main" / "train.jsonl", "main")
    jsonl(folder / "other.jsonl", "stray")  # not in the config: never read
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                      "    path: main/*.jsonl\n---\n# One config\n")
    expected = oracle(folder, tmp_path)
    assert [row["instruction"] for row in expected] == ["main-0", "main-1"]
    assert rows(folder) == expected


def test_overlapping_data_files_patterns_read_each_file_once(tmp_path):
    """A config whose patterns match one file twice (`data/*.jsonl` and `data/a-*.jsonl`) reads it once: folders.py
    keeps each file once (`datasets` 4/5 reads it twice, trains its rows twice; this pins finetune's choice). The
    oracle is the files' own lines."""
    folder = tmp_path / "overlap"
    jsonl(folder / "data" / "a-0.jsonl", "a")
    jsonl(folder / "data" / "b-0.jsonl", "b")
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path:\n    - data/*.jsonl\n    - data/a-*.jsonl\n---\n")
    lines = [json.loads(line) for name in ("a-0", "b-0") for line in (folder / "data" / f"{name}.jsonl").read_text().splitlines()]
    assert sorted(row["instruction"] for row in rows(folder)) == sorted(row["instruction"] for row in lines)


def test_folders_named_with_two_underscores_are_not_data(tmp_path):
    """A zip unpacked on a Mac leaves __MACOSX/ beside the data (and Python leaves __pycache__/): `datasets` skips
    folders whose names start with `__`, and so must finetune, or their copies of the rows train twice."""
    folder = tmp_path / "unzipped"
    jsonl(folder / "train.jsonl", "q")
    jsonl(folder / "__MACOSX" / "train.jsonl", "copy")
    expected = oracle(folder, tmp_path)
    assert [row["instruction"] for row in expected] == ["q-0", "q-1"]
    assert rows(folder) == expected
