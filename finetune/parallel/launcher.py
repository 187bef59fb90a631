"""What the launcher asks for: accelerate's config (as the ACCELERATE_* / FSDP_* environment it gives its workers),
torchrun and the deepspeed launcher (ranks only)."""

from __future__ import annotations

import os

from finetune.errors import LaunchError
from finetune.parallel import accelerate_keys, zero


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


SHARDING_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "_HYBRID_SHARD_ZERO2"}


def fsdp_sharding(env) -> str | None:
    """The FSDP sharding strategy the config asks for, by name, from either of accelerate's two keys.

    accelerate writes both whatever the file says: FSDP_RESHARD_AFTER_FORWARD (default "true"; FSDP2 takes a bool,
    FSDP1 a bool or a strategy name) and FSDP_SHARDING_STRATEGY (default FULL_SHARD; the older FSDP1 key, a name or
    its number). A value other than the default states the file's choice: `fsdp_sharding_strategy: SHARD_GRAD_OP` left
    the reshard key at its default "true", which alone read as full shard.
    """
    reshard = (env.get("FSDP_RESHARD_AFTER_FORWARD") or "").strip()
    strategy = (env.get("FSDP_SHARDING_STRATEGY") or "").strip().upper()
    strategy = SHARDING_NUMBERS.get(strategy, strategy)
    if reshard.lower() in ("false", "0", "no"):
        return "SHARD_GRAD_OP"
    if reshard and reshard.lower() not in ("true", "1", "yes"):
        return SHARDING_NUMBERS.get(reshard.upper(), reshard.upper())
    if strategy:
        return strategy
    return "FULL_SHARD" if reshard else None


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
        sharding = fsdp_sharding(env)
        if sharding is not None:
            settings["reshard_after_forward"] = sharding not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
            if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                settings["sharding_strategy"] = sharding  # judged in accelerate_keys.check
        # accelerate writes these two as "false" even when the config file does not mention them, so only an
        # explicit "true" is a statement of the config that the recipe may contradict.
        settings["cpu_offload"] = _env_bool("FSDP_OFFLOAD_PARAMS") or None
        settings["activation_checkpointing"] = _env_bool("FSDP_ACTIVATION_CHECKPOINTING") or None
        settings["layer_class"] = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
        settings["auto_wrap_policy"] = env.get("FSDP_AUTO_WRAP_POLICY") or None
        settings["cpu_ram_efficient_loading"] = _env_bool("FSDP_CPU_RAM_EFFICIENT_LOADING")
    settings.update(accelerate_keys.read(env))
    settings.update(zero.launcher_settings(env))
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed and mixed != "no":
        settings["mixed_precision"] = mixed
    return {k: v for k, v in settings.items() if v is not None}
