"""Accelerate configs users write themselves (bug bash bb28): what `finetune validate --accelerate-config FILE` checks
is what the launched ranks get, and every key of the file is used, refused or named.

The ranks' side is accelerate's own launch code run in this process (its parser, its config-file merge and the
environment its launchers write), as tests/parallel/test_accelerate_keys.py does; nothing is launched.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe
from shipped import CONFIG_DIR

from finetune import cli, parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.parallel import launcher
from finetune.recipe import validate_recipe

ACCELERATE_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def write_config(tmp_path, base: str | None = "fsdp2", name: str = "changed", fsdp: dict | None = None, **top) -> str:
    """A shipped config (or none: `top` alone) with keys changed, as a user's file; a None value drops the key."""
    values = yaml.safe_load((CONFIG_DIR / f"{base}.yaml").read_text()) if base else {}
    values.update(top)
    if fsdp is not None:
        values["fsdp_config"] = {**(values.get("fsdp_config") or {}), **fsdp}
    values = {key: value for key, value in values.items() if value is not None}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def accelerate_env(path: str, monkeypatch) -> dict[str, str]:
    """The environment `accelerate launch --config_file PATH` gives its workers, by accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    for name in [name for name in os.environ if name.startswith(ACCELERATE_PREFIXES)]:
        monkeypatch.delenv(name)  # (the suite's ACCELERATE_USE_CPU): only what the launch writes
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return prepare_simple_launcher_cmd_env(args)[1]


def resolve(model_dir, launcher_settings: dict, **parallel_keys):
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
                              "lora": {"dora": True}, "parallel": parallel_keys,
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    dist = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    return parallel.resolve_plan(recipe, dist, load_config(recipe), launcher=launcher_settings)


@pytest.fixture
def user_recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, data, tmp_path / "run"))


def validate(recipe, config: str, capsys, *overrides: str) -> tuple[int, str]:
    code = cli.main(["validate", str(recipe), *overrides, "--accelerate-config", config])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ------------------------------------------------------------------------------------- finding 1: fsdp_version
@pytest.mark.parametrize("version", [3, 0, "x"])
def test_bb28_an_fsdp_version_other_than_1_or_2_is_refused_by_validate_and_the_ranks(version, tiny_llama, user_recipe,
                                                                                   tmp_path, capsys, monkeypatch):
    """Found by a bug bash: `fsdp_version: 3` was accepted as "FSDP3", wrapped with FSDP1 but past FSDP1's refusals
    (which ask for version 1), so DoRA in bf16 crashed at step 1; `fsdp_version: x` was a ValueError traceback."""
    config = write_config(tmp_path, fsdp={"fsdp_version": version})
    code, text = validate(user_recipe, config, capsys)
    assert code == 2 and "Traceback" not in text
    assert f"the accelerate config has fsdp_version: {version}: FSDP has two versions" in text and config in text
    ranks = launcher.launcher_settings(accelerate_env(config, monkeypatch))  # what `accelerate launch` hands a rank
    with pytest.raises(LaunchError, match=f"fsdp_version: {version}: FSDP has two versions, 1"):
        resolve(tiny_llama, ranks)


def test_bb28_the_wrap_never_takes_an_unknown_fsdp_version_for_fsdp1():
    """Found by a bug bash: the wrap sent every version but 2 to FSDP1's wrap; the plan's checks refuse it first."""
    plan = parallel.ParallelPlan(strategy="fsdp", world_size=2, fsdp_version=3)
    dist = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="FSDP version 3 is neither 1 nor 2"):
        parallel.wrap(torch.nn.Linear(2, 2), plan, dist)


# ------------------------------------------------------------ finding 3: validate rebuilds the ranks' environment
PARITY = {
    "wrong layer class": ("fsdp2", {"fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"}, {}),
    "layer class list": ("fsdp1", {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaMLP"}, {}),
    "dynamo": ("ddp", None, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}),
    "dynamo, accelerate's short key": ("fsdp2", None, {"dynamo_config": {"backend": "inductor"}}),
    "dynamo, the old top-level key": ("ddp", None, {"dynamo_backend": "INDUCTOR"}),
    "parallelism config": ("fsdp2", None, {"parallelism_config": {"parallelism_config_tp_size": 2}}),
    "parallelism config under DeepSpeed": ("deepspeed_zero3", None, {"parallelism_config": {"parallelism_config_cp_size": 2}}),
    "fsdp keys without their prefix": (None, None, {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
        "version": 1, "sharding_strategy": 2, "backward_prefetch": "NO_PREFETCH", "offload_params": True}}),
    "version as a string": ("fsdp2", {"fsdp_version": "2"}, {}),
    "hybrid shard": ("fsdp2", {"fsdp_sharding_strategy": "HYBRID_SHARD"}, {}),
    "reshard key written by accelerate config": ("fsdp1", {"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, {}),
    **{f"shipped {path.stem}": (path.stem, None, {"main_process_port": 0}) for path in sorted(CONFIG_DIR.glob("*.yaml"))},
}


@pytest.mark.parametrize("name", list(PARITY))
def test_bb28_validate_reads_the_settings_accelerate_launch_gives_the_ranks(name, tmp_path, monkeypatch):
    """Found by a bug bash: validate rebuilt the workers' environment under other names than accelerate launch writes
    (FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP for its FSDP_TRANSFORMER_CLS_TO_WRAP; no ACCELERATE_DYNAMO_BACKEND, no
    PARALLELISM_CONFIG_*), so a wrong layer class, a dynamo backend or a tensor-parallel size passed validate and the
    launched ranks refused them 15 s later. The settings finetune reads are now the same from both."""
    base, fsdp, top = PARITY[name]
    config = write_config(tmp_path, base, fsdp=fsdp, **top)
    ours = launcher.launcher_settings(launcher.accelerate_config_env(config))
    assert ours == launcher.launcher_settings(accelerate_env(config, monkeypatch))


@pytest.mark.parametrize("fsdp,top,needle", [
    ({"fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"}, {},
     "`Qwen2DecoderLayer` is not a module class of this model. Its layer classes: LlamaDecoderLayer"),
    (None, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "the accelerate config has dynamo_backend: INDUCTOR"),
    (None, {"parallelism_config": {"parallelism_config_tp_size": 2}}, "parallelism_config asks for tp_size: 2"),
])
def test_bb28_validate_refuses_what_the_ranks_refuse(fsdp, top, needle, user_recipe, tmp_path, capsys):
    """Found by a bug bash: these three passed `finetune validate` (and `finetune train`'s own check), and only the
    launched ranks refused them."""
    config = write_config(tmp_path, fsdp=fsdp, **top)
    code, text = validate(user_recipe, config, capsys)
    assert code == 2 and needle in text and config in text and "Traceback" not in text


# --------------------------------------------------------------------- finding 4: sections of the wrong shape
@pytest.mark.parametrize("base,top,key", [
    ("fsdp2", {"fsdp_config": "FULL_SHARD"}, "fsdp_config"),
    ("deepspeed_zero3", {"deepspeed_config": [{"zero_stage": 3}]}, "deepspeed_config"),
    ("ddp", {"dynamo_config": "INDUCTOR"}, "dynamo_config"),
    ("fsdp2", {"parallelism_config": 2}, "parallelism_config"),
])
def test_bb28_a_section_that_is_not_a_mapping_is_one_paragraph(base, top, key, tmp_path):
    """Found by a bug bash: `fsdp_config: FULL_SHARD` and a `deepspeed_config` holding a list were AttributeError
    tracebacks ('str' object has no attribute 'get'); accelerate itself would have ignored them."""
    config = write_config(tmp_path, base, **top)
    with pytest.raises(LaunchError) as caught:
        launcher.accelerate_config_env(config)
    message = str(caught.value)
    assert message.startswith(f"accelerate config {config}: {key} must be a mapping of keys") and "Fix:" in message
    assert "\n" not in message


def test_bb28_a_wrong_shape_reaches_the_terminal_as_one_paragraph(user_recipe, tmp_path, capsys):
    """Found by a bug bash: `finetune validate` printed a Python traceback for `fsdp_config: FULL_SHARD`."""
    code, text = validate(user_recipe, write_config(tmp_path, fsdp_config="FULL_SHARD"), capsys)
    assert code == 2 and "fsdp_config must be a mapping of keys" in text and "Traceback" not in text


# -------------------------------------------------------------------------------------- finding 5: unknown keys
@pytest.mark.parametrize("base,fsdp,top,needle", [
    ("fsdp2", {"fsdp_ofload_params": True}, {},
     "fsdp_config.fsdp_ofload_params is not a key accelerate knows (did you mean fsdp_offload_params?)"),
    ("fsdp2", {"offload": True}, {}, "fsdp_config.offload is not a key accelerate knows"),
    ("fsdp2", None, {"num_proceses": 2}, "num_proceses is not a key of an accelerate config (did you mean num_processes?)"),
    ("deepspeed_zero2", None, {"deepspeed_config": {"zero_stag": 2}},
     "deepspeed_config.zero_stag is not a key accelerate knows (did you mean zero_stage?)"),
    ("ddp", None, {"dynamo_config": {"dynamo_backnd": "NO"}}, "did you mean dynamo_backend?"),
])
def test_bb28_a_key_accelerate_does_not_know_is_refused_with_the_closest_one(base, fsdp, top, needle, tmp_path):
    """Found by a bug bash: `fsdp_ofload_params: true` trained without offload and `num_proceses: 2` validated as
    "1 process, as given" (then accelerate launch died with its "unknown keys" traceback): the docs promise that no
    key of an accelerate config is dropped in silence."""
    config = write_config(tmp_path, base, fsdp=fsdp, **top)
    with pytest.raises(LaunchError, match="Fix: correct the key's name, or remove it") as caught:
        launcher.accelerate_config_env(config)
    assert needle in str(caught.value) and config in str(caught.value)


def _written_by_accelerate_config(tmp_path) -> list[str]:
    """Files as `accelerate config` writes them (its ClusterConfig.to_yaml_file), with every key its questions set."""
    from accelerate.commands.config.config_args import ClusterConfig

    common = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": "no", "use_cpu": False, "debug": False,
              "num_processes": 2, "machine_rank": 0, "num_machines": 1, "gpu_ids": "all", "main_process_port": 0,
              "rdzv_backend": "static", "same_network": True, "main_training_function": "main", "tpu_env": [],
              "tpu_use_cluster": False, "tpu_use_sudo": False, "enable_cpu_affinity": False, "downcast_bf16": "no"}
    fsdp = {"fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_cpu_ram_efficient_loading": False, "fsdp_forward_prefetch": False, "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_use_orig_params": True, "fsdp_activation_checkpointing": True, "fsdp_min_num_params": 0}
    deepspeed = {"deepspeed_config_file": "ds.json", "zero_stage": 3, "offload_optimizer_device": "none",
                 "offload_param_device": "none", "offload_optimizer_nvme_path": "none", "offload_param_nvme_path": "none",
                 "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero3_save_16bit_model": False,
                 "zero3_init_flag": False, "deepspeed_moe_layer_cls_names": "", "deepspeed_multinode_launcher": "standard",
                 "deepspeed_hostfile": "hosts", "deepspeed_exclusion_filter": "", "deepspeed_inclusion_filter": ""}
    dynamo = {"dynamo_backend": "NO", "dynamo_mode": "default", "dynamo_use_fullgraph": False,
              "dynamo_use_dynamic": False, "dynamo_use_regional_compilation": False}
    parallelism = {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
                   "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1}
    configs = [ClusterConfig(distributed_type="FSDP", fsdp_config=fsdp, dynamo_config=dynamo, **common),
               ClusterConfig(distributed_type="FSDP", fsdp_config={**fsdp, "fsdp_version": 2,
                             "fsdp_reshard_after_forward": True}, parallelism_config=parallelism, **common),
               ClusterConfig(distributed_type="DEEPSPEED", deepspeed_config=deepspeed, **common),
               ClusterConfig(distributed_type="MULTI_GPU", dynamo_config=dynamo, **common),
               ClusterConfig(distributed_type="NO", **{**common, "num_processes": 1})]
    paths = []
    for index, config in enumerate(configs):
        paths.append(str(tmp_path / f"written-{index}.yaml"))
        config.to_yaml_file(paths[-1])
        written = yaml.safe_load(Path(paths[-1]).read_text())
        assert set(written) <= {field.name for field in dataclasses.fields(ClusterConfig)}
    return paths


def test_bb28_every_key_accelerate_config_writes_and_every_shipped_config_is_accepted(tmp_path):
    """The other side of refusing unknown keys: nothing `accelerate config` writes, and no shipped file, is refused."""
    for path in [*_written_by_accelerate_config(tmp_path), *map(str, sorted(CONFIG_DIR.glob("*.yaml")))]:
        assert launcher.accelerate_config_env(path)["ACCELERATE_NUM_PROCESSES"], path


# ---------------------------------------------------------------------- finding 6: a comma-separated class list
@pytest.mark.parametrize("classes", ["LlamaDecoderLayer,LlamaMLP", "LlamaMLP, LlamaDecoderLayer",
                                     "LlamaDecoderLayer,LlamaDecoderLayer"])
def test_bb28_a_comma_separated_layer_class_list_is_taken_as_accelerate_takes_it(classes, tiny_llama):
    """Found by a bug bash: accelerate's comma-separated fsdp_transformer_layer_cls_to_wrap (as `accelerate config`
    writes it for multimodal models) was refused as one class name, 'LlamaDecoderLayer,LlamaMLP', at the ranks."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_TRANSFORMER_CLS_TO_WRAP": classes}
    plan = resolve(tiny_llama, launcher.launcher_settings(env))
    assert plan.layer_class == "LlamaDecoderLayer"
    said = [note for note in plan.notes if "fsdp_transformer_layer_cls_to_wrap lists" in note]
    assert bool(said) is ("LlamaMLP" in classes)
    assert not said or "LlamaMLP is sharded with the unit that holds it" in said[0]
    agreed = resolve(tiny_llama, launcher.launcher_settings(env), layer_class="LlamaDecoderLayer")  # no disagreement
    assert agreed.layer_class == "LlamaDecoderLayer"


def test_bb28_each_class_of_the_list_must_be_in_the_model(tiny_llama, tmp_path):
    """A name of the list that is not a class of the model is refused by name, with the file."""
    config = write_config(tmp_path, fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,SiglipEncoderLayer"})
    with pytest.raises(LaunchError, match="`SiglipEncoderLayer` is not a module class of this model") as caught:
        recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama)}, "data": {"datasets": [{"path": "x.jsonl"}]}})
        dist = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo")
        parallel.resolve_plan(recipe, dist, load_config(recipe),
                              launcher=launcher.launcher_settings(launcher.accelerate_config_env(config)), config_file=config)
    assert config in str(caught.value)
