"""The planner on every architecture `finetune models` lists as trained, from the config alone; and its use inside a run
(parallel.resolve_plan on a CUDA machine), which must never end a run with a traceback."""

from __future__ import annotations

import pytest
import torch

from finetune import parallel, planner
from finetune.distributed import DistInfo
from finetune.planner import GB
from finetune.recipe import validate_recipe

# The architectures the planner crashed on (a bug bash): Gemma 4's per-layer head_dim, GPT-Neo's intermediate_size None.
CRASHED = ["gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gpt_neo"]


def _recipe():
    return validate_recipe({"model": {"name_or_path": "x", "dtype": "bfloat16"},
                            "lora": {"r": 16, "target_modules": "all-linear"},
                            "data": {"datasets": [{"path": "x.jsonl"}], "max_length": 1024},
                            "train": {"micro_batch_size": 1, "gradient_checkpointing": True}}, dtype_device="gpu")


def _trained_types() -> list[str]:
    from finetune.model.support import support_rows

    return [model_type for model_type, _, status in support_rows() if status.startswith("trained")]


def _tiny(model_type: str):
    from finetune.cli.tiny_arch import tiny_config

    return tiny_config(model_type, vocab_size=512, eos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize("model_type", [*CRASHED, "llama", "qwen3_moe", "gemma3_text"])
def test_the_planner_reads_these_architectures_from_the_config(model_type):
    """Found by a bug bash: `finetune plan` (and every GPU run, which plans) crashed with a traceback on Gemma 4 (the
    global head_dim read from a config whose head_dim is per layer: AmbiguousGlobalPerLayerAttributeError) and on
    GPT-Neo (`intermediate_size: None` taken as the size: TypeError). Now their own facts, not a generic estimate."""
    decision = planner.decide(_recipe(), _tiny(model_type), gpus_per_node=2, gpu_memory_bytes=80 * GB)
    assert decision.fits and not decision.generic, decision.summary


def test_per_layer_head_dims_and_a_none_intermediate_size_read_as_the_model_builds_them():
    """Found by a bug bash: Gemma 4's full-attention layers have head_dim 512 (global_head_dim), its sliding ones 256;
    GPT-Neo builds its MLP 4 x hidden wide when intermediate_size is None (GPTNeoBlock). The key/value width is the
    widest layer's (an upper bound for each layer)."""
    from transformers import CONFIG_MAPPING

    recipe = _recipe()
    gemma4 = planner.facts_from_config(CONFIG_MAPPING["gemma4_text"](), recipe)
    assert not gemma4.generic and gemma4.kv_dim == 4 * 512 and gemma4.heads == 8
    neo = planner.facts_from_config(CONFIG_MAPPING["gpt_neo"](), recipe)
    assert not neo.generic and neo.intermediate == 4 * neo.hidden == 8192
    moe = planner.facts_from_config(CONFIG_MAPPING["gemma4_text"](  # Gemma 4's MoE says top_k_experts
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, hidden_size=64,
        num_hidden_layers=2, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=512), recipe)
    assert moe.experts == 4 and moe.experts_per_token == 2, (moe.experts, moe.experts_per_token)


@pytest.mark.slow
def test_every_trained_architecture_plans_from_its_config_alone():
    """Found by a bug bash: of the 158 model types `finetune models` lists as trained, 152 planned from transformers'
    default config; gemma4, gemma4_text, gemma4_unified, gemma4_unified_text and gpt_neo crashed. Every one plans
    now, from its own facts (the tiny config of the architecture matrix: transformers' defaults, shrunk)."""
    types = _trained_types()
    assert len(types) > 100 and set(CRASHED) <= set(types)
    failed, generic = {}, []
    for model_type in types:
        try:
            decision = planner.decide(_recipe(), _tiny(model_type), gpus_per_node=2, gpu_memory_bytes=80 * GB)
        except Exception as exc:  # noqa: BLE001  (the list says which)
            failed[model_type] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if decision.generic:
            generic.append(model_type)
    assert not failed, failed
    assert not generic, generic


def _one_gpu_run(monkeypatch, config):
    """parallel.resolve_plan as a one-process run on a CUDA machine calls it: no `gpus` given, so it asks
    detect_gpus, the one function that reports the device, patched here to say one 80 GB GPU (no CUDA in the suite)."""
    monkeypatch.setattr("finetune.parallel.plan.detect_gpus", lambda dist: (1, 80 * GB))
    dist = DistInfo(0, 1, 0, 1, torch.device("cpu"), None)
    return parallel.resolve_plan(_recipe(), dist, config, launcher={})


def test_a_run_on_a_gpu_plans_gemma4_without_a_traceback(monkeypatch, capsys):
    """Found by a bug bash: on CUDA resolve_plan calls the planner for every run, and Gemma 4's config crashed it, so
    every GPU run of the model died before loading (CPU runs never plan, so the suite passed)."""
    plan = _one_gpu_run(monkeypatch, _tiny("gemma4_text"))
    assert plan.strategy == "single"
    assert "planner: " in capsys.readouterr().out  # the planner ran (detect_gpus was asked)


def test_a_run_goes_on_with_a_note_when_the_planner_cannot_estimate(monkeypatch, capsys):
    """Found by a bug bash: nothing caught a planner failure inside resolve_plan, so any model it could not read ended
    the run with a traceback. The estimate is advice: now a one-line note, and the run goes on."""
    def cannot(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for *: 'int' and 'NoneType'\nsecond line")

    monkeypatch.setattr(planner, "decide", cannot)
    plan = _one_gpu_run(monkeypatch, _tiny("llama"))
    assert plan.strategy == "single"
    notes = [n for n in plan.notes if n.startswith("no memory plan")]
    assert len(notes) == 1 and "TypeError: unsupported operand" in notes[0] and "\n" not in notes[0], plan.notes
