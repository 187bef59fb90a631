"""DeepSpeed ZeRO-2 / ZeRO-3 as a second engine: its settings and pre-flight checks, the engine, the loop's hooks.

The same recipe, data order, loss normalization and adapter as the torch strategies; only what DeepSpeed does itself
goes through it: partitioning (ZeRO-3: the packed 4-bit base, LoRA and optimizer state; ZeRO-2: optimizer state and
gradients), the gathers, its optimizer wrapper around a plain torch AdamW (nothing to compile), gradient clipping,
and its checkpoint format for the training state. Settings come from the recipe (`parallel.strategy: deepspeed`,
`zero_stage`, `cpu_offload`, `deepspeed_config`) and from an accelerate DeepSpeed config, which `accelerate launch`
hands to its workers as ACCELERATE_USE_DEEPSPEED / ACCELERATE_DEEPSPEED_* variables. We never let accelerate's
Accelerator drive DeepSpeed: on CPU it forms no backend (both ranks report process 0 of 1 and the data is not split),
and ACCELERATE_USE_CPU silently turns DeepSpeed off. distributed.py forms the process group; deepspeed.initialize
wraps it.

Facts measured on CPU (gloo) that this module turns into code (docs/distributed.md has the figures):
  * deepspeed.init_distributed compiles a shared-memory all-reduce op with g++ the first time (~30 s) and fails
    without a compiler; plain gloo needs none, so the build is skipped (`_skip_shm_op_build`).
  * DeepSpeed's own Adam builds FusedAdam / CPUAdam (another compile); the recipe's torch AdamW is passed instead,
    and ZeRO-Offload is told to accept it (`zero_force_ds_cpu_optimizer: false`).
  * `engine.backward` divides by gradient_accumulation_steps unless told not to: the loop already normalizes each
    micro-batch by the step's global token count, so it must not (`scale_wrt_gas=False`).
  * ZeRO-3 keeps a parameter whole on every rank when it is smaller than stage3_param_persistence_threshold; small
    test models need 0 there to be partitioned at all.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from finetune.parallel import zero_json
from finetune.planner.memory import BUCKET_ELEMENTS

INSTALL_HINT = "pip install 'finetune[deepspeed]' (or pip install deepspeed==0.19.8)"
# BUCKET_ELEMENTS (defined in finetune/planner/memory.py, beside the memory model that counts it): gradient reduce,
# all-gather and ZeRO-3 prefetch buckets, in elements (DeepSpeed's default 5e8 would allocate gigabytes
# for a LoRA's few million gradients). The planner counts them. A user's DeepSpeed JSON is read and judged key by
# key in zero_json.py.


@dataclass
class ZeroSettings:
    """What DeepSpeed is asked to do, resolved before any weight loads."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    config_file: str | None = None
    zero_section: dict = field(default_factory=dict)  # the JSON's zero_optimization (tuning), validated
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    engine_config: dict = field(default_factory=dict)  # what deepspeed.initialize gets

    def describe(self) -> str:
        offloaded = [name for name, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params)) if on]
        return f"ZeRO-{self.stage}" + (f", {' and '.join(offloaded)} offloaded to CPU" if offloaded else "")


def installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


# The oldest DeepSpeed `make test-compat` trains: up to 0.19.2 ZeRO-3's coalesced all-gather sends the fp32 LoRA and
# the bf16 base in one gloo/NCCL call (gloo: "invalid tensor type"), and gradient checkpointing recomputes empty tensors.
OLDEST_DEEPSPEED = (0, 19, 3)


def too_old() -> str | None:
    """The installed DeepSpeed's version when it is older than OLDEST_DEEPSPEED, else None (read without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("deepspeed")
    except PackageNotFoundError:
        return None
    parts = tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())
    return text if parts < OLDEST_DEEPSPEED else None


# ---------------------------------------------------------------------------------------- launcher settings
def accelerate_config_env(config: dict) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch` gives its workers for a `distributed_type: DEEPSPEED` config."""
    ds = config.get("deepspeed_config") or {}
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    names = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE", "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
             "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
             "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE", "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
             "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING"}
    for key, name in names.items():
        if ds.get(key) is not None:
            env[name] = str(ds[key]).lower() if isinstance(ds[key], bool) else str(ds[key])
    if config.get("use_cpu"):
        env["ACCELERATE_USE_CPU"] = "true"  # DeepSpeed on the CPU (accelerate's Accelerator would drop it: not used)
    return env


