"""Parallel plans and pre-flight checks (no processes needed): strategy vs processes, recipe vs accelerate config,
the FSDP + 4-bit dtype rule, layer-split placement, and every file in accelerate_configs/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune import parallel
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.recipe import validate_recipe

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "accelerate_configs").glob("*.yaml"))


def dist(world: int) -> DistInfo:
    return DistInfo(rank=0, world_size=world, local_rank=0, local_world_size=world, device=torch.device("cpu"), backend=None)


def recipe(model_dir, dtype="float32", **parallel_keys):
    return validate_recipe({
        "model": {"name_or_path": str(model_dir), "dtype": dtype},
        "data": {"datasets": [{"path": "x.jsonl"}]},
        "parallel": parallel_keys,
    })


def plan(model_dir, world=2, launcher=None, **kwargs):
    r = recipe(model_dir, **kwargs)
    return parallel.resolve_plan(r, dist(world), load_config(r), launcher=launcher or {})


FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"}


def test_auto_strategy_follows_the_launcher(tiny_llama):
    assert plan(tiny_llama, world=1).strategy == "single"
    assert plan(tiny_llama, world=2).strategy == "ddp"
    fsdp = plan(tiny_llama, world=2, launcher=parallel.launcher_settings(FSDP2_ENV))
    assert fsdp.strategy == "fsdp" and fsdp.fsdp_version == 2 and fsdp.layer_class == "LlamaDecoderLayer"


def test_layer_class_from_model_and_recipe(tiny_qwen2):
    assert plan(tiny_qwen2, strategy="fsdp").layer_class == "Qwen2DecoderLayer"
    with pytest.raises(LaunchError, match="`Qwen2Block` is not a module class.*Qwen2DecoderLayer"):
        plan(tiny_qwen2, strategy="fsdp", layer_class="Qwen2Block")


@pytest.mark.parametrize("strategy,world,needle", [
    ("fsdp", 1, "only 1 process was started"),
    ("ddp", 1, "only 1 process was started"),
    ("single", 2, "2 processes were started"),
    ("layer_split", 2, "2 processes were started"),
])
def test_strategy_vs_number_of_processes(tiny_llama, strategy, world, needle):
    with pytest.raises(LaunchError, match=needle):
        plan(tiny_llama, world=world, strategy=strategy)


def test_recipe_vs_accelerate_config_disagreements(tiny_llama):
    launcher = parallel.launcher_settings(FSDP2_ENV)
    with pytest.raises(LaunchError, match="accelerate config is an FSDP config"):
        plan(tiny_llama, launcher=launcher, strategy="ddp")
    with pytest.raises(LaunchError, match="parallel.fsdp_version is 1 .* fsdp_version: 2"):
        plan(tiny_llama, launcher=launcher, fsdp_version=1)
    with pytest.raises(LaunchError, match="reshard_after_forward"):
        plan(tiny_llama, launcher=launcher, reshard_after_forward=False)
    ckpt = parallel.launcher_settings({**FSDP2_ENV, "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    with pytest.raises(LaunchError, match="fsdp_activation_checkpointing"):
        plan(tiny_llama, launcher=ckpt, activation_checkpointing=False)


def test_mixed_precision_must_equal_the_storage_dtype(tiny_llama):
    launcher = parallel.launcher_settings({**FSDP2_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"})
    with pytest.raises(LaunchError, match="mixed_precision: bf16 but the recipe has model.dtype: float32"):
        plan(tiny_llama, launcher=launcher)
    assert plan(tiny_llama, launcher=launcher, dtype="bfloat16").param_dtype == torch.bfloat16


def test_wrap_policy_and_sharded_optimizer_checks(tiny_llama):
    size_based = parallel.launcher_settings({**FSDP2_ENV, "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"})
    with pytest.raises(LaunchError, match="TRANSFORMER_BASED_WRAP"):
        plan(tiny_llama, launcher=size_based)
    r = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
                         "data": {"datasets": [{"path": "x.jsonl"}]}, "train": {"optimizer": "adamw_8bit"},
                         "parallel": {"strategy": "fsdp"}})
    with pytest.raises(LaunchError, match="cannot save sharded"):
        parallel.resolve_plan(r, dist(2), load_config(r), launcher={})


def test_dora_under_fsdp1_in_bf16_is_refused(tiny_llama):
    launcher = parallel.launcher_settings({**FSDP2_ENV, "FSDP_VERSION": "1", "ACCELERATE_MIXED_PRECISION": "bf16"})
    r = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "bfloat16"}, "lora": {"dora": True},
                         "data": {"datasets": [{"path": "x.jsonl"}]}})
    with pytest.raises(LaunchError, match="lora.dora under FSDP1 .* Fix: use FSDP2"):
        parallel.resolve_plan(r, dist(2), load_config(r), launcher=launcher)
    fsdp2 = parallel.launcher_settings({**FSDP2_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert parallel.resolve_plan(r, dist(2), load_config(r), launcher=fsdp2).fsdp_version == 2


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases_under_fsdp1_are_refused_before_loading(tiny_llama, bias):
    """Found by a bug bash of LoRA options: lora.bias all / lora_only under FSDP1 passed validate, loaded every weight
    and died in the wrap ("Must flatten tensors with uniform requires_grad": the trained bias sits in the frozen 4-bit
    layer's unit). DDP and FSDP2 train it (their adapters equal the single-process one)."""
    launcher = parallel.launcher_settings({**FSDP2_ENV, "FSDP_VERSION": "1"})
    r = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32"}, "lora": {"bias": bias},
                         "data": {"datasets": [{"path": "x.jsonl"}]}})
    with pytest.raises(LaunchError, match=f"lora.bias: {bias} under FSDP1: .* Fix: use FSDP2"):
        parallel.resolve_plan(r, dist(2), load_config(r), launcher=launcher)
    assert parallel.resolve_plan(r, dist(2), load_config(r), launcher=parallel.launcher_settings(FSDP2_ENV))


