"""Where rows come from and how datasets mix (bug bash bb7): a streamed folder of JSON Lines and CSV files, weights
and eval files under GRPO, `split` / `subset` on sources without them, an eval hold-out that empties a dataset or
takes every example, and the messages of a glob and of a mistyped folder taken for a hub name."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import addition_rows, write_jsonl

from finetune import data
from finetune.data.sources import check_local_files
from finetune.data.streaming import STREAM_CHUNK_ROWS
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

GRPO = {"num_generations": 4, "max_completion_length": 8, "reward_functions": ["finetune.rewards:exact_match"]}


def make_recipe(datasets: list[dict], *, objective: str = "sft", seed: int = 42, **data_keys):
    raw = {"model": {"name_or_path": "unused"}, "train": {"objective": objective, "micro_batch_size": 4, "seed": seed},
           "data": {"datasets": datasets, "max_length": 64, **data_keys}}
    if objective == "grpo":
        raw["grpo"] = GRPO
    return validate_recipe(raw)


def mixed_folder(folder, json_lines: int):
    """`json_lines` alpaca rows in f1.jsonl, then 5 in sub/f2.csv (read after it: paths in order)."""
    rows = addition_rows(json_lines + 5, seed=3)
    write_jsonl(folder / "f1.jsonl", rows[:json_lines])
    (folder / "sub").mkdir()
    with open(folder / "sub" / "f2.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(rows[json_lines:])
    return folder


# --------------------------------------------------------------------------------------------------- (1)
@pytest.mark.parametrize("json_lines", [3, STREAM_CHUNK_ROWS + 6])
def test_streaming_reads_a_folder_of_json_lines_and_csv_files_as_the_cached_path(tmp_path, tokenizer, json_lines):
    """Found by a bug bash: a streamed folder of f1.jsonl and sub/f2.csv stopped with AttributeError ('dict' object has
    no attribute 'rstrip'): a chunk whose first item was a JSON Lines line was parsed whole as lines, CSV row dicts
    too. With 3 lines at `finetune data` / validate; with 70, the pre-check passed and training died at the CSV."""
    folder = mixed_folder(tmp_path / "fold", json_lines)
    recipe = make_recipe([{"path": str(folder)}], streaming=True, eval_fraction=0.0)
    rows, _, _ = data.stream_examples(recipe, tokenizer)
    streamed = [example for example, _ in rows.pass_examples(0, *rows.start)]
    cached = recipe.model_copy(deep=True)
    cached.data.streaming = False
    expected = list(data.prepare(cached, tokenizer).examples)
    assert len(streamed) == len(expected) == json_lines + 5
    assert [(e.input_ids, e.labels) for e in streamed] == [(e.input_ids, e.labels) for e in expected]


# --------------------------------------------------------------------------------------------------- (2)
def prompt_file(path, count: int):
    return write_jsonl(path, [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(count)])


def test_grpo_refuses_a_weight_that_leaves_a_dataset_no_prompt_and_counts_each_datasets_prompts(tmp_path, tokenizer):
    """Found by a bug bash: under GRPO, 5 prompts at weight 0.05 were dropped without a word (SFT refuses that weight,
    as docs/data.md says), and with every dataset so weighted `finetune data` / validate / train ended in numpy's
    `zero-size array to reduction operation minimum` traceback."""
    first, second = prompt_file(tmp_path / "g1.jsonl", 8), prompt_file(tmp_path / "g2.jsonl", 5)
    for weights in ((1.0, 0.05), (0.05, 0.05)):
        recipe = make_recipe([{"path": str(first), "format": "prompt", "weight": weights[0]},
                              {"path": str(second), "format": "prompt", "weight": weights[1]}], objective="grpo")
        with pytest.raises(DataError) as caught:
            data.prepare(recipe, tokenizer)
        index = weights.index(0.05)
        assert f"data.datasets[{index}]" in str(caught.value) and "weight 0.05" in str(caught.value)
        assert "Fix: a weight of at least" in str(caught.value)
    recipe = make_recipe([{"path": str(first), "format": "prompt"},
                          {"path": str(second), "format": "prompt", "weight": 0.4}], objective="grpo")
    prepared = data.prepare(recipe, tokenizer)
    assert [item["train_examples"] for item in prepared.stats.per_dataset] == [8, 2]
    assert len(prepared.train) == 10


def test_grpo_refuses_eval_files_it_would_never_read(tmp_path, tokenizer):
    """Found by a bug bash: GRPO accepted data.eval_datasets and never used them (`finetune data` said 0 eval, the run
    nothing): GRPO evaluates nothing (docs/grpo.md), so a file the user named was dropped silently."""
    prompts = prompt_file(tmp_path / "g1.jsonl", 8)
    recipe = make_recipe([{"path": str(prompts), "format": "prompt"}], objective="grpo",
                         eval_datasets=[{"path": str(prompts), "format": "prompt"}])
    with pytest.raises(DataError, match=r"data.eval_datasets \(1 given\): GRPO .* Fix: remove data.eval_datasets"):
        data.prepare(recipe, tokenizer)


# --------------------------------------------------------------------------------------------------- (3)
def saved_sources(tmp_path):
    import datasets

    rows = [{"text": f"row {i}"} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "test": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "saved_dict"))
    return tmp_path / "saved", tmp_path / "saved_dict"


def test_split_or_subset_on_a_file_or_a_saved_dataset_is_refused_naming_the_entry(tmp_path):
    """Found by a bug bash: `split` and `subset` were silently ignored on a single file and on a save_to_disk Dataset
    (and `subset` on a saved DatasetDict): the whole source was read, so `eval_datasets: [{path: b.csv, split: test}]`
    evaluated on every training row. A folder refused the same keys."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(4))
    saved, saved_dict = saved_sources(tmp_path)
    cases = [({"path": str(path), "split": "test"}, "split `test` is set, but a single file has no splits"),
             ({"path": str(path), "subset": "main"}, "subset `main` is set, but a single file has no subsets"),
             ({"path": str(saved), "format": "text", "split": "validation"}, "folder of one Dataset, which has no splits"),
             ({"path": str(saved_dict), "format": "text", "subset": "foo"}, "its splits, which `split` picks: train, test")]
    for spec, said in cases:
        for key in ("datasets", "eval_datasets"):
            recipe = make_recipe([{"path": str(path)}, spec] if key == "datasets" else [{"path": str(path)}],
                                 **({"eval_datasets": [spec]} if key == "eval_datasets" else {}))
            with pytest.raises(DataError) as caught:
                check_local_files(recipe)
            message = str(caught.value)
            assert message.startswith(f"data.{key}[{1 if key == 'datasets' else 0}] path") and said in message
            assert "Fix: remove" in message
        with pytest.raises(DataError, match=said.replace("`", ".").replace("(", ".").replace(")", ".")):
            data.load_rows(DatasetSpec(**spec))  # the loaders refuse it too (the cached path and streaming)
    assert len(data.load_rows(DatasetSpec(path=str(saved_dict), format="text", split="test"))) == 1  # a dict's split
    assert len(data.load_rows(DatasetSpec(path=str(path), split="train"))) == 4  # a file is the train split