def launcher_settings(env) -> dict:
    """The DeepSpeed part of what the launcher's environment asks for (empty when it is no DeepSpeed launch)."""
    if (env.get("ACCELERATE_USE_DEEPSPEED") or "").strip().lower() not in ("1", "true", "yes"):
        return {}
    settings = {"strategy": "deepspeed", "zero_stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
                "offload_optimizer_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                "offload_param_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
                "deepspeed_config_file": env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                "gradient_accumulation_steps": env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                "gradient_clipping": env.get("ACCELERATE_GRADIENT_CLIPPING"),
                "zero3_init": env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT"),
                "use_cpu": "true" if (env.get("ACCELERATE_USE_CPU") or "").strip().lower() in ("1", "true", "yes") else None}
    return {k: v for k, v in settings.items() if v not in (None, "", "none") or k == "strategy"}


# ------------------------------------------------------------------------------------------ pre-flight checks
def resolve(recipe, launcher: dict, *, world_size: int, device_type: str, problems: list[str], notes: list[str]) -> ZeroSettings:
    """Every DeepSpeed setting, from the recipe, the accelerate config and the DeepSpeed JSON; refusals go to `problems`."""
    p, t = recipe.parallel, recipe.train
    if not installed():
        problems.append(f"parallel.strategy is deepspeed (or the accelerate config is a DeepSpeed config) but DeepSpeed is "
                        f"not installed. Fix: {INSTALL_HINT}; or use parallel.strategy: fsdp.")
        return ZeroSettings(stage=p.zero_stage or 3)
    if old := too_old():
        oldest = ".".join(map(str, OLDEST_DEEPSPEED))
        problems.append(f"DeepSpeed {old} is installed; finetune needs {oldest} or newer (older ZeRO-3 gathers the fp32 "
                        f"LoRA and the bf16 4-bit base in one collective and fails). Fix: pip install 'deepspeed>={oldest},<0.20'.")
        return ZeroSettings(stage=p.zero_stage or 3)
    env_cpu = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")
    if (env_cpu or launcher.get("use_cpu")) and launcher.get("strategy") == "deepspeed":
        # accelerate's own Accelerator would quietly run plain CPU DDP here; finetune builds the engine itself.
        notes.append("ACCELERATE_USE_CPU: DeepSpeed runs on the CPU over gloo (not accelerate's fallback to CPU DDP)")
    config_file, where = _config_file(p, launcher, problems)
    user = zero_json.read_config_file(config_file, where) if config_file else {}
    zero_section = zero_json.zero_section(user, config_file, problems)
    stage = _stage(p, launcher, zero_section, config_file, problems)
    offload_optimizer, offload_params = _offload(recipe, launcher, zero_section, stage, config_file, problems)
    zero_json.check_owned_keys(recipe, user, launcher, config_file, world_size, problems)
    zero_json.check_top_level_keys(user, config_file, problems, notes)
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero_section.get(key) in (True, "true"):
            # ZeRO++'s int8 quantizer works on float tensors: the packed NF4 bytes (stored as bf16/fp32 words) would be
            # re-quantized to int8 for every all-gather and come back as other bytes, a silently different base.
            problems.append(f"{config_file}: zero_optimization.{key}: true would int8-quantize the base's parameters for "
                            "every all-gather, and the 4-bit base's packed bytes are not numbers it can round: they would "
                            f"come back scrambled. Fix: remove {key} (the base is already 4-bit; LoRA is what trains).")
    if recipe.train.optimizer != "adamw":
        problems.append(f"train.optimizer `{recipe.train.optimizer}` keeps bitsandbytes state that ZeRO cannot partition or "
                        "checkpoint. Fix: set train.optimizer: adamw under DeepSpeed.")
    if stage == 3 and recipe.lora.dora and recipe.quantization.method != "none":
        # DoRA's magnitude reads the base weight (its norm) inside the LoRA layer's own forward, where ZeRO-3 gathers
        # only that module's parameters: the 4-bit base layer's partition is not gathered there, and step 1's backward
        # failed on both ranks ("'Params4bit' object has no attribute 'ds_status'").
        problems.append("lora.dora with a 4-bit base under ZeRO-3: DoRA reads the base layer's weight outside that "
                        "layer's own forward, where ZeRO-3 does not gather the partitioned 4-bit weights (step 1 would "
                        "fail). Fix: use ZeRO-2 (parallel.zero_stage: 2, accelerate_configs/deepspeed_zero2.yaml), FSDP2 "
                        "(accelerate_configs/fsdp2.yaml), or set lora.dora: false.")
    if launcher.get("zero3_init") == "true":
        notes.append("zero3_init_flag: true is not used: the 4-bit base is quantized while loading (each rank loads it), "
                     "then deepspeed.initialize partitions it")
    if device_type == "cpu" and (offload_optimizer or offload_params):
        # Kept on: DeepSpeed's offload code (CPU-resident optimizer state and partitions) runs as on GPUs (its CPU
        # accelerator pins nothing), so the CPU suite exercises it; it only saves memory where the device is a GPU.
        notes.append("CPU offload on a CPU-only machine: the offload code runs, but saves no memory here")
    zero_section.pop("stage", None)
    zero_section.pop("offload_optimizer", None)
    zero_section.pop("offload_param", None)
    settings = ZeroSettings(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                            config_file=config_file, zero_section=zero_section, learning_rate=t.learning_rate,
                            weight_decay=t.weight_decay)
    settings.engine_config = engine_config(recipe, settings, world_size=world_size)
    _validate_with_deepspeed(settings, config_file or "the DeepSpeed settings", problems, device_type=device_type)
    return settings


