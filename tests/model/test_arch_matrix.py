"""The architecture matrix: every architecture finetune/model/support.py lists, built tiny from transformers' own config
class, trains in this process through the library's model path (tests/arch_matrix.py), a representative set also
under the shipped FSDP2 and FSDP1 configs (launched), and the refused ones are refused before any weight loads.
docs/models.md and `finetune models` say exactly what the tables say."""

from __future__ import annotations

import math
import sys

import pytest
from arch_matrix import train_arch
from conftest import LIBRARY_LORA, REPO, addition_rows, recipe_dict, train_losses, write_jsonl, write_recipe
from safetensors.torch import load_file

from finetune.cli.tiny_arch import text_causal_lm_types, tiny_config
from finetune.model.support import ADAPTER_GAPS, REFUSED, SHARDED, TRAINED


def test_every_listed_architecture_is_a_text_causal_lm_of_this_transformers():
    """A row for a model type transformers renamed or dropped would be a claim nothing checks."""
    shipped = set(text_causal_lm_types())
    listed = set(TRAINED) | set(REFUSED)
    assert listed <= shipped, sorted(listed - shipped)
    assert not set(TRAINED) & set(REFUSED) and set(SHARDED) <= set(TRAINED) and set(ADAPTER_GAPS) <= set(TRAINED)


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
        expected = "FSDP2 and FSDP1 launched" if model_type in SHARDED else "trained (one process)"
        assert any(f"`{model_type}`" in line and expected in line for line in printed.splitlines()), model_type
    for model_type in REFUSED:
        assert any(f"`{model_type}`" in line and "refused:" in line for line in printed.splitlines()), model_type


# ---------------------------------------------------------------------------------- launched under FSDP2 and FSDP1
@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize("model_type", SHARDED)
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
    trained = [tensor for name, tensor in adapter.items() if "lora_B" in name]
    assert trained and all(tensor.abs().sum() > 0 for tensor in trained)  # every LoRA B moved from its zero init


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
