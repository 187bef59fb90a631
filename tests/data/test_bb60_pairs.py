"""DPO pairs, KTO rows and GRPO prompts against TRL 1.16's own tokenization (bug bash bb60).

Found by a bug bash (differential fuzzing against TRL 1.16's DPOTrainer / KTOTrainer tokenize_fn and
apply_chat_template): on a tokenizer whose normalizer prepends `▁` (Llama 2's, Mistral v0.1's), a text pair's chosen
and rejected got different prompt tokens, and a cut could leave one of them nothing to score while the pair trained;
GRPO prompts rewrote a history turn's `</think>` line into a `<think>` block no server sends; docs/preference.md said a
merged row is tokenized as TRL tokenizes it, which TRL 1.16 does not; `finetune data` counted only a pair's chosen
sequence in its tokens per example.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_families import family_tokenizer, llama2_like_tokenizer
from conftest import write_jsonl
from trl.data_utils import common_prefix_length

from finetune import data
from finetune.chat_templates import resolve_chat_template
from finetune.data import IGNORE_INDEX
from finetune.data import pairs as pairs_module
from finetune.data.chat import REASONING
from finetune.data.conversations import closing_tag_reads
from finetune.data.prompts import prompt_text
from finetune.data.tokenize import tokenize_chunk
from finetune.recipe import DatasetSpec, validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")
DOCS = Path(__file__).resolve().parents[2] / "docs"
ASKED = "Is the sky blue? Answer: "


@pytest.fixture(scope="module")
def llama2_like():
    """chat_families.llama2_like_tokenizer: a Llama 2 / Mistral v0.1 style tokenizer (`▁` prepended)."""
    return llama2_like_tokenizer()


def _recipe(objective: str, fmt: str, path: str = "rows.jsonl", *, max_prompt: int | None = None, **data_keys):
    section = {"datasets": [{"path": path, "format": fmt}], "max_length": 256, "eval_fraction": 0, **data_keys}
    dpo = {"dpo": {"max_prompt_length": max_prompt}} if max_prompt else {}
    return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"objective": objective}, "data": section,
                            **dpo})


def _parts(example) -> tuple[list[int], list[int]]:
    """(prompt ids, scored ids) of a sequence."""
    start = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
    return example.input_ids[:start], [t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX]


def _trl_pair(tokenizer, row: dict) -> tuple[list[int], list[int], list[int]]:
    """TRL 1.16's DPOTrainer text branch: add_eos, then tokenize_fn's min of the two common prefixes."""
    prompt = tokenizer(row["prompt"])["input_ids"]
    chosen = tokenizer(row["prompt"] + row["chosen"] + tokenizer.eos_token)["input_ids"]
    rejected = tokenizer(row["prompt"] + row["rejected"] + tokenizer.eos_token)["input_ids"]
    shared = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return prompt[:shared], chosen[shared:], rejected[shared:]


# ---------------------------------------------------------------- 1. one prompt per pair, a scored token on each side
@pytest.mark.parametrize("chosen,rejected", [("yes", "42"), ("42", "yes"), ("no.", "7"), ("yes", "no"), ("maybe", "!")])
def test_a_pairs_two_sequences_share_trls_prompt_on_a_prepended_space_tokenizer(llama2_like, chosen, rejected):
    """Found by a bug bash: `▁yes` holds the prompt's last space and `42` does not merge (`▁` `4` `2`), so the chosen
    was scored after `...Answer:` and the rejected after `...Answer:▁`: the pair answered different prompt tokens and
    the space was scored in one answer only. TRL 1.16 gives both the shorter prompt and scores the rejected's `▁`."""
    row = {"prompt": ASKED, "chosen": chosen, "rejected": rejected}
    recipe = _recipe("dpo", "preference")
    (pair,) = tokenize_chunk([row], ["line 1"], [], recipe.data.datasets[0], recipe, llama2_like).examples
    (prompt, scored_chosen), (rejected_prompt, scored_rejected) = _parts(pair), _parts(pair.rejected)
    assert prompt == rejected_prompt
    assert (prompt, scored_chosen, scored_rejected) == _trl_pair(llama2_like, row)


