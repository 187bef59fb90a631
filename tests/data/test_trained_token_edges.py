"""Which tokens a row trains at its edges: EOS, BOS and a cut inside reasoning, against TRL 1.16 and transformers.

A bug bash (bb4) found, each reproduced on the code before this file: text, completion and alpaca rows (and the text
answers of preference pairs) that already end with the EOS text were given a second EOS, both trained; a tokenizer
that adds BOS through its post-processor (Llama 3's tokenizer.json: transformers reports add_bos_token False) gave
text rows no BOS, while TRL and finetune's own GRPO prompts put it first; a tokenizer that adds BOS gave chat rows a
BOS the chat template does not write (`<s><|im_start|>user...` under chatml), which neither apply_chat_template, TRL
nor `finetune generate` gives the model; and under data.reasoning: context a Qwen3 / gpt-oss / GLM row cut inside its
reasoning was kept, training only the reasoning opener (`<think>\\n`), where DeepSeek-R1 and Qwen3.5 rows are dropped.

The oracles: TRL 1.16's SFTTrainer._prepare_dataset (its tokenization, EOS rule and labels) on a stand-in self, and
transformers' apply_chat_template(tokenize=True).
"""

from __future__ import annotations

import argparse
import re
import types

import pytest
from chat_families import FAMILIES, family_tokenizer
from conftest import write_jsonl, write_recipe

from finetune.chat_templates import named_templates
from finetune.cli.tiny import build_tokenizer
from finetune.data import IGNORE_INDEX
from finetune.data.prompts import prompt_ids, prompt_text
from finetune.data.tokenize import tokenize_chunk
from finetune.recipe import validate_recipe

pytest.importorskip("trl")  # the oracle (trl is a dev dependency)
HELLO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def tokenized(rows: list[dict], fmt: str, tokenizer, *, objective: str = "sft", **data_keys):
    """finetune's tokenization of `rows` as the cache builder does it (tokenize_chunk): the ChunkResult."""
    section = {"datasets": [{"path": "rows.jsonl", "format": fmt}], "max_length": 256, **data_keys}
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"objective": objective}})
    places = [f"line {i + 1}" for i in range(len(rows))]
    return tokenize_chunk(rows, places, [], recipe.data.datasets[0], recipe, tokenizer)


