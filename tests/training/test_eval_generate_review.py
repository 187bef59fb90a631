"""The generation eval (eval.generation_rows) asks only rows it can score, says when it has none, and stops where the
model's turn ends.

Found by a bug bash (bb4), each reproduced on the code before this file: a KTO run scored the model against its
undesirable completions too (`q 5` -> reference `BAD ANSWER`); text rows (every token trained, so an empty prompt)
crashed the run before step 1 with an IndexError from transformers' generate; eval.generation_rows with no eval rows
(data.eval_fraction 0, or a fraction that rounds to none) silently gave no generation eval; and generation stopped only
at the tokenizer's EOS, not at the end-of-turn tokens of the model's generation config (`<|im_end|>` of a chat template
given to a base model, Gemma's `<end_of_turn>`), which GRPO already stops at.

In-process and fast: a stand-in tokenizer and model; the decoding of the eval is a recorder of what it was asked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from finetune.data import IGNORE_INDEX, Example
from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.training import evals

X = IGNORE_INDEX


class Tokenizer:
    """Token ids are their own text (`decode([5, 6])` is "5 6"); 0 to 3 are special (pad, BOS, EOS, end of turn)."""

    bos_token_id = None
    eos_token_id = 2
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) <= 3))


def recipe(data_format: str = "alpaca", *, objective: str = "sft", generation_rows: int = 4, **data_keys):
    section = {"datasets": [{"path": "rows.jsonl", "format": data_format}], "max_length": 64, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"objective": objective},
                            "eval": {"generation_rows": generation_rows}})


@pytest.fixture
def asked(monkeypatch) -> list[list[int]]:
    """The prompts the eval generates from; every answer is the text "7"."""
    prompts: list[list[int]] = []

    def recorded(model, tokenizer, chunk, **_):
        prompts.extend(chunk)
        return ["7"] * len(chunk)

    monkeypatch.setattr(evals, "generate_batch", recorded)
    return prompts


def kto_row(prompt: int, answer: int, desirable: bool) -> Example:
    return Example([10, prompt, answer, 2], [X, X, answer, 2], desirable=desirable)


def test_kto_scores_only_the_desirable_completions(asked):
    """Before: 4 rows scored, 2 of them against an undesirable completion (a model that learned to avoid it: wrong)."""
    rows = [kto_row(5, 7, True), kto_row(6, 8, False), kto_row(7, 7, True), kto_row(8, 9, False), kto_row(9, 7, True)]
    record = evals.recipe_generation_eval(nn.Linear(1, 1), Tokenizer(), rows, recipe(
        "unpaired_preference", objective="kto", generation_rows=4), phase="before")
    assert asked == [[10, 5], [10, 7], [10, 9]]
    assert (record["generation_total"], record["generation_correct"]) == (3, 3)
    assert record["generation_sample"]["reference"] == "7"


def test_text_rows_are_refused_for_the_generation_eval():
    """Before: accepted, then `IndexError: index -1 is out of bounds for dimension 1 with size 0` before step 1."""
    with pytest.raises(RecipeError) as refused:
        recipe("text")
    said = " ".join(str(refused.value).split())
    assert "eval.generation_rows (4): the eval rows are text rows (format: text)" in said and "Fix:" in said
    recipe("text", generation_rows=0)  # the eval loss alone: fine
    recipe("text", eval_datasets=[{"path": "eval.jsonl", "format": "completion"}])  # prompts to ask: fine


def test_text_rows_mixed_with_others_are_not_asked(asked):
    """Before: a text row's empty prompt went into the batch (a row of padding only), or alone crashed generate."""
    text_row = Example([5, 6, 7, 2], [5, 6, 7, 2])
    bos_text_row = Example([1, 5, 6, 2], [X, 5, 6, 2])  # a BOS tokenizer's text row: BOS alone is no question
    alpaca_row = Example([10, 11, 7, 2], [X, X, 7, 2])
    tokenizer = Tokenizer()
    tokenizer.bos_token_id = 1
    record = evals.recipe_generation_eval(nn.Linear(1, 1), tokenizer, [text_row, bos_text_row, alpaca_row], recipe(),
                                          phase="before")
    assert asked == [[10, 11]] and record["generation_total"] == 1


def test_no_eval_rows_is_refused_when_the_recipe_holds_none_out():
    """Before: data.eval_fraction 0 with eval.generation_rows validated, and the run had no generation eval, silently."""
    with pytest.raises(RecipeError) as refused:
        recipe(eval_fraction=0)
    said = " ".join(str(refused.value).split())
    assert "eval.generation_rows (4): there are no eval rows to ask" in said and "data.eval_fraction" in said


