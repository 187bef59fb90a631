"""`finetune export` and `finetune generate` of runs whose base is not a plain 16-bit text model: a pre-quantized 4-bit
checkpoint (a merge goes onto the 16-bit folder it was quantized from, or is refused in one paragraph), LoRA on the
tied LM head of a model with tied embeddings (exported and merged, the merged model equal to base + adapter), and a
multimodal model trained without its vision tower (GLM-5: merged and generated with no LoRA on the tower)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune.cli import main

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])


def _run_folder(model_dir: Path, run: Path, target_modules) -> Path:
    """A finished run's folder (adapter/ saved as training saves it, recipe.yaml) of LoRA on `model_dir` (fp32, the
    towers of a multimodal model removed and experts split as training does), every lora_B random so it counts."""
    from peft import LoraConfig

    from finetune import outputs, parallel
    from finetune.model.classes import from_pretrained, without_towers
    from finetune.model.experts import get_peft_model, split_experts

    torch.manual_seed(0)
    model = without_towers(from_pretrained(str(model_dir), dtype=torch.float32))
    split_experts(model, dtype=torch.float32, quantized=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    key_map = outputs.adapter_key_map(peft_model)
    outputs.save_adapter(peft_model.peft_config["default"], key_map, parallel.trainable_state_dict(peft_model, key_map),
                         run / "adapter")
    data = write_jsonl(run / "data.jsonl", addition_rows(8))
    write_recipe(run / "recipe.yaml", recipe_dict(model_dir, data, run, lora={"target_modules": target_modules}))
    return run


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits.float()


def test_a_merge_of_a_run_on_a_4bit_checkpoint_uses_the_base_it_was_quantized_from(tiny_llama, tmp_path, capsys):
    """Before: a transformers load report and a RuntimeError traceback (the 4-bit folder loaded for an fp32 merge)."""
    from transformers import AutoModelForCausalLM

    from finetune.model.quantization.writer import write_quantized
    from finetune.model.settings import quantization_config
    from finetune.recipe import Recipe

    recipe = Recipe.model_validate({"model": {"name_or_path": str(tiny_llama), "dtype": "bfloat16"},
                                    "data": {"datasets": [{"path": "x.jsonl"}]}})
    q4 = write_quantized(tiny_llama, tmp_path / "q4", bnb_config=quantization_config(recipe), dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    run = _run_folder(q4, tmp_path / "run", ["q_proj", "v_proj"])
    capsys.readouterr()

    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    printed = capsys.readouterr().out
    assert f"4-bit checkpoint written by `finetune quantize` from {Path(tiny_llama).resolve()}" in printed
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert getattr(merged.config, "quantization_config", None) is None  # a 16-bit model, not the 4-bit one
    assert all(p.dtype == torch.float32 for p in merged.parameters())

    # --base naming the 4-bit folder itself, and a 4-bit folder that does not say where it came from: one paragraph
    assert main(["export", str(run), str(tmp_path / "again"), "--merge", "--base", str(q4)]) == 2
    error = capsys.readouterr().err
    assert f"Fix: pass --base {Path(tiny_llama).resolve()}" in error and "Traceback" not in error
    (q4 / "quantized_from.json").unlink()
    assert main(["export", str(run), str(tmp_path / "again"), "--merge"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is a 4-bit checkpoint" in error and "Fix: pass --base FOLDER" in error
    assert not (tmp_path / "again").exists()


def test_lora_on_the_tied_lm_head_exports_and_merges_into_base_plus_adapter(tmp_path, capsys):
    """Before: both refused, "1 missing (e.g. base_model.model.lm_head.base_layer.weight) ... omit --base" (PEFT's
    expected keys held the base's head weight); merged naively, the head's LoRA would change the tied embeddings."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from finetune.cli.tiny import build_tiny_model

    base_dir = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    run = _run_folder(base_dir, tmp_path / "run", ["q_proj", "v_proj", "lm_head"])
    capsys.readouterr()

    assert main(["export", str(run), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    assert "the merged model has a head of its own" in capsys.readouterr().out

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    embeddings = base.get_input_embeddings().weight.detach().clone()
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    reference = _logits(with_adapter)
    with with_adapter.disable_adapter():
        assert (reference - _logits(with_adapter)).abs().max() > 1e-3, "the adapter must change the model"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.config.tie_word_embeddings is False
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" in handle.keys()  # noqa: SIM118 (not a dict)
    assert torch.equal(merged.get_input_embeddings().weight, embeddings.to(torch.bfloat16).float())
    assert (_logits(merged) - reference).abs().max() <= 0.02 * reference.abs().max()  # bf16 storage only


def test_glm5_exports_merged_and_generates_with_lora_only_where_training_put_it(tiny_arch, tmp_path, capsys):
    """Before: "the adapter does not fit this mixture-of-experts model (0 unexpected, 150 missing LoRA tensors, e.g.
    ...visual.blocks.0.mlp.gate_proj.lora_A...)": the base reloaded whole kept its vision tower, whose Linears have the
    adapter's leaf names."""
    from safetensors import safe_open

    from finetune.cli.generate import load_for_generation
    from finetune.outputs.export import open_source

    model_dir = tiny_arch("glm5_next")
    run = _run_folder(model_dir, tmp_path / "run", "all-linear")
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    assert "merged fp32 model vs base + adapter" in capsys.readouterr().out
    with safe_open(str(next((tmp_path / "merged").glob("*.safetensors"))), "pt") as handle:
        assert any(".visual." in key for key in handle.keys())  # noqa: SIM118 (the tower saved as the base has it)

    with open_source(str(run / "adapter")) as source:  # the adapter alone: its base loaded by from_pretrained, whole
        model, _ = load_for_generation(source, no_adapter=False)
    lora = [name for name, _ in model.named_parameters() if "lora_" in name]
    assert lora and not [name for name in lora if ".visual." in name]
    assert json.loads((run / "adapter" / "adapter_config.json").read_text()).get("exclude_modules") is None


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_no_tower_lora_on_a_dense_multimodal_model(tiny_arch, tmp_path, targets):
    """Mistral 3 (dense, PeftModel.from_pretrained's path): its Pixtral tower has q_proj/gate_proj too; before, plain
    LoRA layers were put there on reload (the adapter has none for them)."""
    from finetune.model.classes import from_pretrained
    from finetune.model.experts import load_adapter

    model_dir = tiny_arch("mistral3")
    run = _run_folder(model_dir, tmp_path / "run", targets)
    model = load_adapter(from_pretrained(str(model_dir), dtype=torch.float32), run / "adapter")
    lora = [name for name, _ in model.named_parameters() if "lora_" in name]
    assert lora and not [name for name in lora if "vision_tower" in name or "multi_modal_projector" in name]