def _config_file(p, launcher: dict, problems: list[str]) -> tuple[str | None, str]:
    from_recipe, from_launcher = p.deepspeed_config, launcher.get("deepspeed_config_file")
    if from_recipe and from_launcher and Path(from_recipe).resolve() != Path(from_launcher).resolve():
        problems.append(f"parallel.deepspeed_config is {from_recipe} but the accelerate config has deepspeed_config_file: "
                        f"{from_launcher}. Fix: make them equal, or remove one.")
    if from_recipe:
        return from_recipe, "parallel.deepspeed_config"
    return from_launcher, "the accelerate config's deepspeed_config_file"


def _stage(p, launcher: dict, zero_section: dict, config_file: str | None, problems: list[str]) -> int:
    candidates = [("parallel.zero_stage", p.zero_stage), ("the accelerate config's zero_stage", launcher.get("zero_stage")),
                  (f"{config_file}: zero_optimization.stage", zero_section.get("stage"))]
    given = []
    for where, value in candidates:
        if value is None or value == "auto":  # "auto": the trainer decides (HF's meaning), here the other places or 3
            continue
        try:
            stage = int(value)
        except (TypeError, ValueError):
            stage = -1
        if stage not in (2, 3):
            problems.append(f"{where} is {value!r}: finetune runs ZeRO stage 2 (optimizer state and gradients sharded) or 3 "
                            "(the 4-bit base too). Stages 0 and 1 shard nothing a LoRA run needs sharded. Fix: set it to 3 or 2.")
            continue
        given.append((where, stage))
    if len({stage for _, stage in given}) > 1:
        problems.append("the ZeRO stage disagrees: " + ", ".join(f"{w} = {s}" for w, s in given) + ". Fix: make them equal.")
    return given[0][1] if given else 3