def trl_sft(rows: list[dict], tokenizer, max_length: int = 256) -> list[tuple[list[int], list[int]]]:
    """TRL 1.16 SFTTrainer's own dataset preparation (EOS added, tokenized, labels): (input_ids, labels) per row."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="unused", max_length=max_length, report_to=[], dataset_num_proc=None, use_cpu=True)
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, _is_vision_dataset=False, chat_template=None,
                                    completion_only_loss="completion" in rows[0])
    prepared = SFTTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, args, False, None,
                                           "train")
    return [(list(row["input_ids"]), list(row["labels"])) for row in prepared]


def trained_text(example, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


# ------------------------------------------------------------------------------------------------------------- EOS
def test_eos_is_appended_only_where_the_text_does_not_end_with_it():
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token
    text = [{"text": f"Ends with eos already.{eos}"}, {"text": "Plain text."}]
    completion = [{"prompt": "Q: hi\nA:", "completion": f" hello{eos}"}, {"prompt": "Q: 2+2\nA:", "completion": " 4"}]
    for fmt, rows in (("text", text), ("completion", completion)):
        ours = [(e.input_ids, e.labels) for e in tokenized(rows, fmt, tokenizer).examples]
        assert ours == trl_sft(rows, tokenizer), fmt
    (alpaca,) = tokenized([{"instruction": "Say hi", "output": f"hi{eos}"}], "alpaca", tokenizer).examples
    assert trained_text(alpaca, tokenizer) == f"hi{eos}"
    tokenizer.chat_template = None  # a base model: text pairs, whose answers TRL's DPOTrainer ends the same way
    (pair,) = tokenized([{"prompt": "Q: hi\nA:", "chosen": f" hello{eos}", "rejected": " bye"}], "preference",
                        tokenizer, objective="dpo").examples
    assert (trained_text(pair, tokenizer), trained_text(pair.rejected, tokenizer)) == (f" hello{eos}", f" bye{eos}")


# ------------------------------------------------------------------------------------------------------------- BOS
def post_processed_llama():
    """Llama 3.1's tokenizer as its tokenizer.json ships: BOS put first by a TemplateProcessing post-processor, no
    add_bos_token in its config (transformers reports it False)."""
    from tokenizers import processors

    tokenizer = family_tokenizer("llama-3.1")
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_token_id)])
    return tokenizer


def test_text_rows_start_with_the_bos_the_tokenizer_puts_first():
    tokenizer = post_processed_llama()
    bos = tokenizer.bos_token_id
    assert not getattr(tokenizer, "add_bos_token", False) and tokenizer("a")["input_ids"][0] == bos  # the premise
    text = [{"text": "The cat sat."}]
    completion = [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}]
    ((ids, labels),) = trl_sft(text, tokenizer)
    (ours,) = tokenized(text, "text", tokenizer).examples
    assert ours.input_ids == ids and ours.labels[1:] == labels[1:]  # (label 0 is no target: nothing predicts it)
    (ours,) = tokenized(completion, "completion", tokenizer).examples
    assert [(ours.input_ids, ours.labels)] == trl_sft(completion, tokenizer)
    prompt = ours.input_ids[: next(i for i, label in enumerate(ours.labels) if label != IGNORE_INDEX)]
    assert prompt == prompt_ids("Q: 2+2?\nA:", tokenizer, chat=False)  # as GRPO's text prompts
    (written,) = tokenized([{"text": f"{tokenizer.bos_token}The cat sat."}], "text", tokenizer).examples
    assert written.input_ids == ids  # a text that writes BOS gets no second one
    tokenizer.chat_template = None  # a base model's text pairs and KTO rows
    (pair,) = tokenized([{"prompt": "Q:", "chosen": " yes", "rejected": " no"}], "preference", tokenizer,
                        objective="dpo").examples
    (row,) = tokenized([{"prompt": "Q:", "completion": " yes", "label": True}], "unpaired_preference", tokenizer,
                       objective="kto").examples
    assert [pair.input_ids[0], pair.rejected.input_ids[0], row.input_ids[0]] == [bos] * 3


def bos_adding_chatml():
    """A base model's tokenizer that adds BOS (Mistral's, Llama 2's) under model.chat_template: chatml."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    tokenizer.add_bos_token = True
    tokenizer.chat_template = named_templates()["chatml"]
    assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id  # the premise
    return tokenizer


