"""The fused LoRA path (finetune/model/lora/fused.py): PEFT's numbers in fp32, exact gradients, fallbacks where it does not apply."""

from __future__ import annotations

import pytest
import torch
from conftest import recipe_dict

from finetune.model.lora.fused import LoraDelta, fused_forward


def test_fused_function_gradients_are_exact_with_and_without_dropout():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    a = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: LoraDelta.apply(x, a, b, 2.0, 0.0, None), (x, a, b))
    # Dropout: the mask is regenerated from the seed in backward, so the gradient matches the forward exactly.
    assert torch.autograd.gradcheck(lambda x, a, b: LoraDelta.apply(x, a, b, 2.0, 0.3, 1234), (x, a, b))
    dropped = LoraDelta.apply(x, a, b, 1.0, 0.5, 7)
    assert not torch.equal(dropped, LoraDelta.apply(x, a, b, 1.0, 0.0, None))  # dropout really drops


def _model(model_dir, tmp_path, **lora):
    from finetune import model as model_stage
    from finetune.recipe import validate_recipe

    recipe = validate_recipe(recipe_dict(model_dir, tmp_path / "d.jsonl", tmp_path / "o", lora={"dropout": 0.0, **lora}))
    torch.manual_seed(0)
    peft_model = model_stage.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=False)
    with torch.no_grad():  # B = 0 at init would hide A's gradient path
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return peft_model


def _loss_and_grads(peft_model, *, fused: bool):
    layers = [m for m in peft_model.modules() if "forward" in m.__dict__ and m.__dict__["forward"].__func__ is fused_forward]
    saved = {id(m): m.__dict__.pop("forward") for m in layers} if not fused else {}
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    peft_model.zero_grad(set_to_none=True)
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    for m in layers:
        if id(m) in saved:
            m.forward = saved[id(m)]
    return float(loss), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}, len(layers)


def test_fused_path_equals_peft_in_fp32(tiny_llama, tmp_path):
    peft_model = _model(tiny_llama, tmp_path)
    fused_loss, fused_grads, covered = _loss_and_grads(peft_model, fused=True)
    peft_loss, peft_grads, _ = _loss_and_grads(peft_model, fused=False)
    assert covered == 14  # 7 projections x 2 layers, every one 4-bit
    assert fused_loss == pytest.approx(peft_loss, abs=1e-6)
    assert fused_grads.keys() == peft_grads.keys() and len(fused_grads) == 28
    for name, grad in fused_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, peft_grads[name], rtol=1e-5, atol=1e-7)


def test_dora_falls_back_to_peft(tiny_llama, tmp_path):
    peft_model = _model(tiny_llama, tmp_path, dora=True)
    fused_loss, fused_grads, _ = _loss_and_grads(peft_model, fused=True)
    peft_loss, peft_grads, _ = _loss_and_grads(peft_model, fused=False)
    assert fused_loss == peft_loss
    assert all(torch.equal(fused_grads[n], peft_grads[n]) for n in peft_grads)


def test_recipe_can_turn_it_off(tiny_llama, tmp_path):
    from finetune import model as model_stage
    from finetune.recipe import validate_recipe

    recipe = validate_recipe(recipe_dict(tiny_llama, tmp_path / "d.jsonl", tmp_path / "o", lora={"fused": False}))
    peft_model = model_stage.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=False)
    assert not any("forward" in m.__dict__ for m in peft_model.modules())


def test_drop_mask_rate_and_reproducibility():
    """16 random bits per element: the drop rate is p (within sampling noise), the same seed gives the same mask."""
    from finetune.model.lora.fused import drop_mask

    x = torch.empty(1000, 999)
    for p in (0.05, 0.1, 0.5):
        keep = ~drop_mask(x, p, seed=3)
        assert abs(float(keep.float().mean()) - (1 - p)) < 0.003, p  # 999,000 draws: sd ~ 0.0005
        assert torch.equal(keep, ~drop_mask(x, p, seed=3))
        assert not torch.equal(keep, ~drop_mask(x, p, seed=4))
    rows = drop_mask(x, 0.5, seed=9).float().mean(dim=1)  # no structure along the last dimension or across rows
    assert float(rows.std()) < 0.03
