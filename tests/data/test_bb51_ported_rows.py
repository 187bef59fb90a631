"""Rows ported from LLaMA-Factory and axolotl, which a bug bash (bb51) found trained without part of what they say.

Each test reproduces a finding on the code before data/ported_rows.py: an alpaca row's LLaMA-Factory `history` was
dropped without a word (and format chat could not read such rows at all); a ranking or KTO alpaca row's `input` was
dropped once `columns` mapped the prompt to `instruction`; LLaMA-Factory's KTO rows (`messages` + `kto_tag`) were
refused with a hint listing SFT formats; axolotl's per-message training flags (`weight: 0`, `train: false`) were
ignored, so turns the data marks as bad were trained. The oracles are the tools' own rules: LLaMA-Factory's
AlpacaDatasetConverter and SharegptDatasetConverter (src/llamafactory/data/converter.py) and axolotl's
ChatTemplateStrategy (src/axolotl/prompt_strategies/chat_template.py), transcribed below.
"""

from __future__ import annotations

import json

import pytest
from chat_families import family_tokenizer

from finetune import data
from finetune.data.templates import tokenize_many
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, validate_recipe

WHERE = "rows.jsonl line 1"
LF_ROW = {"instruction": "And of Italy?", "input": "", "output": "Rome.", "system": "Be brief.",
          "history": [["Capital of France?", "Paris."], ["Of Spain?", "Madrid."]]}


def _lf_alpaca_messages(row: dict) -> list[dict]:
    """LLaMA-Factory's AlpacaDatasetConverter: history pairs, then "instruction\\ninput" (empty parts left out), the
    output, and the `system` column as the system prompt."""
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for asked, answered in row.get("history") or []:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    query = "\n".join(part for part in (row["instruction"], row.get("input")) if part)
    return messages + [{"role": "user", "content": query}, {"role": "assistant", "content": row["output"]}]


def _trained(examples) -> list[str]:
    return [text for example in examples for text, trained in example if trained]


# ------------------------------------------------------------------------------ 1. LLaMA-Factory's alpaca history
def test_an_alpaca_row_with_a_llama_factory_history_is_refused_naming_format_chat():
    """Found by a bug bash (bb51 #1): format alpaca dropped `history` without a word, so a multi-turn LLaMA-Factory
    dataset trained its last question ("And of Italy?") without the turns it follows. Now the row is refused (a bad
    row: data.bad_rows decides), naming the column and the fix; an empty history is no history."""
    spec, tokenizer = DatasetSpec(path="rows.jsonl", format="alpaca"), family_tokenizer("qwen2.5")
    with pytest.raises(DataError, match=r"`history` holds 2 earlier turns .*LLaMA-Factory's alpaca history.*fixed "
                                        r"Alpaca prompt.*format: chat.*data.bad_rows: skip"):
        data.render_segments(LF_ROW, spec, tokenizer, None, WHERE)
    mapped = DatasetSpec(path="rows.jsonl", format="alpaca", columns={"history": "turns"})
    with pytest.raises(DataError, match=r"`turns` holds 2 earlier turns"):
        data.render_segments({**LF_ROW, "turns": LF_ROW["history"], "history": []}, mapped, tokenizer, None, WHERE)
    single = {key: value for key, value in LF_ROW.items() if key != "history"}
    assert data.render_segments({**single, "history": []}, spec, tokenizer, None, WHERE) == \
        data.render_segments(single, spec, tokenizer, None, WHERE)


def test_format_chat_reads_llama_factorys_alpaca_rows_as_llama_factory_does():
    """Found by a bug bash (bb51 #1, #9): there was no way to train LLaMA-Factory's alpaca rows through the model's
    chat template (format chat refused them: no `messages`), which is how LLaMA-Factory trains them. Now format chat
    reads them as its converter does: every history response and the output trained, each with its end of turn."""
    spec, tokenizer = DatasetSpec(path="rows.jsonl", format="chat"), family_tokenizer("qwen2.5")
    row = {**LF_ROW, "input": "Answer in one word."}
    examples = data.render_examples(row, spec, tokenizer, None, WHERE)
    oracle = tokenizer.apply_chat_template(_lf_alpaca_messages(row), tokenize=False)
    assert "".join(text for text, _ in examples[-1]) == oracle
    assert "And of Italy?\nAnswer in one word." in oracle
    assert _trained(examples) == ["Paris.<|im_end|>", "Madrid.<|im_end|>", "Rome.<|im_end|>"]
    renamed = {"q": row["instruction"], "extra": row["input"], "a": row["output"], "past": row["history"],
               "system": row["system"]}
    mapped = DatasetSpec(path="rows.jsonl", format="chat",
                         columns={"instruction": "q", "input": "extra", "output": "a", "history": "past"})
    assert data.render_examples(renamed, mapped, tokenizer, None, WHERE) == examples
    with pytest.raises(DataError, match=r"`history` must be a list of \[instruction, response\] pairs"):
        data.render_examples({**row, "history": [["only a question"]]}, spec, tokenizer, None, WHERE)


