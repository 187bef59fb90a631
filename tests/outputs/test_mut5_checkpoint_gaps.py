"""Checkpoint gap found by mutation testing round 5 (bb61): a resume restores the random generators the checkpoint
saved, so that what the run draws after it (LoRA dropout masks, data order) is what the uninterrupted run drew.

The bitwise kill-and-resume test (tests/outputs/test_checkpoint.py) trains with lora.dropout 0, where nothing random
runs after the resume. Here the oracle is the uninterrupted run in miniature: the draws that follow the save in this
process, against the draws that follow the load after the generators were moved on (as a new process's are)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import recipe_dict, write_recipe
from test_checkpoint_template import lora_layout

from finetune.outputs import checkpoint
from finetune.outputs.checkpoint_load import load_checkpoint
from finetune.recipe import load_recipe, recipe_to_yaml


@pytest.fixture
def own_generators():
    """The session's generators put back after the test, which moves them."""
    saved = checkpoint.rng_state()
    yield
    checkpoint.set_rng_state(saved)


def _draws(model: torch.nn.Module) -> tuple:
    """What a training step draws next: a LoRA dropout mask (the model's own dropout module), torch, python, numpy."""
    dropout = next(m for name, m in model.named_modules() if name.endswith("lora_dropout.default"))
    dropout.train()
    mask = dropout(torch.ones(4, 64))
    return mask.tolist(), torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_a_resume_draws_what_the_uninterrupted_run_draws_after_the_checkpoint(tmp_path, tiny_llama, own_generators):
    """Found by mutation testing (bb61 cl1): load_checkpoint without `_load_rng` survived the kill-and-resume tests
    (lora.dropout 0): a resumed run kept its fresh seed's generators, so its dropout masks (and anything else drawn
    after the resume) were not the uninterrupted run's. Now the next dropout mask and torch / python / numpy draws
    after the load are those that followed the save."""
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", recipe_dict(
        tiny_llama, tmp_path / "rows.jsonl", tmp_path / "run", lora={"dropout": 0.5})))
    model, trainable = lora_layout(recipe)
    optimizer = torch.optim.AdamW(list(trainable.values()))
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    state = {"step": 2, "world_size": 1, "strategy": "single process", "losses": [], "eval_losses": []}
    saved = checkpoint.save_checkpoint(tmp_path / "run", 2, model, optimizer, set(trainable), state,
                                       recipe_to_yaml(recipe), keep_last=2)
    uninterrupted = _draws(model)

    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # the resumed process: the recipe's seed, not the run's
    assert _draws(model) != uninterrupted
    assert load_checkpoint(saved, model, optimizer, set(trainable))["step"] == 2
    assert _draws(model) == uninterrupted
