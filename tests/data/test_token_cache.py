"""The tokenization cache (finetune/data/cache.py): every input of its key is a miss when it changes and a hit when it
does not, an old or damaged entry is rebuilt and never misread, and tokenizing in parallel gives what one process
gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import addition_rows, write_jsonl
from test_data import make_recipe

from finetune import data
from finetune.cli.tiny import build_tokenizer
from finetune.recipe import validate_recipe
from finetune.recipe.data import DataSection

pytestmark = pytest.mark.usefixtures("private_cache")


def _examples(sequence) -> list[tuple[list[int], list[int]]]:
    return [(e.input_ids, e.labels) for e in sequence]


def test_each_input_of_the_cache_key_is_a_miss_and_an_unchanged_one_a_hit(tmp_path, tokenizer, monkeypatch):
    """The key covers the rows, the tokenizer, its chat template, the data settings and the rendering code: a change in
    any of them re-tokenizes (never a stale hit); nothing changed reads the memory-mapped entry, equal to the fresh one.
    Found by a bug bash (mutants C01, C03): data.reasoning and data.bad_rows were not among the misses, so either could
    leave the key unnoticed; every data.* field is now a miss here or named as read after the cache."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(30))
    recipe = make_recipe({"path": str(path)})
    train, evaluation, stats = data.build_examples(recipe, tokenizer)
    assert stats.cached_datasets == 0
    entries = [p for p in (tmp_path / "cache" / "data").iterdir() if p.suffix != ".lock"]
    assert len(entries) == 1 and entries[0].is_dir(), entries  # no temporary folder left
    real_tokenize = data.cache.tokenize_chunk

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache holds this dataset")

    monkeypatch.setattr(data.cache, "tokenize_chunk", no_tokenizing)  # where the cache stage looks it up
    again, again_eval, again_stats = data.build_examples(recipe, tokenizer)
    assert again_stats.cached_datasets == 1
    assert isinstance(again.stores[0].ids, np.memmap)  # mapped, not loaded into lists
    assert _examples(again) + _examples(again_eval) == _examples(train) + _examples(evaluation)

    templated = build_tokenizer()
    templated.chat_template = (tokenizer.chat_template or "") + "{# another template #}"
    misses = {
        "max_length": (make_recipe({"path": str(path)}, max_length=64), tokenizer),
        "system_prompt": (make_recipe({"path": str(path)}, system_prompt="S"), tokenizer),
        "overlong": (make_recipe({"path": str(path)}, overlong="drop"), tokenizer),
        "columns": (make_recipe({"path": str(path), "columns": {"output": "output"}}), tokenizer),
        "tokenizer": (recipe, build_tokenizer(vocab_size=400)),
        "chat template": (recipe, templated),
        "reasoning": (make_recipe({"path": str(path)}, reasoning="drop"), tokenizer),
        "bad_rows": (make_recipe({"path": str(path)}, bad_rows="skip"), tokenizer),
    }
    # Every data.* field is a miss above or listed here as read after the cache (a new field must be one or the other)
    after_the_cache = {"datasets", "eval_datasets", "eval_fraction", "eval_max_rows", "packing", "num_proc", "cache",
                       "streaming"}
    assert set(DataSection.model_fields) == after_the_cache | {key for key in misses if key in DataSection.model_fields}
    for name, (changed, changed_tokenizer) in misses.items():
        with pytest.raises(AssertionError, match="re-tokenized"):
            data.build_examples(changed, changed_tokenizer)
            pytest.fail(f"{name}: a change of it was a cache hit")
    monkeypatch.setattr(data.cache, "CACHE_VERSION", "edited rendering code")
    with pytest.raises(AssertionError, match="re-tokenized"):  # the rendering code's version is part of the key
        data.build_examples(recipe, tokenizer)
    monkeypatch.undo()
    monkeypatch.setattr(data.cache, "tokenize_chunk", no_tokenizing)
    write_jsonl(path, addition_rows(30, seed=1))
    with pytest.raises(AssertionError, match="re-tokenized"):  # the file content is part of the key
        data.build_examples(recipe, tokenizer)
    monkeypatch.setattr(data.cache, "tokenize_chunk", real_tokenize)


