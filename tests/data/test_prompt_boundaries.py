"""A trained row's prompt has the tokens serving gives it, and what the data and recipe checks say about prompts.

Found by bug bashes (bb36 #1, #4, #5; bb34 F5): with a GPT-2-style tokenizer (SmolLM2's, StarCoder's) an answer that
starts with indentation was trained after a prompt no server sends (the generation prompt's `\\n` and the answer's
spaces were one token `\\n   `, trained); a completion prompt ending in `\\n\\n` was trained as two `\\n` tokens where
the prompt alone is one `\\n\\n`; DeepSeek-R1 rows without reasoning are trained after `<｜Assistant｜>` while serving
prompts end `<｜Assistant｜><think>\\n`, with no word said; `data.chat_template_kwargs` was refused as a setting
"finetune makes itself"; an empty mapped column, and a .txt file's blank line, were told to map the columns.
"""

from __future__ import annotations

import pytest
from chat_families import family_tokenizer

from finetune.chat_templates import resolve_chat_template
from finetune.cli.tiny import CHATML_TEMPLATE
from finetune.data.chat import prefill_misses, prefill_note
from finetune.data.examples import IGNORE_INDEX
from finetune.data.templates import answer_starts, check_row, render_examples, render_segments, tokenize_many
from finetune.data.tokens import own_prompt_note
from finetune.errors import DataError, RecipeError
from finetune.recipe import DatasetSpec, validate_recipe

CHAT = DatasetSpec(path="rows.jsonl", format="chat")
COMPLETION = DatasetSpec(path="rows.jsonl", format="completion")
CODE = {"messages": [{"role": "user", "content": "Indent this line: return x"},
                     {"role": "assistant", "content": "    return x"}]}