# ------------------------------------------------------------------- 1. the `input` of ranking and KTO alpaca rows
def test_a_ranking_or_kto_alpaca_rows_input_is_joined_to_its_prompt_as_llama_factory_joins_it():
    """Found by a bug bash (bb51 #1): LLaMA-Factory's ranking rows (instruction, input, chosen, rejected) read with
    `columns: {prompt: instruction}` lost their `input`: the pair answered the instruction alone. LLaMA-Factory's
    prompt is "instruction\\ninput"; an input beside a prompt of chat messages is refused, not dropped."""
    tokenizer = family_tokenizer("qwen2.5")
    pair = DatasetSpec(path="pairs.jsonl", format="preference", columns={"prompt": "instruction"})
    row = {"instruction": "Capital of this country?", "input": "France", "chosen": "Paris.", "rejected": "Lyon."}
    chosen, rejected = data.render_segments(row, pair, tokenizer, None, WHERE)
    user = [{"role": "user", "content": "Capital of this country?\nFrance"}]
    assert chosen[0][0] == rejected[0][0] == tokenizer.apply_chat_template(user, tokenize=False,
                                                                           add_generation_prompt=True)
    kto = DatasetSpec(path="kto.jsonl", format="unpaired_preference",
                      columns={"prompt": "instruction", "completion": "output", "label": "kto_tag"})
    segments, desirable = data.render_segments({"instruction": "Capital of this country?", "input": "France",
                                                "output": "Paris.", "kto_tag": True}, kto, tokenizer, None, WHERE)
    assert segments[0][0] == chosen[0][0] and desirable is True
    plain = family_tokenizer("qwen2.5", template="")
    plain.chat_template = None
    chosen, _ = data.render_segments(row, pair, plain, None, WHERE)
    assert chosen[0] == ("Capital of this country?\nFrance", False)
    orca = DatasetSpec(path="pairs.jsonl", format="preference", columns={"prompt": "input"})  # (orca_dpo_pairs')
    assert data.render_segments(row, orca, plain, None, WHERE)[0][0] == ("France", False)
    unmapped = DatasetSpec(path="pairs.jsonl", format="preference")  # the input is no prompt of its own
    with pytest.raises(DataError, match=r"`prompt` is missing"):
        data.render_segments(row, unmapped, tokenizer, None, WHERE)
    # Another dataset's `input` column (its prompt not read from `instruction`) is not the prompt's: a review found
    # `input: "gsm8k"` joined to the prompt, and a chat prompt beside it refused.
    spec = DatasetSpec(path="pairs.jsonl", format="preference")
    other = {"prompt": "Capital of France?", "input": "gsm8k", "chosen": "Paris.", "rejected": "Lyon."}
    alone = {key: value for key, value in other.items() if key != "input"}
    assert data.render_segments(other, spec, tokenizer, None, WHERE) == data.render_segments(alone, spec, tokenizer,
                                                                                             None, WHERE)
    conversational = {"prompt": user, "input": "France", "chosen": "Paris.", "rejected": "Lyon."}
    assert data.render_segments(conversational, spec, tokenizer, None, WHERE)[0][0][0].endswith(
        tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True).split("<|im_start|>user")[-1])


# -------------------------------------------------------------------------- 8. KTO rows as one conversation
def _kto_recipe(path, columns=None):
    spec = {"path": str(path), "format": "unpaired_preference", **({"columns": columns} if columns else {})}
    return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"objective": "kto"}, "data": {
        "datasets": [spec], "max_length": 256, "cache": False, "eval_fraction": 0}})


