"""The architecture matrix: every architecture finetune/model/support.py lists, built tiny from transformers' own config
class, trains in this process through the library's model path (tests/arch_matrix.py), a representative set also
under the shipped FSDP2 and FSDP1 configs (launched), and the refused ones are refused before any weight loads.
docs/models.md and `finetune models` say exactly what the tables say."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from arch_matrix import train_arch
from conftest import LIBRARY_LORA, REPO, addition_rows, recipe_dict, train_losses, write_jsonl, write_recipe
from safetensors.torch import load_file

from finetune.cli.tiny_arch import matrix_model_types, text_causal_lm_types, tiny_config
from finetune.model.support import ADAPTER_GAPS, BF16_GAPS, REFUSED, SHARDED, SHARDED_FSDP2, TRAINED


def test_every_listed_architecture_is_a_model_type_of_this_transformers():
    """A row for a model type transformers renamed or dropped would be a claim nothing checks."""
    shipped = set(matrix_model_types())
    listed = set(TRAINED) | set(REFUSED)
    assert listed <= shipped, sorted(listed - shipped)
    assert not set(TRAINED) & set(REFUSED) and set(SHARDED) | set(SHARDED_FSDP2) <= set(TRAINED)
    assert set(ADAPTER_GAPS) <= set(TRAINED) and set(text_causal_lm_types()) <= shipped


def test_every_model_type_of_this_transformers_is_in_the_table():
    """The next transformers release shows what is new: a model type with a causal-LM or image-text-to-text class
    that neither the suite's tables nor the models matrix's record (finetune/model/matrix.json) lists fails here.
    The record's rows name only model types of this transformers, each with an outcome the listing knows."""
    from finetune.model.matrix import STATUS, record

    rows = record()["rows"]
    missing = sorted(set(matrix_model_types()) - set(TRAINED) - set(REFUSED) - set(rows))
    assert not missing, f"not in the table: {missing}. Fix: `make models-matrix` (it writes the record and the docs)"
    assert set(rows) <= set(matrix_model_types()), sorted(set(rows) - set(matrix_model_types()))
    assert {row["outcome"] for row in rows.values()} <= set(STATUS)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TRAINED))
def test_trains_in_one_process(model_type, tiny_arch, tmp_path):
    """4-bit NF4, LoRA r16 / dropout 0.05 on all linears, checkpointing, dtype auto: two steps on one batch, the loss
    falls, and the adapter saved by the library (a MoE one exported by `finetune export`) loads with plain PEFT onto
    the unquantized base, or, for ADAPTER_GAPS, export says it does not."""
    result = train_arch(model_type, tiny_arch(model_type), tmp_path)
    assert result.outcome == ("adapter-not-peft" if model_type in ADAPTER_GAPS else "trained"), result.detail
    assert all(math.isfinite(loss) for loss in result.losses), result.losses
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_before_any_weight_loads(model_type, tmp_path, capsys):
    """`finetune train` on a folder holding only config.json: the refusal (exit 2, one paragraph naming the reason,
    no traceback) comes from the config alone. Had it not, the run would go on to the tokenizer and the weights,
    which are not there, and fail with another message."""
    from finetune.run import main

    model_dir = tmp_path / model_type
    tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0).save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = recipe_dict(model_dir, data, tmp_path / "run", lora=LIBRARY_LORA)
    del recipe["model"]["dtype"]  # the default, as a user's recipe
    if model_type in BF16_GAPS:
        recipe["model"]["dtype"] = "bfloat16"  # what auto picks on GPUs (on CPUs only where they compute bf16)
    code = main([str(write_recipe(tmp_path / "recipe.yaml", recipe))])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "finetune: error:" in err and "Traceback" not in err
    assert "cannot train with these settings" in err and REFUSED[model_type][1] in err, err
    assert "Fix:" in err


