"""A user's DeepSpeed JSON, key by key: the ZeRO section is used, the keys the recipe owns must agree, a precision
section that would cast is refused, every other top-level key DeepSpeed knows is named as unused, and a key it does
not know is refused (with the known key it is closest to). Nothing in the file is dropped in silence, and a section
of the wrong shape (`"bf16": true`, `"offload_param": "cpu"`) is one sentence naming the key and the shape it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import LaunchError
from finetune.parallel.config_keys import did_you_mean, found

# Keys of a DeepSpeed JSON that the recipe owns (value must agree or be "auto") and sections it refuses.
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum",
              "gradient_clipping": "train.max_grad_norm", "train_batch_size": "train.micro_batch_size x train.grad_accum x processes"}
OWNED_SECTIONS = {"optimizer": "train.optimizer / train.learning_rate / train.weight_decay",
                  "scheduler": "train.lr_schedule / train.warmup_steps"}
# The precision sections (bfloat16: DeepSpeed's older name of bf16, which it still reads): `enabled: true` would cast.
PRECISION_SECTIONS = ("fp16", "bf16", "bfloat16", "amp")
OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")
# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the configs it calls) that finetune does not
# pass on: its engine config is the recipe's batch and clipping, its own settings and the zero_optimization section.
# The reason is said where one key has its own; the rest share the general one.
UNUSED_WHY = {
    "communication_data_type": "gradients are reduced in the fp32 LoRA weights' own dtype",
    "activation_checkpointing": "train.gradient_checkpointing is finetune's own, non-reentrant, per decoder layer",
    "data_types": "gradients are accumulated in the LoRA weights' fp32",
    "torch_autocast": "finetune computes in the recipe's model.dtype, without autocast",
    "zero_allow_untested_optimizer": "finetune sets it true: ZeRO wraps the recipe's torch AdamW",
    "zero_force_ds_cpu_optimizer": "finetune sets it false: ZeRO-Offload steps the recipe's torch AdamW",
    "steps_per_print": "finetune logs every train.log_every steps",
    "wall_clock_breakdown": "finetune logs every train.log_every steps",
}
UNUSED = set(UNUSED_WHY) | {
    "aio", "autotuning", "checkpoint", "comms_logger", "comet", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "dataloader_drop_last", "disable_allgather", "disable_python_gc",
    "dump_state", "eigenvalue", "elasticity", "expert_parallel", "flops_profiler", "gradient_allreduce_op",
    "gradient_predivide_factor", "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown",
    "nebula", "pipeline", "prescale_gradients", "progressive_layer_drop", "quantize_training", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "sparse_attention", "sparse_gradients", "tensor_parallel", "tensorboard", "timers",
    "use_data_before_expert_parallelism", "vocabulary_size", "wandb", "weight_quantization",
}
# Engine settings finetune gives DeepSpeed itself: a file that says the same is honoured, not noted.
SET_BY_FINETUNE = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
KNOWN = {"zero_optimization", *BATCH_KEYS, *OWNED_SECTIONS, *PRECISION_SECTIONS, *UNUSED}


def read_config_file(path: str, where: str) -> dict:
    """A DeepSpeed JSON config (as DeepSpeed reads it: plain JSON); refusals name the file and the fix."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")  # UTF-8 whatever the locale; a BOM dropped
    except UnicodeDecodeError as exc:
        raise LaunchError(f"{where}: DeepSpeed config {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                          f"byte {exc.start}). Fix: save it as UTF-8 (in most editors: Save As, encoding UTF-8).") from None
    except OSError as exc:
        raise LaunchError(f"{where}: DeepSpeed config {path} cannot be read ({exc.strerror or exc}). Fix: give the path of "
                          "a DeepSpeed JSON file, relative to the folder the run starts in, or remove it.") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LaunchError(f"{where}: DeepSpeed config {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}). Fix: correct the file (DeepSpeed reads plain JSON: no comments, no trailing commas).") from None
    if not isinstance(config, dict):
        raise LaunchError(f"{where}: DeepSpeed config {path} must hold a JSON object, found {type(config).__name__}.")
    return config