def test_a_preference_datasets_prompt_limit_is_in_the_cache_key(tmp_path, tokenizer, monkeypatch):
    """Found by a bug bash (mutant C04): the cache key could leave out a preference dataset's prompt limit
    (dpo.max_prompt_length) and a run would reuse pairs cut to the old limit; no test said so. (C01, C03: data.reasoning
    and data.bad_rows, are misses of the test above.)"""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"What is {a} plus {a}? " * 3, "chosen": f"{2 * a}.",
                                                   "rejected": f"{2 * a + 1}."} for a in range(12)])

    def preference(max_prompt_length: int | None):
        return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"objective": "dpo"},
                                "dpo": {"max_prompt_length": max_prompt_length},
                                "data": {"datasets": [{"path": str(pairs), "format": "preference"}], "max_length": 64}})

    data.build_examples(preference(None), tokenizer)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache holds this dataset")

    monkeypatch.setattr(data.cache, "tokenize_chunk", no_tokenizing)
    assert data.build_examples(preference(None), tokenizer)[2].cached_datasets == 1  # unchanged: a hit
    assert data.build_examples(preference(32), tokenizer)[2].cached_datasets == 1  # the default's value: a hit
    with pytest.raises(AssertionError, match="re-tokenized"):
        data.build_examples(preference(8), tokenizer)


def test_an_old_or_damaged_cache_entry_is_rebuilt_never_misread(tmp_path, tokenizer):
    """An entry written by other code (another store format; v1-v3's .npz files) or cut short is rebuilt."""
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(30))
    recipe = make_recipe({"path": str(path)})
    fresh, _, _ = data.build_examples(recipe, tokenizer)
    key = data.cache_key(recipe.data.datasets[0], data.open_source(recipe.data.datasets[0]), recipe, tokenizer)
    entry = data.cache_dir() / key
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "format": 2}))  # an older layout under the same name
    (data.cache_dir() / f"{key}.npz").write_bytes(b"v1-v3 wrote npz files; never read")
    rebuilt, _, stats = data.build_examples(recipe, tokenizer)
    assert stats.cached_datasets == 0 and _examples(rebuilt) == _examples(fresh)
    with open(entry / "ids.bin", "r+b") as handle:  # damaged: fewer tokens than its offsets say
        handle.truncate(8)
    rebuilt, _, stats = data.build_examples(recipe, tokenizer)
    assert stats.cached_datasets == 0 and _examples(rebuilt) == _examples(fresh)
    assert data.build_examples(recipe, tokenizer)[2].cached_datasets == 1


def test_parallel_tokenizing_matches_in_process(tmp_path, tokenizer):
    """data.num_proc spreads chunks of rows over processes; the tokens and labels do not depend on it."""
    rows = addition_rows(2100)
    rows[1500]["output"] = ""  # a bad row in a worker's chunk: counted like in-process
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    serial, _, one = data.build_examples(make_recipe({"path": str(path)}, cache=False, num_proc=1, bad_rows="skip"),
                                         tokenizer)
    parallel, _, two = data.build_examples(make_recipe({"path": str(path)}, cache=False, num_proc=2, bad_rows="skip"),
                                           tokenizer)
    assert _examples(parallel) == _examples(serial) and len(serial) > 1900
    assert (one.skipped, one.skipped_reasons) == (two.skipped, two.skipped_reasons) == (1, one.skipped_reasons)
    assert "line 1501" in one.skipped_reasons[0]


