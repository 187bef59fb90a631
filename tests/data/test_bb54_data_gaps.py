"""Data reading that mutation testing (bug bash bb54) found unguarded: each test fails when its code is weakened (a
resume's skip over a folder of files, data.datasets[].max_rows, a text prompt's BOS, the GRPO prompt budget's edge,
a reply with a tool call that does not parse)."""

from __future__ import annotations

import json

import pytest
from chat_families import family_tokenizer
from conftest import write_jsonl

from finetune.cli.tiny import build_tokenizer
from finetune.data.prompts import prompt_examples, prompt_ids
from finetune.data.replies import reply_message
from finetune.data.sources import load_rows, local_rows
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe


def _write(path, rows: list[dict], kind: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        write_jsonl(path, rows)
    elif kind == "json":  # a JSON array of rows
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        path.write_text("text\n" + "".join(f"{row['text']}\n" for row in rows))
    else:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
@pytest.mark.parametrize("start", [3, 7])
def test_a_resume_over_a_folder_of_files_skips_start_rows_in_all_not_in_each(tmp_path, kind, start):
    """Found by a bug bash (bb54 SO05, RD02, RD04): no test resumed a stream over a folder of several files. With the
    rows already read not subtracted file by file, file 2 and later also skipped `start` rows (rows silently lost); and
    a JSON array's or Parquet file's row numbers (the places errors name) after a skip were not checked. The oracle:
    the unskipped read, sliced."""
    folder = tmp_path / "shards"
    a = _write(folder / f"a.{kind}", [{"text": f"a{i}"} for i in range(5)], kind)
    b = _write(folder / f"b.{kind}", [{"text": f"b{i}"} for i in range(4)], kind)
    whole = list(local_rows([a, b], folder))
    assert len(whole) == 9
    assert list(local_rows([a, b], folder, start=start)) == whole[start:]


@pytest.mark.parametrize("streaming", [False, True])
def test_max_rows_reads_exactly_that_many_rows(tmp_path, streaming):
    """Found by a bug bash (bb54 SO04): max_rows was only parsed in the tests (test_recipe_overrides.py), never counted;
    `islice(..., max_rows + 1)` passed everything."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(20)])
    spec = DatasetSpec(path=str(path), format="text", max_rows=7)
    rows = load_rows(spec)
    assert [row["text"] for row in rows] == [f"row {i}" for i in range(7)]
    if streaming:
        from finetune.data.streaming import dataset_rows

        assert len(list(dataset_rows(spec))) == 7


# ------------------------------------------------------------------------------------------------- GRPO prompts
def post_processed_llama():
    """Llama 3.1's tokenizer as its tokenizer.json ships: BOS put first by a post-processor (test_trained_token_edges)."""
    from tokenizers import processors

    tokenizer = family_tokenizer("llama-3.1")
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_token_id)])
    return tokenizer


def test_a_text_prompt_that_writes_its_bos_gets_no_second_one():
    """Found by a bug bash (bb54 PR01): with the `ids[:1] == [bos]` check dropped every test passed, and a text prompt
    that holds the BOS got a second one (training rows never hold two)."""
    tokenizer = post_processed_llama()
    bos = tokenizer.bos_token_id
    plain = prompt_ids("hello there", tokenizer, chat=False)
    assert plain[0] == bos and plain.count(bos) == 1
    assert prompt_ids(f"{tokenizer.bos_token}hello there", tokenizer, chat=False) == plain


def _grpo_recipe(path, max_length: int, completion: int):
    return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"objective": "grpo", "micro_batch_size": 4},
                            "data": {"datasets": [{"path": str(path), "format": "prompt"}], "max_length": max_length},
                            "grpo": {"num_generations": 4, "max_completion_length": completion,
                                     "reward_functions": ["finetune.rewards:exact_match"]}})


def test_a_prompt_of_exactly_the_budget_is_kept(tmp_path):
    """Found by a bug bash (bb54 PR02): `>=` for `>` in the prompt budget check passed; a prompt of exactly
    data.max_length - grpo.max_completion_length tokens would be refused (or dropped)."""
    tokenizer = build_tokenizer()
    text = "What is 2 plus 3 and then some more words?"
    size = len(prompt_ids(text, tokenizer, chat=False))
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": text, "answer": "5"}])
    (kept,), _, stats = prompt_examples(_grpo_recipe(path, size + 8, 8), tokenizer)
    assert len(kept.input_ids) == size and stats.dropped == 0
    with pytest.raises(DataError, match=f"the prompt is {size} tokens, over the prompt budget of {size - 1}"):
        prompt_examples(_grpo_recipe(path, size + 7, 8), tokenizer)


def test_a_reply_whose_second_tool_call_does_not_parse_has_no_tool_calls():
    """Found by a bug bash (bb54 RP02): `all` for `any` passed; a reply whose second `<tool_call>` block does not parse
    gave `tool_calls: [{...}, None]` to reward functions and clients. As TRL's parse_response, the text stays the
    content."""
    tokenizer = family_tokenizer("qwen3")
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"Let me look.\n{good}\n<tool_call>\n{{not json\n</tool_call>"
    message = reply_message(text, tokenizer)
    assert "tool_calls" not in message and message["content"] == text, message
    both = reply_message(f"Let me look.\n{good}\n{good}", tokenizer)
    assert [call["function"]["name"] for call in both["tool_calls"]] == ["get_weather", "get_weather"]


def test_a_folder_of_exactly_the_listed_number_of_files_is_listed(tmp_path):
    """Found by a bug bash (bb54 SO02, weak: a message): a not-found path beside exactly LISTED_FILES data files (and
    no near name) lists them; `<` for `<=` passed."""
    from finetune.data.sources import LISTED_FILES, near_name

    names = [f"{chr(ord('a') + i)}{i}.jsonl" for i in range(LISTED_FILES)]
    for name in names:
        (tmp_path / name).write_text("{}\n")
    assert near_name(tmp_path / "quokka.jsonl") == f" {tmp_path} holds: {', '.join(sorted(names))}."
    (tmp_path / "zz.jsonl").write_text("{}\n")
    assert near_name(tmp_path / "quokka.jsonl") == ""
