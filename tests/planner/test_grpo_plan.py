"""The planner for GRPO: generation (the KV cache of G x micro-batch sequences, the whole FSDP2 model gathered once per
generate call), the extra no-grad forwards, and the training step on the completions; hand counts from the config,
and the KV cache of a real tiny model's generate."""

from __future__ import annotations

import pytest
import torch
from conftest import write_recipe

# Llama-3.1-8B (32 layers, 8 KV heads of 128) and Llama-2-7B (no GQA: 32 KV heads of 128, so its KV cache per token,
# 512 KiB, is twice what checkpointing keeps), as tests/planner/test_planner.py writes their config.json.
from test_planner import LLAMA2_7B, LLAMA31_8B, _config

from finetune.cli import main as cli_main
from finetune.planner import GiB, Hardware, estimate, facts_from_config, held_parameter_bytes
from finetune.planner.objectives import kv_cache_bytes
from finetune.recipe import validate_recipe


def _raw(**grpo) -> dict:
    return {"model": {"name_or_path": "x", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "x.jsonl", "format": "prompt"}], "max_length": 4096},
            "train": {"objective": "grpo", "micro_batch_size": 16, "grad_accum": 2, "gradient_checkpointing": True},
            "grpo": {"num_generations": 8, "max_completion_length": 3584,
                     "reward_functions": ["finetune.rewards:exact_match"], **grpo}}


def _recipe(**grpo):
    return validate_recipe(_raw(**grpo))


def _sft():
    raw = _raw()
    raw["train"].pop("objective")
    raw.pop("grpo")
    raw["data"]["datasets"][0]["format"] = "alpaca"
    return validate_recipe(raw)


def _whole_model(facts) -> int:
    return sum(t.numel * facts.dtype_bytes if t.trainable else t.nbytes for t in facts.tensors)


def test_generation_counts_the_kv_cache_of_every_completion_by_hand():
    """16 completions (2 prompts x G 8) of up to 4096 tokens of Llama-2-7B: 16 x 4096 x 32 layers x (K and V) x 32
    heads x 128 x 2 bytes = 32 GiB, + one layer's again (the cache grows by concatenation). Twice the layer inputs
    checkpointing keeps for the training step: generating is the peak."""
    recipe = _recipe()
    facts = facts_from_config(_config(LLAMA2_7B), recipe)
    by_hand = 16 * 4096 * 32 * 2 * 32 * 128 * 2
    assert kv_cache_bytes(facts, rows=16, tokens=4096) == by_hand == 32 * GiB
    plan = estimate(facts, recipe, "single", Hardware(1, 80 * GiB))
    assert plan.peak_moment == "generation"
    assert plan.parts["kv_cache"] == by_hand + by_hand // 32
    assert plan.parts["logits_loss"] == 16 * 32000 * 48  # one sampling step's logits, not the training loss chunk
    # No gradient is alive while generating: the model state only (LoRA + AdamW's two moments).
    held = held_parameter_bytes(facts, strategy="single", world_size=1)["trainable_bytes"]
    assert plan.parts["lora_grads_adamw"] == 3 * held and plan.gradient_bytes == 0
    assert any("2 prompt(s) x G 8 = 16 completions" in note and "the peak: generation" in note for note in plan.notes)


def test_training_on_the_completions_is_sft_at_the_same_rows_and_length():
    """Llama 3.1 (GQA, 8 KV heads): the step's peak is the training on the micro-batch's completions at
    data.max_length, the same activations as SFT's micro-batch of that many rows (its KV cache, 128 KiB a token, is
    half of what checkpointing keeps)."""
    recipe, sft = _recipe(max_completion_length=64), _sft()
    facts = facts_from_config(_config(LLAMA31_8B), sft)
    grpo_plan = estimate(facts, _recipe(max_completion_length=64).model_copy(
        update={"data": recipe.data.model_copy(update={"max_length": 1024})}), "single", Hardware(1, 80 * GiB))
    sft_plan = estimate(facts, sft.model_copy(update={"data": sft.data.model_copy(update={"max_length": 1024})}),
                        "single", Hardware(1, 80 * GiB))
    assert grpo_plan.peak_moment == sft_plan.peak_moment != "generation"
    assert grpo_plan.parts["activations"] == sft_plan.parts["activations"]
    assert grpo_plan.peak_bytes - sft_plan.peak_bytes == grpo_plan.parts["grpo_logps"] == 0  # mu 1, beta 0: none kept


def test_a_training_chunk_counts_the_activations_of_its_rows_only():
    """grpo.train_chunk_size 8 of a 16-completion micro-batch: the training moment's activations are those of an
    8-completion micro-batch (the rows trained together), while generating still holds the KV cache of all 16; the
    note says it."""
    short = lambda recipe, **train: recipe.model_copy(update={
        "data": recipe.data.model_copy(update={"max_length": 1024}), "train": recipe.train.model_copy(update=train)})
    facts = facts_from_config(_config(LLAMA31_8B), _sft())
    plan = lambda recipe: estimate(facts, recipe, "single", Hardware(1, 80 * GiB))
    whole = plan(short(_recipe(max_completion_length=64)))
    chunked = plan(short(_recipe(max_completion_length=64, train_chunk_size=8)))
    eight = plan(short(_recipe(max_completion_length=64), micro_batch_size=8))
    assert chunked.parts["activations"] == eight.parts["activations"] < whole.parts["activations"]
    assert chunked.peak_bytes < whole.peak_bytes
    assert chunked.parts["grpo_logps"] == whole.parts["grpo_logps"]  # kept for all 16
    assert any("(8 at a time: grpo.train_chunk_size)" in note for note in chunked.notes)


