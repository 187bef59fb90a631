"""The whole path in one process: recipe -> 4-bit + LoRA -> train -> standard PEFT adapter that reproduces logits."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
import yaml
from conftest import RUN_PY, read_metrics, recipe_dict, run_cmd, train_losses, write_recipe

from finetune import data, distributed, model, outputs, parallel, training
from finetune.recipe import validate_recipe

# Golden losses of the seeded 6-step run below (tiny llama, fp32, CPU). A change here is a behaviour change:
# regenerate only on purpose (print train_losses(out) and paste).
GOLDEN_LOSSES = [6.216225, 6.159138, 6.036042, 5.998447, 5.92866, 5.927394]  # LoRA A seeded per module name (model.init_lora_tensor)


@pytest.fixture(scope="module")
def cli_run(tiny_llama, tmp_path_factory):
    """`python finetune/run.py RECIPE overrides` exactly as a user runs it."""
    from conftest import addition_rows, write_jsonl

    root = tmp_path_factory.mktemp("cli-run")
    data_path = write_jsonl(root / "train.jsonl", addition_rows())
    recipe = write_recipe(root / "recipe.yaml", recipe_dict(tiny_llama, data_path, root / "unused"))
    out = root / "run"
    result = run_cmd([sys.executable, str(RUN_PY), str(recipe), f"output.dir={out}", "train.max_steps=6"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, recipe, result


@pytest.mark.slow
def test_run_writes_the_output_contract(cli_run):
    out, _, result = cli_run
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_size > 1000
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert resolved["train"]["max_steps"] == 6 and resolved["output"]["dir"] == str(out)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 7))
    # Hugging Face Trainer's and TRL's names; num_tokens counts the steps so far, as TRL's
    steps = [m for m in metrics if "loss" in m]
    assert {"loss", "learning_rate", "grad_norm", "num_tokens", "mean_token_accuracy", "tokens_per_s"} <= set(steps[0])
    assert not {"lr", "tokens"} & set(steps[0])
    counts = [m["num_tokens"] for m in steps]
    assert all(0 < a < b for a, b in itertools.pairwise(counts))
    assert all(0.0 <= m["mean_token_accuracy"] <= 1.0 for m in steps)
    assert any(0.0 < m.get("eval_mean_token_accuracy", -1) <= 1.0 for m in metrics)
    # train.max_steps given: `epoch` is still step / steps per epoch (61 train rows // micro_batch_size 4 = 15 steps).
    assert "length: train.max_steps 6 = 0.40 epochs of 15 steps (61 rows //" in result.stdout
    assert [m["epoch"] for m in metrics if "loss" in m] == [round(step / 15, 4) for step in range(1, 7)]
    assert any("eval_loss" in m for m in metrics)
    assert "parallel: single process" in result.stdout


@pytest.mark.slow
def test_golden_losses(cli_run):
    out, _, _ = cli_run
    assert train_losses(out) == pytest.approx(GOLDEN_LOSSES, abs=2e-3)


@pytest.mark.slow
def test_finetune_train_is_the_same_code_path(cli_run, tmp_path):
    out, recipe, _ = cli_run
    result = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe), f"output.dir={tmp_path / 'r'}", "train.max_steps=6"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_losses(tmp_path / "r") == train_losses(out)


def test_adapter_loads_with_plain_peft_and_reproduces_logits(tiny_llama, alpaca_file, tmp_path):
    """Train in this process, save through our path, reload with plain PeftModel.from_pretrained: same logits."""
    from peft import PeftModel

    recipe = validate_recipe(recipe_dict(tiny_llama, alpaca_file, tmp_path / "out", train={"max_steps": 8}))
    distributed.init_distributed()
    tokenizer = model.load_tokenizer(recipe)
    train_examples, eval_examples, _ = data.build_examples(recipe, tokenizer)
    torch.manual_seed(0)
    peft_model = model.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=True)
    key_map = outputs.adapter_key_map(peft_model)
    result = training.train(peft_model, recipe, train_examples, eval_examples, pad_id=tokenizer.pad_token_id,
                         out_dir=tmp_path)
    assert result.losses[-1] < result.losses[0] - 0.2  # it learns
    state = parallel.trainable_state_dict(peft_model, key_map)
    outputs.save_adapter(peft_model.peft_config["default"], key_map, state, tmp_path / "adapter")

    probe = torch.tensor([train_examples[0].input_ids])
    peft_model.eval()
    with torch.no_grad():
        trained_logits = peft_model(input_ids=probe).logits
    fresh = model.load_base_model(recipe, device=torch.device("cpu"))
    reloaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    reloaded.eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=probe).logits
    assert torch.allclose(trained_logits, reloaded_logits, atol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_llama) and config["r"] == 8


@pytest.mark.slow
def test_loss_falls_on_a_fixed_dataset(cli_run):
    out, _, _ = cli_run
    losses = train_losses(out)
    assert losses[-1] < losses[0] - 0.2


def test_one_host_sync_per_step_whatever_the_accumulation(tiny_llama, alpaca_file, tmp_path, monkeypatch):
    """The step's loss stays on the device until the one all-reduce of the step: no `float(loss)` per micro-batch
    (32 host syncs a step in the 70B recipe on a GPU). Counted on CPU by patching Tensor.__float__ / Tensor.item,
    the ops that would each wait for the GPU; generation eval and evaluation are off so only the loop is counted."""
    calls = []
    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: calls.append(_n) or _o(self))
    distributed.init_distributed()

    def count(grad_accum: int) -> int:
        recipe = validate_recipe(recipe_dict(tiny_llama, alpaca_file, tmp_path / f"out{grad_accum}", train={
            "max_steps": 2, "micro_batch_size": 2, "grad_accum": grad_accum, "eval_every": 0, "save_every": 0},
            data={"eval_fraction": 0.0}))
        tokenizer = model.load_tokenizer(recipe)
        train_examples, eval_examples, _ = data.build_examples(recipe, tokenizer)
        peft_model = model.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=False)
        (tmp_path / f"out{grad_accum}").mkdir()
        calls.clear()
        training.train(peft_model, recipe, train_examples, eval_examples, pad_id=tokenizer.pad_token_id,
                       out_dir=tmp_path / f"out{grad_accum}")
        return len(calls)

    assert count(4) == count(1), "host syncs grow with the number of micro-batches"
