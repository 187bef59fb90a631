"""A tokenizer larger than the model's embedding (finetune/data/vocab.py): the run, `finetune validate` and `finetune
data` refuse data whose token ids have no embedding row, before any weight loads; data that keep below the rows, and a
vocabulary padded past the tokenizer's, pass."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import pytest
from conftest import RUN_PY, addition_rows, recipe_dict, run_cmd, write_jsonl, write_recipe

from finetune.errors import DataError

REFUSED = (r"has {size} tokens, but the model's embedding has {rows} rows .*`<tool>`, `</tool>`.* "
           r"finetune does not resize")


@pytest.fixture(scope="module")
def added_tokenizer(tiny_llama, tmp_path_factory):
    """The tiny model's tokenizer plus `<tool>` and `</tool>`: two ids past the embedding's rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = len(tokenizer)
    tokenizer.add_tokens(["<tool>", "</tool>"])
    folder = tmp_path_factory.mktemp("added-tokens")
    tokenizer.save_pretrained(folder)
    return folder, rows


def _recipe(tiny_llama, tmp_path, tokenizer_folder, *, tool_rows: bool, **data_keys):
    rows = addition_rows(16)
    if tool_rows:
        rows = [dict(row, output=f"<tool>add {row['output']}</tool>") for row in rows]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    return write_recipe(tmp_path / "r.yaml", recipe_dict(
        tiny_llama, data, tmp_path / "run", model={"tokenizer": str(tokenizer_folder)},
        data={"eval_fraction": 0, **data_keys}, train={"max_steps": 1}))


def test_validate_and_data_refuse_token_ids_past_the_embedding(tiny_llama, added_tokenizer, tmp_path):
    """Found by a bug bash of vocabulary and embeddings: model.tokenizer with added tokens (456 against the model's 454
    embedding rows) and rows that use them passed `finetune validate` ("output: ... is usable") and `finetune data`,
    then the run loaded the model and stopped at step 1 with a raw IndexError traceback (a device-side assert on GPU).
    Now both refuse, naming the tokenizer, both sizes, the tokens without a row and the fix."""
    from finetune.cli.preview import cli_data
    from finetune.cli.validate import validate

    folder, rows = added_tokenizer
    recipe = _recipe(tiny_llama, tmp_path, folder, tool_rows=True)
    refused = REFUSED.format(size=rows + 2, rows=rows)
    with pytest.raises(DataError, match=rf"model.tokenizer \({folder}\) {refused}"):
        validate(str(recipe), [])
    with pytest.raises(DataError, match=refused):
        cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=2, num_processes=None))


def test_data_below_the_embedding_rows_pass_with_a_larger_tokenizer(tiny_llama, added_tokenizer, tmp_path):
    """Found by a bug bash of vocabulary and embeddings (as above): the check refuses what would crash, not a larger
    tokenizer as such: rows that never use the added tokens train, as they did."""
    from finetune.cli.validate import validate

    recipe = _recipe(tiny_llama, tmp_path, added_tokenizer[0], tool_rows=False)
    assert "is usable" in validate(str(recipe), [])


def test_padding_and_streams_past_the_embedding_are_refused_and_a_padded_vocabulary_passes():
    """Found by a bug bash of vocabulary and embeddings (as above): a pad id past the rows is embedded in every padded
    batch, and a stream is not read whole before training, so both are refused with a larger tokenizer; a vocabulary
    padded past the tokenizer's (Qwen's) reads nothing."""
    from finetune.data.examples import Example
    from finetune.data.vocab import check_token_ids

    class Tokenizer:
        pad_token_id = 9

        def __len__(self):
            return 10

        def convert_ids_to_tokens(self, ids):
            return [f"t{i}" for i in ids]

    def recipe(streaming: bool = False):
        return SimpleNamespace(model=SimpleNamespace(tokenizer="tok", name_or_path="m"),
                               data=SimpleNamespace(streaming=streaming))

    low = [Example([1, 2, 3], [1, 2, 3])]
    with pytest.raises(DataError, match=r"has 10 tokens, but the model's embedding has 8 rows .* padding reaches id 9"
                       ) as caught:
        check_token_ids(recipe(), Tokenizer(), low, config=SimpleNamespace(vocab_size=8))
    assert caught.value.alike_on_every_rank is True  # every rank holds the same ids: printed once, by rank 0 (bb38)
    with pytest.raises(DataError, match=r"the stream may reach them \(data.streaming"):
        check_token_ids(recipe(streaming=True), Tokenizer(), low, config=SimpleNamespace(vocab_size=9))
    check_token_ids(recipe(streaming=True), Tokenizer(), [Example([99], [99])], config=SimpleNamespace(vocab_size=16))


@pytest.mark.slow  # one single-process run, refused before its model loads
def test_a_run_refuses_token_ids_past_the_embedding_before_loading(tiny_llama, added_tokenizer, tmp_path):
    """Found by a bug bash of vocabulary and embeddings (as above): `finetune train` got as far as "[finetune] ready"
    and died in torch's embedding with a traceback. Now the run stops after its data line, before the model loads."""
    folder, rows = added_tokenizer
    result = run_cmd([sys.executable, str(RUN_PY), str(_recipe(tiny_llama, tmp_path, folder, tool_rows=True))])
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"has {rows + 2} tokens, but the model's embedding has {rows} rows" in result.stderr, result.stderr[-3000:]
    assert "[finetune] model:" not in result.stdout and "Traceback" not in result.stderr, result.stdout + result.stderr