def test_untried_and_supported_architectures_are_not_refused():
    from finetune.model.support import refusals

    for model_type in ("llama", "mixtral", "qwen3_next"):
        config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
        assert refusals(config, quantized=True, attn_implementation="sdpa") == [], model_type


def test_an_architecture_without_sdpa_is_refused_under_sdpa_only():
    """Gemma 2 (soft-capping): transformers refuses sdpa for it; finetune says so before loading, with the fix that
    MODEL_SETTINGS records and the matrix trains with."""
    from finetune.model.support import MODEL_SETTINGS, refusals

    config = tiny_config("gemma2", vocab_size=512, eos_token_id=2, pad_token_id=0)
    (reason,) = refusals(config, quantized=True, attn_implementation="sdpa")
    assert "Gemma2ForCausalLM" in reason and "Fix: set model.attn_implementation: eager" in reason
    assert refusals(config, quantized=True, attn_implementation=MODEL_SETTINGS["gemma2"]["attn_implementation"]) == []


def test_each_refusal_names_its_fix_and_the_fix_lifts_it():
    """The refusals of issue 40's survey (every text causal LM of transformers 5.25 built tiny and trained through the
    library's settings; these stopped with a traceback before): each goes away with the fix it names, which trains
    (tried with `finetune train` on the tiny models: ctrl, jetmoe, cpmant, gpt_neox_japanese without checkpointing;
    falcon_h1, falcon_mamba with LoRA off out_proj; mamba so and unquantized; xlstm in fp32). nemotron_h has
    no fix yet."""
    from finetune.model.support import refusals

    def config(model_type):
        return tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)

    library = {"quantized": True, "attn_implementation": "auto", "gradient_checkpointing": True}  # the defaults
    others = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "x_proj", "dt_proj", "gate_proj", "up_proj", "down_proj"]
    for model_type in ("ctrl", "jetmoe", "cpmant", "gpt_neox_japanese"):
        (reason,) = refusals(config(model_type), **library)
        assert "Fix: set train.gradient_checkpointing: false" in reason, reason
        assert refusals(config(model_type), **dict(library, gradient_checkpointing=False)) == [], model_type
    for model_type in ("falcon_h1", "falcon_mamba"):
        (reason,) = refusals(config(model_type), **library)
        assert "PEFT refuses LoRA on out_proj" in reason and "Fix: list lora.target_modules without out_proj" in reason
        assert refusals(config(model_type), **library, lora_targets=["q_proj", "conv1d"]) != []  # PEFT's other one
        assert refusals(config(model_type), **library, lora_targets=others) == [], model_type
    four_bit, peft_rule = refusals(config("mamba"), **library)
    assert "dt_proj.weight" in four_bit and "Fix: set quantization.method: none" in four_bit and "out_proj" in peft_rule
    assert refusals(config("mamba"), **dict(library, quantized=False), lora_targets=others) == []
    assert "Fix: set model.dtype: float32" in refusals(config("xlstm"), **library)[0]
    assert refusals(config("xlstm"), **library, dtype="float32") == []
    assert "Fix: none in finetune yet" in refusals(config("nemotron_h"), **dict(library, quantized=False),
                                                  lora_targets=others)[0]


