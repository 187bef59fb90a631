"""Preference tuning (train.objective: dpo): losses against a plain implementation, pair data, and real runs.

* Each dpo.loss's loss, rewards and LoRA gradients of a micro-batch equal the same loss on plain log-probs
  (full-vocabulary log-softmax, the reference from PEFT's own `disable_adapter()`) in fp32; the loss code itself is
  checked against TRL's own in test_preference_oracle.py.
* Pair data: text, message-list and implicit-prompt rows; only response tokens scored; truncation keeps the prompt's
  end and is counted; bad pairs and SFT/DPO mix-ups refused with the row and the fix.
* Runs (real processes): step 1 is ln 2 from a fresh adapter and from an SFT adapter (model.adapter), with the
  reference adapter_off or precomputed, which agree within 1e-5 in fp32; the shipped accelerate configs (bf16, LoRA
  dropout 0.05, checkpointing on) train the same curve from an SFT adapter; kill -9 + resume is bitwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    RUN_PY,
    accelerate_launch,
    free_port,
    objective_recipe,
    read_metrics,
    recipe_dict,
    run_cmd,
    train_losses,
    write_jsonl,
    write_recipe,
)
from processes import finish, start, wait_for_step, worker_pids

from finetune import data, model
from finetune.errors import DataError, RecipeError
from finetune.recipe import validate_recipe
from finetune.training.objectives import preference

CPU = torch.device("cpu")
LN2 = math.log(2)


def pair_rows(n: int = 48, seed: int = 0) -> list[dict]:
    """Addition questions: the right sum preferred to a wrong one."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}.", "rejected": f"{a + b + rng.randint(1, 9)}."})
    return rows


def dpo_recipe(model_dir, data_file, out_dir, **sections) -> dict:
    return objective_recipe("dpo", "preference", model_dir, data_file, out_dir, **sections)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pair_rows())