@pytest.mark.parametrize("name", sorted(named_templates()))
def test_chat_rows_have_bos_where_the_template_writes_it_and_nowhere_else(name):
    """Each shipped template with a tokenizer that adds BOS where its family has one: the context a turn is trained
    in is the generation prompt apply_chat_template gives the model (BOS only where the template writes it)."""
    if name == "chatml":
        tokenizer = bos_adding_chatml()
    else:
        tokenizer = post_processed_llama() if name == "llama-3.1" else family_tokenizer(name)
        tokenizer.chat_template = named_templates()[name]
        if FAMILIES[name][3] is not None:
            tokenizer.add_bos_token = True  # the family's BOS put first by the tokenizer too
            assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id
    context = tokenizer.apply_chat_template(HELLO[:1], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    (ours,) = tokenized([{"messages": HELLO}], "chat", tokenizer).examples
    first = next(i for i, label in enumerate(ours.labels) if label != IGNORE_INDEX)
    assert ours.input_ids[:first] == context[:first] and ours.input_ids.count(tokenizer.bos_token_id) == \
        context.count(tokenizer.bos_token_id)


def test_a_chat_row_is_the_sequence_apply_chat_template_and_trl_give_the_model():
    """... and the context its answer is trained in is the prompt `finetune generate` and GRPO give the model."""
    from finetune.cli.generate import render

    tokenizer = bos_adding_chatml()
    whole = tokenizer.apply_chat_template(HELLO, tokenize=True, return_dict=True)["input_ids"]
    (ours,) = tokenized([{"messages": HELLO}], "chat", tokenizer).examples
    ((theirs, _),) = trl_sft([{"messages": HELLO}], tokenizer)
    assert ours.input_ids == whole == theirs
    context = ours.input_ids[: next(i for i, label in enumerate(ours.labels) if label != IGNORE_INDEX)]
    assert context == render(tokenizer, HELLO[:1], None) == prompt_ids(prompt_text(HELLO[:1], tokenizer, None),
                                                                       tokenizer, chat=True)
    (pair,) = tokenized([{"prompt": HELLO[:1], "chosen": "Hello.", "rejected": "Go away."}], "preference", tokenizer,
                        objective="dpo").examples
    assert pair.input_ids == whole


# ------------------------------------------------------------------------------------------------------- reasoning
COUNT = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "Done.",
                                                               "reasoning_content": " ".join(map(str, range(60)))}]}


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "glm-4.5", "deepseek-r1", "qwen3.5"])
def test_a_row_cut_inside_its_reasoning_under_context_has_nothing_to_learn(family):
    """The reasoning opener a turn writes (Qwen3's `<think>\\n`) is trained but no answer: a cut that keeps it and
    nothing after the reasoning drops the row (error: stops), as where the generation prompt holds the opener."""
    template = named_templates()["deepseek-r1"] if family == "deepseek-r1" else None
    tokenizer = family_tokenizer(family, template=template)
    (whole,) = tokenized([COUNT], "chat", tokenizer, reasoning="context", max_length=4096).examples
    answer = max(i for i, label in enumerate(whole.labels) if label != IGNORE_INDEX)
    while whole.labels[answer - 1] != IGNORE_INDEX:  # the last trained run: `</think>` and the answer after the
        answer -= 1  # untrained reasoning
    cut = tokenized([COUNT], "chat", tokenizer, reasoning="context", max_length=len(whole.input_ids) - 20)
    assert (cut.examples, cut.counts["dropped"], cut.counts["truncated"]) == ([], 1, 0)
    refused = tokenized([COUNT], "chat", tokenizer, reasoning="context", max_length=len(whole.input_ids) - 20,
                        overlong="error")
    assert refused.fatal is not None and "truncation leaves nothing to learn" in refused.fatal
    kept = tokenized([COUNT], "chat", tokenizer, reasoning="context", max_length=answer + 1)  # one answer token kept
    assert kept.counts["truncated"] == 1 and kept.examples[0].labels[answer] != IGNORE_INDEX


def _answer(reasoning_words: int, answer: str) -> list[dict]:
    return [{"role": "assistant", "content": answer, "reasoning_content": " ".join(map(str, range(reasoning_words)))}]


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_a_pair_or_kto_row_cut_inside_its_reasoning_under_context_has_nothing_to_learn(family):
    """Found by a bug bash (bb4), carried over until now: the SFT rule above did not cover DPO and KTO. A pair whose
    chosen answer lay past max_length kept `<think>\n` alone as the chosen response against the rejected one's whole
    answer (DPO preferred saying nothing), and a KTO row kept the opener alone as its desirable completion."""
    tokenizer = family_tokenizer(family)
    pair = {"prompt": COUNT["messages"][:1], "chosen": _answer(60, "Done."), "rejected": _answer(30, "No.")}
    (whole,) = tokenized([pair], "preference", tokenizer, objective="dpo", reasoning="context",
                         max_length=4096).examples
    answer = max(i for i, label in enumerate(whole.labels) if label != IGNORE_INDEX)
    while whole.labels[answer - 1] != IGNORE_INDEX:  # the last trained run: the answer after the reasoning
        answer -= 1
    limit = answer - next(i for i, label in enumerate(whole.labels) if label != IGNORE_INDEX)  # past the prompt's cut
    cut = tokenized([pair], "preference", tokenizer, objective="dpo", reasoning="context", max_length=limit)
    assert (cut.examples, cut.counts["dropped"], cut.counts["truncated"]) == ([], 1, 0)
    assert cut.dropped_rows == ["rows.jsonl line 1"]
    refused = tokenized([pair], "preference", tokenizer, objective="dpo", reasoning="context", max_length=limit,
                        overlong="error")
    assert refused.fatal is not None and "truncation leaves nothing to learn" in refused.fatal
    kept = tokenized([pair], "preference", tokenizer, objective="dpo", reasoning="context", max_length=answer + 1)
    assert kept.counts["truncated"] == 1 and len(kept.examples) == 1
    row = {"prompt": COUNT["messages"][:1], "completion": _answer(60, "Done."), "label": True}
    (kto,) = tokenized([row], "unpaired_preference", tokenizer, objective="kto", reasoning="context",
                       max_length=4096).examples
    assert kto.input_ids == whole.input_ids
    cut = tokenized([row], "unpaired_preference", tokenizer, objective="kto", reasoning="context", max_length=limit)
    assert (cut.examples, cut.counts["dropped"]) == ([], 1)
    assert tokenized([row], "unpaired_preference", tokenizer, objective="kto", reasoning="context",
                     max_length=answer + 1).counts["truncated"] == 1  # the KTO row is the pair's chosen sequence


