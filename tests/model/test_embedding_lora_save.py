"""What a run saves of LoRA on embedding layers, and what it says about it (finetune/quiet.py)."""

from __future__ import annotations

import warnings

import torch

from finetune import quiet

SAVE_EMBEDDINGS = "Setting `save_embedding_layers` to `True`"


def test_no_warning_of_embedding_weights_that_the_adapter_never_holds(tiny_llama, monkeypatch):
    """Found by a bug bash of vocabulary and embeddings: every run and export with `embed_tokens` / `lm_head` in
    lora.target_modules printed PEFT's "UserWarning: Setting `save_embedding_layers` to `True` as embedding layers
    found in `target_modules`", while the adapter finetune writes holds the LoRA tensors only (PEFT is asked for the
    names of the trainable tensors alone). Now the warning is filtered like the other library noise, and the adapter's
    keys are still LoRA tensors only."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.outputs import adapter_key_map

    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens", "lm_head"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()
        keys = adapter_key_map(model)
    assert not [w for w in caught if SAVE_EMBEDDINGS in str(w.message)], [str(w.message) for w in caught]
    assert keys and all(".lora_" in key for key in keys.values()), sorted(keys.values())
    assert any("embed_tokens.lora_embedding_A" in key for key in keys.values())
    with warnings.catch_warnings(record=True) as caught:  # the warning itself is PEFT's, shown with --verbose
        warnings.simplefilter("always")
        adapter_key_map(model)
    assert [w for w in caught if SAVE_EMBEDDINGS in str(w.message)]
