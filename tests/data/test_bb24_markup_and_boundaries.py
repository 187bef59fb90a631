"""Markup-like text in user data and tokenizer boundaries (bug bash 24).

Found by a bug bash (bb24), each reproduced on the code before this file:
1. the fast labelling path left untrained every token but the first of a trained segment's last character (an emoji,
   CJK, a combining accent: several byte-level tokens), where the offsets path trains them all;
2. an answer that writes its own `<think>` after some text and closes it on a line of its own (an XML example) was cut
   into "reasoning" and answer, silently (`data.reasoning: drop` deleted the first half of the answer);
3. text-prompt preference and KTO rows on a Llama-2-style tokenizer (a normalizer that prepends `▁`) scored a space
   the row does not have (`Answer:  yes`), and `finetune data` hid it;
4. a tokenizer with neither a pad nor an EOS token passed `finetune data` and crashed at the first batch;
5. an answer holding a literal `</think>` under Qwen3 was refused with advice that does not work for a Qwen model;
6. a completion that is only the EOS (or a zero-width space) trained only its end token;
7. a UTF-16 data file was told to convert from latin1, and an undecodable line under bad_rows: skip said nothing of why
   it is not skipped.
"""

from __future__ import annotations

import codecs
import json

import pytest
from chat_families import family_tokenizer, llama2_like_tokenizer
from conftest import write_jsonl

from finetune import data
from finetune.chat_templates import resolve_chat_template
from finetune.cli.preview import format_stats, mark_trained
from finetune.cli.tiny import build_tokenizer
from finetune.data import IGNORE_INDEX
from finetune.data.conversations import convert_turns
from finetune.data.loader import collate
from finetune.data.pairs import tokenize_prompted
from finetune.data.templates import _labels, render_examples, render_segments, tokenize_many
from finetune.data.tokenize import check_dataset
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")
CHAT = DatasetSpec(path="rows.jsonl", format="chat")


def trained(example, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


def recipe_for(path, fmt: str, **data_keys):
    section = {"datasets": [{"path": str(path), "format": fmt}], "max_length": 128, "eval_fraction": 0, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"micro_batch_size": 1}})


# ------------------------------------------------------------------------------ 1. a segment's last character
@pytest.mark.parametrize("answer", ["smile 🙂", "日本語", "e\u0301", "ok\u200b", "中"])
def test_fast_labels_train_every_token_of_the_last_character(tokenizer, answer):
    """The Rust fast path (char_to_token of the span's last character) gave only that character's first byte-token:
    `smile 🙂` trained `smile \\xf0`, `日本語` trained `日本` and the first byte of `語`."""
    segments = [("Q:", False), (answer, True), (" tail", False)]
    fast = tokenize_many([segments], tokenizer, bos=False)[0]
    encoded = tokenizer("".join(text for text, _ in segments), add_special_tokens=False, return_offsets_mapping=True)
    assert fast.labels == _labels(encoded["input_ids"], encoded["offset_mapping"], segments)
    assert trained(fast, tokenizer) == answer


# -------------------------------------------------------------------------- 2. `</think>` lines in answers
QUOTED = "```xml\n<think>\nyour plan here\n</think>\n<answer>42</answer>\n```"


def test_an_answer_that_writes_its_own_think_block_stays_the_answer(tokenizer):
    """A content holding `<think>` after some text and its `</think>` on a line of its own is no DeepSeek-R1 output
    (whose template prefills the opening tag): it was cut there, `<think>` added, and reasoning: drop trained only
    `<answer>42</answer>\\n```` of it."""
    (message,) = convert_turns([{"role": "assistant", "content": QUOTED}], CHAT, "row")
    assert message == {"role": "assistant", "content": QUOTED}
    row = {"messages": [{"role": "user", "content": "Show a template."}, {"role": "assistant", "content": QUOTED}]}
    for reasoning in ("train", "drop"):
        segments = render_examples(row, CHAT, tokenizer, None, "row", reasoning=reasoning)[0]
        assert [text for text, flag in segments if flag] == [QUOTED + "<|im_end|>"]
    # R1's shape (no opening tag, the closing one on its own line) is still its reasoning and answer
    (r1,) = convert_turns([{"role": "assistant", "content": "Add them.\n</think>\n\n42"}], CHAT, "row")
    assert (r1["reasoning"], r1["content"]) == ("Add them.", "42")


def test_rows_read_by_the_closing_tag_rule_are_counted_and_named(tmp_path, tokenizer):
    """Rows whose answer became reasoning + answer by the `</think>`-line rule were rewritten without a word: the
    cache keeps their count and first row, and `finetune data` says it (a cached run too)."""
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}
            for content in ("plain answer", "It closes on its own line:\n</think>\nand the answer follows.", QUOTED,
                            "plan\n</think>\n\nanswer")]
    recipe = recipe_for(write_jsonl(tmp_path / "rows.jsonl", rows), "chat")
    for _ in range(2):  # built, then mapped from the cache
        lines = [line for line in format_stats(data.prepare(recipe, tokenizer), recipe).splitlines()
                 if line.startswith("reasoning:")]
        assert len(lines) == 1 and "reasoning: 2 rows (the first: " in lines[0] and "rows.jsonl line 2)" in lines[0]
    quiet = recipe_for(write_jsonl(tmp_path / "plain.jsonl", rows[:1] + rows[2:3]), "chat")
    assert "reasoning:" not in format_stats(data.prepare(quiet, tokenizer), quiet)


