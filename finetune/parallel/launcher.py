"""What the launcher asks for: accelerate's config (as the ACCELERATE_* / FSDP_* environment it gives its workers),
torchrun and the deepspeed launcher (ranks only)."""

from __future__ import annotations

import os

from finetune.errors import LaunchError
from finetune.parallel import accelerate_keys, zero
from finetune.precision import started_by_accelerate


# ---------------------------------------------------------------------------------------- launcher settings
def accelerate_config_env(path: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file PATH` would give its workers (the parts we read)."""
    import yaml

    try:
        with open(path) as handle:
            config = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise LaunchError(f"accelerate config {path}: file not found. Fix: give the path of an accelerate config file, "
                          f"or to `finetune train`/`validate` a library config by name: {library_config_names()}.") from None
    except yaml.YAMLError as exc:
        raise LaunchError(f"accelerate config {path}: not valid YAML ({exc}).") from None
    if not isinstance(config, dict) or not {"distributed_type", "compute_environment"} & set(config):
        recipe = isinstance(config, dict) and {"model", "data"} <= set(config)
        raise LaunchError(f"accelerate config {path}: not an accelerate config (it has no distributed_type"
                          f"{'; it looks like a recipe' if recipe else ''}). Fix: pass a library config by name (fsdp2, "
                          "fsdp1, ddp, single_gpu, deepspeed_zero2, deepspeed_zero3) or a file `accelerate config` wrote.")
    env = {"ACCELERATE_NUM_PROCESSES": str(config.get("num_processes", 1)),
           "ACCELERATE_NUM_MACHINES": str(config.get("num_machines", 1))}  # ours: accelerate gives workers LOCAL_WORLD_SIZE
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


def library_config_names() -> str:
    """The library's accelerate configs, as `--accelerate-config` takes them by name (fsdp2, ddp, ...)."""
    from finetune.recipe_library import data_dir

    return ", ".join(sorted(path.stem for path in data_dir("accelerate_configs").glob("*.yaml"))) or "none found"


# accelerate's launch_command (accelerate/commands/launch.py) starts a config whose distributed_type is FSDP, DEEPSPEED,
# MEGATRON_LM or MULTI_* (MULTI_GPU: ddp.yaml) through torch's elastic launcher (multi_gpu_launcher, deepspeed_launcher)
# whatever num_processes says: WORLD_SIZE and MASTER_ADDR are set, so even one process forms a group, of one rank
# (finetune/distributed.py), and FSDP or ZeRO with CPU offload runs over it (the one-GPU offload route). Only a config
# of distributed_type NO (single_gpu.yaml), or the `--cpu` flag (which `finetune train` never passes; the config's
# use_cpu and ACCELERATE_USE_CPU do not count), takes the simple launcher: one process, without a group.
def accelerate_launch_forms_group(path: str) -> bool:
    """Whether `accelerate launch --config_file PATH`, as `finetune train` runs it, gives its processes a group."""
    import yaml

    with open(path) as handle:
        config = yaml.safe_load(handle) or {}
    kind = str(config.get("distributed_type", "NO") if isinstance(config, dict) else "NO").upper()
    return kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM") or kind.startswith("MULTI_")


# accelerate's FSDP1 sharding strategies (its constants.FSDP_SHARDING_STRATEGY; the number is the name's place + 1). The
# names reach the workers in two variables: FSDP_SHARDING_STRATEGY (fsdp_sharding_strategy, the older key; accelerate
# launch always sets it, FULL_SHARD when the config has none) and FSDP_RESHARD_AFTER_FORWARD (fsdp_reshard_after_forward,
# where `accelerate config` writes FSDP1's strategy name, and FSDP2's bool; accelerate launch always sets it, "true"
# when the config has none). Both are read: HYBRID_SHARD in either means hybrid, SHARD_GRAD_OP or false in either means
# no reshard after forward, so neither variable's default hides what the other states.
SHARDING_NAMES = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "HYBRID_SHARD": (True, True)}
UNSUPPORTED_SHARDING = {"NO_SHARD": "NO_SHARD replicates the whole model on every rank: that is DDP (accelerate_configs/"
                                    "ddp.yaml, or parallel.strategy: ddp)",
                        "HYBRID_SHARD_ZERO2": "HYBRID_SHARD_ZERO2 (hybrid shard without resharding after forward) is not "
                                              "implemented: use HYBRID_SHARD"}
_NUMBERED = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


def sharding_settings(strategy: str | None, reshard: str | None) -> dict:
    """reshard_after_forward / hybrid_shard from the two variables accelerate writes (see SHARDING_NAMES), or
    `unsupported_sharding` (a sentence) for a name this tool does not implement, refused by the checks; hybrid_shard
    only when a variable says HYBRID_SHARD (the defaults accelerate writes state nothing about it)."""
    reshard_values, hybrid = [], False
    for key, value in (("fsdp_sharding_strategy", strategy), ("fsdp_reshard_after_forward", reshard)):
        text = (value or "").strip()
        if text.lower() in ("", "none"):
            continue
        if key == "fsdp_reshard_after_forward" and text.lower() in ("true", "false", "1", "0", "yes", "no"):
            reshard_values.append(text.lower() in ("true", "1", "yes"))  # FSDP2's bool (and FSDP1's, as accelerate writes it)
            continue
        name = text.upper().lstrip("_")
        if name.isdigit() and 1 <= int(name) <= len(_NUMBERED):
            name = _NUMBERED[int(name) - 1]
        if name not in SHARDING_NAMES:
            why = UNSUPPORTED_SHARDING.get(name, f"{text!r} is not an FSDP sharding strategy this tool knows "
                                                 f"(FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD)")
            return {"unsupported_sharding": f"the accelerate config has {key}: {text}: {why}"}
        name_reshards, name_hybrid = SHARDING_NAMES[name]
        reshard_values.append(name_reshards)
        hybrid = hybrid or name_hybrid
    settings: dict = {}
    if reshard_values:
        settings["reshard_after_forward"] = all(reshard_values)
    if hybrid:
        settings["hybrid_shard"] = True
    return settings


def launcher_config_file() -> str | None:
    """The accelerate config this process was launched with, as the user named it (for errors): `--config_file` on
    the parent `accelerate launch` command line (made absolute from the parent's folder), else accelerate's default
    config where it exists; None outside `accelerate launch` or where /proc cannot say."""
    from pathlib import Path

    parent = Path(f"/proc/{os.getppid()}")
    try:
        argv = (parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        cwd = os.readlink(parent / "cwd")
    except OSError:
        return None
    if not any("accelerate" in part for part in argv[:3]):
        return None
    for index, part in enumerate(argv):
        for flag in ("--config_file", "--config-file"):
            value = argv[index + 1] if part == flag and index + 1 < len(argv) else (
                part.split("=", 1)[1] if part.startswith(flag + "=") else None)
            if value:
                return value if os.path.isabs(value) else os.path.normpath(os.path.join(cwd, value))
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return None
    return default_config_file if os.path.isfile(default_config_file) else None


# The variables launcher_settings reads (one of these that changes nothing it reads is not named as ignored).
_SETTING_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def ignored_environment(env=None) -> list[str]:
    """`NAME=value` of each variable launcher_settings would read as an accelerate config's setting, set in an
    environment that no `accelerate launch` made (precision.started_by_accelerate), so ignored; empty in a launch."""
    env = dict(os.environ if env is None else env)
    if started_by_accelerate(env):
        return []

    def read(variables: dict) -> dict | str:
        try:
            return launcher_settings(variables)
        except (ValueError, TypeError) as exc:  # (a value no launch writes, e.g. FSDP_VERSION=x)
            return str(exc)

    settings = read(env)
    if not settings:
        return []
    named = [name for name in sorted(env) if name.startswith(_SETTING_PREFIXES)
             and read({k: v for k, v in env.items() if k != name}) != settings]
    return [f"{name}={env[name]}" for name in named]


def ignored_environment_note(env=None) -> str | None:
    """The one line that names the ignored variables (ignored_environment) and the fix, or None."""
    ignored = ignored_environment(env)
    if not ignored:
        return None
    names = " ".join(item.split("=", 1)[0] for item in ignored)
    return (f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} set in the environment, but no accelerate "
            "launch started this process: ignored (accelerate launch replaces these with its config's settings; the "
            f"recipe, or an accelerate config given to the launch, decides). Fix: unset {names} (a launch's settings "
            "belong in its accelerate config: `finetune train R.yaml --accelerate-config FILE`).")


def launcher_settings(env: dict[str, str] | None = None) -> dict:
    """What the accelerate config (via `accelerate launch`'s environment) asks for; empty under torchrun/python, and
    for this process's own environment where no accelerate launch made it (started_by_accelerate). `env`: the
    environment of a launch (accelerate_config_env's, or a test's), read as it is."""
    if env is None:
        if not started_by_accelerate():
            return {}
        env = os.environ

    def _env_bool(name: str) -> bool | None:
        value = env.get(name)
        if value is None or value == "":
            return None
        return value.strip().lower() in ("1", "true", "yes")

    settings: dict = {}
    if _env_bool("ACCELERATE_USE_FSDP"):
        settings["strategy"] = "fsdp"
        settings["fsdp_version"] = int(env.get("FSDP_VERSION", "1") or 1)
        settings.update(sharding_settings(env.get("FSDP_SHARDING_STRATEGY"), env.get("FSDP_RESHARD_AFTER_FORWARD")))
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