def _offload(recipe, launcher: dict, zero_section: dict, stage: int, config_file: str | None,
             problems: list[str]) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) to CPU; NVMe and parameter offload under ZeRO-2 are refused."""
    devices = {}
    for what, launcher_key, section in (("optimizer", "offload_optimizer_device", "offload_optimizer"),
                                        ("param", "offload_param_device", "offload_param")):
        sources = [(f"the accelerate config's {launcher_key}", launcher.get(launcher_key)),
                   (f"{config_file}: zero_optimization.{section}.device", (zero_section.get(section) or {}).get("device"))]
        found = [(where, str(value).lower()) for where, value in sources if value not in (None, "")]
        for where, value in found:
            if value not in ("none", "cpu"):
                problems.append(f"{where} is `{value}`: finetune offloads to `cpu` or not at all (`none`); NVMe offload needs "
                                "DeepSpeed's compiled async-IO op and a fast local disk. Fix: set it to cpu or none.")
        chosen = {v for _, v in found if v in ("none", "cpu")}
        if len(chosen) > 1:
            problems.append(f"{what} offload disagrees: " + ", ".join(f"{w} = {v}" for w, v in found) + ". Fix: make them equal.")
        devices[what] = "cpu" in chosen
    asked = recipe.parallel.cpu_offload
    if asked is not None and any(v is not None for v in (launcher.get("offload_optimizer_device"), zero_section.get("offload_optimizer"))) \
            and asked != devices["optimizer"]:
        problems.append(f"parallel.cpu_offload is {asked} but the DeepSpeed settings offload the optimizer: {devices['optimizer']}. "
                        "Fix: make them equal, or remove parallel.cpu_offload to follow the config.")
    optimizer = devices["optimizer"] or bool(asked)
    params = devices["param"] or (bool(asked) and stage == 3)
    if devices["param"] and stage == 2:
        problems.append("parameter offload (offload_param) needs ZeRO stage 3: ZeRO-2 keeps whole parameters on every rank. "
                        "Fix: use zero_stage 3, or set offload_param_device: none.")
    return optimizer, params


def engine_config(recipe, settings: ZeroSettings, *, world_size: int) -> dict:
    """The config deepspeed.initialize gets: the recipe's batch and clipping, the ZeRO section, quiet logging."""
    t = recipe.train
    zero = {"stage": settings.stage,
            "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    if settings.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": BUCKET_ELEMENTS, "stage3_gather_16bit_weights_on_model_save": False})
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if settings.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    # The user's tuning (persistence thresholds, buckets, overlap) wins, but "auto" is not a value: it means "the
    # trainer decides" (HF Trainer fills it in), so finetune's own value stays. Where finetune has none it is passed
    # on, and DeepSpeed's schema drops it for its own default (deepspeed/runtime/config_utils.py).
    # Before, an "auto" bucket (LLaMA-Factory's ZeRO-3 JSON) replaced the 5e7 buckets with DeepSpeed's 5e8: 2 GB of
    # fp32 gradient buffer per GPU that the planner did not count.
    zero.update({key: value for key, value in settings.zero_section.items() if not (value == "auto" and key in zero)})
    return {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
            "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
            "gradient_clipping": t.max_grad_norm or 0.0, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}


def _validate_with_deepspeed(settings: ZeroSettings, where: str, problems: list[str], *, device_type: str) -> None:
    """The installed DeepSpeed's own schema for the ZeRO section: unknown or unsupported keys are named."""
    from pydantic import ValidationError

    # Only validating (maybe in `finetune train`'s parent, whose environment the workers inherit): the accelerator
    # choice is set for the import alone, so a GPU machine's workers still pick CUDA.
    previous = os.environ.get("DS_ACCELERATOR")
    _choose_accelerator("cpu" if not torch.cuda.is_available() else device_type)
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    finally:
        if previous is None:
            os.environ.pop("DS_ACCELERATOR", None)

    try:
        DeepSpeedZeroConfig(**settings.engine_config["zero_optimization"])
    except ValidationError as exc:
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"])
            problems.append(f"{where}: zero_optimization.{key}: {error['msg']} (the installed DeepSpeed does not accept "
                            "it). Fix: correct or remove that key.")