@pytest.fixture(scope="module")
def gpt2_like():
    """A byte-level BPE with GPT-2's pre-tokenizer (SmolLM2's), trained here on indented code and paragraphs so that
    `\\n   ` and `\\n\\n` are tokens, with ChatML; `<s>` is put first by its post-processor (a BOS it adds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["def f(x):\n    return x\n\ndef g(y):\n    return y\n", "Answer the question.\n\n", "It is two.\n"] * 50
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token="<s>")
    tokenizer.chat_template = CHATML_TEMPLATE
    assert backend.encode("\n    return", add_special_tokens=False).tokens[0] == "ĊĠĠĠ"  # the premises: the merge,
    assert backend.encode(".\n\n", add_special_tokens=False).tokens == [".", "ĊĊ"]  # and `\n\n` one token alone
    return tokenizer


def _prompt(example) -> list[int]:
    return example.input_ids[: next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)]


def _trained(example, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


def test_an_answer_merging_with_the_generation_prompt_is_trained_after_the_serving_prompt(gpt2_like):
    (segments,) = render_examples(CODE, CHAT, gpt2_like, None, "line 1")
    split: list[int] = []
    (example,) = tokenize_many([segments], gpt2_like, bos=False, own_prompt_rows=split)
    serving = gpt2_like.apply_chat_template(CODE["messages"][:1], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    assert _prompt(example) == serving  # was `...assistant` + a trained `\n   `: a prompt no server sends
    assert _trained(example, gpt2_like) == "    return x<|im_end|>" and split == [0]
    plain = {"messages": [CODE["messages"][0], {"role": "assistant", "content": "return x"}]}
    (segments,) = render_examples(plain, CHAT, gpt2_like, None, "line 2")
    (example,) = tokenize_many([segments], gpt2_like, bos=False, own_prompt_rows=split)
    text = "".join(text for text, _ in segments)  # no straddling token: the one-string tokens, bitwise
    assert example.input_ids == gpt2_like.backend_tokenizer.encode(text, add_special_tokens=False).ids and split == [0]


def test_every_trained_turn_of_a_conversation_follows_its_own_prompt(gpt2_like):
    messages = [*CODE["messages"], {"role": "user", "content": "And y?"}, {"role": "assistant", "content": "    return y"}]
    (segments,) = render_examples({"messages": messages}, CHAT, gpt2_like, None, "line 1")
    (example,) = tokenize_many([segments], gpt2_like, bos=False)
    newline = gpt2_like.convert_tokens_to_ids("Ċ")
    starts = [i for i in range(1, len(example.labels))
              if example.labels[i] != IGNORE_INDEX and example.labels[i - 1] == IGNORE_INDEX]
    assert len(starts) == 2 and all(example.input_ids[i - 1] == newline for i in starts)  # `assistant\n`, both turns
    serving = gpt2_like.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert example.input_ids[: starts[0]] == serving
    assert _trained(example, gpt2_like) == "    return x<|im_end|>    return y<|im_end|>"


def test_a_completion_prompt_keeps_its_own_tokens_and_its_bos(gpt2_like):
    """GPT-2's pre-tokenizer splits a `\\n\\n` before a word into `\\n` `\\n`: no token straddles, yet the prompt alone
    is one `\\n\\n` token (checked on the whitespace run the prompt ends with)."""
    for prompt, answer in (("Answer the question.\n\n", "It is two."), ("def f(x):\n", "    return x")):
        segments = render_segments({"prompt": prompt, "completion": answer}, COMPLETION, gpt2_like, None, "line 1")
        split: list[int] = []
        (example,) = tokenize_many([segments], gpt2_like, own_prompt_rows=split)
        assert _prompt(example) == gpt2_like(prompt)["input_ids"] and split == [0]  # `<s>` first, once
        assert _trained(example, gpt2_like) == answer + "<|im_end|>"


def test_a_turns_answer_after_its_untrained_reasoning_is_no_prompt_end(gpt2_like):
    """data.reasoning: context leaves a turn's reasoning untrained inside the turn: the row is split where the prompt
    ends, not before the answer, and answer_starts finds the answer in the same tokens."""
    from finetune.data.chat import OPENER, REASONING

    segments = [("def f(x):\n", False), ("    <t>", OPENER), (" ok\n", REASONING), ("    return x", True)]
    (example,) = tokenize_many([segments], gpt2_like, bos=False)
    prompt = gpt2_like("def f(x):\n", add_special_tokens=False)["input_ids"]
    assert example.input_ids[: len(prompt)] == prompt
    rest = gpt2_like("    <t> ok\n    return x", add_special_tokens=False)["input_ids"]
    assert example.input_ids[len(prompt):] == rest  # one piece: the turn as the model writes it (`\n   ` joined)
    (start,) = answer_starts([segments], gpt2_like, bos=False)
    assert gpt2_like.decode(example.input_ids[start:]) == "\n    return x"


def test_the_own_prompt_rows_note_counts_and_says_why():
    note = own_prompt_note(2, "rows.jsonl line 4")
    assert note.startswith("2 rows (the first: rows.jsonl line 4) were tokenized in pieces at the end of a prompt")
    assert "as serving tokenizes it" in note and own_prompt_note(1, "x").startswith("1 row (the first: x) was")


def test_deepseek_rows_without_reasoning_are_counted_for_a_note():
    tokenizer = family_tokenizer("deepseek-r1", template=resolve_chat_template("deepseek-r1"))
    before = prefill_misses()
    row = {"messages": [{"role": "user", "content": "Pick a colour."}, {"role": "assistant", "content": "Teal."}]}
    (segments,) = render_examples(row, CHAT, tokenizer, None, "line 1")
    assert prefill_misses() == before + 1
    assert "".join(text for text, trained in segments if not trained).endswith("<｜Assistant｜>")  # unchanged: trained
    thought = {"messages": [row["messages"][0], {**row["messages"][1], "reasoning_content": "Calm."}]}
    render_examples(thought, CHAT, tokenizer, None, "line 2")  # a turn with reasoning follows the whole prompt
    assert prefill_misses() == before + 1
    note = prefill_note(3, "rows.jsonl line 1")
    assert note.startswith("3 rows (the first: rows.jsonl line 1) have an assistant turn without reasoning")
    assert "give those turns a reasoning" in note and "model.chat_template" in note


def test_chat_template_kwargs_is_said_to_be_unsupported_with_what_to_do():
    with pytest.raises(RecipeError) as caught:
        validate_recipe({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}],
                                                                  "chat_template_kwargs": {"enable_thinking": False}},
                         "grpo": {"top_k": 5}})
    text = str(caught.value)
    assert "makes itself" not in text  # (was: "a setting ... that finetune makes itself ...; leave it out")
    assert "`chat_template_kwargs` has no counterpart here: chat template arguments for every row are not a recipe" in text
    assert "`chat_template_kwargs` column" in text  # the rows' own column is (docs/data.md)
    assert "{%- set enable_thinking = false %}" in text and "grpo.temperature and grpo.top_p only" in text


def test_an_empty_field_is_told_apart_from_a_missing_column():
    mapped = DatasetSpec(path="rows.jsonl", format="text", columns={"text": "body"})
    with pytest.raises(DataError) as caught:
        check_row({"body": ""}, mapped, "rows.jsonl line 2")
    assert "missing or empty `body`" in str(caught.value) and "data.datasets[].columns" not in str(caught.value)
    assert "The column is there and empty in this row" in str(caught.value)
    with pytest.raises(DataError, match=r"map the columns with data\.datasets\[\]\.columns"):
        check_row({"content": "x"}, mapped, "rows.jsonl line 3")
    spec = DatasetSpec(path="corpus", format="text")  # a folder of .txt files: `a.txt line 2` (readers.text_rows)
    with pytest.raises(DataError) as caught:
        check_row({"text": ""}, spec, "corpus a.txt line 2")
    text = str(caught.value)
    assert "corpus a.txt line 2: an empty line of a .txt file. A .txt file is read one row per line" in text
    assert "data.datasets[].columns" not in text and "sample_by: paragraph or document" in text


def test_a_later_turn_trains_after_the_history_a_server_sends(gpt2_like):
    """Found by a bug bash (bb55 #1, random conversations against apply_chat_template): a conversation tokenized in
    pieces so that its first turn follows its prompt's own tokens held that cut in its second turn's history: the
    first answer's indentation `\\n   ` became `\\n`, `   `, where a server tokenizes the history as one string. Each
    later turn whose history holds such a cut now gets an example of its own (said in a note); every trained turn
    follows exactly apply_chat_template(history, add_generation_prompt=True), and every answer is trained once."""
    from finetune.data.build import count_notes
    from finetune.data.tokenize import tokenize_chunk

    messages = [*CODE["messages"], {"role": "user", "content": "And y?"}, {"role": "assistant", "content": "    return y"},
                {"role": "user", "content": "And z?"}, {"role": "assistant", "content": "z"}]
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "rows.jsonl",
                              "format": "chat"}], "max_length": 512, "eval_fraction": 0}})
    result = tokenize_chunk([{"messages": messages}], ["line 1"], [], CHAT, recipe, gpt2_like)
    answers = []
    for example in result.examples:
        starts = [i for i in range(1, len(example.labels))
                  if example.labels[i] != IGNORE_INDEX and example.labels[i - 1] == IGNORE_INDEX]
        for start in starts:
            turns = example.input_ids[:start].count(gpt2_like.convert_tokens_to_ids("<|im_start|>")) // 2
            serving = gpt2_like.apply_chat_template(messages[: 2 * turns - 1], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
            assert example.input_ids[:start] == serving, turns  # turn 2's was `...assistant\n`, `   `, ` return`
        answers.append(_trained(example, gpt2_like))
    assert answers == ["    return x<|im_end|>", "    return y<|im_end|>", "z<|im_end|>"]
    assert result.counts["served_turns"] == 2 and result.origins == ["line 1"] * 3
    (note, served) = count_notes([dict(result.counts, first_own_prompt_row="rows.jsonl line 1")])
    assert note.startswith("1 row (the first: rows.jsonl line 1) was tokenized in pieces")
    assert served.startswith("2 later turns of the conversations tokenized in pieces (the first: rows.jsonl line 1)")