def zero_section(user: dict, config_file: str | None, problems: list[str]) -> dict:
    """The JSON's zero_optimization, an object whose offload sections are objects; a wrong shape is refused (and
    left out of what is returned, so that nothing after reads it)."""
    section = user.get("zero_optimization")
    if section is None:
        return {}
    if not isinstance(section, dict):
        example = f'{{"stage": {section}}}' if isinstance(section, int) and not isinstance(section, bool) else '{"stage": 3}'
        problems.append(f"{config_file}: zero_optimization must be an object of ZeRO settings, e.g. {example}, found "
                        f"{found(section)}. Fix: write \"zero_optimization\": {example}.")
        return {}
    section = dict(section)
    for key in OFFLOAD_SECTIONS:
        value = section.get(key)
        if value is not None and not isinstance(value, dict):
            device = value if isinstance(value, str) else "cpu"
            problems.append(f"{config_file}: zero_optimization.{key} must be an object such as {{\"device\": \"cpu\"}}, "
                            f"found {found(value)}. Fix: write \"{key}\": {{\"device\": \"{device}\"}} (or "
                            f"{{\"device\": \"none\"}}, or remove it).")
            section.pop(key)
    return section


def check_top_level_keys(user: dict, config_file: str | None, problems: list[str], notes: list[str]) -> None:
    """Precision sections that would cast (or are not objects), keys DeepSpeed does not know (refused: a typo of
    `zero_optimization` turned a ZeRO-2 file into ZeRO-3 without a word), and the keys finetune does not pass on (one
    note naming them)."""
    for key in PRECISION_SECTIONS:
        value = user.get(key)
        if value is None:
            continue
        alias = " (DeepSpeed's older name of bf16)" if key == "bfloat16" else ""
        if not isinstance(value, dict):
            problems.append(f"{config_file}: {key}{alias} must be an object such as {{\"enabled\": false}}, found "
                            f"{found(value)}. The dtype is the recipe's model.dtype (LoRA masters stay fp32). Fix: "
                            f"remove the `{key}` section (model.dtype: bfloat16 in the recipe trains in bf16).")
        elif value.get("enabled") in (True, "true"):
            problems.append(f"{config_file}: `{key}.enabled: true`{alias} would cast the model, the packed 4-bit storage "
                            f"included. The dtype is the recipe's model.dtype (LoRA masters stay fp32). Fix: remove the "
                            f"`{key}` section.")
    for key in user:
        if key not in KNOWN:
            problems.append(f"{config_file}: `{key}` is not a key of DeepSpeed's config{did_you_mean(key, KNOWN)}: "
                            "DeepSpeed would ignore it without a word, and so would the run. Fix: correct the key's "
                            "name, or remove it.")
    unused = [f"{key} ({UNUSED_WHY[key]})" if key in UNUSED_WHY else key for key, value in user.items()
              if key in UNUSED and not (key in SET_BY_FINETUNE and value == SET_BY_FINETUNE[key])]
    if unused:
        notes.append(f"{config_file}: not used: {', '.join(unused)}. finetune gives DeepSpeed the recipe's batch, "
                     "clipping and precision, its own engine settings and this file's zero_optimization section only "
                     "(docs/distributed.md)")


def check_owned_keys(recipe, user: dict, launcher: dict, config_file: str | None, world_size: int,
                     problems: list[str]) -> None:
    """Batch sizes, accumulation, clipping, optimizer and schedule are the recipe's: a config that says otherwise is refused."""
    t = recipe.train
    wanted = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
              "gradient_clipping": t.max_grad_norm or 0.0, "train_batch_size": t.micro_batch_size * t.grad_accum * world_size}
    sources = [(f"{config_file}: {key}", key, user.get(key)) for key in BATCH_KEYS]
    sources += [("the accelerate config's gradient_accumulation_steps", "gradient_accumulation_steps",
                 launcher.get("gradient_accumulation_steps")),
                ("the accelerate config's gradient_clipping", "gradient_clipping", launcher.get("gradient_clipping"))]
    for where, key, value in sources:
        if value is None or value == "auto":
            continue
        try:
            same = float(value) == float(wanted[key])
        except (TypeError, ValueError):
            same = False
        if not same:
            problems.append(f"{where} is {value!r} but the recipe gives {wanted[key]!r} ({BATCH_KEYS[key]}). The recipe sets "
                            f"batch sizes, accumulation and clipping for every strategy. Fix: set it to {wanted[key]!r} or "
                            "\"auto\", or remove it.")
    for section, owner in OWNED_SECTIONS.items():
        if section in user:
            problems.append(f"{config_file}: the `{section}` section is not used: the recipe's {owner} drive every strategy "
                            "(a torch AdamW wrapped by DeepSpeed; DeepSpeed's own Adam would compile FusedAdam/CPUAdam first). "
                            f"Fix: remove the `{section}` section.")