@pytest.mark.parametrize("family", ["deepseek-r1", "qwen3.5"])
def test_a_pair_whose_answers_both_reason_under_a_prefilling_template_is_scored_under_context(family):
    """Found by a bug bash's fixer (bb60), carried until now: under a template whose generation prompt prefills
    `<think>` (DeepSeek-R1, Qwen3.5), a pair whose two answers both reason was refused under data.reasoning: context as
    "rendered after different prompts ... Give every answer reasoning": the untrained reasoning (falsy flag) was read
    as prompt. Each side is now its chat row's rendering under context (the oracle: SFT's, checked against
    apply_chat_template elsewhere), reasoning untrained; under R1 one side without reasoning is still refused."""
    template = named_templates()["deepseek-r1"] if family == "deepseek-r1" else None
    tokenizer = family_tokenizer(family, template=template)
    prompt = COUNT["messages"][:1]
    pair = {"prompt": prompt, "chosen": _answer(6, "Done."), "rejected": _answer(3, "No.")}
    result = tokenized([pair], "preference", tokenizer, objective="dpo", reasoning="context", max_length=4096)
    assert result.fatal is None and result.reasons == [] and len(result.examples) == 1
    for side, answer in ((result.examples[0], pair["chosen"]), (result.examples[0].rejected, pair["rejected"])):
        (sft,) = tokenized([{"messages": prompt + answer}], "chat", tokenizer, reasoning="context",
                           max_length=4096).examples
        assert side.input_ids == sft.input_ids
        assert trained_text(side, tokenizer) == trained_text(sft, tokenizer)
        assert answer[0]["content"] in trained_text(side, tokenizer)
        assert answer[0]["reasoning_content"] not in trained_text(side, tokenizer)
    if family == "deepseek-r1":  # (Qwen3.5 writes an empty think block after its prefill: one prompt either way)
        one_sided = {**pair, "rejected": [{"role": "assistant", "content": "No."}]}
        refused = tokenized([one_sided], "preference", tokenizer, objective="dpo", reasoning="context", max_length=4096)
        assert refused.examples == [] and "rendered after different prompts" in refused.reasons[0]

def test_finetune_generate_gives_a_text_prompt_the_bos_its_rows_trained_with():
    """`finetune generate` of a model without a chat template encoded the prompt without the tokenizer's BOS, while its
    text rows trained with it (and GRPO's text prompts have it): the model answered from a context it never saw."""
    from finetune.cli.generate import render

    tokenizer = post_processed_llama()
    tokenizer.chat_template = None
    (trained,) = tokenized([{"prompt": "Q: 2+2?\nA:", "completion": " 4"}], "completion", tokenizer).examples
    context = trained.input_ids[: next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)]
    assert render(tokenizer, [{"role": "user", "content": "Q: 2+2?\nA:"}], None) == context
    assert context[0] == tokenizer.bos_token_id


