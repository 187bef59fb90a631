"""Preference, KTO and GRPO rows a review (2026-12-06) found trained wrong without a word or ending in a traceback.

Each was reproduced on the code before this file: an answer given as one message object (LLaMA-Factory's preference
form) trained as its Python repr; a pair alike once rendered passed as a pair; a Qwen-style BPE merged the generation
prompt's last newline into one answer's first token, so the two answers of a pair had different prompt tokens and a
prompt character was scored in one of them; GRPO's chat prompts skipped the normal form every other row goes through
(text parts and ShareGPT turns became empty turns, an unknown role vanished, an assistant-ending prompt got a fresh
header, tools the template cannot render were dropped, a list of strings was a traceback).
"""

from __future__ import annotations

import pytest
from chat_families import family_tokenizer, trl_template

from finetune.data import IGNORE_INDEX
from finetune.data.pairs import tokenize_prompted
from finetune.data.prompts import prompt_text
from finetune.data.templates import render_segments, tokenize_many
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

PAIRS = DatasetSpec(path="pairs.jsonl", format="preference")
UNPAIRED = DatasetSpec(path="kto.jsonl", format="unpaired_preference")
PROMPTS = DatasetSpec(path="prompts.jsonl", format="prompt")
USER = [{"role": "user", "content": "What is 2+2?"}]


