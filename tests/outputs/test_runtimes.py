"""`finetune export` says where an adapter runs: real PEFT adapters of a tiny model (plain, DoRA, rsLoRA at rank 32,
modules_to_save, LoRA on the LM head of a tied base, alpha_pattern), exported, and their runtimes.json read back."""

from __future__ import annotations

import json

import pytest

from finetune.cli import main
from finetune.outputs.runtimes import llama_cpp_verdict, vllm_verdict

CASES = {
    # name: (LoraConfig overrides, PEFT, vLLM, llama.cpp)
    "plain": ({}, "valid", "valid", "valid"),
    "dora": ({"use_dora": True}, "valid", "invalid", "invalid"),
    "rslora-r32": ({"use_rslora": True, "r": 32}, "valid", "needs", "invalid"),
    "modules-to-save": ({"modules_to_save": ["lm_head"]}, "valid", "invalid", "invalid"),
    "lm-head-tied": ({"target_modules": ["q_proj", "lm_head"]}, "valid", "needs", "invalid"),
    "alpha-pattern": ({"alpha_pattern": {"q_proj": 64}}, "valid", "invalid", "invalid"),
}


@pytest.fixture(scope="module")
def tied_llama(tiny_llama, tmp_path_factory):
    """The tiny llama with tied input/output embeddings (as Llama 3.2 1B, Gemma, Qwen2.5 0.5B have)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    folder = tmp_path_factory.mktemp("tied")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_export_reports_each_runtime(case, tied_llama, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    overrides, peft_status, vllm_status, llama_cpp_status = CASES[case]
    settings = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False, **overrides}
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tied_llama), LoraConfig(**settings))
    adapter.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "adapter"), str(out)]) == 0
    printed = capsys.readouterr().out
    report = {item["runtime"].split(" ")[0]: item for item in json.loads((out / "runtimes.json").read_text())}
    assert [report[name]["status"] for name in ("PEFT", "vLLM", "llama.cpp")] == [
        peft_status, vllm_status, llama_cpp_status], report
    assert "Where this adapter runs" in printed and (out / "RUNTIMES.md").read_text().strip() in printed
    reasons = {name: " ".join(item["reasons"]) for name, item in report.items()}
    expected = {"dora": ("DoRA", "DoRA"), "rslora-r32": ("--max-lora-rank 32", "lora_alpha 90.5"),
                "modules-to-save": ("modules_to_save", "modules_to_save"),
                "lm-head-tied": ("lm_head", "tied embeddings"), "alpha-pattern": ("alpha_pattern", "alpha_pattern")}
    if case in expected:
        assert expected[case][0] in reasons["vLLM"] and expected[case][1] in reasons["llama.cpp"], reasons


def test_rules_on_configs_alone():
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert vllm_verdict({"r": 1024, "lora_alpha": 16}, names).status == "invalid"  # above vLLM's largest rank (512)
    assert "--max-lora-rank 64" in vllm_verdict({"r": 48, "lora_alpha": 16}, names).reasons[0]
    no_alpha = llama_cpp_verdict({"r": 8}, names, tied_embeddings=False)
    assert no_alpha.status == "invalid" and "lora_alpha" in no_alpha.reasons[0]
    bias = llama_cpp_verdict({"r": 8, "lora_alpha": 16}, [*names, names[1].replace(".weight", ".bias")],
                             tied_embeddings=False)
    assert bias.status == "invalid" and ".lora_A.weight/.lora_B.weight" in bias.reasons[0]
    patterned = llama_cpp_verdict({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}}, names,
                                  tied_embeddings=False)
    assert patterned.status == "valid"  # llama.cpp reads each module's rank from its tensor