# -------------------------------------------------------------------- 3. Llama-2-style prefix space in pairs
@pytest.fixture(scope="module")
def llama2_like():
    return llama2_like_tokenizer()


def trl_completion(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """TRL 1.16's DPO/KTO rule for text prompts: the joint ids, the completion after their common prefix with the
    prompt's ids (dpo_trainer.py common_prefix_length)."""
    prompt_ids, joint = tokenizer(prompt)["input_ids"], tokenizer(prompt + answer)["input_ids"]
    common = next((k for k, (a, b) in enumerate(zip(prompt_ids, joint)) if a != b), min(len(prompt_ids), len(joint)))
    return joint, common


@pytest.mark.parametrize("fmt", ["preference", "unpaired_preference"])
def test_text_prompt_answers_gain_no_prefix_space(tmp_path, llama2_like, fmt):
    """`Answer: ` + `yes` was scored as `<s> ... Answer: ▁ ▁yes </s>` (the lone answer given the normalizer's `▁`:
    two spaces); TRL scores `... Answer: ▁yes </s>`. The preview showed `Answer: [[yes</s>]]` either way."""
    row = {"prompt": "Is the sky blue? Answer: ", **({"chosen": "yes", "rejected": "no"} if fmt == "preference" else
                                                     {"completion": "yes", "label": True})}
    spec = DatasetSpec(path="rows.jsonl", format=fmt)
    rendered = render_segments(row, spec, llama2_like, None, "row")
    sequences = list(rendered) if fmt == "preference" else [rendered[0]]
    for segments, example in zip(sequences, tokenize_prompted(sequences, llama2_like, bos=True)):
        answer = segments[-1][0].removesuffix("</s>")
        joint, common = trl_completion(llama2_like, segments[0][0], answer)
        assert example.input_ids == joint + [llama2_like.eos_token_id]
        assert [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX] == list(range(common, len(joint) + 1))
        shown = mark_trained(example, llama2_like)
        assert shown.replace("[[", "").replace("]]", "") == llama2_like.decode(example.input_ids)
        assert shown.endswith(f"Answer:[[ {answer}</s>]]")  # the trained `▁yes` holds the prompt's space


def test_preview_shows_a_space_a_run_starts_with(llama2_like):
    """Each run was decoded alone, and a decoder that strips a leading space hid the space (or two) of its first token."""
    ids = llama2_like("Answer:")["input_ids"] + llama2_like.convert_tokens_to_ids(["▁", "▁yes"])
    example = data.Example(ids, [IGNORE_INDEX] * (len(ids) - 1) + [ids[-1]])
    assert mark_trained(example, llama2_like).endswith("Answer: [[ yes]]")


# ----------------------------------------------------------------------------- 4. no pad and no EOS
@pytest.fixture
def no_end_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    return tokenizer


def test_a_tokenizer_without_pad_and_eos_is_refused_before_any_weight_loads(tmp_path, no_end_tokenizer):
    """It passed `finetune data` and `validate`; the run crashed at its first batch in torch.full(..., None)."""
    recipe = recipe_for(write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Q", "completion": "A"}] * 2), "completion")
    with pytest.raises(DataError, match=r"(?s)neither a pad token nor an EOS token.*Fix:.*pad_token.*model\.tokenizer"):
        data.prepare(recipe, no_end_tokenizer)
    with pytest.raises(DataError, match="neither a pad token nor an EOS token"):
        collate([data.Example([1, 2], [1, 2]), data.Example([3], [3])], None)


def test_a_tokenizer_without_eos_is_noted_once(no_end_tokenizer, capsys):
    """With a pad but no EOS, completion rows trained with no end token and the run said nothing."""
    no_end_tokenizer.pad_token = "<|endoftext|>"
    for fmt in ("completion", "completion", "alpaca"):
        check_dataset([], DatasetSpec(path="rows.jsonl", format=fmt), no_end_tokenizer, "rows.jsonl")
    notes = [line for line in capsys.readouterr().out.splitlines() if "has no EOS token" in line]
    assert len(notes) == 1 and "train without an end token" in notes[0]
    check_dataset([], CHAT, build_tokenizer(), "rows.jsonl")  # a tokenizer with its EOS: nothing said
    assert "EOS" not in capsys.readouterr().out


def test_a_run_reading_its_rows_from_the_cache_is_told_they_have_no_end_token(tmp_path, capsys):
    """The no-EOS note came from tokenizing only: a run whose rows came from the token cache (every run after the
    first on the same data) trained without an end token without a word (bb24 #4, the fixer's note)."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(8)])
    for expected_cached in (0, 1):
        tokenizer = build_tokenizer()  # a fresh one each time: the note is said once per tokenizer (per run)
        tokenizer.eos_token = None
        tokenizer.pad_token = "<|endoftext|>"
        prepared = data.prepare(recipe_for(path, "completion"), tokenizer)
        assert prepared.stats.cached_datasets == expected_cached
        assert "has no EOS token" in capsys.readouterr().out


# -------------------------------------------------------------------------- 5. `</think>` under Qwen3
def test_a_literal_closing_tag_under_qwen3_is_named_with_a_fix_that_works():
    """The refusal named no cause and advised the named templates, qwen3 and qwen3.5 included, which fail alike."""
    row = {"messages": [{"role": "user", "content": "Explain the <think> tag."}, {"role": "assistant",
                        "content": "Qwen3 writes <think> then its plan, then </think> and the answer."}]}
    for template in ("qwen3", "qwen3.5"):
        tokenizer = family_tokenizer("qwen3", template=resolve_chat_template(template))
        with pytest.raises(DataError, match=r"(?s)holds the text `</think>`.*Fix:.*model\.chat_template: chatml"):
            render_examples(row, CHAT, tokenizer, None, "row")
    chatml = family_tokenizer("qwen3", template=resolve_chat_template("chatml"))  # the fix it gives
    (segments,) = render_examples(row, CHAT, chatml, None, "row")
    assert [text for text, flag in segments if flag] == [row["messages"][1]["content"] + "<|im_end|>"]


# ----------------------------------------------------------------------------- 6. an answer of only EOS
@pytest.mark.parametrize("fmt,answer", [("completion", "<|im_end|>"), ("completion", "\u200b"),
                                        ("completion", " <|im_end|>\ufeff"), ("alpaca", "<|im_end|>")])
def test_an_answer_of_only_its_end_token_is_refused(tokenizer, fmt, answer):
    """`{"completion": "<|im_end|>"}` trained only the EOS (a chat row with an empty answer is refused for that)."""
    row = {"prompt": "Q5", "completion": answer} if fmt == "completion" else {"instruction": "Q5", "output": answer}
    with pytest.raises(DataError, match="teaching the model to stop at once. Fix the row or set data.bad_rows: skip"):
        render_segments(row, DatasetSpec(path="rows.jsonl", format=fmt), tokenizer, None, "line 5")
    chat = {"messages": [{"role": "user", "content": "Q5"}, {"role": "assistant", "content": "\u200b"}]}
    with pytest.raises(DataError, match="teaching the model to stop at once"):
        render_examples(chat, CHAT, tokenizer, None, "line 5")
    ok = render_segments({"prompt": "Q", "completion": "ok<|im_end|>"}, DatasetSpec(path="r", format="completion"),
                         tokenizer, None, "line 1")
    assert ok == [("Q", False), ("ok<|im_end|>", True)]


# ------------------------------------------------------------------------------------- 7. file encodings
def test_a_utf16_file_is_named_utf16_with_its_iconv_fix(tmp_path, tokenizer):
    """A Windows "Unicode" (UTF-16, BOM FF FE) .jsonl was told `not UTF-8 ... iconv -f latin1`."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(codecs.BOM_UTF16_LE + (json.dumps({"instruction": "hi", "output": "yo"}) + "\n").encode("utf-16-le"))
    with pytest.raises(DataError, match=r"UTF-16 text .*byte-order mark ff fe.*`iconv -f UTF-16 -t UTF-8 IN > OUT`"):
        data.prepare(recipe_for(path, "alpaca", bad_rows="skip"), tokenizer)


def test_an_undecodable_line_says_why_bad_rows_skip_does_not_skip_it(tmp_path, tokenizer):
    """Under bad_rows: skip a broken JSON line is skipped and counted, an undecodable one stopped the run without a
    word of why (its message even suggested removing the line)."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    with pytest.raises(DataError, match=r"(?s)line 2: not UTF-8 text \(byte 0xe9 at column 21\).*data\.bad_rows: skip "
                                        r"does not skip it"):
        data.prepare(recipe_for(path, "alpaca", bad_rows="skip"), tokenizer)


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_a_utf16_csv_is_named_utf16_with_its_iconv_fix(tmp_path, tokenizer, suffix):
    """Excel's "Unicode text" export is UTF-16 (BOM FF FE): a CSV/TSV of it was told `not UTF-8 ... iconv -f latin1`
    (or cp1252), as the .jsonl was before (bb24 #7, the CSV reader)."""
    separator = "," if suffix == ".csv" else "\t"
    path = tmp_path / f"rows{suffix}"
    text = f"instruction{separator}output\nhi{separator}yo\n"
    path.write_bytes(codecs.BOM_UTF16_LE + text.encode("utf-16-le"))
    with pytest.raises(DataError, match=r"UTF-16 text .*byte-order mark ff fe.*`iconv -f UTF-16 -t UTF-8 IN > OUT`"):
        data.prepare(recipe_for(path, "alpaca"), tokenizer)