def test_gpt2_style_conv1d_models_are_refused_under_4_bits_only():
    """GPT-2, GPT-SW3 and OpenAI GPT (transformers' Conv1D, weights stored (in, out)): refused under 4 bits with the fix
    quantization.method: none, which trains (tried with tests/arch_matrix.py's run, unquantized: the loss falls and the
    adapter loads in plain PEFT); OpenAI GPT also needs train.gradient_checkpointing: false. And every text causal LM
    whose modeling file builds a Conv1D is in the table (read from the installed transformers' sources)."""
    import re
    from pathlib import Path

    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetune.model.support import FOUR_BIT_GAPS, refusals

    library = {"quantized": True, "attn_implementation": "auto", "gradient_checkpointing": True}  # the defaults
    for model_type in ("gpt2", "gpt-sw3", "openai-gpt"):
        config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
        reasons = refusals(config, **library)
        conv1d = [reason for reason in reasons if "Conv1D" in reason]
        assert len(conv1d) == 1 and "(in_features, out_features)" in conv1d[0], reasons
        assert conv1d[0].endswith("Fix: set quantization.method: none (the base in model.dtype; LoRA on Conv1D works, "
                                  "PEFT sets fan_in_fan_out)"), conv1d[0]
        unquantized = dict(library, quantized=False, gradient_checkpointing=model_type != "openai-gpt")
        assert refusals(config, **unquantized) == [], model_type
    # The classes defined in a modeling file that builds Conv1D layers; a model type's causal LM class may live in
    # another model's file (GPT-SW3 is GPT2LMHeadModel).
    classes = set()
    for source in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        text = source.read_text()
        if "= Conv1D(" in text:
            classes |= set(re.findall(r"^class (\w+)\(", text, flags=re.MULTILINE))
    # As config.model_type says it (GPT-SW3's config class is GPT2Config: "gpt2").
    with_conv1d = {CONFIG_MAPPING[model_type].model_type for model_type in text_causal_lm_types()
                   if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] in classes}
    assert with_conv1d == {model_type for model_type, why in FOUR_BIT_GAPS.items() if "Conv1D" in why}


def test_a_model_type_whose_tiny_run_failed_is_warned_of_and_listed_untried(monkeypatch, capsys, tmp_path):
    """The models matrix's record (finetune/model/matrix.json) marks `failed` the model types whose tiny run failed:
    a run of one says so before loading (a warning, not a refusal: a tiny model's failure does not prove a real
    checkpoint's), and `finetune models` lists it as untried with the error."""
    from finetune.model import matrix, support
    from finetune.model.support import check_supported, support_rows
    from finetune.recipe import validate_recipe

    row = {"outcome": "failed", "detail": "RuntimeError: shape mismatch @ modeling_x.py:9", "seconds": 1.0}
    monkeypatch.setattr(matrix, "record", lambda: {"transformers": "9.9", "rows": {"xglm": row}})
    monkeypatch.setattr(support, "_WARNED", set())  # said once per process
    config = tiny_config("xglm", vocab_size=512, eos_token_id=2, pad_token_id=0)
    recipe = validate_recipe(recipe_dict(tmp_path, tmp_path / "x.jsonl", tmp_path / "run"))
    check_supported(config, recipe)
    assert "could not train a tiny xglm (RuntimeError: shape mismatch" in capsys.readouterr().err
    status = "untried: the models matrix's tiny run failed (RuntimeError: shape mismatch @ modeling_x.py:9)"
    assert ("xglm", "xglm", status) in support_rows()