def test_no_eval_rows_is_said_when_the_fraction_rounds_to_none(asked, capsys):
    """Before: None and not a word (10 rows x eval_fraction 0.05 = 0.5 rounds to 0 eval rows)."""
    assert evals.recipe_generation_eval(nn.Linear(1, 1), Tokenizer(), [], recipe(), phase="before") is None
    out = capsys.readouterr().out
    assert "[finetune] note: no generation eval before training: eval.generation_rows is 4, but the run has no eval " \
           "rows" in out
    rows = [kto_row(5, 7, False)]
    kto = recipe("unpaired_preference", objective="kto")
    assert evals.recipe_generation_eval(nn.Linear(1, 1), Tokenizer(), rows, kto, phase="after") is None
    assert "none of the 1 eval rows has a prompt and an answer to give" in capsys.readouterr().out and asked == []


class Generator(nn.Module):
    """A model whose generation config lists an end-of-turn token (3) beside the tokenizer's EOS (2)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": [3]})()
        self.asked: dict = {}

    def generate(self, input_ids, attention_mask, **options):
        self.asked = options
        return torch.cat([input_ids, torch.tensor([[7, 3]] * len(input_ids))], dim=1)


def test_generation_stops_at_every_end_token_the_model_lists():
    """Before: eos_token_id=tokenizer.eos_token_id (2 alone), which overrides the generation config's list."""
    model = Generator()
    assert evals.generate_batch(model, Tokenizer(), [[10, 11]], max_new_tokens=4) == ["7"]
    stops = model.asked["eos_token_id"]
    assert sorted(stops if isinstance(stops, list) else [stops]) == [2, 3]


def test_generation_stops_at_the_chat_templates_end_of_turn_where_the_model_lists_none(tiny_qwen2):
    """Found by a bug bash of eval and generate: a base model given a chat template (model.chat_template: its
    generation config lists only <|endoftext|>) generated past <|im_end|>, the end of turn it was trained to emit, in
    the generation eval, `finetune generate` and GRPO's sampling (the same eos_token_ids), to max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.training.objectives.grpo.rollouts import eos_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    tokenizer.eos_token = "<|endoftext|>"  # a base model's: the template's end of turn is another token
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    ends = tokenizer.convert_ids_to_tokens(eos_token_ids(model, tokenizer))
    assert sorted(ends) == ["<|endoftext|>", "<|im_end|>"], ends
    tokenizer.chat_template = None  # no template: the configured ends alone
    assert tokenizer.convert_ids_to_tokens(eos_token_ids(model, tokenizer)) == ["<|endoftext|>"]


def test_the_greedy_loop_of_fsdp1_and_zero3_takes_several_end_tokens_as_transformers_does(tiny_qwen2):
    """Found by the session's CI rehearsal: the eval now passes every end token the model lists (a list), and the
    greedy loop FSDP1 and ZeRO-3 generate through (parallel/engines/base.py GreedyThroughRoot) took one int: every
    FSDP1 / ZeRO-3 run with a generation eval died in it ("full_like(): argument 'fill_value' must be Number, not
    list"). Its answers equal transformers' greedy generate with the same end tokens, one or several."""
    from transformers import AutoModelForCausalLM

    from finetune.parallel.engines.base import GreedyThroughRoot

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    prompts = torch.tensor([[0, 5, 6, 7], [9, 10, 11, 12]])  # the first left-padded
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        free = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    ends = [int(free[0, 5]), int(free[1, 6])]  # tokens the greedy answers do produce: both rows stop early
    for eos in (ends, ends[0]):
        with torch.no_grad():
            expected = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0)
        ours = GreedyThroughRoot(model).generate(prompts, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(ours[:, : expected.shape[1]], expected), (eos, ours, expected)
        assert (ours[:, expected.shape[1]:] == 0).all()  # after every row ended: padding only


def test_the_generation_eval_says_what_it_asks_before_the_minutes_it_takes(asked, capsys):
    """Found by a bug bash: the generation eval before step 1 took 174 s on a loaded machine without a line (and a
    run of 10 steps of 4,984 said `0.00 epochs`)."""
    from finetune.training.loop import _epochs

    rows = [kto_row(5, 7, True), kto_row(7, 7, True)]
    evals.recipe_generation_eval(nn.Linear(1, 1), Tokenizer(), rows, recipe(
        "unpaired_preference", objective="kto", generation_rows=4), phase="before")
    assert "[finetune] asking 2 held-out prompts for the generation eval before training (up to " in \
        capsys.readouterr().out
    assert (_epochs(10 / 4984), _epochs(6 / 15), _epochs(3.0)) == ("0.002", "0.40", "3.00")
