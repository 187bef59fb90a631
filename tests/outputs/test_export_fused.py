"""`finetune export` of a mixture-of-experts adapter loads in plain PEFT (`PeftModel.from_pretrained` on the stock
transformers 5 base, unquantized) and computes what finetune's per-expert LoRA computes: per-expert tensors where PEFT
converts them itself (Mixtral), else PEFT's LoRA on the fused expert parameters (finetune/outputs/export_fused.py),
for every expert layout family (concatenated, Llama 4's transposed, gpt-oss's interleaved and biased, DeepSeek-V4's
own gating) and for models
with shared experts and dense MLP layers beside the routed ones."""

from __future__ import annotations

import json

import pytest
import torch


def _per_expert_adapter(model_dir, out, *, use_rslora: bool):
    """finetune's per-expert LoRA on the tiny model (fp32, experts split as training splits them), every B random so
    that every expert's LoRA counts, saved as the library saves a run's adapter; returns the model."""
    from peft import LoraConfig

    from finetune import outputs, parallel
    from finetune.model.classes import from_pretrained, without_towers
    from finetune.model.experts import get_peft_model, split_experts

    torch.manual_seed(0)
    model = without_towers(from_pretrained(str(model_dir), dtype=torch.float32))
    split_experts(model, dtype=torch.float32, quantized=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.05, use_rslora=use_rslora,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B small and random: each expert's delta a few percent of its weight
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    key_map = outputs.adapter_key_map(peft_model)
    outputs.save_adapter(peft_model.peft_config["default"], key_map,
                         parallel.trainable_state_dict(peft_model, key_map), out)
    return peft_model.eval()


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "form", "use_rslora"), [
    ("gpt_oss", "fused", False),  # interleaved gate/up, stored (in, out), is_transposed; a square down_proj
    ("llama4_text", "fused", True),  # stored (in, out) without is_transposed: PEFT reads it (out, in); rsLoRA
    ("qwen2_moe", "fused", False),  # a shared expert whose gate_proj PEFT's rewrite would move onto the experts
    ("granitemoe", "fused", False),  # no per-expert tensors in its checkpoints: nothing for PEFT to convert
    ("mixtral", "per-expert", False),  # PEFT converts it itself: the per-expert form vLLM reads stays
    ("deepseek_v4", "fused", False),  # experts with their own gating (clamped SwiGLU), hash routing
    ("mistral_large4", "fused", False),  # Mistral's format: renames PEFT applies to the adapter's keys again
])
def test_exported_moe_adapter_loads_in_plain_peft_and_computes_the_trained_model(model_type, form, use_rslora,
                                                                                 tiny_arch, tmp_path, capsys):
    from peft import PeftModel
    from safetensors import safe_open

    from finetune.cli import main
    from finetune.model.classes import from_pretrained  # AutoModelForCausalLM's class, or the one it does not map

    model_dir = tiny_arch(model_type)
    ours = _per_expert_adapter(model_dir, tmp_path / "adapter", use_rslora=use_rslora)
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    exported = tmp_path / "exported"
    config = json.loads((exported / "adapter_config.json").read_text())
    with safe_open(str(exported / "adapter_model.safetensors"), "pt") as handle:
        per_expert = [key for key in handle.keys() if ".experts.0." in key]  # noqa: SIM118 (not a dict)
    assert bool(config.get("target_parameters")) == (form == "fused") and bool(per_expert) == (form == "per-expert")
    verdicts = {item["runtime"].split(" ")[0]: item for item in json.loads((exported / "runtimes.json").read_text())}
    assert verdicts["PEFT"]["status"] == "valid", verdicts["PEFT"]

    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 2]])
    with torch.no_grad():
        reference = ours(input_ids=ids).logits
        stock = from_pretrained(str(model_dir), dtype=torch.float32)
        base = stock(input_ids=ids).logits
        plain = PeftModel.from_pretrained(stock, str(exported)).eval()
        got = plain(input_ids=ids).logits
    assert (reference - base).abs().max() > 1e-2, "the adapter must change the model"
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max() + 1e-6, (got - reference).abs().max()


@pytest.mark.parametrize("installed", ["0.18.0", "0.19.1"])
def test_export_of_expert_lora_refuses_a_peft_that_loads_no_form_of_it(installed, tiny_mixtral, tmp_path, capsys,
                                                                       monkeypatch):
    """Measured with the real releases (this test file's load test under PEFT 0.18.0, 0.19.0 and 0.20.0): below 0.20
    loading the fused form fails on every shape (0.19's ParamWrapper reads a 3-D parameter the other way round), and
    0.18 converts no per-expert name either. Only the version is patched here, as the compat floor (PEFT 0.18) has it:
    the export refuses with the fix, and writes nothing."""
    import importlib.metadata

    from finetune.cli import main

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "peft" else real(name))
    _per_expert_adapter(tiny_mixtral, tmp_path / "adapter", use_rslora=False)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert f"PEFT {installed}" in err and "pip install -U 'peft>=0.20'" in err and "Traceback" not in err, err
    assert not (tmp_path / "exported").exists()