def test_extra_forwards_keep_their_log_probs_and_the_reference_copy():
    """num_iterations 2 keeps the old policy's log-probs, beta > 0 the reference's: (completions x
    max_completion_length) fp32 per micro-batch of the step each; from a starting adapter the reference swaps it in
    (its values kept, as DPO's)."""
    facts = facts_from_config(_config(LLAMA31_8B), _recipe())
    plain = estimate(facts, _recipe(), "single", Hardware(1, 80 * GiB))
    both = estimate(facts, _recipe(num_iterations=2, beta=0.04), "single", Hardware(1, 80 * GiB))
    assert plain.parts["grpo_logps"] == 0
    assert both.parts["grpo_logps"] == 2 * (2 * 16 * 3584 * 4)  # two copies x grad_accum x completions x tokens
    note = " ".join(both.notes)
    assert "old policy's log-probs" in note and "reference" in note and "reused for 2 steps" in note
    raw = _raw(beta=0.04)
    raw["model"]["adapter"] = "runs/sft/adapter"
    started = estimate(facts, validate_recipe(raw), "single", Hardware(1, 80 * GiB))
    held = held_parameter_bytes(facts, strategy="single", world_size=1)["trainable_bytes"]
    assert started.parts["dpo_reference_copy"] == 2 * held and "dpo_reference_copy" not in both.parts


@pytest.mark.parametrize("key", ["fsdp", "zero3"])
def test_fsdp2_and_zero3_gather_the_whole_model_once_unless_per_forward(key):
    """FSDP2 and ZeRO-3 generate with every unit (parameter) whole for the call (parallel/generation.py, gather once):
    the whole model, frozen as stored and LoRA in bf16, on every GPU; per_forward gathers what training gathers."""
    facts = facts_from_config(_config(LLAMA2_7B), _recipe())
    hw = Hardware(2, 80 * GiB)
    once = estimate(facts, _recipe(), key, hw)
    per_forward = estimate(facts, _recipe(generation_gather="per_forward"), key, hw)
    assert once.peak_moment == "generation" and once.parts["fsdp_unsharded"] == _whole_model(facts)
    training_gather = estimate(facts, _sft(), key, hw).parts["fsdp_unsharded"]
    assert per_forward.parts["fsdp_unsharded"] == training_gather < _whole_model(facts)
    assert "gathered once per call" in " ".join(once.notes) and "gathered once" not in " ".join(per_forward.notes)


def test_largest_micro_batch_is_a_multiple_of_the_group():
    from finetune.planner.fit import largest_micro_batch

    raw = _raw(max_completion_length=512)
    raw["data"]["max_length"] = 1024
    recipe = validate_recipe(raw)
    facts = facts_from_config(_config(LLAMA31_8B), recipe)
    hw = Hardware(1, 24 * GiB)
    largest = largest_micro_batch(facts, recipe, "single", hw)
    assert largest > 0 and largest % 8 == 0
    assert estimate(facts, recipe, "single", hw, micro_batch=largest).fits
    assert not estimate(facts, recipe, "single", hw, micro_batch=largest + 8).fits


def test_kv_cache_matches_a_tiny_models_real_cache():
    """The formula against the cache transformers builds: a tiny Llama (2 layers, 2 KV heads of 16, bf16) run over 6
    rows of 10 prompt tokens, then 5 decoding steps, as training/rollout.py calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (6, 10))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(5):
            out = model(input_ids=ids[:, :1], cache=out.cache, use_cache=True)
    cache = out.cache
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    raw = _raw()
    raw["data"]["max_length"], raw["grpo"]["max_completion_length"], raw["grpo"]["num_generations"] = 15, 5, 2
    facts = facts_from_config(config, validate_recipe(raw))
    assert measured == kv_cache_bytes(facts, rows=6, tokens=15) == 6 * 15 * 2 * 2 * 32 * 2


@pytest.mark.parametrize("gather, fits", [("per_forward", True), ("once", False)])
def test_plan_cli_shows_what_grpo_runs_for_the_70b_recipe(capsys, gather, fits):
    """`finetune plan` on the shipped 70B GRPO recipe (2 x 24 GB): it fits because it generates per forward; gathering
    the whole 4-bit 70B once (~37 GiB) would not."""
    from pathlib import Path

    recipe = Path(__file__).parents[2] / "recipes" / "llama-3.1-70b-2x24gb-grpo.yaml"
    assert cli_main(["plan", str(recipe), f"grpo.generation_gather={gather}", "--gpus", "2", "--gpu-memory",
                     "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "grpo: per micro-batch, 1 prompt(s) x G 4 = 4 completions of up to 256 tokens" in out
    assert ("FSDP + CPU offload on 2 GPU(s) fits" in out) is fits


def test_plan_of_a_grpo_recipe_file(tmp_path, capsys):
    path = write_recipe(tmp_path / "r.yaml", {**_raw(), "model": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}})
    assert cli_main(["plan", str(path), "--gpus", "1", "--gpu-memory", "80GiB"]) == 0
    assert "KV cache of 8.0 GiB" in capsys.readouterr().out