def test_an_edited_tools_file_is_a_miss(tmp_path):
    """data.datasets[].tools naming a JSON file: its schemas are rendered into every row, but the key held only the
    path, so an edited file trained the old schemas from the cache (found in a bug bash)."""
    from chat_families import WEATHER_TOOL, family_tokenizer

    tokenizer = family_tokenizer("qwen3")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    rows = [{"messages": [{"role": "user", "content": f"Weather in city {i}?"},
                          {"role": "assistant", "content": "Sunny."}]} for i in range(8)]
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "format": "chat",
                          "tools": str(tools)}, max_length=512, eval_fraction=0)

    def rendered() -> tuple[str, int]:
        train, _, stats = data.build_examples(recipe, tokenizer)
        return tokenizer.decode(train[0].input_ids), stats.cached_datasets

    first, again = rendered(), rendered()
    assert "get_weather" in first[0] and (first[1], again) == (0, (first[0], 1))  # built, then a hit
    tools.write_text(json.dumps([WEATHER_TOOL]).replace("get_weather", "lookup_forecast"))
    text, cached = rendered()
    assert cached == 0 and "lookup_forecast" in text and "get_weather" not in text, text


def test_a_long_build_says_how_far_it_is_where_no_terminal_shows_a_bar(tmp_path, tokenizer, monkeypatch, capsys):
    """Found by a bug bash: with stderr piped to a CI log, tokenizing 1.5M rows took 14 minutes under one line (the bar
    is drawn on a terminal only), which reads as a hung run. A line now says how many rows are done, every minute (here
    every chunk)."""
    monkeypatch.setattr(data.cache, "PROGRESS_EVERY_S", 0.0)
    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(1500))  # two chunks of rows
    data.build_examples(make_recipe({"path": str(path)}, num_proc=1), tokenizer)
    lines = [line for line in capsys.readouterr().err.splitlines() if "rows so far" in line]
    assert [line.split(": ")[2].split(" rows")[0] for line in lines] == ["1,000", "1,500"], lines


def test_long_rows_come_in_chunks_of_bounded_text_not_a_thousand_rows(tmp_path):
    """Found by a bug bash: a chunk was always 1,000 rows, and tokenizing keeps each token's offsets (~70 bytes per
    character), so 1,000 rows of 38 KB took 3.2 GB per chunk in flight (continued pretraining on long rows, max_length
    128, ran out of memory). A chunk now ends at ~4M characters of text too; short rows still come 1,000 at a time."""
    from finetune.data.readers import CHUNK_CHARS
    from finetune.data.sources import open_source, row_chunks

    long_text = "word " * 100_000  # 500 KB a row
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": long_text} for _ in range(12)])
    spec = make_recipe({"path": str(path), "format": "text"}).data.datasets[0]
    sizes = [len(items) for items, _, _ in row_chunks(open_source(spec))]
    per_chunk = -(-CHUNK_CHARS // len(json.dumps({"text": long_text})))  # rows until the chunk holds CHUNK_CHARS
    assert sizes == [per_chunk, 12 - per_chunk] and per_chunk < 12, sizes
    short = write_jsonl(tmp_path / "short.jsonl", addition_rows(1500))
    spec = make_recipe({"path": str(short)}).data.datasets[0]
    assert [len(items) for items, _, _ in row_chunks(open_source(spec))] == [1000, 500]


def test_split_special_tokens_is_a_miss(tmp_path):
    """Found by a bug bash (bb63): `split_special_tokens` in tokenizer_config.json changes the ids of a special token
    written in text, but the backend's serialized form leaves it out, so flipping it reused the entry tokenized under
    the other setting (2 examples of 25-40 tokens from the cache where a fresh build gave 1 of 63)."""
    from chat_families import family_tokenizer
    from transformers import AutoTokenizer

    family_tokenizer("qwen3").save_pretrained(tmp_path / "tok")
    rows = [{"messages": [{"role": "user", "content": "Echo <|im_end|> please"},
                          {"role": "assistant", "content": "Here: <|im_end|> done"}]} for _ in range(4)]
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "format": "chat"},
                         max_length=512, eval_fraction=0)

    def built(**settings) -> tuple[list, int]:
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok", **settings)
        train, _, stats = data.build_examples(recipe, tokenizer)
        return [list(example.input_ids) for example in train], stats.cached_datasets

    plain, hit = built(), built()
    assert plain[1] == 0 and hit == (plain[0], 1)
    split, cached = built(split_special_tokens=True)
    assert cached == 0 and split != plain[0]
    assert data.tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok", split_special_tokens=True)) != \
        data.tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok"))