# --------------------------------------------------------------------------------- the log-probs against plain math
def plain_logps(peft_model, batch, *, reference: bool):
    """Summed response log-probs per sequence and their counts: full-vocabulary log-softmax, the reference from PEFT's
    own `disable_adapter()`."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "reference_logps")}
    adapter = peft_model.disable_adapter() if reference else contextlib.nullcontext()
    with torch.set_grad_enabled(not reference), adapter:
        logits = peft_model(**inputs, use_cache=False).logits
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (logp * mask).sum(dim=1), mask.sum(dim=1)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "orpo", "simpo"])
def test_each_loss_equals_the_plain_implementation(loss, tiny_llama, pairs_file, tmp_path, monkeypatch):
    """A micro-batch's loss, metrics and LoRA gradients through the model: ours (log-probs from the fused head, the
    reference from the adapter switch) against the same loss code on plain log-probs. The loss code itself is checked
    against TRL's in test_preference_oracle.py."""
    recipe = validate_recipe(dpo_recipe(tiny_llama, pairs_file, tmp_path / "out", dpo={"loss": loss, "beta": 0.5}))
    tokenizer = model.load_tokenizer(recipe)
    examples = data.prepare(recipe, tokenizer).train[:4]
    batch = data.collate(examples, tokenizer.pad_token_id)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    with torch.no_grad():  # B away from zero: policy and reference differ, every LoRA tensor gets a gradient
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    peft_model.eval()  # dropout off in both (a dropout mask is not part of the comparison)
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    reference = preference.Reference(peft_model, recipe)

    def step(batch):
        loss_sum, nll_sum, metrics, counts = preference.micro_batch_terms(peft_model, batch, recipe.dpo, reference, CPU)
        value = preference.combine(loss_sum, nll_sum, counts.tolist(), recipe.dpo)
        return value, torch.autograd.grad(value, trained), dict(zip(preference.METRICS, metrics.tolist())), counts

    ours, grads, sums, counts = step(batch)
    plain_reference, _ = plain_logps(peft_model, batch, reference=True)
    with monkeypatch.context() as patch:
        patch.setattr(preference, "sequence_logps", lambda *args, **_: plain_logps(peft_model, batch, reference=False))
        expected, expected_grads, expected_sums, _ = step({**batch, "reference_logps": plain_reference.double()})
    assert counts.tolist() == [4, float((batch["labels"][:4, 1:] != -100).sum())]
    assert float(ours) == pytest.approx(float(expected), abs=1e-5, rel=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert float(want.abs().sum()) > 0
    for name, value in expected_sums.items():
        assert sums[name] == pytest.approx(value, abs=1e-4, rel=1e-5), name
    if loss in preference.WITH_REFERENCE:
        assert expected_sums["rewards/margins"] != pytest.approx(0, abs=1e-3)  # policy != reference: a swap shows


@pytest.mark.parametrize("loss", ["orpo", "sigmoid"])
def test_logged_metrics_have_trls_names_and_values(loss, tiny_llama, pairs_file, tmp_path):
    """The step metrics under TRL's names, against the plain math: ORPOTrainer's nll_loss (chosen tokens' mean NLL),
    log_odds_ratio (mean log sigmoid of the log odds) and log_odds_chosen (mean log odds), and logps/* as the scores
    the rewards come from (ORPO: mean log-prob per token; DPO: sums)."""
    recipe = validate_recipe(dpo_recipe(tiny_llama, pairs_file, tmp_path / "out", dpo={"loss": loss, "beta": 0.5}))
    tokenizer = model.load_tokenizer(recipe)
    batch = data.collate(data.prepare(recipe, tokenizer).train[:4], tokenizer.pad_token_id)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    peft_model.eval()
    with torch.no_grad():
        summed, tokens = plain_logps(peft_model, batch, reference=False)
        half = summed.size(0) // 2
        scores = summed / tokens.clamp(min=1) if recipe.dpo.normalized() else summed
        pc, pr, chosen_sums, chosen_tokens = scores[:half], scores[half:], summed[:half], tokens[:half].sum()
        sums = summed[:half], summed[half:]
        reference = preference.Reference(peft_model, recipe)
        _, _, metric_sums, counts = preference.micro_batch_terms(peft_model, batch, recipe.dpo, reference, CPU)
    logged = preference.metric_means(metric_sums.tolist(), counts.tolist(), recipe.dpo)
    names = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected"}
    if loss == "orpo":
        log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
        assert set(logged) == names | {"nll_loss", "log_odds_ratio", "log_odds_chosen"}
        assert logged["nll_loss"] == pytest.approx(float(-chosen_sums.sum() / chosen_tokens), abs=1e-5)
        assert logged["log_odds_ratio"] == pytest.approx(float(torch.nn.functional.logsigmoid(log_odds).mean()), abs=1e-5)
        assert logged["log_odds_chosen"] == pytest.approx(float(log_odds.mean()), abs=1e-5)
        assert logged["logps/chosen"] == pytest.approx(float(pc.mean()), abs=1e-5)
        assert logged["logps/rejected"] == pytest.approx(float(pr.mean()), abs=1e-5)
    else:
        assert set(logged) == names
        assert logged["logps/chosen"] == pytest.approx(float(sums[0].mean()), abs=1e-4)
        assert logged["logps/rejected"] == pytest.approx(float(sums[1].mean()), abs=1e-4)


def test_the_head_never_hands_full_vocabulary_logits_to_the_preference_loss(tiny_llama, pairs_file, tmp_path):
    recipe = validate_recipe(dpo_recipe(tiny_llama, pairs_file, tmp_path / "out"))
    tokenizer = model.load_tokenizer(recipe)
    batch = data.collate(data.prepare(recipe, tokenizer).train[:2], tokenizer.pad_token_id)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    widest = []
    head = peft_model.get_output_embeddings()
    from finetune.training.loss import install

    install(peft_model, CPU)  # once per run, at the first loss: the probe forward that measures the head's transform
    hook = head.register_forward_hook(lambda module, args, out: widest.append(tuple(out.shape)))
    logps, counts = preference.sequence_logps(peft_model, batch, CPU)
    hook.remove()
    assert logps.shape == (4,) and bool((counts > 0).all())
    vocab = peft_model.config.vocab_size
    assert widest and all(shape[-1] != vocab or len(shape) < 3 for shape in widest)  # per-token losses, not (B, T, V)


# ---------------------------------------------------------------------------------------------------- pair data
def _prepared(tiny_llama, rows, tmp_path, **data_keys):
    data_file = write_jsonl(tmp_path / "rows.jsonl", rows)
    values = dpo_recipe(tiny_llama, data_file, tmp_path / "out")
    values["data"].update({"eval_fraction": 0.0, "cache": False, **data_keys})
    recipe = validate_recipe(values)
    return data.prepare(recipe, model.load_tokenizer(recipe)), model.load_tokenizer(recipe)


def _scored(example, tokenizer) -> str:
    return tokenizer.decode([i for i, label in zip(example.input_ids, example.labels) if label != -100])


def test_pair_forms_score_only_the_responses(tiny_llama, tmp_path):
    conversation = [{"role": "user", "content": "Name a colour."}]
    rows = [
        {"prompt": "Name a colour.", "chosen": "Blue", "rejected": "Seven"},
        {"prompt": conversation, "chosen": [{"role": "assistant", "content": "Blue"}], "rejected": "Seven"},
        {"chosen": conversation + [{"role": "assistant", "content": "Blue"}],  # implicit prompt (UltraFeedback)
         "rejected": conversation + [{"role": "assistant", "content": "Seven"}]},
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, *conversation],
         "chosen": "Blue", "rejected": "Seven"},  # a multi-turn prompt: its assistant turn is not scored
    ]
    prepared, tokenizer = _prepared(tiny_llama, rows, tmp_path)
    assert len(prepared.train) == 4
    for example in prepared.train:
        assert _scored(example, tokenizer).startswith("Blue") and _scored(example.rejected, tokenizer).startswith("Seven")
        assert "Hello" not in _scored(example, tokenizer)
        prompt = lambda e: e.input_ids[: next(i for i, label in enumerate(e.labels) if label != -100)]
        assert prompt(example) == prompt(example.rejected)  # both answer the same prompt tokens
    assert prepared.train[0].input_ids == prepared.train[2].input_ids  # text prompt = a user turn through the template


