"""Export gaps found by mutation testing round 5 (bb61): an adapter with non-finite values, a checkpoint holding LoRA
tensors its recipe.yaml's layout has not, and the tokenizer a step's adapter takes from the finished run's adapter/.

Oracles: adapters written by PEFT itself (`save_pretrained`), torch.isfinite, the set difference of the tensor names by
hand, and the bytes of the template file saved beside the run's adapter. In-process and fast: the checkpoints are
written by `save_checkpoint` as the training loop calls it (tests/outputs/test_checkpoint_template.py's way)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import recipe_dict, write_recipe
from test_checkpoint_template import EDITED, TRAINED, lora_layout, stopped_run

from finetune.cli import main
from finetune.errors import CheckpointError
from finetune.outputs import checkpoint
from finetune.outputs.checkpoint_adapter import write_checkpoint_adapter
from finetune.outputs.trained_template import TEMPLATE_FILE
from finetune.recipe import load_recipe, recipe_to_yaml


@pytest.mark.parametrize("tensor,row,value", [
    ("model.layers.1.self_attn.v_proj.lora_B", 2, float("inf")),
    ("model.layers.0.self_attn.q_proj.lora_A", 1, float("nan")),
    ("model.layers.0.self_attn.v_proj.lora_B", 0, float("-inf")),
])
def test_an_adapter_with_one_non_finite_value_is_not_exported(tensor, row, value, tiny_llama, tmp_path, capsys):
    """Found by mutation testing (bb61 ex3): the finite check narrowed to `isnan(value).all()` (only an all-NaN
    tensor refused) passed every test, none of which fed export a non-finite adapter: one NaN or any inf was exported
    and said valid. Oracle: PEFT's adapter with one element set, torch.isfinite of the file PEFT wrote."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        peft_model.get_parameter(f"base_model.model.{tensor}.default.weight")[row, 1] = value
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert [key for key, v in saved.items() if not torch.isfinite(v).all()] == [f"base_model.model.{tensor}.weight"]
    capsys.readouterr()
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"tensor base_model.model.{tensor}.weight (and 0 more) has NaN/inf values; not exported." in error, error
    assert "Traceback" not in error and not (tmp_path / "out").exists()


def test_a_checkpoint_with_lora_tensors_its_recipe_has_not_is_refused(tmp_path, tiny_llama):
    """Found by mutation testing (bb61 ca1): only missing tensors refused (`if missing:`) passed every test: a
    checkpoint holding LoRA tensors its recipe.yaml's layout has not (trained on more targets than the recipe.yaml now
    names) was exported without them, an incomplete adapter, in silence. Oracle: the set difference by hand (o_proj's
    A and B in each of the 2 layers: 4 tensors the q_proj/v_proj layout has not)."""
    narrow = load_recipe(write_recipe(tmp_path / "narrow.yaml", recipe_dict(
        tiny_llama, tmp_path / "rows.jsonl", tmp_path / "run", lora={"target_modules": ["q_proj", "v_proj"]})))
    wide = narrow.model_copy(update={"lora": narrow.lora.model_copy(
        update={"target_modules": ["q_proj", "v_proj", "o_proj"]})})
    model, trainable = lora_layout(wide)
    extra = sorted(name for name in trainable if ".o_proj." in name)
    assert len(extra) == 4 and len(trainable) == 12
    state = {"step": 2, "world_size": 1, "strategy": "single process", "losses": [], "eval_losses": []}
    saved = checkpoint.save_checkpoint(tmp_path / "run", 2, model, torch.optim.AdamW(list(trainable.values())),
                                       set(trainable), state, recipe_to_yaml(narrow), keep_last=2)
    with pytest.raises(CheckpointError) as refused:
        write_checkpoint_adapter(saved, tmp_path / "exported")
    message = str(refused.value)
    assert "its LoRA tensors do not match the layout of its recipe.yaml (0 missing" in message, message
    assert f"{len(extra)} unexpected, e.g. ['" in message and "o_proj.lora_A" in message, message
    assert not (tmp_path / "exported").exists()


