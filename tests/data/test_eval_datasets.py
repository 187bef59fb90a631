"""data.eval_datasets: evaluation files instead of (or besides) the held-out fraction, in the loss eval, the
generation eval and `finetune data`; a missing or wrong-format eval file exits 2 before anything loads."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune import data
from finetune.cli import main
from finetune.cli.tiny import build_tokenizer
from finetune.recipe import load_recipe, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

EVAL_ROWS = [{"instruction": "Subtract the numbers.", "input": f"{a} minus {a - 1}", "output": "1"} for a in range(10, 16)]


def recipe_with(tmp_path, **data_section):
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(40))
    raw = {"model": {"name_or_path": "some/model"},
           "data": {"datasets": [{"path": str(train)}], "max_length": 128, **data_section}}
    return validate_recipe(raw)


def test_eval_files_replace_the_held_out_fraction(tmp_path):
    eval_path = write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    recipe = recipe_with(tmp_path, eval_datasets=[{"path": str(eval_path)}])
    assert recipe.data.eval_fraction == 0.0  # resolved, so the run folder's recipe.yaml splits the same way
    tokenizer = build_tokenizer()
    prepared = data.prepare(recipe, tokenizer)
    assert prepared.stats.train_examples == 40 and len(prepared.eval) == len(EVAL_ROWS) == len(prepared.eval_files)
    assert "Subtract" in tokenizer.decode(prepared.eval[0].input_ids)
    assert [item.get("role") for item in prepared.stats.per_dataset] == [None, "eval"]


def test_eval_files_besides_the_fraction_when_both_are_set(tmp_path):
    eval_path = write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    recipe = recipe_with(tmp_path, eval_datasets=[{"path": str(eval_path)}], eval_fraction=0.1)
    train, evaluation, stats = data.build_examples(recipe, build_tokenizer())
    assert len(train) == 36 and len(evaluation) == len(EVAL_ROWS) + 4 and stats.eval_examples == len(evaluation)


def test_preview_shows_the_eval_files(tmp_path, tiny_llama, capsys):
    from finetune.cli.preview import cli_data

    eval_path = write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(40))
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name_or_path": str(tiny_llama)}, "data": {
        "datasets": [{"path": str(train)}], "eval_datasets": [{"path": str(eval_path)}], "max_length": 128}})
    assert cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=2)) == 0
    out = capsys.readouterr().out
    assert out.count("--- eval example") == 2 and "10 minus 9" in out
    assert f"eval dataset {eval_path} (alpaca): 6 rows -> 6 examples" in out
    assert "examples: 40 train, 6 eval (6 from data.eval_datasets)" in out


@pytest.mark.parametrize("problem", ["missing", "wrong format", "not json lines", "unsupported type"])
def test_bad_eval_file_exits_2_before_anything_loads(tmp_path, capsys, problem):
    eval_path = tmp_path / {"unsupported type": "eval.txt"}.get(problem, "eval.jsonl")
    if problem == "wrong format":  # chat rows in a dataset declared alpaca
        write_jsonl(eval_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    elif problem == "not json lines":
        eval_path.write_text("instruction,output\nhi,yo\n")
    elif problem == "unsupported type":
        eval_path.write_text("hi\n")
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    # The model folder does not exist: a run that got past the data check would fail on it instead.
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tmp_path / "no-model", train, tmp_path / "run",
                                                           data={"eval_datasets": [{"path": str(eval_path)}]}))
    for verb in ("train", "validate", "data"):
        assert main([verb, str(recipe)]) == 2
        err = capsys.readouterr().err
        assert "data.eval_datasets[0] path" in err and str(eval_path.name) in err and "Traceback" not in err, err
        assert "no-model" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_loss_and_generation_evals_use_the_eval_file(tiny_llama, tmp_path):
    eval_path = write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(
        tiny_llama, train, out, data={"eval_datasets": [{"path": str(eval_path)}]},
        train={"max_steps": 2}, eval={"generation_rows": 2, "max_new_tokens": 2}))
    assert main(["train", str(recipe)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in records)
    generation = [r for r in records if "generation_total" in r]
    assert [r["generation_total"] for r in generation] == [2, 2]
    assert all("minus" in r["generation_sample"]["prompt"] for r in generation)
    assert load_recipe(out / "recipe.yaml").data.eval_fraction == 0.0


def test_eval_examples_that_are_training_examples_are_counted_and_said(tmp_path):
    """An eval file that is the training file, or rows duplicated across the held-out split, were taken without a
    word (found in a bug bash): the eval loss then measures recall."""
    tokenizer = build_tokenizer()
    same = data.prepare(recipe_with(tmp_path, eval_datasets=[{"path": str(tmp_path / "train.jsonl")}]), tokenizer)
    assert same.stats.eval_in_train == 40
    assert "warning: 40 of 40 eval examples are also training examples" in data.data_line(same.stats, recipe_with(
        tmp_path))
    apart = data.prepare(recipe_with(tmp_path, eval_datasets=[{"path": str(write_jsonl(tmp_path / "e.jsonl",
                                                                                      EVAL_ROWS))}]), tokenizer)
    assert apart.stats.eval_in_train == 0 and "warning" not in data.data_line(apart.stats, recipe_with(tmp_path))
    rows = addition_rows(30)
    doubled = write_jsonl(tmp_path / "doubled.jsonl", rows + rows[:10])  # 10 rows twice, split at random
    split = data.prepare(validate_recipe({"model": {"name_or_path": "m"}, "data": {
        "datasets": [{"path": str(doubled)}], "max_length": 128, "eval_fraction": 0.5}}), tokenizer)
    picks = set(split.train.picks.tolist())
    twins = {i for i in range(10) if {i, 30 + i} - picks and {i, 30 + i} & picks}  # one copy each side
    assert split.stats.eval_in_train == len(twins) > 0


def test_a_weight_that_leaves_a_dataset_nothing_is_refused_and_weighted_counts_are_shown(tmp_path, capsys):
    tokenizer = build_tokenizer()
    train = tmp_path / "train.jsonl"
    with pytest.raises(data.DataError, match=r"data.datasets\[0\] \(.*train.jsonl\): weight 0.01 of its 40 training "
                                             r"examples keeps round\(0.01 x 40\) = 0.*at least 0.025"):
        data.prepare(recipe_with(tmp_path, eval_fraction=0, datasets=[{"path": str(write_jsonl(
            train, addition_rows(40))), "weight": 0.01}]), tokenizer)
    half = data.prepare(recipe_with(tmp_path, eval_fraction=0, datasets=[{"path": str(train), "weight": 0.5}]),
                        tokenizer)
    assert half.stats.per_dataset[0]["train_examples"] == 20 == half.stats.train_examples


def test_an_eval_csv_error_names_its_eval_key(tmp_path):
    (tmp_path / "eval.csv").write_text("instruction,output\n")
    with pytest.raises(data.DataError) as raised:
        data.prepare(recipe_with(tmp_path, eval_datasets=[{"path": str(tmp_path / "eval.csv")}]), build_tokenizer())
    assert "data.eval_datasets[0]" in str(raised.value) and "data.datasets" not in str(raised.value), raised.value
    folder = tmp_path / "flat"  # a folder's refusals (split, subset) named data.datasets[].split (found in a review)
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", EVAL_ROWS)
    with pytest.raises(data.DataError) as raised:
        data.prepare(recipe_with(tmp_path, eval_datasets=[{"path": str(folder), "split": "validation"}]),
                     build_tokenizer())
    assert "data.eval_datasets[0].split" in str(raised.value) and "data.datasets" not in str(raised.value), raised.value


def test_the_rows_fingerprint_is_of_the_training_rows_not_the_eval_files(tmp_path):
    """A resume's check of the training rows hashed every store of the view, the eval files' too: an edited eval file
    gave a false "other training rows" note (found in a review)."""
    tokenizer = build_tokenizer()
    eval_path = write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)

    def fingerprint() -> str:
        return data.rows_fingerprint(data.prepare(recipe_with(tmp_path, eval_datasets=[{"path": str(eval_path)}]),
                                                  tokenizer).train)

    first = fingerprint()
    write_jsonl(eval_path, EVAL_ROWS[::-1])
    assert fingerprint() == first
    write_jsonl(tmp_path / "train.jsonl", addition_rows(40, seed=3))  # recipe_with writes seed 0's rows again...
    changed = data.rows_fingerprint(data.prepare(validate_recipe({"model": {"name_or_path": "m"}, "data": {
        "datasets": [{"path": str(tmp_path / "train.jsonl")}], "max_length": 128, "eval_datasets": [
            {"path": str(eval_path)}]}}), tokenizer).train)
    assert changed != first
