"""The chunked loss of models whose forward scales or caps the LM head's output (bug bash bb66, a sweep of every
architecture): finetune's head returns the loss in place of the logits, and the model then applied its own
transform to that loss. Cohere trained on logit_scale x the loss (gradient 16x too small), Mistral Large 4 on a
tanh-capped loss sum (its cap in text_config, missed: ~1% of the gradient), Granite on loss / logits_scaling. Each is
compared, under PEFT as a run wraps it, with the full logits the model itself returns (test_loss.compare: loss,
eval loss and every LoRA gradient), and the per-token and tempered log-probs of DPO and GRPO with a log-softmax of
them. In process, fp32 tiny models from their configs with non-default values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss import CPU, batches, compare

from finetune.cli.tiny import build_tokenizer
from finetune.cli.tiny_arch import tiny_config
from finetune.model import classes
from finetune.training import loss as chunked

# model type: config values that make its transform visible (transformers' tiny defaults are 1.0 for some)
CASES = {"cohere": {"logit_scale": 0.0625}, "cohere2": {"logit_scale": 0.25}, "granite": {"logits_scaling": 8.0},
         "granitemoe": {"logits_scaling": 4.0}, "gemma2": {"final_logit_softcapping": 5.0},
         "mistral_large4": {}, "gemma4": {}, "llama": {}}


def _model(model_type: str):
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer()
    config = tiny_config(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    text = config.get_text_config()
    for key, value in CASES[model_type].items():
        setattr(text, key, value)
    if model_type == "mistral_large4":
        text.final_logit_softcapping = 3.0  # in text_config only: the top-level config has none
    torch.manual_seed(0)
    base = classes.from_config(config, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model, len(tokenizer)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_loss_of_a_scaled_or_capped_head_is_the_models_own(model_type):
    model, vocab = _model(model_type)
    diff = compare(model, {k: v for k, v in batches(vocab)["padded"].items()})
    assert diff["loss"] < 1e-5 and diff["eval"] < 1e-5 and diff["grad"] < 1e-4, diff


@pytest.mark.parametrize("model_type", ["cohere", "mistral_large4", "granite"])
def test_per_token_and_tempered_log_probs_are_the_models_own(model_type):
    model, vocab = _model(model_type)
    batch = batches(vocab)["padded"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
        positions, wanted = chunked.trained_positions(batch["labels"])
        for temperature in (1.0, 0.7):
            flat = (logits / temperature).reshape(-1, logits.size(-1)).index_select(0, positions)
            want = -F.cross_entropy(flat, wanted, reduction="none")
            got = chunked.token_logps(model, batch, CPU, temperature=temperature)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (temperature, (got - want).abs().max())
        logps, _ = chunked.sequence_logps(model, batch, CPU)
        rows = positions // batch["labels"].size(1)
        flat = logits.reshape(-1, logits.size(-1)).index_select(0, positions)
        want = torch.zeros(batch["labels"].size(0)).index_add(0, rows, -F.cross_entropy(flat, wanted, reduction="none"))
        assert torch.allclose(logps, want, rtol=1e-5, atol=1e-4), (logps, want)


def test_a_model_that_does_what_the_head_cannot_read_takes_the_plain_path():
    """A forward that changes the logits in a way (scale, cap) does not fit (here: an added bias, a hook on the causal
    LM) gets no chunked head: the plain path's full logits are the model's own, whatever it does."""
    model, vocab = _model("llama")
    lm = chunked.causal_lm(model)
    lm.register_forward_hook(lambda module, args, output: output.__setitem__("logits", output.logits + 0.5) or output)
    assert chunked.install(model, CPU) is None
    diff = compare(model, batches(vocab)["padded"])
    assert diff["loss"] < 1e-6, diff


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "cohere", "mistral_large4", "gemma2"])
def test_the_chunked_head_is_taken_whatever_the_heads_name(model_type):
    """The head is found by its attribute (GPT-NeoX's is `embed_out`): no model the head can serve falls back to the
    plain path's full-vocabulary logits (the memory the chunked loss saves)."""
    if model_type not in CASES:
        CASES[model_type] = {}
    model, _ = _model(model_type)
    assert chunked.install(model, CPU) is not None


@pytest.mark.parametrize("model_type", ["gemma2", "cohere"])
def test_a_reward_score_is_the_score_heads_own_under_a_capped_or_scaled_head(model_type):
    """Found beside bb66's finding: the reward objective put its score head in place of the LM head, and the model
    then capped (Gemma) or scaled (Cohere) the score, which a sequence classifier serving the exported head does not:
    training scored what serving would not. The oracle: the score head on the last token's final hidden state."""
    from finetune.model.reward_head import attach_score_head
    from finetune.training.objectives.reward import rewards

    model, vocab = _model(model_type)
    score = attach_score_head(model, seed=0, device=CPU)
    with torch.no_grad():
        score.weight.mul_(400.0)  # scores well past the cap of 5 (and far from x 0.0625)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = rewards(model, {"input_ids": ids, "attention_mask": mask}, CPU)
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states[-1]
        want = score(hidden[:, -1]).float()[:, 0]
    assert want.abs().max() > 10, want
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got, want)