def test_a_cut_pair_keeps_a_token_to_score_on_each_side(llama2_like):
    """Found by a bug bash: cut to data.max_length 10 (dpo.max_prompt_length 9), the chosen `42` kept only prompt
    tokens (`...Answer:` `▁`, its own longer prompt) and the pair was kept: the empty check ran before the cut."""
    row = {"prompt": ASKED, "chosen": "42", "rejected": "yes"}
    recipe = _recipe("dpo", "preference", max_length=10, max_prompt=9)
    result = tokenize_chunk([row], ["line 1"], [], recipe.data.datasets[0], recipe, llama2_like)
    (pair,) = result.examples
    assert pair.num_trained and pair.rejected.num_trained
    assert _parts(pair)[0] == _parts(pair.rejected)[0]
    assert llama2_like.convert_ids_to_tokens(_parts(pair)[1]) == ["▁"]  # TRL's keep_start scores the same


def test_a_pair_the_cut_leaves_a_side_without_a_scored_token_is_dropped(llama2_like, monkeypatch):
    """Found by a bug bash: the check that each side has a token to score ran before the cut only. Here the two
    prompts are left unshared (as before share_prompt) so that the cut empties the chosen: the pair is dropped and
    counted (and named), not trained on its rejected side alone."""
    monkeypatch.setattr(pairs_module, "share_prompt", lambda chosen, rejected: None, raising=False)
    row = {"prompt": ASKED, "chosen": "42", "rejected": "yes"}
    recipe = _recipe("dpo", "preference", max_length=10, max_prompt=9)
    result = tokenize_chunk([row], ["line 1"], [], recipe.data.datasets[0], recipe, llama2_like)
    assert result.examples == [] and result.counts["dropped"] == 1 and result.dropped_rows == ["rows.jsonl line 1"]


def test_a_pairs_untrained_reasoning_is_never_made_its_prompt(tokenizer):
    """share_prompt scores a side's prompt tokens past the shared prompt; with untrained reasoning (data.reasoning:
    context) right after the prompt, the tokens before the first trained one are not all prompt: the reasoning the two
    answers open alike must stay untrained."""
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    rendered = [([(prompt, False), ("Let me add the two", REASONING), ("\n</think>\n\n4<|im_end|>", True)],
                 [(prompt, False), ("Let me take the other", REASONING), ("\n</think>\n\n5<|im_end|>", True)])]
    counts = {"dropped": 0, "truncated": 0, "prompt_truncated": 0, "response_truncated": 0}
    (pair,) = pairs_module.pair_examples(rendered, ["line 1"], tokenizer, _recipe("dpo", "preference"), counts, [], [],
                                         bos=False)
    for side, answer in ((pair, "4"), (pair.rejected, "5")):
        assert tokenizer.decode(_parts(side)[1]) == f"\n</think>\n\n{answer}<|im_end|>"


def test_kto_rows_on_a_prepended_space_tokenizer_are_scored_as_trl_scores_them(llama2_like):
    """Checked for the bug bash: a KTO row has one sequence, so no two prompts to share; each is TRL 1.16's
    KTOTrainer tokenize_fn (the joint ids after their common prefix with the prompt's), merged or not."""
    rows = [{"prompt": ASKED, "completion": answer, "label": bool(i % 2)} for i, answer in enumerate(["yes", "42", "no."])]
    recipe = _recipe("kto", "unpaired_preference")
    result = tokenize_chunk(rows, ["line 1", "line 2", "line 3"], [], recipe.data.datasets[0], recipe, llama2_like)
    for row, example in zip(rows, result.examples):
        prompt = llama2_like(row["prompt"])["input_ids"]
        joint = llama2_like(row["prompt"] + row["completion"] + "</s>")["input_ids"]
        shared = common_prefix_length(prompt, joint)
        assert _parts(example) == (joint[:shared], joint[shared:])