def test_truncation_keeps_the_end_of_the_prompt_and_is_counted(tiny_llama, tmp_path):
    long_prompt = " ".join(f"word{i}" for i in range(80)) + " What is 2 plus 2?"
    rows = [{"prompt": long_prompt, "chosen": "4. " * 30, "rejected": "5."}, {"prompt": "Q?", "chosen": "A", "rejected": "B"}]
    prepared, tokenizer = _prepared(tiny_llama, rows, tmp_path, max_length=64)
    stats = prepared.stats
    assert (stats.truncated, stats.prompt_truncated, stats.response_truncated) == (1, 1, 1)
    cut = prepared.train[0]
    assert len(cut.input_ids) <= 64 and len(cut.rejected.input_ids) <= 64
    text = tokenizer.decode(cut.input_ids)
    assert "What is 2 plus 2?" in text and "word0 " not in text
    prompt_tokens = next(i for i, label in enumerate(cut.labels) if label != -100)
    assert prompt_tokens == 32  # cut down to dpo.max_prompt_length's default, half of data.max_length
    from finetune.cli.preview import render_preview

    recipe = validate_recipe(dpo_recipe(tiny_llama, tmp_path / "rows.jsonl", tmp_path / "out", data={"max_length": 64}))
    preview = render_preview(prepared, tokenizer, recipe, rows=2)  # what `finetune data` prints
    assert "--- pair 2: rejected" in preview and "[[B" in preview
    assert "pairs truncated: 1 lost the beginning of their prompt" in preview and "1 lost the end of their responses" in preview
    # Found by a bug bash (bb53 #8): it suggested `data.packing: true`, which a DPO recipe refuses.
    assert "packing: off (train.objective dpo rows are not packed)" in preview and "packing: true" not in preview


