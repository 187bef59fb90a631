"""4-bit gaps found by mutation testing round 5 (bb61): the vLLM server's dequantized base (grpo.vllm_base
as_trained) and the dequantization dtype of a pre-quantized checkpoint made from another dtype than the run's.

Oracles: bitsandbytes' own quantize_4bit / dequantize_4bit, and transformers' load of the bf16 base with a
BitsAndBytesConfig (what quantizing at load gives)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.recipe import Recipe

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _recipe(name_or_path: Path) -> Recipe:
    return Recipe.model_validate({"model": {"name_or_path": str(name_or_path), "dtype": "bfloat16"},
                                  "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def test_the_vllm_base_as_trained_is_each_weight_quantized_and_dequantized_once(tiny_llama, tmp_path):
    """Found by mutation testing (bb61 wr1): `write_quantized(dequantize=True)` returning each original weight
    unchanged survived every fast test (the only guard needs a vLLM environment): the server would sample with the
    16-bit base, not the 4-bit one the trainer multiplies by. Oracle: bitsandbytes' quantize_4bit then
    dequantize_4bit of each bf16 weight, with the recipe's settings (nf4, double quant, blocksize 64)."""
    import bitsandbytes as bnb
    from safetensors.torch import load_file

    from finetune.model.quantization.writer import write_quantized
    from finetune.model.settings import quantization_config

    recipe = _recipe(tiny_llama)
    assert (recipe.quantization.method, recipe.quantization.double_quant) == ("nf4", True)
    out = write_quantized(tiny_llama, tmp_path / "as-trained", bnb_config=quantization_config(recipe),
                          dtype=torch.bfloat16, device=CPU, dequantize=True)
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    original = {k: v for f in sorted(Path(tiny_llama).glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(written) == set(original)
    projections = [k for k in original if k.endswith(".weight") and k.split(".")[-2] in PROJECTIONS]
    assert len(projections) == 14  # 7 per layer, 2 layers
    for key, stored in original.items():
        value = stored.to(torch.bfloat16)
        if key in projections:
            packed, state = bnb.functional.quantize_4bit(value, blocksize=64, compress_statistics=True,
                                                         quant_type="nf4")
            expected = bnb.functional.dequantize_4bit(packed, state).to(torch.bfloat16)
            assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], expected), key
            assert not torch.equal(written[key], value), key  # 4-bit rounding moved it
        else:  # embeddings, norms, the head: not 4-bit in a run, written as they are
            assert torch.equal(written[key], value), key


def _linear4bit_weights(model) -> dict[str, torch.nn.Parameter]:
    """Every bitsandbytes 4-bit weight by its module path without PEFT's levels."""
    import bitsandbytes as bnb

    return {name.removeprefix("base_model.model.").replace(".base_layer", ""): module.weight
            for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}


@pytest.fixture(scope="module")
def fp16_checkpoint(tiny_arch, tmp_path_factory) -> tuple[Path, Path]:
    """(a bf16 base, transformers' 4-bit checkpoint of it made in float16: its quant states say float16, as a hub
    "-bnb-4bit" repository of an fp16 model does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    base = tiny_arch("llama")
    folder = tmp_path_factory.mktemp("fp16-4bit")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float16)
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float16, quantization_config=config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return base, folder


def test_a_4bit_checkpoint_made_in_fp16_dequantizes_to_the_runs_bf16(fp16_checkpoint):
    """Found by mutation testing (bb61 pq1): dropping the override of the quant state's dtype survived
    test_prequantized.py, whose checkpoints are all made in the run's dtype: a bf16 run of a checkpoint quantized from
    fp16 dequantized its weights to float16 (weights in another dtype than the activations: fp16's range and a second
    rounding). Oracle: transformers quantizing the bf16 base at load (BitsAndBytesConfig, bf16): the same packed
    bytes and absmax (a bf16 weight is exact in fp16), quant states in bfloat16, bitwise the same dequantized weights."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.model import loading

    base, folder = fp16_checkpoint
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    expected = _linear4bit_weights(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16,
                                                                        quantization_config=config))
    loaded = loading.load_model(_recipe(folder), sharded=False, device=CPU, device_map=None,
                                gradient_checkpointing=False).model
    held = _linear4bit_weights(loaded)
    assert sorted(held) == sorted(expected) and len(held) == 14
    for name, weight in held.items():
        want = expected[name]
        assert torch.equal(weight.data.view(torch.uint8), want.data.view(torch.uint8)), name
        assert weight.quant_state.dtype == want.quant_state.dtype == torch.bfloat16, (name, weight.quant_state.dtype)
        dequantized = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
        assert dequantized.dtype == torch.bfloat16, name
        assert torch.equal(dequantized, bnb.functional.dequantize_4bit(want.data, want.quant_state)), name