def test_an_answer_given_as_one_message_is_that_message():
    tokenizer = family_tokenizer("qwen3")
    as_lists = {"prompt": USER, "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}]}
    as_objects = {"prompt": USER, "chosen": {"role": "assistant", "content": "4"}, "rejected": {"from": "gpt", "value": "5"}}
    assert render_segments(as_objects, PAIRS, tokenizer, None, "line 1") == render_segments(as_lists, PAIRS, tokenizer,
                                                                                            None, "line 1")
    kto = {"prompt": USER, "completion": {"role": "assistant", "content": "4"}, "label": True}
    (segments, desirable) = render_segments(kto, UNPAIRED, tokenizer, None, "line 1")
    assert desirable and [text for text, trained in segments if trained] == ["<think>\n\n</think>\n\n4<|im_end|>"]
    with pytest.raises(DataError, match=r"line 1: `chosen` is True; an answer is text, an assistant message"):
        render_segments({**as_lists, "chosen": True}, PAIRS, tokenizer, None, "line 1")


def test_a_pair_alike_once_rendered_or_without_a_prompt_is_refused():
    row = {"prompt": USER, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "4"}
    with pytest.raises(DataError, match="`chosen` and `rejected` render identically"):
        render_segments(row, PAIRS, family_tokenizer("qwen3"), None, "line 1")
    with pytest.raises(DataError, match=r"line 1: `prompt` is missing: the answers need the prompt"):  # (was: "ends
        render_segments({"chosen": "4", "rejected": "5"}, PAIRS, family_tokenizer("qwen3"), None, "line 1")  # with nothing")


def _qwen_like_bpe():
    """A small BPE with Qwen2's pre-tokenizer (a newline run is one pre-token: `\\n\\n` is one token, as in Qwen's
    vocabulary), trained here, with Qwen3.5's template (it prefills `<think>\\n`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    split = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
             r"""\s+(?!\S)|\s+""")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["Hello there\n\nThis is a paragraph\n\nAnother one, two plus two\n"] * 50,
                                trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                    "<|im_end|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = trl_template("qwen3_5_think.jinja")
    return tokenizer


def _prompt_ids(example) -> list[int]:
    return example.input_ids[: next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)]


def test_both_answers_of_a_pair_follow_the_same_prompt_tokens():
    """TRL tokenizes a preference row's prompt apart from its answers; finetune does where a token would straddle."""
    tokenizer = _qwen_like_bpe()
    row = {"prompt": [{"role": "user", "content": "What is two plus two?"}],
           "chosen": [{"role": "assistant", "reasoning_content": "two plus two is four", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    pair = list(render_segments(row, PAIRS, tokenizer, None, "line 1"))
    chosen, rejected = tokenize_many(pair, tokenizer)
    assert _prompt_ids(chosen) == _prompt_ids(rejected)  # tokenize_many splits such a row too (data/tokens.py)
    chosen, rejected = tokenize_prompted(pair, tokenizer)
    assert _prompt_ids(chosen) == _prompt_ids(rejected)
    assert tokenizer.decode([t for t, label in zip(rejected.input_ids, rejected.labels) if label != IGNORE_INDEX]) == \
        "\n</think>\n\n5<|im_end|>"
    assert tokenize_prompted([pair[0]], family_tokenizer("qwen3")) == tokenize_many([pair[0]], family_tokenizer("qwen3"))


@pytest.mark.parametrize("prompt", [
    [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}],
    [{"from": "human", "value": "What is 2+2?"}],
], ids=["text parts", "sharegpt"])
def test_grpo_chat_prompts_take_every_shape_a_chat_row_takes(prompt):
    tokenizer = family_tokenizer("qwen3")
    expected = prompt_text(USER, tokenizer, "Be brief.", spec=PROMPTS)
    assert "What is 2+2?" in expected
    assert prompt_text(prompt, tokenizer, "Be brief.", spec=PROMPTS, where="row 3") == expected


@pytest.mark.parametrize("prompt,match", [
    ([{"role": "usr", "content": "Hi"}], r"row 3: message 1 has role `usr`"),
    ([*USER, {"role": "assistant", "content": "4"}], r"row 3: a chat prompt must end with a user turn .*ends with assistant"),
    (["What is 2+2?"], r"row 3: message 1 needs `role` and `content`"),
], ids=["unknown role", "assistant last", "list of strings"])
def test_grpo_prompts_the_policy_cannot_answer_are_the_rows_error(prompt, match):
    with pytest.raises(DataError, match=match):
        prompt_text(prompt, family_tokenizer("qwen3"), None, spec=PROMPTS, where="row 3")


def test_grpo_tools_a_template_cannot_render_are_refused():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert "get_weather" in prompt_text(USER, family_tokenizer("qwen3"), None, tools=tools, spec=PROMPTS)
    with pytest.raises(DataError, match=r"row 3: the row offers tools, but the tokenizer's chat template does not render"):
        prompt_text(USER, family_tokenizer("deepseek-r1"), None, tools=tools, spec=PROMPTS, where="row 3")


def test_a_rows_own_system_heads_its_pair_and_kto_prompt():
    """A row's `system` column (LLaMA-Factory's preference exports carry one per row) was dropped from pairs, KTO and
    GRPO prompts while chat rows honoured it: the pair was scored without the instruction it answers."""
    tokenizer = family_tokenizer("qwen3")
    pair = {"system": "Answer in French.", "prompt": "What is 2+2?", "chosen": "quatre", "rejected": "four"}
    as_messages = {**pair, "prompt": [{"role": "system", "content": "Answer in French."}, *USER]}
    del as_messages["system"]
    chosen, rejected = render_segments(pair, PAIRS, tokenizer, "Be brief.", "line 1")
    assert (chosen, rejected) == render_segments(as_messages, PAIRS, tokenizer, None, "line 1")
    assert "Answer in French." in chosen[0][0] and "Be brief." not in chosen[0][0]
    kto = {"system": "Answer in French.", "prompt": "What is 2+2?", "completion": "quatre", "label": True}
    (segments, _) = render_segments(kto, UNPAIRED, tokenizer, None, "line 1")
    assert segments == chosen
    # no row system: the dataset's, then data.system_prompt; a base model's raw text gets it as alpaca rows do
    assert "Be brief." in render_segments({**pair, "system": ""}, PAIRS, tokenizer, "Be brief.", "line 1")[0][0][0]
    base = family_tokenizer("qwen3")
    base.chat_template = None
    raw, _ = render_segments(pair, PAIRS, base, None, "line 1")
    assert raw[0] == ("Answer in French.\n\nWhat is 2+2?", False)


def test_a_grpo_rows_system_heads_its_chat_prompt(tmp_path):
    from finetune.data.prompts import prompt_examples
    from finetune.recipe import Recipe

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "What is 2+2?"}], "system": "Answer in French."}\n')
    recipe = Recipe.model_validate({"model": {"name_or_path": "tiny"}, "train": {"objective": "grpo", "micro_batch_size": 8},
                                    "grpo": {"reward_functions": ["finetune.rewards:exact_match"],
                                             "max_completion_length": 64},
                                    "data": {"datasets": [{"path": str(path), "format": "prompt"}],
                                             "system_prompt": "Be brief."}})
    tokenizer = family_tokenizer("qwen3")
    (example,), _, _ = prompt_examples(recipe, tokenizer)
    text = tokenizer.decode(example.input_ids)
    assert "Answer in French." in text and "Be brief." not in text
    assert example.row["system"] == "Answer in French."  # the reward functions still see the column
