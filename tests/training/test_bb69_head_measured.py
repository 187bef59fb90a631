"""The LM head's transform is measured, not read from the forward's source (bug bash bb69, a review of bb66's fix).

bb66 read the lines after the head call for `logits = ...` lines naming known attributes. It missed a scale on the
head call's own line (HyperCLOVAX `lm_head(h) * logits_scaling`, Falcon-H1 `* self.model.lm_head_multiplier`), a
remote-code subclass's override (the parent transformers forward was read), a cap under another name
(RecurrentGemma's `logits_soft_cap`), and took x or / from the attribute's name: each trained on a loss that was not the
model's (loss 1.7-17x, gradients 6-37x off at a trained model's logit size). Now one probe forward fits (scale, cap)
from what the model returns for designed head outputs (training/loss.head_transform). The oracle, as bb66's tests:
the model's own full logits under PEFT (test_loss.compare: loss, eval loss, every LoRA gradient), with the head's
weights x 40 so that the logits have a trained model's size. In process, fp32 tiny models from their configs."""
from __future__ import annotations

import pytest
import torch
from test_loss import CPU, batches, compare

from finetune.cli.tiny import build_tokenizer
from finetune.cli.tiny_arch import tiny_config
from finetune.model import classes
from finetune.training import loss as chunked

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
CASES = {  # model type: (config values, LoRA targets, the (scale, cap) the forward applies)
    "hyperclovax": ({"logits_scaling": 0.125}, "all-linear", (0.125, None)),  # lm_head(h) * logits_scaling
    "falcon_h1": ({"lm_head_multiplier": 0.25}, ATTENTION, (0.25, None)),  # lm_head(h) * self.model.lm_head_multiplier
    "recurrent_gemma": ({"logits_soft_cap": 2.0}, "all-linear", (1.0, 2.0)),  # tanh(logits / cap) * cap
    "granite": ({"logits_scaling": 8.0}, "all-linear", (0.125, None)),  # logits / logits_scaling
    "gemma2": ({"final_logit_softcapping": 5.0}, "all-linear", (1.0, 5.0)),
}


def _model(model_type: str, values: dict, targets, *, model_class=None):
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer()
    config = tiny_config(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    for key, value in values.items():
        setattr(config.get_text_config(), key, value)
    torch.manual_seed(0)
    base = (model_class(config).float() if model_class is not None else classes.from_config(config, dtype=torch.float32))
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(40.0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model, len(tokenizer)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_measured_transform_is_the_models_and_the_loss_its_own(model_type):
    values, targets, transform = CASES[model_type]
    model, vocab = _model(model_type, values, targets)
    assert chunked.install(model, CPU) is not None
    assert chunked.head_transform(model, chunked.causal_lm(model), CPU) == transform
    diff = compare(model, batches(vocab)["padded"])
    assert diff["loss"] < 1e-5 and diff["eval"] < 1e-5 and diff["grad"] < 1e-4, diff


def test_a_remote_code_subclass_that_scales_its_logits_is_measured():
    """A `trust_remote_code` class overriding a transformers forward (here defined in this test, outside
    transformers.models): bb66 read the parent's forward and found no transform."""
    from transformers import LlamaForCausalLM

    class ScaledLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            outputs = super().forward(*args, **kwargs)
            lm_logits = outputs.logits * 0.2
            outputs.logits = lm_logits
            return outputs

    model, vocab = _model("llama", {}, "all-linear", model_class=ScaledLlama)
    scale, cap = chunked.head_transform(model, chunked.causal_lm(model), CPU)
    assert scale == pytest.approx(0.2, rel=1e-6) and cap is None
    diff = compare(model, batches(vocab)["padded"])
    assert diff["loss"] < 1e-5 and diff["eval"] < 1e-5 and diff["grad"] < 1e-4, diff


def test_the_probe_leaves_the_random_state_and_the_head_as_they_were():
    """The probe forward runs in training mode (dropout would draw): the random state is put back and no hook stays,
    so a run's numbers are those it would train without the probe."""
    model, _ = _model("hyperclovax", {"logits_scaling": 0.125}, "all-linear")
    head = chunked.causal_lm(model).get_output_embeddings()
    state = torch.random.get_rng_state()
    chunked.head_transform(model, chunked.causal_lm(model), CPU)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not head._forward_hooks and all(p.grad is None for p in model.parameters())
