"""Mutation testing round 6 (bb72): gaps in finetune/outputs/runtimes.py's vLLM verdict. The oracle is vLLM's own
check, vllm/lora/peft_helper.py (PEFTHelper.validate_legal) of vLLM 0.32, the version `make vllm` installs:
`if max_rank > lora_config.max_lora_rank` (default 16) and `if self.bias != "none"` / `if self.lora_bias` (refused,
no flag). tests/outputs/test_runtimes.py runs configs through `finetune export`; these pin the edges."""

from __future__ import annotations

import pytest

from finetune.outputs.runtimes import VLLM_DEFAULT_MAX_RANK, vllm_verdict

NAMES = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]


@pytest.mark.parametrize("rank,status,flag", [(VLLM_DEFAULT_MAX_RANK, "valid", None),
                                              (VLLM_DEFAULT_MAX_RANK + 1, "needs", "--max-lora-rank 32"),
                                              (32, "needs", "--max-lora-rank 32")])
def test_vllms_default_max_lora_rank_admits_its_own_rank(rank, status, flag):
    """vLLM refuses a rank *greater* than max_lora_rank: r 16 loads with the defaults (the most common rank), and the
    flag named for a larger one is the smallest rank vLLM accepts that holds it."""
    verdict = vllm_verdict({"r": rank, "lora_alpha": 16}, NAMES)
    assert verdict.status == status, verdict.line()
    if flag:
        assert flag in verdict.line()


@pytest.mark.parametrize("config", [{"bias": "all"}, {"bias": "lora_only"}, {"lora_bias": True}],
                         ids=["bias-all", "bias-lora-only", "lora-bias"])
def test_an_adapter_with_biases_is_refused_by_vllm(config):
    verdict = vllm_verdict({"r": 8, "lora_alpha": 16, **config}, NAMES)
    assert verdict.status == "invalid" and "--enable-lora-bias" not in verdict.line(), verdict.line()


@pytest.mark.parametrize("config", [{"bias": "all"}, {"lora_bias": True}], ids=["bias-all", "lora-bias"])
def test_an_adapter_with_biases_is_never_called_valid_for_vllm(config):
    """Whatever the fix of the finding above, both of PEFT's bias settings are flagged (PEFT's `lora_bias` too: it
    was read beside `bias`)."""
    assert vllm_verdict({"r": 8, "lora_alpha": 16, **config}, NAMES).status != "valid"


# --------------------------------------------------------------------------------- llama.cpp's converter, fast
# The slow tests/outputs/test_llama_cpp_converter.py runs llama.cpp's converter on these cases (lm-head-untied,
# modules-to-save-norm); these pin the verdict's rules without it, so the fast suite catches a change.
def test_lora_on_the_lm_head_of_an_untied_base_converts_for_llama_cpp():
    """The base's GGUF has output.weight when the embeddings are not tied, so llama.cpp takes output.weight.lora_a/b;
    only a tied base lacks it (the `LoRA tensor 'output.weight' does not exist in base model` refusal)."""
    names = [*NAMES, "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"]
    from finetune.outputs.runtimes import llama_cpp_verdict

    assert llama_cpp_verdict({"r": 8, "lora_alpha": 16}, names, tied_embeddings=False).status == "valid"
    tied = llama_cpp_verdict({"r": 8, "lora_alpha": 16}, names, tied_embeddings=True)
    assert tied.status == "invalid" and "tied embeddings" in tied.line()


def test_a_final_norm_in_the_adapter_is_named_as_kept_then_skipped_not_as_a_converter_stop():
    """convert_lora_to_gguf.py keeps norm vectors (`model.norm.weight`: modules_to_save=["norm"], mergekit's
    extracted LoRA) and llama.cpp skips them on load: the reason says that, not that the converter stops."""
    from finetune.outputs.runtimes import llama_cpp_verdict

    names = [*NAMES, "base_model.model.model.norm.weight"]
    verdict = llama_cpp_verdict({"r": 8, "lora_alpha": 16, "modules_to_save": ["norm"]}, names, tied_embeddings=False)
    assert verdict.status == "invalid" and "1 norm weight(s) in the adapter" in verdict.line(), verdict.line()
    assert "Not a lora_A or lora_B tensor" not in verdict.line()