# -------------------------------------------------------------------------- 2. a GRPO prompt's `</think>` line
def test_a_grpo_prompts_think_line_is_sent_as_written():
    """Found by a bug bash: a GRPO prompt's history turn `Let me think.\\n</think>\\nTeal.` was read as reasoning and,
    under Llama 3.1 (no reasoning field), rendered as a `<think>` block the row does not hold, without the counted
    note training rows get. TRL's GRPOTrainer, vLLM's chat and apply_chat_template send the content as written."""
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Let me think.\n</think>\nTeal."},
                {"role": "user", "content": "Another?"}]
    for name in ("llama-3.1", "gpt-oss", "qwen3"):
        tokenizer = family_tokenizer(name, template=resolve_chat_template(name))
        before = closing_tag_reads()
        text = prompt_text(messages, tokenizer, None, spec=DatasetSpec(path="prompts.jsonl", format="prompt"))
        assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), name
        assert closing_tag_reads() == before
    # a chat row's prompt (finetune generate on an SFT run) still renders as its rows trained: the rule reads it
    tokenizer = family_tokenizer("llama-3.1", template=resolve_chat_template("llama-3.1"))
    chat = prompt_text(messages, tokenizer, None, spec=DatasetSpec(path="chat.jsonl", format="chat"))
    assert "<think>\nLet me think.\n</think>" in chat and closing_tag_reads() == before + 1



def test_a_grpo_prompts_think_block_split_over_content_parts_is_one_block():
    """Found by a review (bb65): the `</think>` stand-in was chosen text by text, so a history turn given as content
    parts, `<think>Calm tones.` then `</think>Teal.`, had its closing tag hidden and was refused as "an unbalanced
    <think> block"; the parts are one content, read as their texts joined (as format: chat reads them)."""
    parts = [{"type": "text", "text": "<think>Calm tones."}, {"type": "text", "text": "</think>Teal."}]
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": parts},
                {"role": "user", "content": "Another?"}]
    tokenizer = family_tokenizer("qwen3", template=resolve_chat_template("qwen3"))
    texts = [prompt_text(messages, tokenizer, None, spec=DatasetSpec(path="p.jsonl", format=fmt))
             for fmt in ("prompt", "chat")]
    whole = [{**message, "content": "<think>Calm tones.</think>Teal."} if message["role"] == "assistant" else message
             for message in messages]
    assert texts == [prompt_text(whole, tokenizer, None, spec=DatasetSpec(path="p.jsonl", format="prompt"))] * 2

# ---------------------------------------------------------------------- 3. what the docs say of TRL's tokenization
def test_the_docs_say_how_trl_tokenizes_a_merged_row():
    """Found by a bug bash: docs/preference.md said a row whose answer merges with the prompt's end "is tokenized as
    TRL's trainers tokenize every row, the prompt apart from the answer"; TRL 1.16 scores the joint ids after their
    common prefix with the prompt's (the merged token scored, the prompt cut short). pairs.py said the same."""
    doc = " ".join((DOCS / "preference.md").read_text().split())
    assert "tokenized as TRL's trainers tokenize every row" not in doc
    assert "That is not TRL 1.16's rule" in doc and "common prefix" in doc
    assert "as TRL's preference trainers tokenize every row" not in " ".join(pairs_module.tokenize_prompted.__doc__.split())


# -------------------------------------------------------------------------- 4. a pair's tokens in `finetune data`
def test_finetune_data_counts_both_sequences_of_a_pair(tmp_path, llama2_like):
    """Found by a bug bash: `tokens per example` and the trained share counted the chosen sequences only (a pair of
    11 + 18 tokens, 2 + 9 scored, showed `11 tokens, 2 trained`)."""
    path = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Is the sky blue? Answer:", "chosen": " yes", "rejected": " no no no no no no no no"}])
    recipe = _recipe("dpo", "preference", str(path), max_length=64)
    prepared = data.prepare(recipe, llama2_like)
    (pair,) = prepared.train
    sequences = (pair, pair.rejected)
    assert prepared.stats.total_tokens == sum(len(s.input_ids) for s in sequences) == prepared.stats.tokens_max
    assert prepared.stats.trained_tokens == sum(sum(label != IGNORE_INDEX for label in s.labels) for s in sequences)


def test_finetune_data_says_a_pairs_tokens_are_two_sequences(tmp_path, llama2_like, capsys):
    """Found by a review (bb65): after the fix above, `finetune data` said "4 truncated (max_length 64)" and then
    "tokens per example: min 128 / median 128 / max 128", as if the cut had not held: the line names a pair's two
    sequences."""
    from finetune.cli.preview import format_stats

    path = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Is the sky blue? Answer:", "chosen": " yes", "rejected": " no no no no no no no no"}])
    recipe = _recipe("dpo", "preference", str(path), max_length=64)
    said = format_stats(data.prepare(recipe, llama2_like), recipe)
    assert "tokens per pair (chosen + rejected, each within max_length): min " in said, said
    assert "tokens per example" not in said
