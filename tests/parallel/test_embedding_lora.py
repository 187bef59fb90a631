"""LoRA on embedding layers under the parallel strategies: FSDP1 cannot wrap PEFT's embedding LoRA (its A/B are
ParameterDicts), so the plan refuses it before any weight loads, with the fix; FSDP2 and DDP train it."""

from __future__ import annotations

import pytest
import torch

from finetune import parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.recipe import validate_recipe

FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"}
TWO_RANKS = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend=None)


def _plan(model_dir, fsdp_version: int, **model_keys):
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32", **model_keys},
                              "lora": {"target_modules": ["q_proj", "v_proj", "embed_tokens", "lm_head"]},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    launcher = parallel.launcher_settings({**FSDP_ENV, "FSDP_VERSION": str(fsdp_version)})
    return parallel.resolve_plan(recipe, TWO_RANKS, load_config(recipe), launcher=launcher)


def test_embedding_lora_under_fsdp1_is_refused_before_loading(tiny_llama):
    """Found by a bug bash of vocabulary and embeddings: `embed_tokens` in lora.target_modules under FSDP1 passed
    `finetune validate`, loaded every weight and crashed at the first step ("TypeError: Index given to ParameterDict
    cannot be used as a key"): FSDP1's wrap made PEFT's embedding LoRA ParameterDicts units of their own. Now the plan
    refuses it, naming the layer and the fix; FSDP2 (and lm_head alone under FSDP1) still plan."""
    with pytest.raises(LaunchError, match=r"lora.target_modules puts LoRA on the embedding layer model.embed_tokens "
                                          r"under FSDP1: .* Fix: use FSDP2 .* or DDP, or drop embed_tokens"):
        _plan(tiny_llama, 1)
    assert _plan(tiny_llama, 2).fsdp_version == 2
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
                              "lora": {"target_modules": ["q_proj", "lm_head"]},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    launcher = parallel.launcher_settings({**FSDP_ENV, "FSDP_VERSION": "1"})
    assert parallel.resolve_plan(recipe, TWO_RANKS, load_config(recipe), launcher=launcher).fsdp_version == 1


def test_an_adapter_with_embedding_lora_under_fsdp1_is_refused(tiny_llama, tmp_path):
    """Found by a bug bash of vocabulary and embeddings (as above): with model.adapter the targets are the adapter's
    own (lora.target_modules left at all-linear), so an adapter trained with embedding LoRA is refused under FSDP1
    too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    get_peft_model(base, config).save_pretrained(tmp_path)
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32", "adapter": str(tmp_path)},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    launcher = parallel.launcher_settings({**FSDP_ENV, "FSDP_VERSION": "1"})
    with pytest.raises(LaunchError, match=r"model.adapter's LoRA .* embedding layer model.embed_tokens under FSDP1: "
                                          r".* Fix: use FSDP2 .* or DDP\."):
        parallel.resolve_plan(recipe, TWO_RANKS, load_config(recipe), launcher=launcher)


@pytest.mark.slow  # one 2-rank FSDP1 launch (accelerate_configs/fsdp1.yaml), refused before any weight loads
def test_fsdp1_launch_with_embedding_lora_stops_before_loading(tiny_llama, tmp_path):
    """Found by a bug bash of vocabulary and embeddings: the launched ranks loaded the model and crashed with a
    TypeError traceback at step 1. Now each rank refuses in its pre-flight: the paragraph, no weights, no traceback."""
    from conftest import accelerate_launch, addition_rows, recipe_dict, write_jsonl, write_recipe

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(
        tiny_llama, data, tmp_path / "run", lora={"target_modules": ["q_proj", "embed_tokens"], "dropout": 0.0},
        train={"max_steps": 1, "micro_batch_size": 2}))
    result = accelerate_launch("fsdp1", recipe)
    assert result.returncode != 0
    assert "embedding layer model.embed_tokens under FSDP1" in result.stderr, result.stderr[-3000:]
    assert "ready:" not in result.stdout, result.stdout[-2000:]
    # (accelerate's launcher prints its own report of a failed worker; no frame of finetune's may be in it)
    frames = [line for line in result.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert not any("finetune/" in line for line in frames), result.stderr[-3000:]
