"""Reward models (train.objective: reward): the recipe, the head, the loss against TRL's RewardTrainer, the adapter
as plain PEFT loads it, and real runs (one process; 2 FSDP2 ranks through the shipped config).

The oracle is the exported adapter itself: transformers' AutoModelForSequenceClassification(num_labels=1) with
PeftModel.from_pretrained scores the same right-padded rows, and TRL's RewardTrainer.compute_loss (as it ships) runs on
that model; finetune's in-training rewards and loss must equal both.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import objective_recipe, read_metrics, recipe_dict, write_jsonl, write_recipe

from finetune.errors import RecipeError
from finetune.recipe import validate_recipe

CPU = torch.device("cpu")


def pairs(n: int = 48, seed: int = 0) -> list[dict]:
    """Sums answered right (chosen) or wrong and wordy (rejected): a preference a tiny model learns in a few steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}.",
                     "rejected": f"{a + b + rng.randint(1, 9)} apples, I think."})
    return rows


def reward_recipe(model_dir, data_file, out_dir, **sections) -> dict:
    return objective_recipe("reward", "preference", model_dir, data_file, out_dir, **sections)


def _refused(values) -> str:
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    return str(caught.value)


def test_the_reward_section_goes_with_its_objective_and_preference_rows(tmp_path):
    values = reward_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", reward={"center_rewards_coefficient": 0.01})
    assert validate_recipe(values).reward.center_rewards_coefficient == 0.01
    values["data"]["datasets"][0]["format"] = "alpaca"
    assert "has format `alpaca`, but train.objective is reward, which trains on preference rows" in _refused(values)
    values = recipe_dict(tmp_path, tmp_path / "a.jsonl", tmp_path / "out", reward={"center_rewards_coefficient": 0.01})
    assert "reward.center_rewards_coefficient: set, but train.objective is sft" in _refused(values)
    values = reward_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", dpo={"beta": 0.3})
    assert "dpo.beta: set, but train.objective is reward, which does not read the dpo: section" in _refused(values)


