"""Parallel strategies: single process, DDP, FSDP (2 or 1) with the transformer auto-wrap policy, DeepSpeed ZeRO-2/3
(its glue lives in engine_deepspeed.py), layer split.

The plan is resolved and checked before any weight loads (`resolve_plan`), from the recipe, the launcher's
environment (accelerate writes its config there as ACCELERATE_* / FSDP_* variables; torchrun sets only the ranks)
and the model's config on the meta device. Wrapping uses torch's own APIs (`fully_shard`, `FullyShardedDataParallel`,
`DistributedDataParallel`), so the code the CPU tests run with gloo is the code that runs on GPUs with NCCL.

The FSDP + 4-bit rules, enforced here rather than documented:
  * the packed 4-bit storage dtype = the dtype FSDP sees for every frozen base tensor = the mixed-precision param
    dtype (otherwise FSDP's cast reinterprets packed bytes as numbers);
  * FSDP1 flattens each unit into one tensor: one dtype and one requires_grad per unit, so every LoRA leaf is its
    own unit (fp32 master weights) and the base stays in model.dtype (we never upcast norms, see model.py);
  * FSDP1 and FSDP2 compute in model.dtype (LoRA included) and reduce gradients in fp32; FSDP1 must cast every
    unit's inputs for that (see `_fsdp1_mixed_precision`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from finetune import engine_deepspeed
from finetune.distributed import DistInfo, print0
from finetune.errors import LaunchError
from finetune.recipe import Recipe

Strategy = Literal["single", "ddp", "fsdp", "deepspeed", "layer_split"]


@dataclass
class ParallelPlan:
    strategy: Strategy
    world_size: int
    fsdp_version: int = 2
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    layer_class: str | None = None
    activation_checkpointing: bool = True
    param_dtype: torch.dtype = torch.bfloat16
    zero: engine_deepspeed.ZeroSettings | None = None  # strategy deepspeed
    device_map: dict | None = None
    sharded_loading: bool = False  # FSDP: the wrap builds each unit from the checkpoint and shards it at once
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.strategy == "fsdp":
            shard = "full shard" if self.reshard_after_forward else "shard-grad-op"
            offload = ", params offloaded to CPU" if self.cpu_offload else ""
            return f"FSDP{self.fsdp_version} over {self.world_size} processes ({shard}{offload}), unit = {self.layer_class}"
        if self.strategy == "ddp":
            return f"DDP over {self.world_size} processes"
        if self.strategy == "deepspeed":
            return f"DeepSpeed {self.zero.describe()} over {self.world_size} processes"
        if self.strategy == "layer_split":
            devices = sorted({str(d) for d in (self.device_map or {}).values()})
            return f"layer split over {', '.join(devices) or 'one device'} in one process"
        return "single process"


# ---------------------------------------------------------------------------------------- launcher settings
def accelerate_config_env(path: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file PATH` would give its workers (the parts we read)."""
    import yaml

    try:
        with open(path) as handle:
            config = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise LaunchError(f"accelerate config {path}: file not found (the library's configs are in accelerate_configs/).") from None
    except yaml.YAMLError as exc:
        raise LaunchError(f"accelerate config {path}: not valid YAML ({exc}).") from None
    env = {"ACCELERATE_NUM_PROCESSES": str(config.get("num_processes", 1))}
    if config.get("mixed_precision"):
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"])
    if config.get("distributed_type") == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        fsdp = config.get("fsdp_config") or {}
        env["FSDP_VERSION"] = str(fsdp.get("fsdp_version", 1))
        for key, value in fsdp.items():
            if key != "fsdp_version" and key.startswith("fsdp_"):
                env[key.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    if config.get("distributed_type") == "DEEPSPEED":
        env.update(engine_deepspeed.accelerate_config_env(config))
    return env


def launcher_settings(env: dict[str, str] | None = None) -> dict:
    """What the accelerate config (via `accelerate launch`'s environment) asks for; empty under torchrun/python."""
    env = os.environ if env is None else env

    def _env_bool(name: str) -> bool | None:
        value = env.get(name)
        if value is None or value == "":
            return None
        return value.strip().lower() in ("1", "true", "yes")

    settings: dict = {}
    if _env_bool("ACCELERATE_USE_FSDP"):
        settings["strategy"] = "fsdp"
        settings["fsdp_version"] = int(env.get("FSDP_VERSION", "1") or 1)
        reshard = _env_bool("FSDP_RESHARD_AFTER_FORWARD")
        strategy_name = env.get("FSDP_SHARDING_STRATEGY", "")
        if reshard is None and strategy_name:
            reshard = strategy_name.upper() not in ("SHARD_GRAD_OP", "2")
        settings["reshard_after_forward"] = reshard
        # accelerate writes these two as "false" even when the config file does not mention them, so only an
        # explicit "true" is a statement of the config that the recipe may contradict.
        settings["cpu_offload"] = _env_bool("FSDP_OFFLOAD_PARAMS") or None
        settings["activation_checkpointing"] = _env_bool("FSDP_ACTIVATION_CHECKPOINTING") or None
        settings["layer_class"] = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
        settings["auto_wrap_policy"] = env.get("FSDP_AUTO_WRAP_POLICY") or None
        settings["cpu_ram_efficient_loading"] = _env_bool("FSDP_CPU_RAM_EFFICIENT_LOADING")
    settings.update(engine_deepspeed.launcher_settings(env))
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed and mixed != "no":
        settings["mixed_precision"] = mixed
    return {k: v for k, v in settings.items() if v is not None}


# -------------------------------------------------------------------------------------------- model facts
def meta_model(config, *, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree with no storage (classes and names for wrap and placement plans)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def decoder_layer_class(model: nn.Module, requested: str | None = None) -> type[nn.Module]:
    """The class of the repeated decoder block: `requested`, else the model's `_no_split_modules`."""
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if requested:
        if requested not in classes:
            layer_like = sorted(n for n in classes if "Layer" in n or "Block" in n) or sorted(classes)
            raise LaunchError(
                f"parallel.layer_class (or fsdp_transformer_layer_cls_to_wrap) `{requested}` is not a module class of this "
                f"model. Its layer classes: {', '.join(layer_like)}. Fix: set it to one of those, or remove it to use the default."
            )
        return classes[requested]
    base = getattr(model, "get_base_model", lambda: model)()
    for name in getattr(base, "_no_split_modules", None) or []:
        if name in classes:
            return classes[name]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        return type(max(lists, key=len)[0])
    raise LaunchError("cannot find the decoder layer class of this model; set parallel.layer_class.")


def decoder_layers_path(model: nn.Module, layer_cls: type[nn.Module]) -> tuple[str, int]:
    """Dotted name of the ModuleList holding the decoder layers, and its length."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and isinstance(module[0], layer_cls):
            return name, len(module)
    raise LaunchError(f"no list of {layer_cls.__name__} modules found in the model.")


def layer_split_device_map(model: nn.Module, layer_cls: type[nn.Module], devices: list[str]) -> dict[str, str]:
    """Place consecutive decoder layers on `devices` in balanced groups; embeddings first, head last.

    Balance is by layer count (decoder layers are identical); when the split is uneven the extra layers go to the
    first devices, since the last one also holds the final norm, the LM head and the full-vocabulary logits.
    """
    layers_path, num_layers = decoder_layers_path(model, layer_cls)
    n = len(devices)
    if num_layers < n:
        raise LaunchError(f"layer split over {n} devices needs at least {n} decoder layers, the model has {num_layers}.")
    sizes = [num_layers // n] * n
    for i in range(num_layers % n):
        sizes[i] += 1
    plan: dict[str, str] = {}
    index = 0
    for device, size in zip(devices, sizes):
        for _ in range(size):
            plan[f"{layers_path}.{index}"] = device
            index += 1
    # Everything that is not a decoder layer: modules before the layer list go first, the rest last.
    prefix = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    for name, module in model.named_children() if not prefix else model.get_submodule(prefix).named_children():
        full = f"{prefix}.{name}" if prefix else name
        if full == layers_path:
            continue
        plan[full] = devices[0] if "embed" in name or "rotary" in name else devices[-1]
    for name, _ in model.named_children():
        if prefix and name != prefix.split(".")[0]:
            plan[name] = devices[-1]
    return plan


# ------------------------------------------------------------------------------------------- the plan + checks
def detect_gpus(dist: DistInfo) -> tuple[int, int] | None:
    """(GPUs per node, bytes per GPU) when this process runs on CUDA, else None (nothing to plan memory for)."""
    if dist.device.type != "cuda":
        return None
    per_node = dist.local_world_size if dist.world_size > 1 else torch.cuda.device_count()
    return per_node, torch.cuda.get_device_properties(dist.device).total_memory


def resolve_plan(recipe: Recipe, dist: DistInfo, model_config, *, launcher: dict | None = None,
                 gpus: tuple[int, int] | None = None) -> ParallelPlan:
    """Choose and check the strategy before any weight loads; every refusal names its fix.

    `gpus` = (GPUs per node, bytes per GPU) turns on the memory planner: `strategy: auto` then follows its decision,
    and an explicit strategy it says will not fit gets a warning with the figures (an error with `parallel.strict`).
    """
    from finetune.model import torch_dtype

    launcher = launcher_settings() if launcher is None else launcher
    problems: list[str] = []
    gpus = gpus or detect_gpus(dist)
    decision = _planner_decision(recipe, dist, model_config, gpus) if gpus else None
    strategy = _choose_strategy(recipe, dist, launcher, problems, decision)
    p = recipe.parallel
    plan = ParallelPlan(
        strategy=strategy,
        world_size=dist.world_size,
        fsdp_version=p.fsdp_version or launcher.get("fsdp_version", 2),
        reshard_after_forward=p.reshard_after_forward if p.reshard_after_forward is not None else launcher.get("reshard_after_forward", True),
        cpu_offload=bool(p.cpu_offload if p.cpu_offload is not None else launcher.get("cpu_offload", False)),
        activation_checkpointing=p.activation_checkpointing if p.activation_checkpointing is not None else recipe.train.gradient_checkpointing,
        param_dtype=torch_dtype(recipe.model.dtype),
    )
    if decision is not None:
        _apply_decision(recipe, plan, decision, launcher, problems)
    _check_agreement(recipe, launcher, plan, problems)
    _check_fsdp_rules(recipe, launcher, plan, problems)
    if strategy == "deepspeed":
        plan.zero = engine_deepspeed.resolve(recipe, launcher, world_size=dist.world_size, device_type=dist.device.type,
                                             problems=problems, notes=plan.notes)
        plan.cpu_offload = plan.zero.offload_params
    if problems:
        raise LaunchError("the parallel setup cannot work:\n" + "\n".join(f"  - {p}" for p in problems))
    if strategy in ("fsdp", "layer_split") or p.layer_class:
        meta = meta_model(model_config, trust_remote_code=recipe.model.trust_remote_code)
        layer_cls = decoder_layer_class(meta, p.layer_class or launcher.get("layer_class"))
        plan.layer_class = layer_cls.__name__
        if strategy == "layer_split":
            count = torch.cuda.device_count() if dist.device.type == "cuda" else 0
            devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
            plan.device_map = layer_split_device_map(meta, layer_cls, devices)
    if plan.cpu_offload and dist.device.type == "cpu" and strategy != "deepspeed":
        plan.notes.append("parameter offload asked for, but the parameters already live in CPU memory: nothing to offload")
        plan.cpu_offload = False
    plan.sharded_loading = strategy == "fsdp" and p.sharded_loading and not recipe.lora.dora
    if strategy == "fsdp" and not plan.sharded_loading:
        why = "lora.dora: DoRA's magnitudes come from the full weights" if recipe.lora.dora else "parallel.sharded_loading: false"
        plan.notes.append(f"{why}: every rank loads and quantizes the full base before FSDP shards it")
    return plan


def _planner_decision(recipe: Recipe, dist: DistInfo, model_config, gpus: tuple[int, int]):
    from finetune.planner import decide

    per_node, memory = gpus
    return decide(recipe, model_config, gpus_per_node=per_node, gpu_memory_bytes=memory, nodes=dist.num_nodes)


def _choose_strategy(recipe: Recipe, dist: DistInfo, launcher: dict, problems: list[str], decision=None) -> Strategy:
    asked = recipe.parallel.strategy
    world = dist.world_size
    if asked == "auto":
        if world == 1:
            # One process: the planner may spread layers over the GPUs it sees when one GPU is not enough.
            return "layer_split" if decision is not None and decision.strategy == "layer_split" else "single"
        if launcher.get("strategy") in ("fsdp", "deepspeed"):
            return launcher["strategy"]
        if recipe.parallel.zero_stage is not None or recipe.parallel.deepspeed_config:
            return "deepspeed"  # torchrun / the deepspeed launcher: the recipe's DeepSpeed keys say which engine
        if decision is None:
            return "ddp"
        ddp = next((e for e in decision.estimates if e.strategy == "ddp"), None)
        return "ddp" if ddp is not None and ddp.fits else "fsdp"  # DDP when it fits (faster), else shard
    if asked in ("ddp", "fsdp", "deepspeed") and world == 1:
        config = {"fsdp": "fsdp2", "ddp": "ddp", "deepspeed": "deepspeed_zero3"}[asked]
        problems.append(
            f"parallel.strategy is `{asked}` but only 1 process was started. Fix: launch N processes "
            f"(`accelerate launch --config_file accelerate_configs/{config}.yaml ...` or "
            "`torchrun --nproc_per_node N ...`), or set parallel.strategy: single."
        )
    if asked in ("single", "layer_split") and world > 1:
        problems.append(
            f"parallel.strategy is `{asked}` but {world} processes were started: each would train its own copy. Fix: launch one "
            "process (`accelerate launch --config_file accelerate_configs/single_gpu.yaml`), or set parallel.strategy: ddp, "
            "fsdp or deepspeed."
        )
    return asked


def _apply_decision(recipe: Recipe, plan: ParallelPlan, decision, launcher: dict, problems: list[str]) -> None:
    """Print the planner's figures; follow its offload advice under `auto`; warn (or refuse) when it will not fit."""
    print0(f"[finetune] planner: {decision.summary}\n{decision.table}")
    by_key = {e.strategy: e for e in decision.estimates}
    auto = recipe.parallel.strategy == "auto"
    unset = recipe.parallel.cpu_offload is None and launcher.get("cpu_offload") is None
    if auto and unset and plan.strategy == "fsdp" and not by_key["fsdp"].fits and by_key["fsdp_offload"].fits:
        plan.cpu_offload = True
        plan.notes.append("the planner turned on CPU offload of parameters: FSDP without it does not fit")
    key = {"single": "single", "ddp": "ddp", "layer_split": "layer_split"}.get(plan.strategy)
    if plan.strategy == "deepspeed":
        stage = recipe.parallel.zero_stage or int(launcher.get("zero_stage") or 3)
        key = "zero3" if stage == 3 else "zero2"
    elif key is None:
        key = "fsdp_offload" if plan.cpu_offload else ("fsdp" if plan.reshard_after_forward else "fsdp_grad_op")
    chosen = by_key.get(key)
    if chosen is None or chosen.fits:
        return
    text = (f"the memory planner estimates {chosen.label} needs {chosen.peak_bytes / 2**30:.1f} GiB per GPU, more than "
            f"fits ({-chosen.margin_bytes / 2**30:.1f} GiB short). {decision.summary}")
    if recipe.parallel.strict:
        problems.append(text + " Fix: pick the strategy it recommends, lower the batch or sequence length, or set "
                        "parallel.strict: false to try anyway.")
    else:
        plan.notes.append("WARNING: " + text)


def _check_agreement(recipe: Recipe, launcher: dict, plan: ParallelPlan, problems: list[str]) -> None:
    """The recipe and the accelerate config must not contradict each other (neither silently wins)."""
    p = recipe.parallel
    config_kind = launcher.get("strategy")
    if config_kind in ("fsdp", "deepspeed") and p.strategy not in ("auto", config_kind):
        name = {"fsdp": "an FSDP", "deepspeed": "a DeepSpeed"}[config_kind]
        problems.append(
            f"parallel.strategy is `{p.strategy}` but the accelerate config is {name} config. Fix: use the accelerate config "
            f"of that strategy (accelerate_configs/), or set parallel.strategy: {config_kind} (or auto)."
        )
    if plan.strategy != "deepspeed" and (p.zero_stage is not None or p.deepspeed_config):
        problems.append(
            f"parallel.zero_stage / parallel.deepspeed_config are set but the strategy is {plan.strategy}. Fix: set "
            "parallel.strategy: deepspeed (or launch with a DeepSpeed accelerate config), or remove them."
        )
    if plan.strategy != "fsdp":
        return
    pairs = [
        ("fsdp_version", p.fsdp_version, "fsdp_version"),
        ("reshard_after_forward", p.reshard_after_forward, "fsdp_reshard_after_forward"),
        ("cpu_offload", p.cpu_offload, "fsdp_offload_params"),
        ("layer_class", p.layer_class, "fsdp_transformer_layer_cls_to_wrap"),
    ]
    for key, recipe_value, config_key in pairs:
        config_value = launcher.get(key)
        if recipe_value is not None and config_value is not None and recipe_value != config_value:
            problems.append(
                f"parallel.{key} is {recipe_value!r} in the recipe but the accelerate config has {config_key}: {config_value!r}. "
                f"Fix: make them equal, or remove parallel.{key} from the recipe to follow the config."
            )
    config_ckpt = launcher.get("activation_checkpointing")
    if config_ckpt is not None and config_ckpt != plan.activation_checkpointing:
        problems.append(
            f"the accelerate config has fsdp_activation_checkpointing: {config_ckpt} but the recipe has "
            f"train.gradient_checkpointing / parallel.activation_checkpointing: {plan.activation_checkpointing}. Checkpointing "
            "is applied once, by this tool, non-reentrant (reentrant recompute under FSDP re-runs the all-gathers). Fix: make them equal."
        )


def _check_fsdp_rules(recipe: Recipe, launcher: dict, plan: ParallelPlan, problems: list[str]) -> None:
    mixed = launcher.get("mixed_precision")
    if mixed:
        mixed_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed, mixed)
        if mixed_dtype != recipe.model.dtype:
            problems.append(
                f"the accelerate config has mixed_precision: {mixed} but the recipe has model.dtype: {recipe.model.dtype}. "
                "FSDP would cast the packed 4-bit storage and every frozen weight to the mixed-precision dtype. Fix: set "
                f"model.dtype: {mixed_dtype} or mixed_precision: {'bf16' if recipe.model.dtype == 'bfloat16' else 'no'} in the config."
            )
    if plan.strategy != "fsdp":
        return
    if recipe.train.optimizer != "adamw":
        problems.append(
            f"train.optimizer `{recipe.train.optimizer}` keeps its state in bitsandbytes' own tensors, which torch distributed "
            "checkpointing cannot save sharded under FSDP. Fix: set train.optimizer: adamw."
        )
    if plan.fsdp_version == 1 and recipe.lora.dora and plan.param_dtype != torch.float32:
        # DoRA reads lora_A/lora_B.weight inside the magnitude's forward, outside their own FSDP1 units: their
        # gradients then bypass FSDP1's mixed-precision handling and stay in the compute dtype (AdamW fails on them).
        problems.append(
            f"lora.dora under FSDP1 with model.dtype: {recipe.model.dtype}: DoRA uses the LoRA weights outside their FSDP1 "
            "units, whose gradients then miss FSDP1's mixed-precision handling. Fix: use FSDP2 (accelerate_configs/"
            "fsdp2.yaml, or parallel.fsdp_version: 2), or set lora.dora: false."
        )
    policy = launcher.get("auto_wrap_policy")
    if policy and policy != "TRANSFORMER_BASED_WRAP":
        problems.append(
            f"the accelerate config has fsdp_auto_wrap_policy: {policy}. With a frozen 4-bit base and trainable LoRA, FSDP units "
            "must follow decoder layers (and FSDP1 needs the LoRA leaves apart). Fix: set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP."
        )


# ------------------------------------------------------------------------------------------------ wrapping
def wrap(model: nn.Module, plan: ParallelPlan, dist: DistInfo, *,
         materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply the plan; returns the module the training loop calls (the PeftModel itself under FSDP2).

    `materialize` (sharded loading): `model` is a meta-device skeleton and `materialize(unit)` builds a unit's
    tensors from the checkpoint. Each unit is built right before FSDP shards it, so a rank holds at most its shard
    plus one unit: FSDP2 builds and shards each decoder layer, then the root; FSDP1 calls it as `param_init_fn`,
    which FSDP runs for each unit just before flattening and sharding it.
    """
    if plan.strategy == "fsdp" and plan.fsdp_version == 2:
        return _wrap_fsdp2(model, plan, dist, materialize)
    if plan.strategy == "fsdp":
        return _wrap_fsdp1(model, plan, dist, materialize)
    if materialize is not None:
        raise ValueError("a meta-device skeleton can only be built by the FSDP wrap")
    if plan.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Every rank loaded the same weights and seeded the same LoRA init: no start-up broadcast needed (init_sync).
        device_ids = [dist.device] if dist.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, init_sync=False)
    if plan.strategy == "deepspeed":
        return engine_deepspeed.initialize(model, plan.zero, device_type=dist.device.type)  # ZeRO-3 partitions it
    return model


def _layer_modules(model: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == plan.layer_class]


def _wrap_fsdp2(model: nn.Module, plan: ParallelPlan, dist: DistInfo, materialize=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    options = {
        "mesh": mesh,
        "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy(),
    }
    for layer in _layer_modules(model, plan):
        if materialize is not None:
            materialize(layer)  # read + quantize this layer only; fully_shard then keeps this rank's shard
        fully_shard(layer, **options)
    if materialize is not None:
        materialize(model)  # what is left: embeddings, final norm, LM head
    fully_shard(model, **options)
    return model


def _wrap_fsdp1(model: nn.Module, plan: ParallelPlan, dist: DistInfo, materialize=None) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    layer_cls = {type(m) for m in _layer_modules(model, plan)}

    def is_trainable_leaf(module: nn.Module) -> bool:
        # LoRA A/B (and DoRA magnitude) leaves: own unit, so every flat parameter has one dtype and one requires_grad.
        return not list(module.named_children()) and any(p.requires_grad for p in module.parameters(recurse=False))

    policy = functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=is_trainable_leaf),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls),
        ],
    )
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD if plan.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=_fsdp1_mixed_precision(plan),
        cpu_offload=CPUOffload(offload_params=plan.cpu_offload),
        device_id=dist.device,  # required on CPU too ("FSDP needs a non-CPU accelerator device" otherwise)
        limit_all_gathers=True,
        use_orig_params=False,
        param_init_fn=materialize,  # sharded loading: called per unit, on its modules, before the unit is flattened
    )


def _fsdp1_mixed_precision(plan: ParallelPlan):
    """FSDP1's precision, the same as FSDP2's: fp32 LoRA master weights, compute in model.dtype, fp32 reductions.

    The LoRA leaves keep PEFT's fp32 (their own units, so one dtype per flat parameter): the optimizer updates fp32
    shards, and small updates are not rounded away in bf16. Each unit's forward runs on its parameters cast to
    `param_dtype` (the 4-bit storage dtype; a no-op for the base), and gradients are reduced in fp32.

    `cast_forward_inputs=True` is what makes a bf16 run work at all: PEFT's 4-bit LoRA layer casts its input to
    `lora_A.weight.dtype` before calling lora_A. Outside the unit's own forward FSDP1 shows the fp32 flat parameter,
    so the input becomes fp32, and inside the forward the weight is bf16: F.linear fails with "expected m1 and m2 to
    have the same dtype, but got: float != c10::BFloat16" (the training loop uses no autocast, on any device). FSDP1
    casts only the root's inputs by default; FSDP2's MixedPrecisionPolicy casts every unit's, which is why FSDP2 ran.
    Casting every unit's floating inputs to `param_dtype` computes the LoRA path in bf16 exactly as FSDP2 does (and
    as autocast would), so FSDP1 and FSDP2 train the same loss curve (tests/test_shipped_configs.py).
    """
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=plan.param_dtype, reduce_dtype=torch.float32, buffer_dtype=plan.param_dtype,
                          cast_forward_inputs=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The PeftModel inside DDP / FSDP1 / DeepSpeed wrappers (FSDP2 wraps in place)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if engine_deepspeed.is_engine(model):
        return model.module
    while isinstance(model, (nn.parallel.DistributedDataParallel, FSDP)):
        model = model.module
    return model


def gradient_sync(model: nn.Module, *, enabled: bool):
    """Context for one micro-batch: skip the gradient all-reduce / reduce-scatter until the last of the step.

    DeepSpeed ZeRO-2/3 reduce-scatter at every micro-batch (they have no no_sync); they are told where the step ends.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if engine_deepspeed.is_engine(model):
        engine_deepspeed.set_boundary(model, last=enabled)
        return contextlib.nullcontext()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, (nn.parallel.DistributedDataParallel, FSDP)) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def generation_model(model: nn.Module):
    """The module to call `.generate()` on, for every rank together (FSDP forwards are collectives).

    DDP: the inner module (no collectives in a forward). FSDP2: generate() calls inner modules, so the root's
    unshard hooks must wrap `generate` too (register_fsdp_forward_method). FSDP1: the full parameters are gathered
    for the duration (summon_full_params): a full 4-bit copy per rank, as in loading.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, "generate")
        yield model
    elif isinstance(model, FSDP):
        yield _GreedyThroughRoot(model)
    elif engine_deepspeed.is_engine(model) and model.zero_optimization_stage() == 3:
        yield _GreedyThroughRoot(engine_deepspeed.generation_module(model))  # forwards gather: same count on every rank
    else:
        yield unwrap(model)


class _GreedyThroughRoot(nn.Module):
    """`generate(input_ids, attention_mask, max_new_tokens, ...)` as plain greedy decoding by full forwards of the
    root module (no KV cache: fine for the short answers of an eval). Every rank runs every step, so the FSDP
    collectives line up whatever each rank's rows are."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.root = root  # a child module: .eval()/.train()/.parameters() reach the real model

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 eos_token_id: int | None = None, pad_token_id: int | None = None, **_ignored) -> torch.Tensor:
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
            logits = self.root(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               use_cache=False).logits
            token = logits[:, -1].argmax(-1)
            if eos_token_id is not None:
                token = torch.where(finished, torch.full_like(token, pad_token_id or eos_token_id), token)
                finished |= token == eos_token_id
            input_ids = torch.cat([input_ids, token[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, (~finished | (token == eos_token_id))[:, None].long()], dim=1)
        return input_ids


def backward(model: nn.Module, loss: torch.Tensor) -> None:
    """Backpropagate one micro-batch's (already normalized) loss."""
    if engine_deepspeed.is_engine(model):
        engine_deepspeed.backward(model, loss)
    else:
        loss.backward()


def engine_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    """The torch optimizer an engine was built with (DeepSpeed), so the scheduler can drive its learning rate."""
    return engine_deepspeed.torch_optimizer(model) if engine_deepspeed.is_engine(model) else None


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                   max_norm: float | None, *, allowed: bool) -> tuple[float, bool]:
    """Clip, step and zero the gradients, unless the loss (`allowed`) or the gradient norm is not finite.

    Returns (gradient norm before clipping, whether the parameters were updated). Under DeepSpeed the engine clips and
    steps, and skips the update itself when the norm is NaN/inf.
    """
    if engine_deepspeed.is_engine(model):
        return engine_deepspeed.optimizer_step(model)
    norm = clip_grad_norm(model, parameters, max_norm)
    stepped = allowed and math.isfinite(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def clip_grad_norm(model: nn.Module, parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip by the global norm over all ranks' shards; returns the norm before clipping."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    limit = max_norm if max_norm is not None else float("inf")
    if isinstance(model, FSDP):
        norm = model.clip_grad_norm_(limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, limit)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    return float(norm)


_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def normalize_key(key: str) -> str:
    """Strip every wrapper component: FSDP1 nests `_fsdp_wrapped_module.` at each unit, activation checkpointing and
    torch.compile add theirs, DDP prefixes `module.`."""
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key.removeprefix("module.")


def trainable_state_dict(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the trainable parameters `names` (model names, wrappers stripped), on every rank.

    A collective under FSDP: every rank must call it. `ignore_frozen_params` is a hint only (a single-process
    model still returns its frozen weights), hence the explicit `names`.
    """
    names = set(names)
    if engine_deepspeed.is_engine(model):
        return engine_deepspeed.trainable_state_dict(model, names)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    result = {}
    for key, value in state.items():
        if normalize_key(key) not in names:
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        result[normalize_key(key)] = value.detach().to("cpu").clone()
    return result


def local_parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank actually holds (its shard under FSDP and ZeRO-3), split frozen / trainable."""
    if engine_deepspeed.is_engine(model):
        return engine_deepspeed.local_parameter_bytes(model)
    frozen = trainable = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        size = local.numel() * local.element_size()
        if param.requires_grad:
            trainable += size
        else:
            frozen += size
    return {"frozen_bytes": frozen, "trainable_bytes": trainable}


def report(plan: ParallelPlan) -> None:
    print0(f"[finetune] parallel: {plan.describe()}")
    for note in plan.notes:
        print0(f"[finetune] note: {note}")
