"""Mutation testing round 6 (bb72): gaps in finetune/parallel/accelerate_keys.py. The oracle is accelerate's own launch
code: the environment `accelerate launch --config_file X` gives its workers for a config with the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from finetune import parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.recipe import validate_recipe

CONFIG_DIR = Path(__file__).resolve().parents[2] / "accelerate_configs"


def accelerate_env(tmp_path, config: str, fsdp: dict) -> dict[str, str]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    values = yaml.safe_load((CONFIG_DIR / f"{config}.yaml").read_text())
    values["fsdp_config"] = {**values.get("fsdp_config", {}), **fsdp}
    path = tmp_path / f"{config}-changed.yaml"
    path.write_text(yaml.safe_dump(values))
    args = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))[0]
    return prepare_multi_gpu_env(args)


def resolve(model_dir, env: dict[str, str]):
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    dist = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend=None)
    return parallel.resolve_plan(recipe, dist, load_config(recipe), launcher=parallel.launcher_settings(env))


@pytest.mark.parametrize("config", ["fsdp1", "fsdp2"])
def test_fsdp_ignored_modules_is_refused_with_the_fix(config, tiny_llama, tmp_path):
    """accelerate hands `fsdp_ignored_modules` to the workers (FSDP_IGNORED_MODULES); a module left out of FSDP would
    train without its gradients reduced, so the launch is refused (docs/distributed.md, "Every accelerate key"),
    never run with the key dropped."""
    env = accelerate_env(tmp_path, config, {"fsdp_ignored_modules": "lm_head"})
    assert env.get("FSDP_IGNORED_MODULES") == "lm_head"  # the oracle: what accelerate gives the workers
    with pytest.raises(LaunchError, match="fsdp_ignored_modules: lm_head") as caught:
        resolve(tiny_llama, env)
    assert "Fix: remove the key" in str(caught.value)