@pytest.mark.slow  # ~10 s: a tiny model, an adapter written and loaded by transformers + PEFT, TRL's loss
def _scoring_model(tiny_llama, tmp_path, **sections):
    """(recipe, tokenizer, model): a reward run's model in one process, LoRA B and the score head random (both
    matter), on 8 pairs without an eval split."""
    from finetune import model

    recipe = validate_recipe(reward_recipe(tiny_llama, write_jsonl(tmp_path / "p.jsonl", pairs(8)), tmp_path / "out",
                                           quantization={"method": "none"}, data={"eval_fraction": 0.0}, **sections))
    tokenizer = model.load_tokenizer(recipe)
    peft_model = model.load_model(recipe, sharded=False, device=CPU, device_map=None,
                                  gradient_checkpointing=False).model
    model.with_score_head(peft_model, recipe, CPU)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or name.endswith("score.weight"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    return recipe, tokenizer, peft_model


def test_rewards_and_loss_equal_the_exported_adapter_under_transformers_and_trls_reward_trainer(tiny_llama, tmp_path):
    """Our model (LoRA + the score head, random so both matter) scores a real preference batch; the adapter written as
    the run writes it loads with plain PEFT onto AutoModelForSequenceClassification, which scores the same rows (the
    right-padded batch as a user has it) alike; TRL's RewardTrainer.compute_loss on that model, with centering, gives
    our loss."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer

    from finetune import data, model, outputs, parallel
    from finetune.data import eval_batches
    from finetune.training.objectives.reward import pair_terms, rewards

    recipe, tokenizer, peft_model = _scoring_model(tiny_llama, tmp_path, reward={"center_rewards_coefficient": 0.01})
    key_map = outputs.adapter_key_map(peft_model)
    assert key_map["base_model.model.score.weight"] == "base_model.model.score.weight"
    outputs.save_adapter(model.adapter_config(peft_model, recipe), key_map,
                         parallel.trainable_state_dict(peft_model, key_map), tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["task_type"] == "SEQ_CLS" and written["modules_to_save"] == ["score"]

    train, _, _ = data.build_examples(recipe, tokenizer)
    batch = next(iter(eval_batches(list(train), micro_batch_size=4, rank=0, world_size=1,
                                   pad_id=tokenizer.pad_token_id)))
    peft_model.eval()
    with torch.no_grad():
        ours = rewards(peft_model, batch, CPU, tokenizer.pad_token_id)
        loss_sum, sums, _, valid = pair_terms(peft_model, batch, recipe.reward, CPU, tokenizer.pad_token_id)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        theirs = loaded(**inputs).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert float(ours.std()) > 0  # the rows' rewards differ: the head and the LoRA act

    trainer = object.__new__(RewardTrainer)  # compute_loss as it ships, on the attributes it reads
    vars(trainer).update(model=loaded, args=SimpleNamespace(center_rewards_coefficient=0.01), _tp_size=1,
                         _total_train_tokens=0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                         accelerator=SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t))
    with torch.no_grad():
        expected = RewardTrainer.compute_loss(trainer, loaded, dict(inputs))
    assert int(valid) == batch["input_ids"].size(0) // 2
    assert float(loss_sum / valid) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)
    # TRL's metrics from the same rewards, by value (found by a bug bash, mutant R04: only their presence was checked)
    logged = {name: values[-1] for name, values in trainer._metrics["eval"].items() if values}
    for name, total in zip(("accuracy", "margin", "mean_reward"), sums.tolist()):
        assert total / int(valid) == pytest.approx(logged[name], abs=1e-5), name


def _plain_reward(peft_model, ids: list[int]) -> float:
    """The score head on the final hidden state of the row alone (no padding, no hook, no left shift)."""
    from finetune.training.loss import causal_lm

    with torch.no_grad():
        hidden = peft_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        return float(causal_lm(peft_model).score(hidden[0, -1]).squeeze())


def test_rewards_metrics_and_the_scored_token_where_the_pad_is_the_eos(tiny_llama, tmp_path):
    """Found by a bug bash (mutants R02, R04): where pad == EOS and a row ends with its EOS (inside the attention
    mask), the score is read at the last token that is not the EOS, as transformers' *ForSequenceClassification picks
    it; nothing had a row ending that way, so not stripping the EOS passed. And the margin summed |c - r| passed: no
    fast test read pair_terms' metric sums. Oracle: the score head on each row alone, cut by hand."""
    from finetune import data
    from finetune.training.objectives.reward import pair_terms, rewards

    recipe, tokenizer, peft_model = _scoring_model(tiny_llama, tmp_path)
    peft_model.eval()
    eos = tokenizer.eos_token_id
    examples = list(data.build_examples(recipe, tokenizer)[0])[:3]
    chosen_rows, rejected_rows = [e.input_ids for e in examples], [e.rejected.input_ids for e in examples]
    chosen_rows[2], rejected_rows[2] = rejected_rows[2], chosen_rows[2]  # one pair the model ranks wrong: margin < 0
    rows = chosen_rows + rejected_rows
    ended = [ids + [eos] if ids[-1] != eos else ids for ids in rows]  # every row ends with its EOS, the pad id
    ended[0] = ended[0] + [eos]  # and one with two
    width = max(map(len, ended))
    batch = {"input_ids": torch.tensor([ids + [0] * (width - len(ids)) for ids in ended]),
             "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in ended]),
             "labels": torch.tensor([[-100] + ids[1:] + [-100] * (width - len(ids)) for ids in ended])}
    cut = [ids[: max(i for i, token in enumerate(ids) if token != eos) + 1] for ids in ended]
    plain = torch.tensor([_plain_reward(peft_model, ids) for ids in cut])
    with torch.no_grad():
        torch.testing.assert_close(rewards(peft_model, batch, CPU, eos), plain, atol=1e-4, rtol=1e-4)
        _, sums, _, valid = pair_terms(peft_model, batch, recipe.reward, CPU, eos)
    chosen, rejected = plain.chunk(2)
    assert int(valid) == 3 and bool((chosen < rejected).any()) and bool((chosen > rejected).any())
    expected = [float((chosen > rejected).float().sum()), float((chosen - rejected).sum()), float(plain.sum() / 2)]
    assert sums.tolist() == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow  # ~30 s: a reward model trained in one process and under four shipped multi-process configs
def test_a_reward_model_trains_under_every_engine_and_exports_with_its_head(tiny_llama, tmp_path):
    """The run as users launch it (finetune/run.py; accelerate_configs/ddp.yaml, fsdp2.yaml, fsdp1.yaml and
    deepspeed_zero3.yaml with 2 ranks: the head trained in full beside the LoRA under each engine), the library's LoRA
    settings: the loss falls and the held-out accuracy rises to 1 on pairs it learns, TRL's metrics are logged, and each
    run's adapter loads with plain PEFT as a sequence classifier that ranks a held-out chosen answer above its
    rejected one."""
    from conftest import LIBRARY_LORA, accelerate_launch, run_cmd
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.run import __file__ as run_py

    rows = write_jsonl(tmp_path / "pairs.jsonl", pairs(64))
    runs = {}
    for name in ("single", "ddp", "fsdp2", "fsdp1", "deepspeed_zero3"):
        values = reward_recipe(tiny_llama, rows, tmp_path / name, lora=LIBRARY_LORA,
                               train={"max_steps": 12, "learning_rate": 1e-2, "micro_batch_size": 4 if name == "single"
                                      else 2, "log_every": 1, "eval_every": 12},
                               data={"eval_fraction": 0.125})
        recipe = write_recipe(tmp_path / f"{name}.yaml", values)
        result = (run_cmd(["python", run_py, str(recipe)]) if name == "single"
                  else accelerate_launch(name, recipe))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = [m for m in read_metrics(tmp_path / name)]
    # Step 1's gradient is the single process's under every engine (each rank's loss scaled by the world size, as
    # DDP, FSDP and ZeRO average gradients); without the factor it was half (bug bash bb50 S5). LoRA dropout 0.05:
    # each rank draws its own masks, so the norms differ by more than rounding (measured within 7.6e-3 of 0.905).
    norms = {name: next(m["grad_norm"] for m in metrics if "loss" in m) for name, metrics in runs.items()}
    print("step-1 grad norms:", norms)
    for name, norm in norms.items():
        assert norm == pytest.approx(norms["single"], rel=0.05), (name, norms)
    for name, metrics in runs.items():
        steps = [m for m in metrics if "loss" in m]
        assert len(steps) == 12 and {"accuracy", "margin", "mean_reward", "min_reward", "max_reward"} <= set(steps[0])
        assert sum(m["loss"] for m in steps[-3:]) < sum(m["loss"] for m in steps[:3]), (name, steps)
        final = [m for m in metrics if "eval_loss" in m][-1]
        assert final["eval_accuracy"] >= 0.75, (name, final)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / name / "adapter")
        base = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, dtype=torch.float32)
        scorer = PeftModel.from_pretrained(base, tmp_path / name / "adapter").eval()
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": "What is 4 plus 3?"},
                                                {"role": "assistant", "content": answer}], tokenize=False)
                 for answer in ("7.", "12 apples, I think.")]
        with torch.no_grad():
            scores = scorer(**tokenizer(texts, return_tensors="pt", padding=True)).logits[:, 0]
        assert float(scores[0]) > float(scores[1]), (name, scores)
    # `finetune export --step` of a reward run: its checkpoint's adapter, with the head, as the final one
    result = run_cmd(["python", "-m", "finetune", "export", str(tmp_path / "single"), str(tmp_path / "step12"),
                      "--step", "12"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    from safetensors.torch import load_file

    exported, final = (load_file(str(tmp_path / folder / "adapter_model.safetensors"))
                       for folder in ("step12", "single/adapter"))
    assert exported.keys() == final.keys() and "base_model.model.score.weight" in exported
    assert all(torch.equal(exported[key], final[key]) for key in final)
    assert json.loads((tmp_path / "step12" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"


@pytest.fixture(scope="module")
def reward_run(tiny_llama, tmp_path_factory):
    """A reward model trained on the sums' pairs (one process, 12 steps): the run folder."""
    from conftest import run_cmd

    from finetune.run import __file__ as run_py

    folder = tmp_path_factory.mktemp("reward-run")
    values = reward_recipe(tiny_llama, write_jsonl(folder / "pairs.jsonl", pairs(64)), folder / "run",
                           train={"max_steps": 12, "learning_rate": 1e-2})
    result = run_cmd(["python", run_py, str(write_recipe(folder / "reward.yaml", values))])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder / "run"


def test_reward_models_are_checked_with_the_recipe(tmp_path):
    from test_grpo import grpo_recipe

    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out",
                         {"reward_functions": [], "reward_models": [str(tmp_path / "nowhere")], "reward_weights": [1, 2]})
    message = _refused(values)
    assert f"grpo.reward_models[0]: {tmp_path / 'nowhere'} is not a folder. Fix: the folder of a finetune reward run" in message
    assert "grpo.reward_weights: 2 weights for 0 reward functions and 1 reward models" in message


@pytest.mark.slow  # ~20 s: a reward run, then 2 GRPO steps scored by it
def test_grpo_scores_completions_with_a_trained_reward_model(tiny_llama, reward_run, tmp_path):
    """grpo.reward_models: [the reward run] beside a reward function, weighted: each logged completion's reward from
    the model is what transformers + PEFT's sequence classifier gives the chat-rendered prompt and completion, and the
    weighted sum is the logged reward."""
    from conftest import run_cmd
    from peft import PeftModel
    from test_grpo import grpo_recipe
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.run import __file__ as run_py

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": r["prompt"]}],
                                                        "answer": r["chosen"]} for r in pairs(16)])
    values = grpo_recipe(tiny_llama, prompts, tmp_path / "grpo",
                         {"reward_functions": ["finetune.rewards:length_penalty"], "reward_models": [str(reward_run)],
                          "reward_weights": [0.5, 2.0]}, train={"max_steps": 2, "trackers": ["tensorboard"]})
    result = run_cmd(["python", run_py, str(write_recipe(tmp_path / "grpo.yaml", values))])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [m for m in read_metrics(tmp_path / "grpo") if "loss" in m]
    assert len(steps) == 2 and "rewards/run/mean" in steps[0] and "rewards/length_penalty/mean" in steps[0]
    logged = [json.loads(line) for line in (tmp_path / "grpo" / "completions" / "rank0.jsonl").read_text().splitlines()]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "grpo" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()  # each step's completions, as a table in the trackers (TRL's completions table)
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("completions/text_summary")}
    assert sorted(tables) == [1, 2]
    assert all(table.count("\n") == 1 + sum(r["step"] == step for r in logged) for step, table in tables.items())
    assert "| rewards.run |" in tables[1] and logged[0]["completion"].replace("\n", " ") in tables[1]
    tokenizer = AutoTokenizer.from_pretrained(reward_run / "adapter")
    base = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, dtype=torch.float32)
    scorer = PeftModel.from_pretrained(base, reward_run / "adapter").eval()
    for row in logged[:8]:
        text = tokenizer.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": row["completion"]}],
                                             tokenize=False)
        with torch.no_grad():
            score = float(scorer(**tokenizer([text], return_tensors="pt", add_special_tokens=False)).logits[0, 0])
        assert row["rewards"]["run"] == pytest.approx(score, abs=1e-4)
        assert row["reward"] == pytest.approx(0.5 * row["rewards"]["length_penalty"] + 2.0 * score, abs=1e-4)
