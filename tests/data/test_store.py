"""The tokenized store: built once by several processes at once, memory-mapped, and read through views that give the
same rows as the list path (the packing of lists is the oracle of the packed view)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, addition_rows, child_env, write_jsonl

from finetune import data
from finetune.cli.tiny import build_tokenizer
from finetune.data import pack_examples
from finetune.recipe import validate_recipe

PREPARE = """
import hashlib, json, sys
from finetune import data
from finetune.cli.tiny import build_tokenizer
from finetune.recipe import validate_recipe
recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 4},
                          "data": {"datasets": [{"path": sys.argv[1]}], "max_length": 128, "packing": True}})
prepared = data.prepare(recipe, build_tokenizer())
digest = hashlib.sha256(json.dumps([(e.input_ids, e.labels, e.position_ids) for e in prepared.train]).encode())
print(json.dumps({"built": prepared.stats.cached_datasets == 0, "rows": len(prepared.train),
                  "digest": digest.hexdigest(), "mapped": type(prepared.train.base.stores[0].ids).__name__}))
"""


@pytest.mark.slow
def test_two_processes_started_together_tokenize_once_and_map_the_same_rows(tmp_path):
    """Two processes (as two ranks of a node) want the same dataset at once: one builds it while the other waits on
    the lock, then both map the same files and pack the same rows."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(3000))  # three chunks: long enough to overlap
    env = child_env(FINETUNE_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE, str(path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["built"] for r in results) == [False, True], results  # tokenized once
    assert results[0]["digest"] == results[1]["digest"] and results[0]["rows"] > 100
    assert {r["mapped"] for r in results} == {"memmap"}
    assert len([p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]) == 1


def test_views_give_the_rows_of_the_list_path(tmp_path):
    """The packed view's rows are those pack_examples makes from the same examples as lists; the views hold arrays."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(300))
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 4},
                              "data": {"datasets": [{"path": str(path)}, {"path": str(path), "weight": 0.5}],
                                       "max_length": 96, "packing": True}})
    prepared = data.prepare(recipe, build_tokenizer())
    listed = [prepared.train.base[i] for i in range(len(prepared.train.base))]
    expected = pack_examples(listed, 96)
    got = [prepared.train[i] for i in range(len(prepared.train))]
    assert [(e.input_ids, e.labels, e.position_ids) for e in got] == \
        [(e.input_ids, e.labels, e.position_ids) for e in expected]
    held_out = prepared.stats.eval_examples
    assert len(prepared.train.base) == prepared.stats.train_examples < len(prepared.examples) - held_out  # half of one
    assert isinstance(prepared.train.members, np.ndarray) and isinstance(prepared.train.base.picks, np.ndarray)
    assert prepared.stats.batch_efficiency == data.batch_efficiency(expected, micro_batch_size=4, seed=42)


def test_a_hub_dataset_is_cached_by_its_datasets_fingerprint(tmp_path, monkeypatch):
    """A `datasets` name (no local bytes to hash) is keyed by the fingerprint `datasets` gives the loaded split: the
    same revision is a hit, other files a miss. The hub is stood in for by `load_dataset("json", ...)` of a local file
    (the tests have no network); the key code path is the hub's."""
    import datasets

    from finetune.data import sources

    path = write_jsonl(tmp_path / "hub" / "train.jsonl", addition_rows(40))
    monkeypatch.setattr(sources, "_load_hub", lambda spec: datasets.load_dataset(
        "json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf")))
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 4},
                              "data": {"datasets": [{"path": "someone/addition", "format": "alpaca"}]}})
    tokenizer = build_tokenizer()
    first = data.prepare(recipe, tokenizer)
    second = data.prepare(recipe, tokenizer)
    assert (first.stats.cached_datasets, second.stats.cached_datasets) == (0, 1)
    assert [e.input_ids for e in second.examples] == [e.input_ids for e in first.examples]
    write_jsonl(path, addition_rows(40, seed=5))  # a new revision of the dataset
    assert data.prepare(recipe, tokenizer).stats.cached_datasets == 0


@pytest.mark.slow
def test_a_ddp_launch_tokenizes_in_worker_processes_forked_after_the_process_group(tiny_llama, tmp_path, monkeypatch):
    """The cache is built inside a launched run, after the gloo group formed: one rank forks data.num_proc workers
    (more than one chunk of rows), the other waits on the lock, and both train on the one mapped entry."""
    from conftest import read_metrics, recipe_dict, torchrun, write_recipe

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))  # this launch's own cache, to count its entries
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(2500))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, path, tmp_path / "run", data={"num_proc": 2},
                                                          train={"max_steps": 2, "micro_batch_size": 2}))
    result = torchrun(recipe, "parallel.strategy=ddp", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2436 train / 64 eval examples" in result.stdout, result.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [1, 2]
    entries = [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file(), entries  # built once, no temporary left
