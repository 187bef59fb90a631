"""Token cache gap found by mutation testing round 5 (bb61): the key must change with the tokenizer's eos_token, which
ends every row and turn and is not in the backend tokenizer's serialized form (tokenizer.json).

Oracle: the tokenizer itself (its eos_token_id), loaded by transformers from the same files with tokenizer_config.json
edited, as a user's edit or a re-download with a fixed eos leaves them."""

from __future__ import annotations

import json

import pytest
from conftest import addition_rows, write_jsonl
from test_data import make_recipe

from finetune import data
from finetune.cli.tiny import build_tokenizer

pytestmark = pytest.mark.usefixtures("private_cache")


def test_a_tokenizer_whose_eos_token_changed_is_a_cache_miss(tmp_path, monkeypatch):
    """Found by mutation testing (bb61 cc1): the cache key without str(tokenizer.eos_token) passed every test: a
    tokenizer whose tokenizer_config.json names another eos_token (tokenizer.json, the vocabulary and the template
    unchanged) reused the cached rows, which end in the old eos. Now it is a miss and the rows end in the new one."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(folder)
    before = AutoTokenizer.from_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|endoftext|>"  # another token of the same vocabulary
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    after = AutoTokenizer.from_pretrained(folder)
    assert before.backend_tokenizer.to_str() == after.backend_tokenizer.to_str()  # only the config's eos differs
    assert before.eos_token_id != after.eos_token_id

    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(8)))})
    old, _, stats = data.build_examples(recipe, before)
    assert stats.cached_datasets == 0 and all(e.input_ids[-1] == before.eos_token_id for e in old)
    real_tokenize = data.cache.tokenize_chunk
    tokenized = []

    def counted(*args, **kwargs):
        tokenized.append(1)
        return real_tokenize(*args, **kwargs)

    monkeypatch.setattr(data.cache, "tokenize_chunk", counted)
    data.build_examples(recipe, before)
    assert tokenized == []  # unchanged: a hit
    new, _, stats = data.build_examples(recipe, after)
    assert tokenized and stats.cached_datasets == 0  # the changed eos: a miss, tokenized again
    assert all(e.input_ids[-1] == after.eos_token_id for e in new)