# --------------------------------------------------------------------------------------------------- (4)
def test_an_eval_hold_out_that_takes_a_whole_dataset_is_refused_and_train_counts_are_shown(tmp_path, tokenizer):
    """Found by a bug bash: the eval hold-out, drawn from every dataset's examples together, took the one example of
    a small dataset (weight 3), which then trained 0 times with no refusal or warning; with weight 1 `finetune data`
    showed no train count per dataset at all."""
    big, one = write_jsonl(tmp_path / "a.jsonl", addition_rows(20)), write_jsonl(tmp_path / "one.jsonl", addition_rows(1))
    datasets = [{"path": str(big)}, {"path": str(one), "weight": 3}]
    with pytest.raises(DataError) as caught:  # train.seed 1 holds out rows 20 and 17: one.jsonl's only example
        data.prepare(make_recipe(datasets, seed=1, eval_fraction=0.1), tokenizer)
    message = str(caught.value)
    assert message.startswith(f"data.datasets[1] ({one}): the eval hold-out took all 1 of its examples")
    assert "data.eval_fraction 0.1" in message and "Fix:" in message and "data.eval_datasets" in message
    prepared = data.prepare(make_recipe([{"path": str(big)}, {"path": str(one)}], seed=3, eval_fraction=0.1), tokenizer)
    assert [item["train_examples"] for item in prepared.stats.per_dataset] == [18, 1]  # weight 1: counted too