def test_all_problems_reported_together(tiny_llama):
    launcher = parallel.launcher_settings({**FSDP2_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"})
    with pytest.raises(LaunchError) as err:
        plan(tiny_llama, launcher=launcher, strategy="ddp")
    assert str(err.value).count("\n  - ") == 2


@pytest.mark.slow
def test_multimodal_unit_is_the_language_model_layer_on_every_rank():
    """Gemma 3 12B/27B: `_no_split_modules` is a set holding the SigLIP blocks and Gemma3DecoderLayer, iterated in a
    hash-seeded order that differs between processes, so ranks wrapped different units and FSDP aborted. Each seed
    stands for a rank's process."""
    import os
    import subprocess
    import sys

    code = ("from finetune.cli.tiny import tiny_config_like; from finetune import parallel; "
            "meta = parallel.meta_model(tiny_config_like('google/gemma-3-27b-it', vocab_size=512, eos_token_id=2, "
            "pad_token_id=0)); print(parallel.decoder_layer_class(meta).__name__)")
    chosen = set()
    for seed in range(4):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                             check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        chosen.add(out.stdout.strip().splitlines()[-1])
    assert chosen == {"Gemma3DecoderLayer"}


def test_layer_split_placement_is_balanced(tiny_llama):
    from finetune.cli.tiny import build_tiny_model

    config = load_config(recipe(tiny_llama))
    config.num_hidden_layers = 10
    meta = parallel.meta_model(config)
    layer_cls = parallel.decoder_layer_class(meta)
    device_map = parallel.layer_split_device_map(meta, layer_cls, ["cuda:0", "cuda:1", "cuda:2"])
    per_device = [sum(1 for k, v in device_map.items() if ".layers." in k and v == d) for d in ("cuda:0", "cuda:1", "cuda:2")]
    assert per_device == [4, 3, 3]  # the last device also holds the head and the logits
    assert device_map["model.embed_tokens"] == "cuda:0"
    assert device_map["model.norm"] == "cuda:2" and device_map["lm_head"] == "cuda:2"
    # consecutive layers: the device index never goes down along the stack
    order = [int(device_map[f"model.layers.{i}"][-1]) for i in range(10)]
    assert order == sorted(order)
    # every module of the model is placed
    placed = set(device_map)
    assert all(any(name == p or name.startswith(p + ".") for p in placed) for name, _ in meta.named_parameters())
    with pytest.raises(LaunchError, match="needs at least 11 decoder layers"):
        parallel.layer_split_device_map(meta, layer_cls, [f"cuda:{i}" for i in range(11)])
    del build_tiny_model


def test_layer_split_plan_on_cpu_keeps_one_device(tiny_llama):
    p = plan(tiny_llama, world=1, strategy="layer_split")
    assert set(p.device_map.values()) == {"cpu"}


@pytest.mark.parametrize("path", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_accelerate_config_loads_and_agrees_with_a_matching_recipe(path, tiny_llama):
    env = parallel.accelerate_config_env(str(path))
    launcher = parallel.launcher_settings(env)
    world = int(env["ACCELERATE_NUM_PROCESSES"])
    dtype = "bfloat16" if launcher.get("mixed_precision") == "bf16" else "auto"
    activation = bool(launcher.get("activation_checkpointing", True))
    r = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": dtype},
                         "data": {"datasets": [{"path": "x.jsonl"}]},
                         "train": {"gradient_checkpointing": activation}})
    result = parallel.resolve_plan(r, dist(world), load_config(r), launcher=launcher)
    expected = launcher.get("strategy") or ("ddp" if world > 1 else "single")
    assert result.strategy == expected


def test_normalize_key_strips_every_wrapper():
    key = ("_fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."
           "self_attn.q_proj.lora_A._fsdp_wrapped_module.default.weight")
    assert parallel.normalize_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert parallel.normalize_key("module.base_model.x") == "base_model.x"


GiB = 2**30


def test_auto_follows_the_planner_with_gpus(tiny_llama, capsys):
    """With GPUs present (given here as (per node, bytes)), `auto` uses the planner and prints its figures."""
    r = recipe(tiny_llama)
    config = load_config(r)
    assert parallel.resolve_plan(r, dist(2), config, launcher={}, gpus=(2, 24 * GiB)).strategy == "ddp"
    assert parallel.resolve_plan(r, dist(1), config, launcher={}, gpus=(1, 24 * GiB)).strategy == "single"
    out = capsys.readouterr().out
    assert "planner:" in out and "fits" in out


def test_explicit_strategy_that_will_not_fit_warns_or_refuses(tiny_llama):
    big = {"name_or_path": "meta-llama/Llama-2-70b-hf", "dtype": "bfloat16"}
    loose = validate_recipe({"model": big, "data": {"datasets": [{"path": "x.jsonl"}]}, "parallel": {"strategy": "ddp"}})
    result = parallel.resolve_plan(loose, dist(2), load_config(loose), launcher={}, gpus=(2, 24 * GiB))
    assert result.strategy == "ddp" and any(n.startswith("WARNING: the memory planner") for n in result.notes)
    strict = validate_recipe({"model": big, "data": {"datasets": [{"path": "x.jsonl"}]},
                              "parallel": {"strategy": "ddp", "strict": True}})
    with pytest.raises(LaunchError, match="memory planner estimates .* GiB short"):
        parallel.resolve_plan(strict, dist(2), load_config(strict), launcher={}, gpus=(2, 24 * GiB))
    auto = validate_recipe({"model": big, "data": {"datasets": [{"path": "x.jsonl"}]}})
    # 70B on 2 x 24 GB: DDP does not fit, so auto shards; on 2 x 80 GB a replica fits and auto picks DDP.
    assert parallel.resolve_plan(auto, dist(2), load_config(auto), launcher={}, gpus=(2, 24 * GiB)).strategy == "fsdp"
    assert parallel.resolve_plan(auto, dist(2), load_config(auto), launcher={}, gpus=(2, 80 * GiB)).strategy == "ddp"


def test_the_deepspeed_launchers_local_size_counts_this_nodes_processes(monkeypatch):
    """`deepspeed` sets LOCAL_SIZE, not LOCAL_WORLD_SIZE: 2 nodes x 8 GPUs is 8 processes per node, not WORLD_SIZE=16
    (which the one-GPU-per-process check would refuse on an 8-GPU node). Simulated: no CUDA here, the check is pure."""
    from finetune import devices, distributed

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "8")
    assert distributed.local_world_size(16) == 8
    devices.check_one_gpu_per_process(distributed.local_world_size(16), visible_gpus=8)  # no refusal
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun / accelerate's own word wins
    assert distributed.local_world_size(16) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    assert distributed.local_world_size(2) == 2  # one node: WORLD_SIZE
    with pytest.raises(LaunchError, match="16 processes were started on this node but it sees 8"):
        devices.check_one_gpu_per_process(distributed.local_world_size(16), visible_gpus=8)


