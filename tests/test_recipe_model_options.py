"""Options of the model and quantization sections that were accepted and then crashed, or were silently ignored.

Found by a bug bash of the quantization and memory options (bb15), each reproduced on the code before: flash attention
on a CPU passed validate and ended in a traceback after transformers tried to fetch a kernel from the Hub; the two
checkpointing keys were read apart (the loader used parallel.activation_checkpointing, the architecture check
train.gradient_checkpointing: a traceback on one combination, a wrong refusal on the other); a compute dtype under
`quantization.method: none` was ignored; `finetune quantize --dtype float16` was offered and always refused.
"""

from __future__ import annotations

import pytest
from transformers import BloomConfig, CTRLConfig

from finetune.errors import ModelLoadError, RecipeError
from finetune.model.support import check_supported, refusals
from finetune.recipe import validate_recipe

BASE = {"model": {"name_or_path": "some/model", "dtype": "float32"}, "data": {"datasets": [{"path": "d.jsonl"}]}}


def recipe(**sections):
    raw = {**BASE, **{name: {**BASE.get(name, {}), **keys} for name, keys in sections.items()}}
    return validate_recipe(raw)


def test_flash_attention_on_a_cpu_is_refused_before_anything_loads():
    with pytest.raises(RecipeError) as error:
        recipe(model={"attn_implementation": "flash_attention_2"})
    assert "flash_attention_2 runs on CUDA GPUs only" in str(error.value)
    assert "model.attn_implementation: auto" in str(error.value)
    with pytest.raises(RecipeError, match="computes in bfloat16 or float16 only"):  # planned for GPUs, in fp32
        validate_recipe({**BASE, "model": {**BASE["model"], "attn_implementation": "flash_attention_2"}},
                        dtype_device="gpu")
    planned = validate_recipe({**BASE, "model": {"name_or_path": "x", "attn_implementation": "flash_attention_2"}},
                              dtype_device="gpu")
    assert planned.model.attn_implementation == "flash_attention_2"  # bf16 on GPUs: what `finetune plan` plans for
    reasons = refusals(BloomConfig(), quantized=True, attn_implementation="flash_attention_2")
    assert any("no flash attention for BloomForCausalLM" in reason for reason in reasons)


def test_the_checkpointing_the_loader_uses_is_the_one_the_architecture_check_reads():
    no_checkpointing = CTRLConfig(n_layer=1, n_embd=16, n_head=2, n_positions=512)  # no gradient checkpointing
    off = recipe(parallel={"activation_checkpointing": False}, quantization={"method": "none"})
    check_supported(no_checkpointing, off)  # refused before, though the run checkpoints nothing
    on = recipe(parallel={"activation_checkpointing": True}, quantization={"method": "none"})
    with pytest.raises(ModelLoadError, match="parallel.activation_checkpointing"):
        check_supported(no_checkpointing, on)
    for train, parallel in ((False, True), (True, False)):  # a traceback at load, or parallel's silently winning
        with pytest.raises(RecipeError, match="disagree"):
            recipe(train={"gradient_checkpointing": train}, parallel={"activation_checkpointing": parallel})


def test_a_compute_dtype_without_quantization_is_refused_not_ignored():
    with pytest.raises(RecipeError) as error:
        recipe(quantization={"method": "none", "compute_dtype": "bfloat16"})
    assert "set model.dtype: bfloat16" in str(error.value)
    assert recipe(quantization={"method": "none", "compute_dtype": "float32", "double_quant": True})  # no effect


def test_finetune_quantize_offers_no_dtype_it_refuses(capsys):
    from finetune.cli import main

    with pytest.raises(SystemExit):
        main(["quantize", "base", "out", "--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_flash_attention_run_read_back_on_a_cpu_exports_with_sdpa(tmp_path, tiny_llama, capsys):
    """The refusal above is for training here: a run trained with flash attention on a GPU is exported or generated
    from on a CPU (its saved recipe read with trains=False, the base built with auto attention and a note)."""
    import torch
    import yaml

    from finetune.model.base import load_base_model
    from finetune.outputs.run_folder import saved_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_llama), "dtype": "bfloat16",
                                              "attn_implementation": "flash_attention_2"},
                                    "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}]}}))
    saved = saved_recipe(path)
    model = load_base_model(saved, device=torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa" and "flash_attention_2 runs on CUDA only" in capsys.readouterr().err


def test_a_max_length_past_a_fixed_position_table_is_refused_before_loading():
    """Found by a bug bash (positions): GPT-2 / OPT / GPT-Neo with data.max_length above their position table passed
    validate and died at step 1 with an IndexError in the position embedding (GPT-Neo also when packed rows restart
    their positions; the generation eval at prompt + max_new_tokens). RoPE models have no table: not refused."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    long = recipe(data={"max_length": 64}, quantization={"method": "none"})
    with pytest.raises(ModelLoadError, match=r"a table of 32 \(config.json's n_positions\).*data.max_length to 32"):
        check_supported(GPT2Config(n_positions=32, n_layer=1, n_embd=16, n_head=2), long)
    with pytest.raises(ModelLoadError, match=r"max_position_embeddings.*max_new_tokens 32.*data.max_length to 32 or"):
        check_supported(OPTConfig(max_position_embeddings=64, num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                  ffn_dim=32), recipe(data={"max_length": 64}, eval={"generation_rows": 2}))
    check_supported(OPTConfig(max_position_embeddings=64, num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                              ffn_dim=32), long)
    check_supported(LlamaConfig(max_position_embeddings=32, num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                intermediate_size=32), long)


def test_a_max_length_past_a_rotary_models_context_is_warned(capsys):
    """Found by the same bug bash: Llama with data.max_length above max_position_embeddings and no RoPE scaling
    trained without a word at positions the base never saw (no crash: rotary positions have no table)."""
    from transformers import LlamaConfig

    small = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32}
    check_supported(LlamaConfig(max_position_embeddings=48, **small), recipe(data={"max_length": 64}))
    assert "data.max_length 64 is past the model's context of 48 tokens" in capsys.readouterr().err
    scaled = LlamaConfig(max_position_embeddings=48, rope_scaling={"rope_type": "linear", "factor": 2.0}, **small)
    check_supported(scaled, recipe(data={"max_length": 96}))
    assert "past the model's context" not in capsys.readouterr().err
