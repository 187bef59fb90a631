"""The eval hold-out keeps a row whole (bug bash bb53 #3), and counts of examples are called examples (bb53 #7).

Under templates that rewrite history (Qwen3, gpt-oss, GLM, R1) a conversation gives an example per assistant turn;
the hold-out drew examples, so turn k was evaluated while turn k+1 (whose history holds turn k) was trained. Rows
that give one example each must be split exactly as before.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from chat_families import family_tokenizer
from conftest import addition_rows, write_jsonl

from finetune import data
from finetune.data.build import data_line, split_eval_indices
from finetune.data.store import row_numbers
from finetune.recipe import validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")


def make_recipe(path, *, objective: str = "sft", data_format: str = "chat", seed: int = 42, **data_keys):
    return validate_recipe({"model": {"name_or_path": "unused"},
                            "train": {"objective": objective, "micro_batch_size": 2, "seed": seed},
                            "data": {"datasets": [{"path": str(path), "format": data_format}], "max_length": 256,
                                     **data_keys}})


def old_split(count: int, recipe) -> tuple[list[int], list[int]]:
    """The hold-out before rows were kept whole (build.split_eval_indices as it was): the oracle for one example per
    row."""
    order = list(range(count))
    random.Random(recipe.train.seed).shuffle(order)
    n_eval = min(recipe.data.eval_max_rows, round(recipe.data.eval_fraction * count))
    eval_ids = set(order[:n_eval])
    return [i for i in range(count) if i not in eval_ids], sorted(eval_ids)


def conversations(tmp_path, rows: int = 20):
    """Rows of three plain turns, each naming its row (`Row 7:`) in every user turn."""
    lines = []
    for row in range(rows):
        messages = []
        for turn in range(3):
            messages += [{"role": "user", "content": f"Row {row}: colour {turn}?"},
                         {"role": "assistant", "content": f"Colour {row}-{turn}."}]
        lines.append({"messages": messages})
    return write_jsonl(tmp_path / "chat.jsonl", lines)


def rows_of(view, tokenizer) -> list[int]:
    return [int(re.search(r"Row (\d+):", tokenizer.decode(example.input_ids)).group(1)) for example in view]


def test_a_conversation_is_held_out_whole(tmp_path):
    """Found by a bug bash (bb53 #3): under Qwen3, 20 three-turn rows gave 60 examples and eval_fraction 0.25 held
    out 15 of them, drawn one by one: a held-out turn's row had its other turns trained (the eval measured recall).
    Now 5 rows are held out, each with all its examples, and none of their examples is trained."""
    tokenizer = family_tokenizer("qwen3")
    prepared = data.prepare(make_recipe(conversations(tmp_path), eval_fraction=0.25), tokenizer)
    train_rows, eval_rows = rows_of(prepared.train, tokenizer), rows_of(prepared.eval, tokenizer)
    assert len(prepared.examples) == 60  # a turn each
    assert len(set(eval_rows)) == 5 and len(eval_rows) == 15, eval_rows
    assert not set(eval_rows) & set(train_rows) and len(set(train_rows)) == 15


def test_a_kto_pair_unpaired_into_two_rows_stays_on_one_side(tmp_path):
    """Found by a bug bash (bb53 #3): a pair file under KTO is unpaired into two rows (its chosen and its rejected
    completion); the hold-out drew them apart, so one pair's prompt was both evaluated and trained."""
    from finetune.cli.tiny import build_tokenizer

    pairs = [{"prompt": f"Row {i}: what is {i} plus 1?", "chosen": str(i + 1), "rejected": str(i + 2)}
             for i in range(20)]
    tokenizer = build_tokenizer()
    recipe = make_recipe(write_jsonl(tmp_path / "pairs.jsonl", pairs), objective="kto", data_format="preference",
                         eval_fraction=0.3)
    prepared = data.prepare(recipe, tokenizer)
    train_rows, eval_rows = rows_of(prepared.train, tokenizer), rows_of(prepared.eval, tokenizer)
    assert len(prepared.examples) == 40 and len(eval_rows) == 12 and len(set(eval_rows)) == 6, eval_rows
    assert not set(eval_rows) & set(train_rows)
    assert row_numbers(["line 1 (chosen)", "line 2", "line 1 (rejected)"], 3).tolist() == [0, 1, 0]


@pytest.mark.parametrize(("count", "fraction", "max_rows", "seed"),
                         [(64, 0.05, 64, 42), (200, 0.3, 17, 7), (3, 0.4, 64, 0), (10, 0.0, 64, 1)])
def test_one_example_per_row_is_split_as_before(tmp_path, count, fraction, max_rows, seed):
    """Found by a bug bash (bb53 #3), the guard of its fix: rows of one example each (every alpaca, text or pair row)
    are held out exactly as before rows were kept whole: the same seeded draw over the same indices."""
    from finetune.cli.tiny import build_tokenizer

    recipe = make_recipe(tmp_path / "a.jsonl", data_format="alpaca", seed=seed, eval_fraction=fraction,
                         eval_max_rows=max_rows)
    assert split_eval_indices(count, recipe) == old_split(count, recipe)
    assert split_eval_indices(count, recipe, rows=np.arange(count)) == old_split(count, recipe)
    write_jsonl(tmp_path / "a.jsonl", addition_rows(count, seed=seed))
    prepared = data.prepare(recipe, build_tokenizer())
    train_ids, eval_ids = old_split(count, recipe)
    assert prepared.eval.picks.tolist() == eval_ids and sorted(prepared.train.picks.tolist()) == train_ids


def test_counts_of_examples_are_called_examples(tmp_path):
    """Found by a bug bash (bb53 #7): `rows: 40 read, 0 skipped, 0 truncated, 59 dropped`: more rows dropped than
    read, since truncated and dropped count examples (a conversation gives one per turn under Qwen3). Both the rows
    line of `finetune data` and the run's data line now say those are of the rows' examples."""
    from finetune.cli.preview import format_stats

    long = [{"role": "user", "content": "Go."}]
    for step in range(3):
        long += [{"role": "assistant", "content": f"Step {step}: " + "word " * 60}, {"role": "user", "content": "On."}]
    long.append({"role": "assistant", "content": "Done."})
    short = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (short, long, short)), encoding="utf-8")
    recipe = make_recipe(path, eval_fraction=0, max_length=100, overlong="drop")
    prepared = data.prepare(recipe, family_tokenizer("qwen3"))
    assert prepared.stats.dropped > prepared.stats.rows - 2  # the long row's turns past max_length
    examples = len(prepared.examples) + prepared.stats.dropped
    expected = f"3 read, 0 skipped; of their {examples} examples, 0 truncated, {prepared.stats.dropped} dropped"
    assert f"rows: {expected}" in format_stats(prepared, recipe)
    assert f"(3 rows, 0 skipped; of their {examples} examples, 0 truncated, {prepared.stats.dropped} dropped" \
        in data_line(prepared.stats, recipe)
