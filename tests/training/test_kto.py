"""KTO (train.objective: kto): unpaired preference data, the KL rows, and real runs.

* Data: text and message-list rows score the completion only and carry their label; the token store keeps the label;
  bad rows (missing label, a label that is not a bool) name the row and the fix; unpaired rows as pairs, and KTO with
  the wrong data format or sections are refused with the fix (a pair file under kto is unpaired: test_kto_pairs.py).
* The KL rows: each row's prompt with the completion of the row before it in the optimizer step, the same rows for
  any world size and micro-batch split.
* A micro-batch's loss through the model against plain log-probs (full-vocabulary log-softmax, PEFT's own
  `disable_adapter()`); the loss code itself is checked against TRL's in test_kto_oracle.py.
* Runs: step 1 is 0.5 x the mean row weight (policy = reference: every log-ratio and the KL estimate are 0), and it
  learns; the shipped accelerate configs train the same curve from an SFT adapter.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    accelerate_launch,
    objective_recipe,
    read_metrics,
    train_losses,
    write_jsonl,
    write_recipe,
)
from test_preference import _train

from finetune import data, model
from finetune.data import IGNORE_INDEX, BatchStream, Example, kl_sequence
from finetune.errors import DataError, RecipeError
from finetune.recipe import validate_recipe
from finetune.training import objectives
from finetune.training.objectives import kto

CPU = torch.device("cpu")


def unpaired_rows(n: int = 48, seed: int = 0, desirable: float = 0.5) -> list[dict]:
    """Addition questions, each answered once: the right sum desirable, a wrong one undesirable (`desirable`: the
    share of desirable rows, in expectation)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, good = rng.randint(0, 50), rng.randint(0, 50), rng.random() < desirable
        answer = a + b if good else a + b + rng.randint(1, 9)
        rows.append({"prompt": f"What is {a} plus {b}?", "completion": f"{answer}.", "label": good})
    return rows


def kto_recipe(model_dir, data_file, out_dir, **sections) -> dict:
    return objective_recipe("kto", "unpaired_preference", model_dir, data_file, out_dir, **sections)


@pytest.fixture(scope="module")
def unpaired_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("unpaired") / "unpaired.jsonl", unpaired_rows())


