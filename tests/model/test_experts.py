"""Mixture-of-experts models as real QLoRA (finetune/model/experts/, checkpoints/conversions.py): on a tiny Mixtral and a tiny
Qwen3-MoE saved by transformers 5's own `save_pretrained` (per-expert tensors, as hub checkpoints ship them), every
expert weight is 4-bit, LoRA with dropout sits on every expert projection, the router stays unquantized and frozen,
and the per-tensor loader reads the checkpoint through transformers' key conversions with from_pretrained's bytes.

Before: experts stayed bf16 (bitsandbytes quantizes nn.Linear only), PEFT refused dropout on them (ParamWrapper), and
the per-tensor and sharded loaders refused the checkpoint (per-expert names, `block_sparse_moe.`)."""

from __future__ import annotations

import pytest
import torch
from conftest import recipe_dict
from host_syncs import HostSyncs
from loading_check import held_tensors
from safetensors.torch import save_file

MOE_FAMILIES = ("mixtral", "qwen3_moe", "llama4")
# Per family: the config's expert count and expert width fields, and where the router sits.
EXPERT_FIELDS = {"mixtral": ("num_local_experts", "intermediate_size", ".mlp.gate."),
                 "qwen3_moe": ("num_experts", "moe_intermediate_size", ".mlp.gate."),
                 "llama4": ("num_local_experts", "intermediate_size", ".feed_forward.router.")}


@pytest.fixture(scope="module")
def moe_models(tiny_mixtral, tiny_qwen3_moe, tiny_llama4):
    """The session's tiny MoE models (shared with the shipped-config runs and the export test)."""
    return {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe, "llama4": tiny_llama4}


def _recipe(model_dir, **lora):
    from finetune.recipe import Recipe

    recipe = recipe_dict(model_dir, model_dir / "unused.jsonl", model_dir / "unused-run", model={"dtype": "bfloat16"},
                         lora={"r": 2, "alpha": 4, "dropout": 0.05, "target_modules": "all-linear", **lora})
    return Recipe.model_validate(recipe)


def _fused_checkpoint(model_dir, target):
    """The same weights saved with transformers 5's fused 3-D expert tensors (as some newer uploads store them)."""
    from transformers import AutoModelForCausalLM

    target.mkdir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(target)
    return target


@pytest.mark.parametrize("family,train_router", [("mixtral", False), ("qwen3_moe", True), ("llama4", False),
                                                 ("llama4", True)])