def test_a_step_without_a_recorded_template_takes_the_finished_runs_adapter_tokenizer(tmp_path, tiny_llama, capsys):
    """Found by mutation testing (bb61 ca2): the finished run's adapter/ looked for beside the checkpoints
    (<run>/checkpoints/adapter) passed every test, none of which had a finished run and a checkpoint without
    chat_template.json (an earlier finetune's): the step's adapter then got the recipe's template as edited since,
    with the 'today's template' note, not the template training saved beside the run's adapter. Oracle: the bytes of
    that saved chat_template.jinja."""
    from transformers import AutoTokenizer

    run, saved = stopped_run(tmp_path, tiny_llama)  # model.chat_template: a file, edited after the run
    (saved / TEMPLATE_FILE).unlink()  # as an earlier finetune wrote its checkpoints
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TRAINED
    tokenizer.save_pretrained(run / "adapter")  # as the finished run saved it beside its adapter
    kept = (run / "adapter" / "chat_template.jinja").read_bytes()
    assert kept == TRAINED.encode() and (run / "adapter" / "tokenizer_config.json").is_file()
    capsys.readouterr()
    write_checkpoint_adapter(saved, tmp_path / "exported")
    assert (tmp_path / "exported" / "chat_template.jinja").read_bytes() == kept != EDITED.encode()
    assert "today's template" not in capsys.readouterr().out
    assert json.loads((tmp_path / "exported" / "adapter_config.json").read_text())["r"] == 8


def _per_expert_adapter(model_dir, out, **patterns):
    """finetune's per-expert LoRA on the tiny MoE model (fp32, experts split as training splits them) with PEFT's
    per-module `patterns` (alpha_pattern, rank_pattern), every B random, saved as a run's adapter; returns the model
    (tests/outputs/test_export_fused.py's, with patterns)."""
    from peft import LoraConfig

    from finetune import outputs, parallel
    from finetune.model.classes import from_pretrained, without_towers
    from finetune.model.experts import get_peft_model, split_experts

    torch.manual_seed(0)
    model = without_towers(from_pretrained(str(model_dir), dtype=torch.float32))
    split_experts(model, dtype=torch.float32, quantized=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **patterns)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    key_map = outputs.adapter_key_map(peft_model)
    outputs.save_adapter(peft_model.peft_config["default"], key_map,
                         parallel.trainable_state_dict(peft_model, key_map), out)
    return peft_model.eval()


@pytest.mark.parametrize("model_type,patterns", [
    ("gpt_oss", {"alpha_pattern": {"up_proj": 32}}),  # gate and up interleaved in one fused parameter
    ("qwen2_moe", {"rank_pattern": {"gate_proj": 8}}),  # concatenated gate_up; another rank, so another alpha / r
])
def test_fused_parts_of_different_scalings_export_to_the_trained_model(model_type, patterns, tiny_arch, tmp_path,
                                                                      capsys):
    """Found by mutation testing (bb61 ef1): the parts fused into one parameter (gate and up in gate_up_proj) with
    different scalings (alpha_pattern / rank_pattern) have the non-reference part's B rescaled, as PEFT keeps one
    scaling per fused parameter; the inverted ratio (reference / scale) survived, as the export oracle used one r
    and alpha everywhere. Oracle: plain PEFT's `PeftModel.from_pretrained` of the export on the stock model computes
    the per-expert model's logits (test_export_fused.py's)."""
    from peft import PeftModel

    from finetune.model.classes import from_pretrained

    model_dir = tiny_arch(model_type)
    ours = _per_expert_adapter(model_dir, tmp_path / "adapter", **patterns)
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "exported" / "adapter_config.json").read_text()).get("target_parameters")
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 2]])
    with torch.no_grad():
        reference = ours(input_ids=ids).logits
        stock = from_pretrained(str(model_dir), dtype=torch.float32)
        base = stock(input_ids=ids).logits
        got = PeftModel.from_pretrained(stock, str(tmp_path / "exported")).eval()(input_ids=ids).logits
    assert (reference - base).abs().max() > 1e-2, "the adapter must change the model"
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max() + 1e-6, (got - reference).abs().max()
