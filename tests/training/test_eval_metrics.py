"""Held-out figures against independent arithmetic: SFT's eval_loss is the token-weighted mean over the whole eval set
(not a mean of micro-batch means), and the generation eval's metrics score as their names say after whitespace is
normalized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import write_jsonl

from finetune import data, model
from finetune.recipe import validate_recipe
from finetune.training.evals import METRICS
from finetune.training.loop import evaluate_figures

CPU = torch.device("cpu")


def test_sft_eval_loss_is_the_token_weighted_mean_over_uneven_micro_batches(tiny_qwen2, tmp_path):
    """Found by a bug bash (mutant EV1): no test computed eval_loss independently (test_deepspeed compares it with the
    function that logged it), so a mean of per-micro-batch means passed. Oracle: F.cross_entropy's sum over every
    trained token of 3 rows of very different lengths, over their count; micro-batches of 2 and 1 rows."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "line " + "of the text " * n} for n in (12, 1, 2)])
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_qwen2), "dtype": "float32"}, "lora": {"dropout": 0.0},
                              "data": {"datasets": [{"path": str(path), "format": "text"}], "max_length": 64,
                                       "eval_fraction": 0.0, "cache": False}, "train": {"micro_batch_size": 2}})
    tokenizer = model.load_tokenizer(recipe)
    examples = list(data.prepare(recipe, tokenizer).train)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    figures = evaluate_figures(peft_model, examples, recipe, pad_id=tokenizer.pad_token_id)

    sums, tokens, correct = [], [], []
    with torch.no_grad():
        for example in examples:
            logits = peft_model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1]
            labels = torch.tensor(example.labels[1:])
            sums.append(float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")))
            tokens.append(int((labels != -100).sum()))
            correct.append(int(((logits.argmax(-1) == labels) & (labels != -100)).sum()))
    token_mean = sum(sums) / sum(tokens)
    batch_means = (sum(sums[:2]) / sum(tokens[:2]) + sums[2] / tokens[2]) / 2  # what averaging the batches gives
    assert len(set(tokens)) == 3 and abs(token_mean - batch_means) > 5e-4
    assert figures["eval_loss"] == pytest.approx(token_mean, abs=2e-5)
    assert figures["eval_mean_token_accuracy"] == pytest.approx(sum(correct) / sum(tokens), abs=1e-9)


@pytest.mark.parametrize(("metric", "generated", "reference", "right"), [
    ("exact_match", "42", "42", True),
    ("exact_match", "  a\n  b\t", "a b", True),  # inner and outer whitespace normalized
    ("exact_match", "a b", "a\n\nb ", True),
    ("exact_match", "42.", "42", False),
    ("exact_match", "ab", "a b", False),  # whitespace is collapsed, not removed
    ("contains", "The answer is 42.", "42", True),
    ("contains", "The answer\n is   42.", "answer is 42", True),
    ("contains", "4", "42", False),  # the reply must hold the reference, not the other way round
    ("contains", "", "42", False),
    ("contains", "41 or 43", "42", False),
    ("prefix_match", "42 because 40 + 2", "42", True),
    ("prefix_match", "\n 42\n\nbecause", "42 because", True),
    ("prefix_match", "4", "42", False),
    ("prefix_match", "so 42", "42", False),
])
def test_the_generation_metrics_score_as_their_names_say(metric, generated, reference, right):
    """Found by a bug bash (mutants EV2, EV3): no test used `contains` or `prefix_match`, and every exact_match test
    compared strings whose whitespace already matched, so a reversed `contains` (a short or empty reply scored right)
    and a normalization that only stripped the ends both passed. Oracle: the table, by hand."""
    assert METRICS[metric](generated, reference) is right