# --------------------------------------------------------------------------------------------------- (5)
@pytest.mark.parametrize(("rows", "fraction"), [(3, 0.9), (2, 0.75)])
def test_an_eval_fraction_that_takes_every_example_is_refused(tmp_path, tokenizer, rows, fraction):
    """Found by a bug bash: 3 rows at eval_fraction 0.9 (and 2 at 0.75) gave `3 train, 0 eval`: the eval set asked
    for would take every example, and was silently dropped whole."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(rows))
    with pytest.raises(DataError, match=rf"data.eval_fraction {fraction} of the {rows} training examples holds out "
                                        rf"round\({fraction} x {rows}\) = {rows}, every one"):
        data.prepare(make_recipe([{"path": str(path)}], eval_fraction=fraction), tokenizer)
    prepared = data.prepare(make_recipe([{"path": str(path)}], eval_fraction=0.4), tokenizer)
    assert len(prepared.eval) == 1 and prepared.stats.train_examples == rows - 1


# --------------------------------------------------------------------------------------------------- (6)
def test_a_glob_path_is_said_not_to_be_expanded(tmp_path, monkeypatch):
    """Found by a bug bash: `path: data/*.csv` said only `file not found`, though users of load_dataset(data_files=...)
    expect globs to expand; the message now says they are not, and to name the folder."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "data" / "a.jsonl", addition_rows(2))
    recipe = make_recipe([{"path": "data/*.jsonl"}])
    with pytest.raises(DataError, match=r"data.datasets\[0\] path `data/\*.jsonl`: not found, and .* glob pattern, "
                                        r"which is not expanded.* Fix: point the path at the folder"):
        check_local_files(recipe)
    with pytest.raises(DataError, match="glob pattern"):
        data.load_rows(DatasetSpec(path="data/*.jsonl"))


def test_a_mistyped_local_folder_taken_for_a_hub_name_is_said_so(tmp_path, monkeypatch):
    """Found by a bug bash: `path: data/splitz` (for data/splits) was taken for a hub name and ended in `datasets`'
    "Dataset data/splitz is not cached in None", without a word that no such local folder exists."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_jsonl(tmp_path / "data" / "splits" / "train.jsonl", addition_rows(2))
    for streaming in (False, True):
        with pytest.raises(DataError) as caught:
            if streaming:
                list(data.streaming.dataset_rows(DatasetSpec(path="data/splitz")))
            else:
                data.load_rows(DatasetSpec(path="data/splitz"))
        message = str(caught.value)
        assert "in None" not in message, message
        assert "No local file or folder `data/splitz` exists" in message and "did you mean data/splits?" in message
    assert json.loads((tmp_path / "data" / "splits" / "train.jsonl").read_text().splitlines()[0])


# ------------------------------------------------------------------------------ the batch efficiency of pairs
def test_the_batch_efficiency_of_pairs_counts_the_rejected_sequences_the_batch_pads_alike(tmp_path, tokenizer):
    """Found by a bug bash of the numbers a run reports: `finetune validate` and the run's data line gave DPO's batch
    efficiency from the chosen sequences alone (91.3%), while the micro-batches the run builds pad chosen and rejected
    sequences to the longest of both (79.6%). The oracle: the run's own collate over epoch 0's micro-batches."""
    short, long = "yes", " ".join(["a long and rambling answer"] * 6)
    rows = [{"prompt": f"Question {i}?", "chosen": short, "rejected": long} for i in range(12)]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    recipe = make_recipe([{"path": str(path), "format": "preference"}], objective="dpo", eval_fraction=0.0)
    prepared = data.prepare(recipe, tokenizer)
    train = prepared.train
    order = data.epoch_permutation(len(train), recipe.train.seed, 0)
    real = total = 0
    for start in range(0, len(order), 4):
        batch = data.collate([train[int(i)] for i in order[start:start + 4]], pad_id=0)
        real, total = real + int(batch["attention_mask"].sum()), total + batch["attention_mask"].numel()
    assert prepared.stats.batch_efficiency == pytest.approx(real / total)
    assert prepared.stats.batch_efficiency < 0.75  # each batch pads its short chosen halves to the long rejected ones
