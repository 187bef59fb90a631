"""Every key of an accelerate config is honoured or refused with its reason (finetune/parallel/accelerate_keys.py).

The environment a worker sees is made by accelerate's own launch code, in this process (its argument parser, its
config-file merge and `prepare_multi_gpu_env`), from a shipped file with one key changed: the keys accelerate writes
whatever the file says, with its defaults, are part of what is judged. One real launch shows the FSDP1 prefetch
keys reach a training run.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import accelerate_launch, addition_rows, recipe_dict, write_jsonl, write_recipe
from shipped import CONFIG_DIR

from finetune import parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.recipe import validate_recipe


def accelerate_env(tmp_path, config: str, fsdp: dict | None = None, **top) -> dict[str, str]:
    """What `accelerate launch --config_file <shipped config with these keys>` gives its workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    values = yaml.safe_load((CONFIG_DIR / f"{config}.yaml").read_text())
    values.update(top)
    if fsdp:
        values["fsdp_config"] = {**values.get("fsdp_config", {}), **fsdp}
    path = tmp_path / f"{config}-changed.yaml"
    path.write_text(yaml.safe_dump(values))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args = _validate_launch_command(args)[0]
    return prepare_multi_gpu_env(args)


def resolve(model_dir, env: dict[str, str]):
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    dist = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend=None)
    return parallel.resolve_plan(recipe, dist, load_config(recipe), launcher=parallel.launcher_settings(env))


@pytest.mark.parametrize("config", ["fsdp1", "fsdp2", "multi_node"])
def test_the_shipped_fsdp_configs_resolve_as_they_say(config, tiny_llama, tmp_path):
    plan = resolve(tiny_llama, accelerate_env(tmp_path, config))
    assert plan.strategy == "fsdp" and plan.reshard_after_forward and plan.backward_prefetch is None
    assert not plan.forward_prefetch and not plan.notes


@pytest.mark.parametrize("fsdp,expected", [
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, False),  # was read as full shard: the reshard key's default won
    ({"fsdp_sharding_strategy": 2}, False),
    ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, False),
    ({"fsdp_reshard_after_forward": False}, False),
    ({"fsdp_sharding_strategy": "FULL_SHARD"}, True),
])
def test_fsdp1s_sharding_strategy_key_is_read(fsdp, expected, tiny_llama, tmp_path):
    plan = resolve(tiny_llama, accelerate_env(tmp_path, "fsdp1", fsdp))
    assert plan.reshard_after_forward is expected
    assert ("shard-grad-op" in plan.describe()) is not expected


@pytest.mark.parametrize("config,fsdp,top,needle", [
    ("fsdp1", {"fsdp_sharding_strategy": "NO_SHARD"}, {}, "NO_SHARD replicates the whole model on every rank: that is DDP"),
    ("fsdp1", {"fsdp_sharding_strategy": "HYBRID_SHARD"}, {}, "implemented for FSDP2 only"),  # was full shard
    ("fsdp2", {"fsdp_backward_prefetch": "NO_PREFETCH"}, {}, "fsdp_backward_prefetch: NO_PREFETCH, which FSDP2 does not have"),
    ("fsdp2", {"fsdp_backward_prefetch": "BACKWARD_POST"}, {}, "BACKWARD_POST, which FSDP2 does not have"),
    ("fsdp2", {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, {}, "LOCAL_STATE_DICT: a rank's flat shard"),
    ("fsdp2", {"fsdp_activation_checkpointing_offload": True}, {}, "fsdp_activation_checkpointing_offload: true"),
    ("fsdp2", {}, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_backend: INDUCTOR"),
])
def test_keys_that_cannot_be_honoured_are_refused_with_the_fix(config, fsdp, top, needle, tiny_llama, tmp_path):
    with pytest.raises(LaunchError, match=needle) as caught:
        resolve(tiny_llama, accelerate_env(tmp_path, config, fsdp, **top))
    assert "Fix:" in str(caught.value)


def test_keys_that_are_honoured_reach_the_plan(tiny_llama, tmp_path):
    fsdp1 = resolve(tiny_llama, accelerate_env(tmp_path, "fsdp1", {"fsdp_backward_prefetch": "NO_PREFETCH",
                                                                   "fsdp_forward_prefetch": True}))
    assert (fsdp1.backward_prefetch, fsdp1.forward_prefetch) == ("NO_PREFETCH", True)
    assert "backward prefetch NO_PREFETCH, forward prefetch" in fsdp1.describe()
    fsdp2 = resolve(tiny_llama, accelerate_env(tmp_path, "fsdp2", {"fsdp_backward_prefetch": "BACKWARD_PRE",
                                                                   "fsdp_forward_prefetch": True}))
    assert (fsdp2.backward_prefetch, fsdp2.forward_prefetch) == ("BACKWARD_PRE", True)
    full = resolve(tiny_llama, accelerate_env(tmp_path, "fsdp2", {"fsdp_state_dict_type": "FULL_STATE_DICT"}))
    assert any("FULL_STATE_DICT: the adapter is written whole" in note for note in full.notes)
    # accelerate's defaults for keys that change nothing here: no word, no refusal
    quiet = resolve(tiny_llama, accelerate_env(tmp_path, "fsdp1", {"fsdp_sync_module_states": False,
                                                                  "fsdp_use_orig_params": False}))
    assert not quiet.notes and quiet.backward_prefetch is None


def test_parallelism_config_beyond_data_parallel_is_refused(tiny_llama):
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
           "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1"}
    with pytest.raises(LaunchError, match="tp_size: 2: tensor, context and sequence parallelism"):
        resolve(tiny_llama, env)


def test_fsdp1_takes_the_prefetch_names():
    from torch.distributed.fsdp import BackwardPrefetch

    from finetune.parallel.wrapping import _fsdp1_backward_prefetch

    assert _fsdp1_backward_prefetch(None) is BackwardPrefetch.BACKWARD_PRE
    assert _fsdp1_backward_prefetch("BACKWARD_POST") is BackwardPrefetch.BACKWARD_POST
    assert _fsdp1_backward_prefetch("NO_PREFETCH") is None


@pytest.mark.slow
def test_a_run_trains_with_the_prefetch_keys_and_sharding_strategy_of_fsdp1(tiny_llama, tmp_path):
    """`accelerate launch` with FSDP1's older keys: shard-grad-op by fsdp_sharding_strategy, no backward prefetch,
    forward prefetch; the run says so and trains."""
    values = recipe_dict(tiny_llama, write_jsonl(tmp_path / "train.jsonl", addition_rows(16)), tmp_path / "run",
                         train={"max_steps": 2, "micro_batch_size": 2})
    flags = ("--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_backward_prefetch", "NO_PREFETCH",
             "--fsdp_forward_prefetch", "true")
    result = accelerate_launch("fsdp1", write_recipe(tmp_path / "recipe.yaml", values), flags=flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "FSDP1 over 2 processes (shard-grad-op, backward prefetch NO_PREFETCH, forward prefetch)" in result.stdout
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
