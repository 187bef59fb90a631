"""The LoRA start of every layer kind follows PEFT's own init for that kind (finetune/model/lora/init.py), through every
loader. The oracle is plain PEFT: `get_peft_model` on the same base with the same LoRA settings. finetune draws from a
generator seeded by (train.seed, tensor name), not PEFT's global one, so the tensors are compared by PEFT's rule (which
side is zero; the spread of the random side), not value by value."""

from __future__ import annotations

import pytest
import torch

from finetune.model import base as model_stage
from finetune.model import loading
from finetune.recipe import validate_recipe

CPU = torch.device("cpu")
TARGETS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]


def _finetune_start(model_dir, route: str) -> dict[str, torch.Tensor]:
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                              "quantization": {"method": "none"},
                              "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": TARGETS},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    model_stage.load_config(recipe)
    if route == "from_pretrained":  # transformers' load, then attach_lora
        model = model_stage.build_model(recipe, device=CPU, gradient_checkpointing=False)
    else:  # the per-tensor reader (single process, DDP) or the FSDP skeleton built unit by unit
        loaded = loading.load_model(recipe, sharded=route == "sharded", device=CPU, device_map=None,
                                    gradient_checkpointing=False)
        if loaded.materialize is not None:
            loading._whole_model(loaded.model, loaded.builder)
        model = loaded.model
    return {name: param.detach().clone() for name, param in model.named_parameters() if ".lora_" in name}


def _peft_start(model_dir) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    return {name: param.detach().clone() for name, param in model.named_parameters() if ".lora_" in name}


@pytest.mark.parametrize("route", ["per_tensor", "sharded", "from_pretrained"])
def test_every_lora_layer_kind_starts_as_peft_starts_it(tiny_llama, route):
    """Found by a bug bash of vocabulary and embeddings: LoRA on `embed_tokens` started as a Linear layer's (A
    kaiming-uniform, B zeros) while PEFT starts embeddings the other way round (A zeros, B normal(0, 1)). The embedding
    update was then sqrt(vocab) times smaller than PEFT's (22x at vocab 454, 66x at 32k: it barely trained) and every
    step moved the rows of tokens absent from the data. Now each tensor's zero side and the spread of its random side
    are PEFT's, Linear (q_proj, v_proj, lm_head) and Embedding alike."""
    ours, peft = _finetune_start(tiny_llama, route), _peft_start(tiny_llama)
    assert ours.keys() == peft.keys()
    assert any(".lora_embedding_B." in name for name in ours) and any(".lora_A." in name for name in ours)
    for name, theirs in peft.items():
        mine = ours[name]
        assert mine.shape == theirs.shape, name
        if not theirs.any():
            assert not mine.any(), f"{name}: PEFT starts it at zero"
            continue
        assert mine.any(), f"{name}: PEFT draws it, finetune left it zero"
        # the same distribution: kaiming-uniform's bound (1/sqrt(fan_in)) for A, normal(0, 1) for an embedding's B
        assert mine.abs().max() <= theirs.abs().max() * 1.1 + 1e-6, name
        assert 0.8 < float(mine.std() / theirs.std()) < 1.25, (name, float(mine.std()), float(theirs.std()))
        if ".lora_embedding_B." in name:
            assert abs(float(mine.std()) - 1.0) < 0.15 and abs(float(mine.mean())) < 0.15, name


def test_embedding_lora_moves_only_the_rows_of_tokens_it_sees(tiny_llama):
    """Found by a bug bash of vocabulary and embeddings: with an embedding's LoRA A drawn dense (the Linear rule), one
    optimizer step on a batch changed the embedding of every token, the ones absent from the batch more than the ones
    in it. From PEFT's start (A zeros), a step moves the rows of the batch's tokens only."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.model.lora.init import init_lora_weights

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["embed_tokens"]))
    init_lora_weights(model, 42)
    layer = model.base_model.model.model.embed_tokens

    def delta() -> torch.Tensor:
        with torch.no_grad():
            return (layer.lora_embedding_B["default"] @ layer.lora_embedding_A["default"]).T * layer.scaling["default"]

    assert not delta().any()  # the start is the base model
    ids = torch.tensor([[5, 9, 17, 33, 64, 100]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    moved = delta().abs().sum(dim=1)
    seen = torch.zeros(len(moved), dtype=torch.bool)
    seen[ids[0, :-1]] = True  # (the last token predicts nothing that is scored: its row gets no gradient)
    assert moved[seen].min() > 0 and not moved[~seen].any()
