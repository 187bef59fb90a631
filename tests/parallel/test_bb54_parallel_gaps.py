"""Parallel plan settings that mutation testing (bug bash bb54) found no test read back: each test fails when its code
is weakened (FSDP's reshard default, CPU offload under a planned layer split, a wrap policy other than the
transformer's, DeepSpeed's global batch and clipping). No processes: the plans are resolved in this process, as
test_parallel.py does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from finetune import parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.parallel import zero
from finetune.recipe import validate_recipe

GiB = 2**30
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"}


def dist(world: int) -> DistInfo:
    return DistInfo(rank=0, world_size=world, local_rank=0, local_world_size=world, device=torch.device("cpu"), backend=None)


def recipe(model_dir, train: dict | None = None, **parallel_keys):
    return validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                            "data": {"datasets": [{"path": "x.jsonl"}]}, "train": train or {},
                            "parallel": parallel_keys})


def plan(model_dir, world=2, launcher=None, **kwargs):
    r = recipe(model_dir, **kwargs)
    return parallel.resolve_plan(r, dist(world), load_config(r), launcher=launcher or {})


def test_fsdp_without_a_reshard_key_reshards_after_forward(tiny_llama):
    """Found by a bug bash (bb54 PL01): a launcher without the reshard key defaulting to False (SHARD_GRAD_OP: more
    memory than planned) passed every test: the tests' configs all set the key."""
    env = {key: value for key, value in FSDP2_ENV.items() if key != "FSDP_RESHARD_AFTER_FORWARD"}
    launcher = parallel.launcher_settings(env)
    assert "reshard_after_forward" not in launcher  # the premise: the key is absent, not false
    assert plan(tiny_llama, launcher=launcher).reshard_after_forward is True
    assert plan(tiny_llama, strategy="fsdp").reshard_after_forward is True  # torchrun: no accelerate config at all


def test_cpu_offload_under_a_layer_split_the_planner_chose_is_refused(tiny_llama, monkeypatch):
    """Found by a bug bash (bb54 PC01): `strategy: auto` + parallel.cpu_offload, which the planner turns into a layer
    split on one process over several GPUs (simulated here: the planner's decision says layer_split), must refuse the
    offload a layer split does not have; dropping the `or plan.strategy == "layer_split"` term passed every test."""
    from finetune.parallel import plan as plan_module

    real = plan_module._planner_decision

    def layer_split(recipe, dist, model_config, gpus):
        decision, notes = real(recipe, dist, model_config, gpus)
        return dataclasses.replace(decision, strategy="layer_split", chosen="layer_split"), notes

    monkeypatch.setattr(plan_module, "_planner_decision", layer_split)
    r = recipe(tiny_llama, cpu_offload=True)
    with pytest.raises(LaunchError, match="parallel.cpu_offload is true but the strategy is layer_split, which has no "
                                          "offload"):
        parallel.resolve_plan(r, dist(1), load_config(r), launcher={}, gpus=(2, 24 * GiB))


@pytest.mark.parametrize("policy", ["NO_WRAP", "SIZE_BASED_WRAP"])
def test_every_wrap_policy_but_the_transformers_is_refused(tiny_llama, policy):
    """Found by a bug bash (bb54 PC04): only SIZE_BASED_WRAP was tested; `policy == "SIZE_BASED_WRAP"` passed and
    NO_WRAP (one unit: the LoRA leaves not apart) went through."""
    launcher = parallel.launcher_settings({**FSDP2_ENV, "FSDP_AUTO_WRAP_POLICY": policy})
    with pytest.raises(LaunchError, match=f"fsdp_auto_wrap_policy: {policy}.*TRANSFORMER_BASED_WRAP"):
        plan(tiny_llama, launcher=launcher)


def test_deepspeeds_global_batch_counts_every_rank_and_no_max_grad_norm_clips_nothing():
    """Found by a bug bash (bb54 ZE02, ZE03): no test read engine_config's values. `mb * ga` for the global batch (one
    rank's, which DeepSpeed refuses or misreads with 2 ranks) and `or 1.0` for an unset max_grad_norm (clipping at 1
    a run that asked for none) both passed."""
    r = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "x.jsonl"}]},
                         "train": {"micro_batch_size": 3, "grad_accum": 5, "max_grad_norm": None}})
    config = zero.engine_config(r, zero.ZeroSettings(stage=2), world_size=2)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 5)
    assert config["train_batch_size"] == 3 * 5 * 2
    assert config["gradient_clipping"] == 0.0
    clipped = validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "x.jsonl"}]},
                               "train": {"max_grad_norm": 0.5}})
    assert zero.engine_config(clipped, zero.ZeroSettings(stage=3), world_size=4)["gradient_clipping"] == 0.5