def _prepared(tiny_llama, rows, tmp_path, **data_keys):
    values = kto_recipe(tiny_llama, write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out")
    values["data"].update({"eval_fraction": 0.0, "cache": False, **data_keys})
    recipe = validate_recipe(values)
    return data.prepare(recipe, model.load_tokenizer(recipe)), model.load_tokenizer(recipe)


def _scored(example, tokenizer) -> str:
    return tokenizer.decode([i for i, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


# ------------------------------------------------------------------------------------------------------------ data
def test_rows_score_the_completion_only_and_carry_their_label(tiny_llama, tmp_path):
    question = [{"role": "user", "content": "Name a colour."}]
    rows = [{"prompt": "Name a colour.", "completion": "Blue", "label": True},
            {"prompt": question, "completion": [{"role": "assistant", "content": "Seven"}], "label": False},
            {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, *question],
             "completion": "Blue", "label": True}]  # a multi-turn prompt: its assistant turn is not scored
    prepared, tokenizer = _prepared(tiny_llama, rows, tmp_path)
    examples = list(prepared.train)
    assert [e.desirable for e in examples] == [True, False, True]
    assert [_scored(e, tokenizer).split("<")[0] for e in examples] == ["Blue", "Seven", "Blue"]
    assert "Hello" not in _scored(examples[2], tokenizer)
    from finetune.cli.preview import render_preview

    recipe = validate_recipe(kto_recipe(tiny_llama, tmp_path / "rows.jsonl", tmp_path / "out"))
    preview = render_preview(prepared, tokenizer, recipe, rows=2)  # what `finetune data` prints
    assert "trained, desirable) ---" in preview and "trained, undesirable) ---" in preview
    # through the token store (the cache), the labels come back with the rows
    cached, _ = _prepared(tiny_llama, rows, tmp_path, cache=True)
    assert [e.desirable for e in cached.train] == [True, False, True]
    assert [e.input_ids for e in cached.train] == [e.input_ids for e in examples]


@pytest.mark.parametrize("row,needle", [
    ({"prompt": "Q?", "completion": "A"}, "missing or empty `label`"),
    ({"prompt": "Q?", "completion": "A", "label": 1}, "`label` must be true (a desirable completion) or false"),
    ({"prompt": "Q?", "completion": "A", "label": "yes"}, "got 'yes'"),  # ("true"/"false" as text: a CSV's cells)
    ({"prompt": "Q?", "completion": "", "label": True}, "missing or empty `completion`"),
])
def test_bad_rows_name_the_row_and_the_fix(tiny_llama, tmp_path, row, needle):
    rows = [{"prompt": "Fine?", "completion": "Yes", "label": True}, row]
    with pytest.raises(DataError) as error:
        _prepared(tiny_llama, rows, tmp_path)
    assert needle in str(error.value) and "line 2" in str(error.value) and "data.bad_rows: skip" in str(error.value)
    prepared, _ = _prepared(tiny_llama, rows, tmp_path, bad_rows="skip")
    assert (len(prepared.train), prepared.stats.skipped) == (1, 1)


def test_unpaired_rows_as_pairs_say_what_the_rows_are(tiny_llama, tmp_path):
    values = kto_recipe(tiny_llama, write_jsonl(tmp_path / "unpaired.jsonl", unpaired_rows(4)), tmp_path / "out")
    values["data"]["datasets"][0]["format"], values["train"]["objective"] = "preference", "dpo"
    values["data"]["cache"] = False
    recipe = validate_recipe(values)
    with pytest.raises(DataError, match=r"have `completion` and `label`.*format: unpaired_preference and "
                                        r"train.objective: kto"):
        data.prepare(recipe, model.load_tokenizer(recipe))


@pytest.mark.parametrize("change,needle", [
    ({"format": "alpaca"}, r"format `alpaca`, but train.objective is kto.*format: unpaired_preference, or give pairs"),
    ({"objective": "dpo"}, r"format `unpaired_preference`, but train.objective is dpo.*format: preference"),
    ({"objective": "sft"}, r"format `unpaired_preference` \(preference data\), but train.objective is sft.*objective: kto"),
    ({"dpo": {"loss": "ipo", "beta": 0.3}}, r"dpo.beta, dpo.loss: train.objective kto reads only dpo.reference"),
    ({"dpo": {"reference": "precomputed"}}, "dpo.reference: precomputed is not supported with train.objective: kto"),
    ({"objective": "dpo", "format": "preference", "kto": {"beta": 0.2}}, "kto.beta: set, but train.objective is dpo"),
    ({"streaming": True}, "data.streaming: train.objective: kto pairs each prompt"),
])
def test_kto_recipes_with_the_wrong_data_or_sections_are_refused(tiny_llama, tmp_path, change, needle):
    values = kto_recipe(tiny_llama, tmp_path / "x.jsonl", tmp_path / "out")
    if "format" in change:
        values["data"]["datasets"][0]["format"] = change["format"]
    if "objective" in change:
        values["train"]["objective"] = change["objective"]
    if "streaming" in change:
        values["data"]["streaming"] = True
    values.update({key: change[key] for key in ("dpo", "kto") if key in change})
    with pytest.raises(RecipeError, match=needle):
        validate_recipe(values)


def test_a_resolved_kto_recipe_reloads(tiny_llama, tmp_path):
    """recipe.yaml lists every key (the dpo: section's defaults too): the section checks compare with the defaults."""
    import yaml

    from finetune.recipe import recipe_to_yaml

    values = kto_recipe(tiny_llama, tmp_path / "x.jsonl", tmp_path / "out", kto={"beta": 0.2},
                        dpo={"reference": "adapter_off"})
    reloaded = validate_recipe(yaml.safe_load(recipe_to_yaml(validate_recipe(values))))
    assert (reloaded.train.objective, reloaded.kto.beta) == ("kto", 0.2)


# ------------------------------------------------------------------------------------------------------ KL rows
def _rows(n: int) -> list[Example]:
    """Row i: prompt [100 + i, 100 + i], completion [i] (trained), an untrained tail token, its label."""
    return [Example([100 + i, 100 + i, i, 7], [IGNORE_INDEX, IGNORE_INDEX, i, IGNORE_INDEX], desirable=i % 2 == 0)
            for i in range(n)]


def test_a_kl_row_is_the_prompt_with_the_partners_completion():
    row, partner = _rows(2)
    assert kl_sequence(row, partner, max_length=None) == Example([100, 100, 1, 7], [IGNORE_INDEX, IGNORE_INDEX, 1,
                                                                                    IGNORE_INDEX])
    long = Example([5] * 6 + [9], [IGNORE_INDEX] * 6 + [9])
    assert kl_sequence(long, partner, max_length=4).labels == [IGNORE_INDEX] * 4  # cut: scores nothing


def test_the_kl_row_takes_the_partners_whole_completion_as_trls(tiny_llama, tmp_path):
    """A partner row whose long prompt cut its completion at data.max_length lends its whole completion to the KL row
    (TRL 1.16 rotates the uncut completion_ids and cuts only the KL row): TRL's collator on the uncut rows' tokens is
    the oracle, the rows read back from the token store as training reads them."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    rows = [{"prompt": "Hi?", "completion": "Fine thanks.", "label": True},
            {"prompt": " ".join(f"p{i}" for i in range(16)), "completion": " ".join(map(str, range(12))), "label": False}]
    uncut, tokenizer = _prepared(tiny_llama, rows, tmp_path / "uncut", max_length=4096)
    short, long = sorted(uncut.train, key=lambda e: not e.desirable)
    start = lambda e: next(i for i, label in enumerate(e.labels) if label != IGNORE_INDEX)
    max_length = start(long) + 3  # the long row keeps 3 of its completion's tokens
    cut, _ = _prepared(tiny_llama, rows, tmp_path / "cut", max_length=max_length)
    assert type(cut.train).__name__ == "ExampleView"  # read from the token store
    row, partner = sorted(cut.train, key=lambda e: not e.desirable)
    assert cut.stats.truncated == 1 and partner.num_trained == 3
    ours = kl_sequence(row, partner, max_length=max_length)
    trl = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)([{
        "prompt_ids": short.input_ids[: start(short)], "completion_ids": short.input_ids[start(short):],
        "KL_completion_ids": long.input_ids[start(long):], "label": True}])
    assert ours.input_ids == trl["KL_input_ids"][0].tolist()
    assert ours == kl_sequence(short, long, max_length=max_length) and ours.num_trained > 3  # TRL: the same tokens
    scored = trl["KL_completion_mask"][0].tolist()  # (TRL's also scores the newline after the end of turn)
    assert all(scored[i] for i, label in enumerate(ours.labels) if label != IGNORE_INDEX)


def _step_kl_rows(n: int, *, micro_batch_size: int, world_size: int, grad_accum: int) -> list[list[tuple]]:
    """Per optimizer step: the (prompt, completion) tokens of every KL row of every rank, as sets."""
    steps = []
    streams = [iter(BatchStream(_rows(n), micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=3,
                                pad_id=0, grad_accum=grad_accum, kl_max_length=64)) for rank in range(world_size)]
    for _ in range(n // (micro_batch_size * world_size * grad_accum)):
        pairs = set()
        for stream in streams:
            for _ in range(grad_accum):
                batch = next(stream)
                for ids, labels in zip(batch["kl_input_ids"].tolist(), batch["kl_labels"].tolist()):
                    pairs.add((ids[0], next(label for label in labels if label != IGNORE_INDEX)))
                assert batch["desirable"].tolist() == [row % 2 == 0 for row in (batch["input_ids"][:, 2]).tolist()]
        steps.append(pairs)
    return steps


def test_a_step_of_one_row_is_refused():
    with pytest.raises(DataError, match="pairs its prompt with its own completion.*Fix: raise train.micro_batch_size"):
        BatchStream(_rows(4), micro_batch_size=1, rank=0, world_size=1, seed=0, pad_id=0, kl_max_length=64)


def test_the_kl_rows_are_the_same_for_any_world_size_and_micro_batch_split():
    """TRL's rotation by one (the first row takes the last row's completion), over the optimizer step's rows: the
    same mismatched pairs for 1 x 8, 2 x 4, 2 x 2 x accumulation 2 and 1 x 1 x accumulation 8."""
    single = _step_kl_rows(24, micro_batch_size=8, world_size=1, grad_accum=1)
    for split in ({"micro_batch_size": 4, "world_size": 2, "grad_accum": 1},
                  {"micro_batch_size": 2, "world_size": 2, "grad_accum": 2},
                  {"micro_batch_size": 1, "world_size": 1, "grad_accum": 8}):
        assert _step_kl_rows(24, **split) == single, split
    # one micro-batch per step: exactly TRL's `[completion_ids[-1]] + completion_ids[:-1]` over the batch's rows
    batch = next(iter(BatchStream(_rows(24), micro_batch_size=8, rank=0, world_size=1, seed=3, pad_id=0,
                                  kl_max_length=64)))
    completions = batch["input_ids"][:, 2].tolist()
    assert batch["kl_input_ids"][:, 2].tolist() == completions[-1:] + completions[:-1]
    assert batch["kl_input_ids"][:, 0].tolist() == batch["input_ids"][:, 0].tolist()  # each row's own prompt
    for pairs in single:  # every prompt once, every completion once, never its own
        prompts, completions = zip(*pairs)
        assert len(set(prompts)) == len(set(completions)) == 8 and all(p - 100 != c for p, c in pairs)


# ----------------------------------------------------------------------------------- the loss against plain math
def _plain_logps(peft_model, batch, *, reference: bool):
    import contextlib

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    adapter = peft_model.disable_adapter() if reference else contextlib.nullcontext()
    with torch.set_grad_enabled(not reference), adapter:
        logits = peft_model(**inputs, use_cache=False).logits
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (logp * mask).sum(dim=1)


def test_a_micro_batch_equals_the_plain_implementation(tiny_llama, unpaired_file, tmp_path):
    """Loss, KL estimate and LoRA gradients of a micro-batch through the model (fused head, adapter switch) against
    the KTO formulas on plain log-probs."""
    recipe = validate_recipe(kto_recipe(tiny_llama, unpaired_file, tmp_path / "out", kto={"beta": 0.5,
                                                                                          "undesirable_weight": 1.4}))
    tokenizer = model.load_tokenizer(recipe)
    batch = next(iter(BatchStream(data.prepare(recipe, tokenizer).train, micro_batch_size=6, rank=0, world_size=1,
                                  seed=0, pad_id=tokenizer.pad_token_id, kl_max_length=recipe.data.max_length)))
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    with torch.no_grad():  # B away from zero: policy and reference differ, every LoRA tensor gets a gradient
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    peft_model.eval()
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    objective = objectives.KTO(peft_model, recipe)
    totals = [float(v) for v in objective.counts(peft_model, [batch], CPU)]
    loss = objective.loss(peft_model, batch, totals, CPU)[0]
    grads = torch.autograd.grad(loss, trained)

    mismatched = {key[3:]: value for key, value in batch.items() if key.startswith("kl_")}
    with torch.no_grad():
        mean_ratio = (_plain_logps(peft_model, mismatched, reference=False)
                      - _plain_logps(peft_model, mismatched, reference=True)).mean()
    z = mean_ratio.clamp(min=0)
    ratio = _plain_logps(peft_model, batch, reference=False) - _plain_logps(peft_model, batch, reference=True)
    desirable = batch["desirable"]
    losses = torch.where(desirable, 1 - torch.sigmoid(0.5 * (ratio - z)), 1.4 * (1 - torch.sigmoid(0.5 * (z - ratio))))
    expected = losses.mean()
    expected_grads = torch.autograd.grad(expected, trained)
    assert 0 < desirable.sum() < 6 and abs(float(mean_ratio)) > 1e-3
    assert totals[3:] == [pytest.approx(6 * float(mean_ratio), abs=1e-5), 6]  # the KL rows' log-ratio sum, count
    assert kto.kl_estimate(totals[3], totals[4]) == pytest.approx(float(z), abs=1e-6)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in expected_grads) > 0


def test_eval_pairs_each_prompt_with_the_previous_rows_completion_as_the_plain_formula(tiny_llama, unpaired_file,
                                                                                      tmp_path):
    """Found by a bug bash (mutant K06): evaluate builds its own KL rows and nothing checked them; pairing each eval
    row with itself (its own log-ratio as the KL estimate) passed. Oracle: the KL rows built by hand (row i's prompt,
    row i - 1's completion, TRL's rotation), plain log-probs, the KTO formula; 5 rows in uneven micro-batches of 2."""
    from finetune.data import collate

    recipe = validate_recipe(kto_recipe(tiny_llama, unpaired_file, tmp_path / "out", kto={"beta": 0.5,
                                        "undesirable_weight": 1.4}, train={"micro_batch_size": 2}))
    tokenizer = model.load_tokenizer(recipe)
    rows = list(data.prepare(recipe, tokenizer).train)[:5]
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    peft_model.eval()
    got = objectives.KTO(peft_model, recipe).evaluate(peft_model, rows, recipe, pad_id=tokenizer.pad_token_id)

    start = lambda e: next(i for i, label in enumerate(e.labels) if label != IGNORE_INDEX)
    kl_rows = [Example(row.input_ids[: start(row)] + partner.input_ids[start(partner):],
                       [IGNORE_INDEX] * start(row) + partner.labels[start(partner):])
               for row, partner in zip(rows, rows[-1:] + rows[:-1])]
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        log_ratio = lambda batch: (_plain_logps(peft_model, batch, reference=False)
                                   - _plain_logps(peft_model, batch, reference=True))
        z = log_ratio(collate(kl_rows, pad)).mean().clamp(min=0)
        ratio = log_ratio(collate(rows, pad))
    desirable = torch.tensor([row.desirable for row in rows])
    losses = torch.where(desirable, 1 - torch.sigmoid(0.5 * (ratio - z)), 1.4 * (1 - torch.sigmoid(0.5 * (z - ratio))))
    own = ratio.mean().clamp(min=0)  # what pairing each row with itself would give
    assert 0 < int(desirable.sum()) < 5 and abs(float(z) - float(own)) > 1e-3 and float(z) > 1e-4
    assert got["eval_kl"] == pytest.approx(float(z), abs=1e-5)  # (rounded to 6 digits)
    assert got["eval_loss"] == pytest.approx(float(losses.mean()), abs=1e-5)


# ------------------------------------------------------------------------------------------------------ real runs
@pytest.mark.slow
def test_step_one_is_half_the_mean_weight_and_it_learns(tiny_llama, unpaired_file, tmp_path):
    """fp32, a fresh adapter, library LoRA dropout (off during KTO as TRL): policy = reference at step 1, so every
    log-ratio and the KL estimate are 0 and each row's loss is weight x (1 - sigmoid(0)) = weight / 2."""
    values = kto_recipe(tiny_llama, unpaired_file, tmp_path / "run", lora={"dropout": 0.05},
                        kto={"undesirable_weight": 2.0, "beta": 0.5},
                        train={"max_steps": 12, "micro_batch_size": 8, "learning_rate": 2e-2, "eval_every": 2})
    # evaluated on the training rows themselves: learning is fitting them (a step's loss moves with its mix of labels,
    # and a tiny random model does not generalize from 48 rows)
    values["data"]["eval_datasets"] = [{"path": str(unpaired_file), "format": "unpaired_preference"}]
    _train(write_recipe(tmp_path / "kto.yaml", values))
    logged = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    first = logged[0]
    # the rows of step 1: the first 8 of epoch 0's shuffle (BatchStream), of the train split's rows
    recipe = validate_recipe(values)
    train = data.prepare(recipe, model.load_tokenizer(recipe)).train
    rows = [train[i] for i in data.epoch_permutation(len(train), recipe.train.seed, 0)[:8]]
    undesirable = sum(not e.desirable for e in rows)
    assert 0 < undesirable < 8
    assert first["loss"] == pytest.approx((0.5 * (8 - undesirable) + 1.0 * undesirable) / 8, abs=1e-6)
    assert first["kl"] == 0 and first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    # it learns
    evals = [m for m in read_metrics(tmp_path / "run") if "eval_loss" in m]
    assert len(evals) == 6 and {"eval_rewards/margins", "eval_kl", "eval_logps/chosen"} <= set(evals[-1])
    desirable = sum(row["label"] for row in unpaired_rows())
    before = (0.5 * desirable + 1.0 * (48 - desirable)) / 48  # the eval loss of the starting weights (= reference)
    assert evals[-1]["eval_loss"] < before - 0.05, (before, evals)


# The shipped configs (bf16 as shipped) from an SFT adapter: the reference pass (rows and KL rows) swaps the starting
# LoRA values into DDP replicas, FSDP2 DTensor shards, FSDP1 flat parameters and ZeRO-3 partitions, then back. The KL
# estimate is the step's, all-reduced with the counts: the curve is the single process's within bf16's tolerance.
# Every file in accelerate_configs/: deepspeed_zero2 swaps whole parameters (the DDP branch) inside the DeepSpeed
# engine; multi_node is fsdp2 launched as 2 machines of 1 process (tests/shipped.py).
SHIPPED = ("single_gpu", "ddp", "fsdp2", "fsdp1", "deepspeed_zero2", "deepspeed_zero3", "multi_node")
# Measured (6 steps, 2 CPU processes): DDP, FSDP2, FSDP1 within 9.1e-4 of one process on an Intel Xeon, and with
# ZeRO-2 and multi_node within 1.7e-3 on an AMD EPYC (the same curve to the bit), ZeRO-3 within 8.2e-4; the
# logged kl (0.53 and 0.39 at steps 4 and 5, 0 elsewhere: clamped) within 2.5e-3 and 5.3e-3 (ZeRO-3).
BF16_TOLERANCE = 3e-3  # every config, ZeRO-3 included (it was 6e-3 while DeepSpeed kept the LoRA gathered: fixed)
# Step 1's grad norm, relative: measured within 7.2e-4 of one process (0.2043; ZeRO-3 0.2041); a missing world-size
# factor halves it.
GRAD_NORM_TOLERANCE = 5e-3



def test_every_accelerate_config_is_trained_with_kto():
    """The KTO shipped-config test launches every file in accelerate_configs/ (a new file must be added there)."""
    from shipped import CONFIG_DIR

    assert set(SHIPPED) == {path.stem for path in CONFIG_DIR.glob("*.yaml")}

@pytest.mark.slow
def test_every_shipped_config_trains_the_same_kto_curve_from_an_sft_adapter(tiny_llama, sft_adapter, tmp_path):
    from conftest import LIBRARY_LORA
    from shipped import ACCELERATE_CONFIG_RUNS, recipe_dtype

    # mostly desirable rows: the policy raises the answers' log-probs under other prompts too, so the KL estimate is
    # positive (live in the loss) in these steps
    rows = write_jsonl(tmp_path / "rows.jsonl", unpaired_rows(desirable=0.8))
    curves, kls, norms = {}, {}, {}
    for config in SHIPPED:
        processes = ACCELERATE_CONFIG_RUNS[f"{config}.yaml"].processes
        values = kto_recipe(tiny_llama, rows, tmp_path / config, lora={**LIBRARY_LORA, "r": 8, "alpha": 16}, kto={"beta": 0.5},
                            model={"dtype": recipe_dtype(f"{config}.yaml"), "adapter": str(sft_adapter)},
                            train={"max_steps": 6, "micro_batch_size": 8 // processes, "learning_rate": 2e-2})
        result = accelerate_launch(config, write_recipe(tmp_path / f"{config}.yaml", values))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        curves[config] = train_losses(tmp_path / config)
        kls[config] = [m["kl"] for m in read_metrics(tmp_path / config) if "kl" in m]
        norms[config] = next(m["grad_norm"] for m in read_metrics(tmp_path / config) if "loss" in m)
    # Step 1's gradient is the single process's under every engine (each rank's loss scaled by the world size, as
    # DDP, FSDP and ZeRO average gradients); without the factor it was half (bug bash bb50 S5), and the curves agreed.
    print("step-1 grad norms:", norms)
    for config, norm in norms.items():
        assert norm == pytest.approx(norms["single_gpu"], rel=GRAD_NORM_TOLERANCE), (config, norms)
    reference = curves.pop("single_gpu")
    print("largest loss and kl gap to one process:", {config: (max(abs(a - b) for a, b in zip(losses, reference)),
                                                       max(abs(a - b) for a, b in zip(kls[config], kls["single_gpu"])))
                                                      for config, losses in curves.items()})
    assert reference[0] == pytest.approx(0.5, abs=1e-6) and max(abs(loss - 0.5) for loss in reference) > 5 * BF16_TOLERANCE
    assert max(kls["single_gpu"]) > 0.01  # the KL term is live in these steps
    for config, losses in curves.items():
        assert losses == pytest.approx(reference, abs=BF16_TOLERANCE), (config, losses, reference)
        assert kls[config] == pytest.approx(kls["single_gpu"], abs=10 * BF16_TOLERANCE), (config, kls)