def test_experts_are_4bit_with_lora_and_both_loaders_hold_the_same_bytes(moe_models, family, train_router, tmp_path):
    """Routers frozen by default (Mixtral); with lora.train_router (Qwen3-MoE) each is PEFT's modules_to_save: a
    trainable fp32 copy that both loaders build with the same bytes, the original frozen in model.dtype."""
    from finetune.model import base, loading
    from finetune.model.experts import RoutedExperts

    model_dir, cpu = moe_models[family], torch.device("cpu")
    recipe = _recipe(model_dir, train_router=train_router)
    reference = base.build_model(recipe, device=cpu, gradient_checkpointing=False)  # from_pretrained, then split
    loaded = loading.load_model(recipe, sharded=False, device=cpu, device_map=None, gradient_checkpointing=False)
    model, config = loaded.model, reference.config
    assert loaded.builder is not None  # read tensor by tensor through the key conversions, not refused
    expected = held_tensors(reference)
    held = held_tensors(model)
    assert sorted(held) == sorted(expected)
    assert [k for k in held if not torch.equal(held[k], expected[k])] == []

    # Every expert weight is stored 4-bit: packed bytes = half the expert elements, no 3-D expert tensor left.
    experts_field, inter_field, router = EXPERT_FIELDS[family]
    experts, inter = getattr(config, experts_field), getattr(config, inter_field)
    expert_elements = config.num_hidden_layers * experts * 3 * config.hidden_size * inter
    expert_weights = {n: p for n, p in model.named_parameters() if ".experts." in n and ".lora_" not in n}
    assert len(expert_weights) == config.num_hidden_layers * experts * 3
    assert all(type(p).__name__ == "Params4bit" and p.quant_state.nested for p in expert_weights.values())
    assert sum(p.numel() * p.element_size() for p in expert_weights.values()) == expert_elements // 2
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    assert sum(isinstance(m, RoutedExperts) for m in model.modules()) == config.num_hidden_layers
    # The router: model.dtype, unquantized, frozen.
    routers = {n: p for n, p in model.named_parameters() if router in n}
    frozen = {n: p for n, p in routers.items() if ".modules_to_save." not in n}
    trained = {n: p for n, p in routers.items() if ".modules_to_save." in n}
    assert len(frozen) == config.num_hidden_layers and len(trained) == (config.num_hidden_layers if train_router else 0)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in frozen.values())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in trained.values())
    # LoRA with the library's dropout on every expert projection.
    expert_lora = [m for n, m in model.named_modules() if ".experts." in n and hasattr(m, "lora_dropout")
                   and "default" in m.lora_dropout]
    assert len(expert_lora) == len(expert_weights)
    assert {m.lora_dropout["default"].p for m in expert_lora} == {0.05}

    # The forward: the same as transformers' own fused experts (quantization off, fp32), and it trains.
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".experts." in n and "lora_A" in n]
    assert grads and all(g is not None for g in grads)  # every expert's LoRA is in the graph, routed to or not
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())

    # A checkpoint storing the fused 3-D tensors reads as the same bytes (each expert sliced from them). Mixtral's,
    # renamed and fused, is read sharded under FSDP1 in tests/model/test_loading.py; Llama 4's checkpoint is fused.
    if family != "qwen3_moe":
        return
    fused_recipe = _recipe(_fused_checkpoint(model_dir, tmp_path / "fused"), train_router=train_router)
    fused = loading.load_model(fused_recipe, sharded=False, device=cpu, device_map=None, gradient_checkpointing=False).model
    fused_held = held_tensors(fused)
    assert [k for k in held if not torch.equal(fused_held[k], held[k])] == []


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_split_experts_compute_what_transformers_fused_experts_compute(moe_models, family):
    from transformers import AutoModelForCausalLM

    from finetune.model.experts import split_experts

    model = AutoModelForCausalLM.from_pretrained(moe_models[family], dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        fused = model(input_ids=ids).logits
        assert split_experts(model, dtype=torch.float32) == model.config.num_hidden_layers
        split = model(input_ids=ids).logits
    torch.testing.assert_close(split, fused, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_wait_for_the_device_once_per_layer_not_once_per_expert(moe_models, family):
    """A training forward and backward of the split experts makes one host sync per MoE layer, whatever the number of
    experts: one sort and one read of the group bounds (`expert_groups`), not a `torch.where(top_k_index == e)` per
    expert (128 experts x 48 layers = 6k syncs per forward on Qwen3-30B-A3B before).

    This machine has no CUDA, so the sync is simulated: the test counts the host-transfer ops (`.item()`, `int()`,
    `bool()`, `.tolist()`, nonzero / one-argument torch.where, boolean-mask indexing, bincount: HostSyncs,
    tests/training/host_syncs.py) that the model makes. The model's experts get a 16-way router so that one sync
    per expert (32 in this forward) and one per layer (2) cannot be confused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.experts import RoutedExperts, split_experts

    config = AutoConfig.from_pretrained(moe_models[family])
    setattr(config, EXPERT_FIELDS[family][0], 16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert split_experts(model, dtype=torch.float32) == config.num_hidden_layers
    assert {len(m) for m in model.modules() if isinstance(m, RoutedExperts)} == {16}
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with HostSyncs() as syncs:
        model(input_ids=ids).logits.square().mean().backward()
    assert len(syncs.ours()) <= config.num_hidden_layers, syncs.ours()
    assert all("finetune/model/experts/" in where for where in syncs.ours()), syncs.ours()


@pytest.mark.parametrize("targets,says", [
    (["q_proj", "gate"], "set lora.train_router: true"),  # the router: trained in full, if at all
    (["gate_up_proj"], "`gate_up_proj` is transformers 5's fused expert tensor"),
])
def test_lora_targets_that_cannot_work_are_refused_before_any_weight_loads(moe_models, monkeypatch, targets, says):
    from finetune.errors import ModelLoadError, RecipeError
    from finetune.model import loading
    from finetune.model.sources import files as checkpoint_files

    def no_reads(self, name):
        raise AssertionError(f"read {name} before refusing")

    monkeypatch.setattr(checkpoint_files.TensorReader, "get", no_reads)
    with pytest.raises((ModelLoadError, RecipeError)) as error:  # (loading.check_lora_targets: validate's RecipeError)
        loading.load_model(_recipe(moe_models["mixtral"], target_modules=targets), sharded=True,
                           device=torch.device("cpu"), device_map=None, gradient_checkpointing=False)
    assert says in str(error.value) and "Fix:" in str(error.value)
    assert "w1/w3/w2" in str(error.value) or "`gate` is the experts' router" in str(error.value)


def test_expert_layouts_it_cannot_split_are_refused_when_quantizing(moe_models):
    """A fused layout no family takes (here Mixtral's experts given biases, which only gpt-oss's family reads, and
    gpt-oss's is another class): refused with every family's reason and the fix under 4-bit, left fused without it.
    (gpt-oss itself is split: tests/model/test_experts_gpt_oss.py.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.errors import ModelLoadError
    from finetune.model.experts import fused_expert_modules, split_experts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_models["mixtral"]))
    for _, module in fused_expert_modules(model):
        module.has_bias = True
    with pytest.raises(ModelLoadError, match=r"have biases; it is not gpt-oss's.*Fix: set quantization.method: none"):
        split_experts(model, dtype=torch.bfloat16, quantized=True)
    assert split_experts(model, dtype=torch.bfloat16, quantized=False) == 0


def test_llama4_text_model_trains_from_its_multimodal_checkpoint(tmp_path):
    """Llama 4 Scout's hub checkpoint is multimodal (Llama4ForConditionalGeneration: `language_model.model.*`, a
    vision tower and projector beside it), and transformers' causal LM for its config is the text model
    (Llama4ForCausalLM, base_model_prefix `language_model`). The per-tensor loader strips that prefix as
    from_pretrained does (checkpoints/conversions.py) and never reads the vision tower: the same bytes as
    from_pretrained + split, every expert 4-bit with a LoRA, and it trains. Before, the pre-flight check built the text
    class from the multimodal config (AttributeError: no vocab_size) and the loader found no text weight."""
    from safetensors import safe_open

    from finetune.cli.tiny import build_tiny_model_like
    from finetune.model import base, loading

    model_dir = build_tiny_model_like("meta-llama/Llama-4-Scout-17B-16E-Instruct", tmp_path / "scout")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as stored:  # the hub's layout, as transformers saves it
        keys = list(stored.keys())
    assert any(k.startswith("vision_model.") for k in keys) and any(k.startswith("multi_modal_projector.") for k in keys)
    assert all(k.startswith(("language_model.model.", "language_model.lm_head.", "vision_model.",
                             "multi_modal_projector.")) for k in keys)
    recipe, cpu = _recipe(model_dir), torch.device("cpu")
    reference = base.build_model(recipe, device=cpu, gradient_checkpointing=False)  # from_pretrained, then split
    loaded = loading.load_model(recipe, sharded=False, device=cpu, device_map=None, gradient_checkpointing=False)
    model = loaded.model
    assert loaded.builder is not None and type(model.get_base_model()).__name__ == "Llama4ForCausalLM"
    assert not [name for name, _ in model.named_modules() if "vision" in name or "projector" in name]
    expected, held = held_tensors(reference), held_tensors(model)
    assert sorted(held) == sorted(expected) and len(held) > 50
    assert [k for k in held if not torch.equal(held[k], expected[k])] == []
    config = model.config
    experts = [p for n, p in model.named_parameters() if ".experts." in n and ".lora_" not in n]
    assert len(experts) == config.num_hidden_layers * config.num_local_experts * 3
    assert all(type(p).__name__ == "Params4bit" for p in experts)
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." in n and "lora_A" in n)