@pytest.mark.parametrize("row,needle", [
    ({"prompt": "Q?", "chosen": "A"}, "missing or empty `rejected`"),
    ({"prompt": "Q?", "chosen": "", "rejected": "B"}, "missing or empty `chosen`"),
    ({"prompt": "Q?", "chosen": "Same", "rejected": "Same"}, "are identical"),
    ({"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "chosen": "B", "rejected": "C"},
     "must end with a user turn"),
])
def test_bad_pairs_name_the_row_and_the_fix(tiny_llama, tmp_path, row, needle):
    rows = [{"prompt": "Fine?", "chosen": "Yes", "rejected": "No"}, row]
    with pytest.raises(DataError) as error:
        _prepared(tiny_llama, rows, tmp_path)
    assert needle in str(error.value) and "line 2" in str(error.value) and "data.bad_rows: skip" in str(error.value)
    prepared, _ = _prepared(tiny_llama, rows, tmp_path, bad_rows="skip")
    assert (len(prepared.train), prepared.stats.skipped) == (1, 1)


def test_sft_data_in_a_dpo_recipe_and_the_reverse_are_refused(tiny_llama, tmp_path):
    values = dpo_recipe(tiny_llama, tmp_path / "x.jsonl", tmp_path / "out")
    values["data"]["datasets"][0]["format"] = "alpaca"
    with pytest.raises(RecipeError, match=r"data.datasets\[0\].*format `alpaca`, but train.objective is dpo"):
        validate_recipe(values)
    values["data"]["datasets"][0]["format"], values["train"]["objective"] = "preference", "sft"
    with pytest.raises(RecipeError, match="format `preference`.*train.objective is sft"):
        validate_recipe(values)


# ------------------------------------------------------------------------------------------------------ real runs
def _train(recipe_path, *overrides, nproc: int = 1):
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    result = run_cmd([*launcher, str(RUN_PY), str(recipe_path), *overrides])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def train_sft_adapter(tiny_llama: Path, root: Path) -> Path:
    """An SFT run's adapter on the same prompts (the SFT -> DPO pipeline's first half): the session fixture
    `sft_adapter` (tests/conftest.py) trains it once for this file and test_kto.py."""
    rows = [{"instruction": r["prompt"], "output": r["chosen"]} for r in pair_rows()]
    recipe = write_recipe(root / "sft.yaml", recipe_dict(tiny_llama, write_jsonl(root / "sft.jsonl", rows), root / "run",
                                                          train={"max_steps": 4}))
    _train(recipe)
    return root / "run" / "adapter"


@pytest.mark.slow
# From the SFT adapter, the pipeline's case; a fresh adapter's step 1 is checked by the 1-step run at the end (a fresh
# run of both reference modes cost 14 s for the same swap code).
@pytest.mark.parametrize("start", ["adapter"])
def test_step_one_is_ln2_and_the_precomputed_reference_matches_adapter_off(start, tiny_llama, pairs_file, sft_adapter,
                                                                          tmp_path):
    """fp32, library LoRA dropout (0.05, off during DPO as TRL): policy = reference at step 1, so the loss is ln 2."""
    values = dpo_recipe(tiny_llama, pairs_file, tmp_path / "unused", lora={"dropout": 0.05},
                        train={"max_steps": 4, "micro_batch_size": 4})
    if start == "adapter":
        values["model"]["adapter"] = str(sft_adapter)
    recipe = write_recipe(tmp_path / "dpo.yaml", values)
    curves, logged = {}, {}
    for mode in ("adapter_off", "precomputed"):
        out = tmp_path / mode
        output = _train(recipe, f"output.dir={out}", f"dpo.reference={mode}").stdout
        curves[mode], logged[mode] = train_losses(out), read_metrics(out)
        assert ("reference log-probs: 48 pairs (precomputed)" in output) == (mode == "precomputed")
    assert curves["adapter_off"][0] == pytest.approx(LN2, abs=1e-6)
    assert curves["precomputed"] == pytest.approx(curves["adapter_off"], abs=1e-5)
    first = logged["adapter_off"][0]
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert curves["adapter_off"][-1] < curves["adapter_off"][0]  # it learns the preference
    evals = [m for m in logged["adapter_off"] if "eval_loss" in m]
    assert evals and {"eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"} <= set(evals[-1])
    adapter_config = json.loads((tmp_path / "adapter_off" / "adapter" / "adapter_config.json").read_text())
    if start == "adapter":  # the policy started from the SFT adapter: its log-probs, not the base's
        assert adapter_config["r"] == json.loads((sft_adapter / "adapter_config.json").read_text())["r"]
        fresh = _train(recipe, f"output.dir={tmp_path / 'fresh'}", "model.adapter=null", "train.max_steps=1")
        assert fresh.returncode == 0
        assert read_metrics(tmp_path / "fresh")[0]["logps/chosen"] != pytest.approx(first["logps/chosen"], abs=1e-3)
        assert train_losses(tmp_path / "fresh")[0] == pytest.approx(LN2, abs=1e-6)  # a fresh policy is its reference


# The shipped configs (bf16 as shipped; multi_node.yaml is the multi-machine template of fsdp2, trained for SFT by
# tests/parallel/test_shipped.py) from the SFT adapter, adapter_off: the reference pass swaps the starting LoRA
# values into DDP replicas, FSDP2 DTensor shards, FSDP1 flat parameters and ZeRO-3 partitions, then swaps back.
# deepspeed_zero2.yaml is not among them (one launch less): its whole parameters take the reference swap's DDP branch
# (`_local` in finetune/training/preference.py) and the DeepSpeed engine's side is ZeRO-3's here; ZeRO-2 trains SFT as
# shipped in tests/parallel/test_shipped.py. ZeRO-2 x DPO is the one combination not run.
SHIPPED = ("single_gpu", "ddp", "fsdp2", "fsdp1", "deepspeed_zero3")
# Shard-grad-op, the FSDP files' documented switch, given as a user's `accelerate launch` option: units stay gathered
# between forwards, so the swap must reshard first (FSDP2 died on a shape mismatch) and after the reference forward
# (FSDP1's next forward reused the gathered reference values: the reference equalled the policy, every loss ln 2).
SHARD_GRAD_OP = {"fsdp2": ("--fsdp_reshard_after_forward", "false"), "fsdp1": ("--fsdp_reshard_after_forward", "SHARD_GRAD_OP")}
# Measured over these 6 steps against single_gpu: DDP/FSDP within 1.2e-4, shard-grad-op 2.3e-4, ZeRO-3 3.8e-4 (its
# partitioned LoRA goes through PEFT's bf16 forward; it was 4.1e-3 while DeepSpeed could keep the LoRA parameters
# gathered across the reference swap, now freed by parallel.reshard). The reference curve moves more than 5x this from
# ln 2, which every loss would keep if the swap wrote nothing (reference = policy).
TOLERANCE = 1.5e-3
# Step 1's grad norm, relative: measured within 1.5e-3 of single_gpu (0.1001; ZeRO-3 0.09998); a missing world-size
# factor halves it.
GRAD_NORM_TOLERANCE = 5e-3


@pytest.mark.slow
def test_every_shipped_config_trains_the_same_dpo_curve_from_an_sft_adapter(tiny_llama, pairs_file, sft_adapter, tmp_path):
    from conftest import LIBRARY_LORA
    from shipped import ACCELERATE_CONFIG_RUNS, recipe_dtype

    curves, norms = {}, {}
    runs = [(config, config, ()) for config in SHIPPED]
    runs += [(f"{config}-shard-grad-op", config, flags) for config, flags in SHARD_GRAD_OP.items()]
    for name, config, flags in runs:
        processes = ACCELERATE_CONFIG_RUNS[f"{config}.yaml"].processes
        # DDP in 2 micro-batches of 1 row a step: all-reduced after the step's last one only (after the first, the
        # replicas drifted apart and the run's checkpoint read-back refused them; every run had grad_accum 1: bb50 S7)
        accumulate = 2 if config == "ddp" else 1
        values = dpo_recipe(tiny_llama, pairs_file, tmp_path / name, lora={**LIBRARY_LORA, "r": 8, "alpha": 16},
                            model={"dtype": recipe_dtype(f"{config}.yaml"), "adapter": str(sft_adapter)},
                            train={"max_steps": 6, "micro_batch_size": 4 // processes // accumulate,
                                   "grad_accum": accumulate, "learning_rate": 1e-2})
        result = accelerate_launch(config, write_recipe(tmp_path / f"{name}.yaml", values), flags=flags)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert ("(shard-grad-op)" in result.stdout) == bool(flags), result.stdout[-2000:]
        curves[name] = train_losses(tmp_path / name)
        norms[name] = next(m["grad_norm"] for m in read_metrics(tmp_path / name) if "loss" in m)
        assert (tmp_path / name / "adapter" / "adapter_model.safetensors").is_file()
    print("step-1 grad norms:", norms)
    # Step 1's gradient (one state everywhere: the SFT adapter) is the single process's under every engine: DDP, FSDP
    # and ZeRO average the ranks' gradients, so each rank's loss is scaled by the world size. Without that the norm
    # was half of it (bug bash bb50 S5: Adam's update hardly moves with a uniform gradient scale, so the curves agreed;
    # max_grad_norm clipped at twice its threshold).
    for name, norm in norms.items():
        assert norm == pytest.approx(norms["single_gpu"], rel=GRAD_NORM_TOLERANCE), (name, norms)
    reference = curves.pop("single_gpu")
    assert reference[0] == pytest.approx(LN2, abs=1e-6) and max(abs(loss - LN2) for loss in reference) > 5 * TOLERANCE
    final = [m for m in read_metrics(tmp_path / "single_gpu") if "eval_loss" in m][-1]
    assert {"eval_rewards/margins", "eval_rewards/accuracies"} <= set(final)  # 2 held-out pairs: present, not judged
    for config, losses in curves.items():
        assert losses == pytest.approx(reference, abs=TOLERANCE), (config, losses, reference)


@pytest.mark.slow
def test_kill_then_resume_with_a_precomputed_reference_is_bitwise(tiny_llama, pairs_file, tmp_path):
    from safetensors.torch import load_file

    values = dpo_recipe(tiny_llama, pairs_file, tmp_path / "unused", dpo={"reference": "precomputed"},
                        train={"max_steps": 8, "save_every": 3, "micro_batch_size": 2, "log_every": 1})
    recipe = write_recipe(tmp_path / "dpo.yaml", values)
    args = lambda out, *extra: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                f"--master_port={free_port()}", str(RUN_PY), str(recipe), f"output.dir={out}",
                                "parallel.strategy=fsdp", *extra]
    code, output = finish(start(args(tmp_path / "ref"), tmp_path / "ref.log"), tmp_path / "ref.log")
    assert code == 0, output[-3000:]
    run, log = tmp_path / "run", tmp_path / "killed.log"
    process = start(args(run), log)
    wait_for_step(process, run, 5, log)
    for pid in [*worker_pids(process.pid).values(), process.pid]:
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert not (run / "adapter").exists() and (run / preference.REFERENCE_FILE).is_file()
    code, output = finish(start(args(run, "train.resume=auto"), tmp_path / "resumed.log"), tmp_path / "resumed.log")
    assert code == 0, output[-3000:]
    assert "reference log-probs: 48 pairs (read from the run folder)" in output
    assert train_losses(run) == train_losses(tmp_path / "ref")
    untimed = lambda folder: [{k: v for k, v in m.items() if k not in ("tokens_per_s", "elapsed_s")}
                              for m in read_metrics(folder)]
    assert untimed(run) == untimed(tmp_path / "ref")  # rewards, log-probs and evals too
    ref_adapter, resumed = (load_file(str(folder / "adapter" / "adapter_model.safetensors")) for folder in (tmp_path / "ref", run))
    assert ref_adapter.keys() == resumed.keys() and all(torch.equal(ref_adapter[k], resumed[k]) for k in ref_adapter)