def test_llama_factory_kto_rows_in_one_conversation_train_as_their_prompt_completion_label_rows(tmp_path):
    """Found by a bug bash (bb51 #8): LLaMA-Factory's KTO rows (`messages` whose last message is the completion, and
    `kto_tag`) were refused before any tokenizer loaded with a hint listing SFT formats (alpaca | chat | ...), which a
    kto run cannot use. Now they are read as LLaMA-Factory's converter reads them (prompt: the messages before the
    last), `kto_tag` as TRL's `label`: the same examples as the TRL prompt/completion/label rows they stand for."""
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "Paris."}],
        [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four?"},
         {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Five."}]]
    lf = [{"messages": turns, "kto_tag": tag} for turns, tag in zip(conversations, (True, False))]
    trl = [{"prompt": turns[:-1], "completion": turns[-1:], "label": tag} for turns, tag in zip(conversations,
                                                                                               (True, False))]
    (tmp_path / "lf.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lf), encoding="utf-8")
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps(row) + "\n" for row in trl), encoding="utf-8")
    tokenizer = family_tokenizer("qwen2.5")
    data.check_local_files(_kto_recipe(tmp_path / "lf.jsonl"))  # (the check that refused them)
    ported, _, _ = data.build_examples(_kto_recipe(tmp_path / "lf.jsonl"), tokenizer)
    expected, _, _ = data.build_examples(_kto_recipe(tmp_path / "trl.jsonl"), tokenizer)
    assert [(e.input_ids, e.labels, e.desirable) for e in ported] == \
        [(e.input_ids, e.labels, e.desirable) for e in expected]
    assert [e.desirable for e in ported] == [True, False]
    spec = DatasetSpec(path="kto.jsonl", format="unpaired_preference")
    with pytest.raises(DataError, match=r"`conversations` ends with a user turn.*the last message is the completion"):
        data.render_segments({"conversations": conversations[1][:-1], "kto_tag": True}, spec, tokenizer, None, WHERE)


# ------------------------------------------------------------------------- 2. axolotl's per-message training flags
def _axolotl_labels(tokenizer, turns: list[dict], flags: list) -> tuple[list[int], list[int]]:
    """axolotl's ChatTemplateStrategy._tokenize_single_prompt with message_field_training set, roles_to_train
    ["assistant"] and train_on_eos "turn" (its defaults): a turn is trained when its flag says so, else when it is
    an assistant turn; its tokens are those where the conversation through it parts from the same one with the turn's
    content replaced by "[[dummy_message]]" (find_turn), and the first EOS token at most 3 tokens after them."""
    def ids(conversation):
        return tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]

    input_ids = ids(turns)
    labels = [-100] * len(input_ids)
    for index, (turn, flag) in enumerate(zip(turns, flags)):
        if not (flag if flag is not None else turn["role"] == "assistant"):
            continue
        dummy, full = ids(turns[:index] + [{"role": turn["role"], "content": "[[dummy_message]]"}]), ids(turns[: index + 1])
        common = min(len(dummy), len(full))
        start = next(k for k in range(common) if dummy[k] != full[k])
        end = next(len(full) - k for k in range(common) if dummy[-1 - k] != full[-1 - k])
        labels[start:end] = input_ids[start:end]
        eos = next((k for k in range(end, len(input_ids)) if input_ids[k] == tokenizer.eos_token_id), -1)
        if eos != -1 and eos - end <= 3:
            labels[eos] = input_ids[eos]
    return input_ids, labels


ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "BAD ANSWER", "weight": 0},
                  {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Good answer.", "weight": 1}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "BAD ANSWER", "train": False},
                       {"from": "human", "value": "Again", "train": False},
                       {"from": "gpt", "value": "Good answer.", "train": True}]},
    {"conversations": [{"from": "system", "value": "Be kind.", "weight": None},  # SlimOrca's weights (null: no flag)
                       {"from": "human", "value": "Hi", "weight": 0.0},
                       {"from": "gpt", "value": "Good answer.", "weight": 1.0},
                       {"from": "human", "value": "Again", "weight": 0.0},
                       {"from": "gpt", "value": "BAD ANSWER", "training": False}]},
], ids=["weight-0-1", "sharegpt-train", "slimorca-null-float"])
def test_axolotl_training_flags_train_exactly_the_tokens_axolotl_trains(row):
    """Found by a bug bash (bb51 #2): a message's `weight: 0` / `train: false` (axolotl's message_field_training)
    was ignored, so the turn the dataset marks as bad was trained. Now a turn flagged off is context: the trained
    tokens equal axolotl's, token by token, and the flags never reach the template."""
    tokenizer = family_tokenizer("qwen2.5")
    spec = DatasetSpec(path="rows.jsonl", format="chat")
    examples = data.render_examples(row, spec, tokenizer, None, WHERE)
    assert len(examples) == 1 and "BAD ANSWER" not in "".join(_trained(examples))
    (example,) = tokenize_many(examples, tokenizer, bos=False)
    raw = row.get("messages") or row["conversations"]
    turns = [{"role": turn.get("role") or ROLES[turn["from"]], "content": turn.get("content", turn.get("value"))}
             for turn in raw]
    flags = [next((turn[key] for key in ("training", "train", "weight") if turn.get(key) is not None), None)
             for turn in raw]
    input_ids, labels = _axolotl_labels(tokenizer, turns, flags)
    # an untrained last turn is left out of the example (it changes no trained token's loss); axolotl keeps it as -100s
    kept = len(example.input_ids)
    assert example.input_ids == input_ids[:kept] and set(labels[kept:]) <= {-100}
    assert example.labels == labels[:kept]
    assert "weight" not in "".join(text for text, _ in examples[0])