def test_checkpoint_layouts_are_transformers_own_conversions():
    """The layouts read by transformers' from_pretrained (support.CHECKPOINT_LAYOUTS) are what the installed
    transformers splits, concatenates or transposes at load (a WeightConverter of its conversion mapping, reading the
    tensor the reason names), and `converted_at_load` sends them there; every other trained architecture has no such
    converter outside its experts (finetune/model/experts/ reads those), so finetune's own loaders read it."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    from finetune.model.classes import from_config
    from finetune.model.support import CHECKPOINT_LAYOUTS, converted_at_load

    def converters(model_type):
        return [item for item in get_checkpoint_conversion_mapping(model_type) or []
                if isinstance(item, WeightConverter)]

    for model_type, layout in CHECKPOINT_LAYOUTS.items():
        sources = [pattern.replace("\\", "").removesuffix(".weight")
                   for item in converters(model_type) for pattern in item.source_patterns]
        assert any(source in layout for source in sources), (model_type, sources)
        config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
        assert converted_at_load(config) == layout
    for model_type in set(TRAINED) - set(CHECKPOINT_LAYOUTS):
        outside = [item.target_patterns for item in converters(model_type)
                   if not all("expert" in target for target in item.target_patterns)]
        if outside:  # a multimodal model's tower converters (Kimi K2.5's qkv): the model finetune builds has no tower
            with torch.device("meta"):
                built = [name for name, _ in from_config(tiny_config(model_type, vocab_size=512, eos_token_id=2,
                                                                     pad_token_id=0)).named_parameters()]
            outside = [t for t in outside if any(re.search(p, name) for p in t for name in built)]
        assert not outside, (model_type, outside)


def test_the_mamba_rule_is_peft_s_own():
    """finetune refuses before loading what PEFT refuses inside get_peft_model (a ValueError traceback mid-load):
    the same model types and module names as the installed PEFT's check."""
    import inspect
    import re

    from peft.tuners import tuners_utils

    from finetune.model.support import PEFT_MAMBA_MODEL_TYPES, PEFT_MAMBA_MODULES

    source = inspect.getsource(tuners_utils._check_lora_target_modules_mamba)
    sets = {name: set(re.findall(r'"([\w-]+)"', body)) for name, body in re.findall(r"(\w+) = \{([^}]*)\}", source)}
    assert sets["mamba_model_types"] == set(PEFT_MAMBA_MODEL_TYPES)
    assert sets["incompatible_modules"] == set(PEFT_MAMBA_MODULES)


def test_docs_and_the_cli_list_the_table(capsys):
    from finetune.cli.command import main
    from finetune.cli.models import models_doc
    from finetune.model.support import support_table

    assert (REPO / "docs" / "models.md").read_text() == models_doc(), "run `make models-doc`"
    assert main(["models"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == support_table()
    # every row, with its status, independently of how the table is rendered
    for model_type in TRAINED:
        expected = ("FSDP2 and FSDP1 launched" if model_type in SHARDED else "FSDP2 launched"
                    if model_type in SHARDED_FSDP2 else "trained (one process)")
        assert any(f"`{model_type}`" in line and expected in line for line in printed.splitlines()), model_type
    for model_type in REFUSED:
        assert any(f"`{model_type}`" in line and "refused:" in line for line in printed.splitlines()), model_type


# ---------------------------------------------------------------------------------- launched under FSDP2 and FSDP1
@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "config"), [(model_type, config) for model_type in SHARDED
                                                    for config in ("fsdp2", "fsdp1")]
                         + [(model_type, "fsdp2") for model_type in SHARDED_FSDP2])
def test_trains_under_the_shipped_fsdp_config(model_type, config, tiny_arch, tmp_path):
    """`accelerate launch --config_file accelerate_configs/<config>.yaml finetune/run.py` on the tiny model, 2
    processes, the library's LoRA settings: the whole run (data, wrap, steps, eval, checkpoint, adapter)."""
    from shipped import launch, recipe_dtype

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(24))
    out = tmp_path / "run"
    recipe = recipe_dict(tiny_arch(model_type), data, out, model={"dtype": recipe_dtype(config)}, lora=LIBRARY_LORA,
                         train={"max_steps": 3, "micro_batch_size": 2, "eval_every": 3},
                         eval={"generation_rows": 1, "max_new_tokens": 2})
    result = launch(config, write_recipe(tmp_path / "recipe.yaml", recipe), timeout=600)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    version = config.removeprefix("fsdp")
    assert f"parallel: FSDP{version} over 2 processes" in result.stdout
    losses = train_losses(out)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    # Every LoRA B moved from its zero init, but a sparse-attention indexer's (DeepSeek-V3.2 / V4): it picks the
    # positions attended to by top-k, which passes no gradient from the LM loss (DeepSeek trains it by a loss of its own).
    trained = [tensor for name, tensor in adapter.items() if "lora_B" in name and ".indexer." not in name]
    assert trained and all(tensor.abs().sum() > 0 for tensor in trained)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
