"""What the launcher asks for: accelerate's config (as the ACCELERATE_* / FSDP_* environment it gives its workers),
torchrun and the deepspeed launcher (ranks only)."""

from __future__ import annotations

import os

from finetune.errors import LaunchError
from finetune.parallel import zero


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
        env.update(zero.accelerate_config_env(config))
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
    settings.update(zero.launcher_settings(env))
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed and mixed != "no":
        settings["mixed_precision"] = mixed
    return {k: v for k, v in settings.items() if v is not None}