def test_one_process_with_cpu_offload_shards_over_its_group_or_is_refused(tiny_llama):
    """`strategy: auto` with one process took `single` and dropped CPU offload without a word (a recipe's
    parallel.cpu_offload, or an FSDP / DeepSpeed config's offload keys launched with --num_processes 1): the one-GPU
    route for a model larger than the GPU (FSDP over one rank, as fsdp_qlora offers) trained unoffloaded."""
    grouped = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                       backend="gloo")
    r = recipe(tiny_llama, cpu_offload=True)
    one = parallel.resolve_plan(r, grouped, load_config(r), launcher={})
    assert (one.strategy, one.cpu_offload) == ("fsdp", True)
    config = parallel.launcher_settings({**FSDP2_ENV, "FSDP_OFFLOAD_PARAMS": "true"})
    assert parallel.resolve_plan(recipe(tiny_llama), grouped, load_config(r), launcher=config).cpu_offload is True
    with pytest.raises(LaunchError, match=r"parallel.cpu_offload: true asks for CPU offload.*torchrun --standalone --nproc_per_node 1"):
        plan(tiny_llama, world=1, cpu_offload=True)  # no process group (accelerate's one CPU process)
    with pytest.raises(LaunchError, match="fsdp_offload_params: true asks for CPU offload"):
        plan(tiny_llama, world=1, launcher=config)
    with pytest.raises(LaunchError, match="parallel.cpu_offload is true but the strategy is single, which has no offload"):
        plan(tiny_llama, world=1, strategy="single", cpu_offload=True)
    with pytest.raises(LaunchError) as one_problem:  # said once, not again as "the strategy is single"
        plan(tiny_llama, world=1, cpu_offload=True)
    assert str(one_problem.value).count("\n  - ") == 1, one_problem.value
    # several processes under auto: FSDP, which offloads (auto chose DDP, then refused its own choice)
    assert (plan(tiny_llama, world=2, cpu_offload=True).strategy, plan(tiny_llama, world=2).strategy) == ("fsdp", "ddp")


def test_a_sharding_config_launched_as_one_process_says_it_trains_single(tiny_llama):
    zero3 = parallel.launcher_settings({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    for launcher, name in ((parallel.launcher_settings(FSDP2_ENV), "an FSDP"), (zero3, "a DeepSpeed")):
        one = plan(tiny_llama, world=1, launcher=launcher)
        assert one.strategy == "single"
        assert any(f"the accelerate config is {name} config, but 1 process was started" in note for note in one.notes)


def test_validate_and_train_name_the_accelerate_config_of_a_refusal(tiny_llama, tmp_path, capsys):
    """`finetune train/validate --accelerate-config FILE` refuse in the parent process, whose own parent is the shell:
    the file was named only under a raw `accelerate launch` (found in a review)."""
    from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

    from finetune.cli import main

    mine = tmp_path / "my_fsdp.yaml"
    mine.write_text(CONFIGS[[path.name for path in CONFIGS].index("fsdp2.yaml")].read_text())
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "out",
                                                           train={"gradient_checkpointing": False}))
    for verb in ("validate", "train"):
        assert main([verb, str(recipe), "--accelerate-config", str(mine)]) == 2
        assert f"the parallel setup cannot work (the accelerate config: {mine}):" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