@pytest.mark.parametrize("turn", [
    {"role": "user", "content": "Again", "train": True},
    {"role": "user", "content": "Again", "weight": 0.5},
    {"role": "user", "content": "Again", "train_detail": [{"begin_offset": 0, "end_offset": 2, "train": False}]},
    {"role": "user", "content": "Again", "train": False, "weight": 1},
    {"role": "user", "content": "Again", "training": {"source": "gsm8k"}},
], ids=["user-flagged-on", "fractional-weight", "train-detail", "disagreeing", "other-data"])
def test_keys_that_are_no_clear_flag_leave_the_row_as_without_them(turn):
    """Found by a review of the bb51 #2 fix: rows whose messages carried `weight`, `train` or `training` keys meaning
    something else (a fractional weight, a user turn's flag, an object, axolotl's spans) trained before and were then
    refused. Only a clear flag off on an assistant turn changes what trains; the rest renders as without the keys."""
    spec, tokenizer = DatasetSpec(path="rows.jsonl", format="chat"), family_tokenizer("qwen2.5")
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, turn,
                        {"role": "assistant", "content": "Good answer."}]}
    plain = {"messages": [*row["messages"][:2], {"role": "user", "content": "Again"}, row["messages"][3]]}
    assert data.render_examples(row, spec, tokenizer, None, WHERE) == data.render_examples(plain, spec, tokenizer,
                                                                                           None, WHERE)


def test_a_row_whose_every_assistant_turn_is_flagged_off_is_a_bad_row_not_an_empty_one(tmp_path):
    """Found by a bug bash (bb51 #2): with the flags read, a row whose assistant turns are all flagged off trains
    nothing; it is refused (skipped with a count under data.bad_rows: skip), not silently left out."""
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No.", "weight": 0}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": str(path), "format": "chat"}], "max_length": 256, "cache": False, "eval_fraction": 0,
        "bad_rows": "skip"}})
    examples, _, stats = data.build_examples(recipe, family_tokenizer("qwen2.5"))
    assert len(examples) == 1 and stats.skipped == 1
    assert "every assistant turn to train is flagged not to be trained" in stats.skipped_reasons[0]


def test_a_preference_answer_with_a_turn_flagged_off_is_refused_and_prompt_flags_change_nothing():
    """Found by a bug bash (bb51 #2): flags were ignored in preference rows too. An answer is what DPO and KTO score,
    so a turn of it flagged off is refused; an assistant turn of the prompt flagged off is context either way."""
    tokenizer, spec = family_tokenizer("qwen2.5"), DatasetSpec(path="pairs.jsonl", format="preference")
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "weight": 0},
              {"role": "user", "content": "Capital of France?"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Paris."}], "rejected": "Lyon."}
    plain = {**row, "prompt": [{key: value for key, value in turn.items() if key != "weight"} for turn in prompt]}
    assert data.render_segments(row, spec, tokenizer, None, WHERE) == data.render_segments(plain, spec, tokenizer,
                                                                                           None, WHERE)
    with pytest.raises(DataError, match=r"`chosen` has a turn flagged not to be trained.*what the loss scores"):
        data.render_segments({**row, "chosen": [{"role": "assistant", "content": "Paris.", "train": False}]}, spec,
                             tokenizer, None, WHERE)