def test_a_text_prompt_ends_where_its_rows_context_ends_when_the_tokenizer_also_appends_eos():
    """Carried over from a bug bash (bb4): a tokenizer whose post-processor appends EOS too (`add_eos_token: true`,
    Llama 2 fine-tunes) ended every text prompt of `finetune generate` and GRPO with EOS, a context its rows never
    trained in (they are tokenized without special tokens, BOS put first), so the model answered after an end."""
    from tokenizers import processors

    from finetune.cli.generate import render

    tokenizer = post_processed_llama()
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0 {eos}:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1 {eos}:1",
        special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
    tokenizer.chat_template = None
    assert tokenizer("Q")["input_ids"][-1] == tokenizer.eos_token_id  # the premise
    (trained,) = tokenized([{"prompt": "Q: 2+2?\nA:", "completion": " 4"}], "completion", tokenizer).examples
    context = trained.input_ids[: next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)]
    assert context[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in context
    assert prompt_ids("Q: 2+2?\nA:", tokenizer, chat=False) == context
    assert render(tokenizer, [{"role": "user", "content": "Q: 2+2?\nA:"}], None) == context


def test_preview_never_counts_or_marks_an_examples_first_token_as_trained(tmp_path, tiny_qwen2, capsys):
    """Found by a bug bash of packing: `finetune data` on text rows with a tokenizer that adds no BOS marked each
    example from its first token and said "1692 tokens, 1692 trained (100.0%)", though nothing predicts an example's
    first token (training counted 1668 targets). Plain text trains every other token: tokens - examples targets."""
    from finetune.cli.preview import cli_data

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i} of the text"} for i in range(6)])
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name_or_path": str(tiny_qwen2)}, "data": {
        "datasets": [{"path": str(path), "format": "text"}], "max_length": 64, "eval_fraction": 0}})
    assert cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=2)) == 0
    out = capsys.readouterr().out
    total, trained = (int(n) for n in re.search(r"; (\d+) tokens, (\d+) trained", out).groups())
    assert trained == total - 6, out
    assert "--- example 1 (" in out and "\n[[l" not in out and "(13 tokens, 12 trained)" in out, out


# ------------------------------------------------------------------------------------------------- the length cut
def test_an_answer_starting_at_max_length_is_dropped_and_one_a_token_earlier_keeps_one_target():
    """Found by a bug bash (mutation testing, bb50 S6): `first <= max_length` in place of `<` passed every test; a row
    whose answer starts at token max_length was then cut to max_length tokens and kept with nothing to learn.
    Counted by hand: the tiny tokenizer has no BOS and makes one token of each `|` and of `4`; the completion row
    `|` x n + `4` + EOS is n + 2 tokens, its first target at index n."""
    tokenizer, limit = build_tokenizer(), 16
    assert tokenizer.bos_token is None and tokenizer.tokenize("|" * 5 + "4") == ["|"] * 5 + ["4"]
    four = tokenizer.convert_tokens_to_ids("4")
    at, before = ({"prompt": "|" * n, "completion": "4"} for n in (limit, limit - 1))
    result = tokenized([at, before], "completion", tokenizer, max_length=limit)
    assert result.counts["dropped"] == 1 and result.dropped_rows == ["rows.jsonl line 1"] and not result.fatal
    (kept,) = result.examples  # line 2: cut to `|` x 15 + `4` (its EOS cut), one trained token
    assert len(kept.input_ids) == limit and kept.input_ids[-1] == four
    assert [label for label in kept.labels if label != IGNORE_INDEX] == [four] and kept.labels.index(four) == limit - 1
    assert result.counts["truncated"] == 1 and result.counts["cut_tokens"] == 1
    refused = tokenized([at, before], "completion", tokenizer, max_length=limit, overlong="error")
    assert "rows.jsonl line 1: the answer starts at token 16 of max_length 16" in refused.fatal
    assert tokenized([before], "completion", tokenizer, max_length=limit, overlong="error").fatal is None