# ----------------------------------------------------------------------------------------------- the engine
def _choose_accelerator(device_type: str) -> None:
    """DeepSpeed picks its accelerator at import (CUDA when it sees one): a CPU run (no GPU, or ACCELERATE_USE_CPU)
    must say so before the import, or its tensors and finetune's process group would be on different devices."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _skip_shm_op_build() -> None:
    """deepspeed.comm builds a shared-memory all-reduce op with g++ on CPU the first time; plain gloo needs no compiler."""
    import importlib

    # importlib, not `import deepspeed.comm.torch as ...`: the package's `torch` attribute is torch itself.
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


def initialize(model: nn.Module, settings: ZeroSettings, *, device_type: str) -> nn.Module:
    """Wrap the PeftModel in a DeepSpeed engine with the recipe's torch AdamW (partitions it under ZeRO-3)."""
    _choose_accelerator(device_type)
    import deepspeed

    _skip_shm_op_build()
    # DeepSpeed calls the collectives torch renamed (all_gather_into_tensor...): one FutureWarning per call and rank.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=settings.engine_config,
                                           dist_init_required=False)
    engine.finetune_torch_optimizer = optimizer  # the scheduler steps this one; ZeRO steps it through its wrapper
    return engine


def is_engine(model) -> bool:
    return hasattr(model, "finetune_torch_optimizer")


def torch_optimizer(engine) -> torch.optim.Optimizer:
    return engine.finetune_torch_optimizer


def set_boundary(engine, *, last: bool) -> None:
    """Tell ZeRO whether this micro-batch ends the optimizer step (it reduces and keeps gradients accordingly)."""
    engine.set_gradient_accumulation_boundary(last)


def backward(engine, loss: torch.Tensor) -> None:
    engine.backward(loss, scale_wrt_gas=False)  # the loop's normalization is already per step, over every rank


def optimizer_step(engine) -> tuple[float, bool]:
    """ZeRO's step: global grad norm, clip, AdamW, zero grads. A NaN/inf norm makes it skip the update by itself.

    Returns (norm before clipping, whether the parameters changed).
    """
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else float("nan")
    return norm, bool(engine.was_step_applied())


def _partitioned(engine, params: list[nn.Parameter]):
    """Context in which ZeRO-3 parameters hold their full data on every rank (no-op under ZeRO-2)."""
    import contextlib

    import deepspeed

    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def trainable_state_dict(engine, names) -> dict[str, torch.Tensor]:
    """Full LoRA tensors gathered from the partitions, on every rank (a collective: every rank calls it)."""
    names = set(names)
    named = [(name, param) for name, param in engine.module.named_parameters() if name in names]
    with _partitioned(engine, [param for _, param in named]):
        return {name: param.detach().to("cpu").clone() for name, param in named}


def local_parameter_bytes(engine) -> dict[str, int]:
    """Bytes of parameters this rank holds: its ZeRO-3 partitions (`ds_tensor`) plus anything left gathered.

    `packed_4bit_*`: the bitsandbytes weights alone, this rank's partitions and their whole size (ds_numel).
    """
    frozen = trainable = gathered = packed_held = packed_whole = 0
    for param in engine.module.parameters():
        partition = getattr(param, "ds_tensor", None)
        size = param.data.numel() * param.data.element_size()
        if partition is not None:
            gathered += size
            size += partition.numel() * partition.element_size()
        if param.requires_grad:
            trainable += size
        else:
            frozen += size
        if type(param).__name__ == "Params4bit":
            packed_held += size
            packed_whole += getattr(param, "ds_numel", param.numel()) * param.element_size()
    return {"frozen_bytes": frozen, "trainable_bytes": trainable, "gathered_bytes": gathered,
            "packed_4bit_bytes": packed_held, "packed_4bit_whole_bytes": packed_whole}


def generation_module(engine) -> nn.Module:
    """The PeftModel. Under ZeRO-3 its forwards gather parameters layer by layer, so generation must run the same
    number of forwards on every rank (parallel.generation_model uses fixed-length greedy decoding then)."""
    return engine.module
