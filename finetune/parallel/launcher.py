"""What the launcher asks for: accelerate's config (as the ACCELERATE_* / FSDP_* environment it gives its workers),
torchrun and the deepspeed launcher (ranks only)."""

from __future__ import annotations

import functools
import os

from finetune.errors import LaunchError
from finetune.parallel import accelerate_keys, zero
from finetune.parallel.config_keys import did_you_mean, found
from finetune.precision import started_by_accelerate


# ---------------------------------------------------------------------------------------- launcher settings
def accelerate_config_env(path: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file PATH` gives its workers (the variables finetune reads, named
    and written as accelerate/utils/launch.py writes them, accelerate's defaults included), after the file's keys are
    checked: one it does not know, or a section of the wrong shape, is refused here (accelerate would refuse the first
    kind after the launch, with a traceback, and drop the second without a word)."""
    config = _read_accelerate_config(path)
    if problems := accelerate_config_problems(config):
        raise LaunchError(f"accelerate config {path}: {problems[0]}" if len(problems) == 1 else
                          f"accelerate config {path} cannot be used:\n" + "\n".join(f"  - {p}" for p in problems))
    kind = config.get("distributed_type")
    env = {"ACCELERATE_NUM_PROCESSES": str(config.get("num_processes", 1)),
           "ACCELERATE_NUM_MACHINES": str(config.get("num_machines", 1))}  # ours: accelerate gives workers LOCAL_WORLD_SIZE
    if config.get("mixed_precision"):
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"]).lower()  # as accelerate's PrecisionType
    if kind != "DEEPSPEED":  # accelerate's multi-GPU and simple launchers write it; its DeepSpeed launcher does not
        env["ACCELERATE_DYNAMO_BACKEND"] = _dynamo_backend(config)
    if kind == "FSDP":
        env.update(_fsdp_env(config.get("fsdp_config") or {}))
    if kind == "DEEPSPEED":
        env.update(zero.accelerate_config_env(config))
    # accelerate's multi-GPU and DeepSpeed launchers (not the simple one, which MULTI_CPU takes) add these
    # (prepare_extend_env_parallelism_config)
    if config.get("parallelism_config") and (kind in ("FSDP", "DEEPSPEED") or (
            str(kind).startswith("MULTI_") and kind != "MULTI_CPU")):
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        defaults = _launch_defaults()
        for size in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            key = f"parallelism_config_{size}_size"
            env[key.upper()] = str(config["parallelism_config"].get(key, defaults.get(key)))
    return env


def _read_accelerate_config(path: str) -> dict:
    import yaml

    try:  # UTF-8 as accelerate reads it, whatever the locale (a comment with `ü`: a UnicodeDecodeError under LC_ALL=C)
        with open(path, encoding="utf-8-sig") as handle:
            config = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise LaunchError(f"accelerate config {path}: file not found. Fix: give the path of an accelerate config file, "
                          f"or to `finetune train`/`validate` a library config by name: {library_config_names()}.") from None
    except yaml.YAMLError as exc:  # one paragraph with the line and the fix, as a recipe's (not PyYAML's 3 lines, bb56)
        from finetune.recipe.text import yaml_syntax_error

        raise LaunchError(f"accelerate config {yaml_syntax_error(exc, path)}") from None
    except UnicodeDecodeError as exc:
        raise LaunchError(f"accelerate config {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at byte "
                          f"{exc.start}). Fix: save it as UTF-8 (in most editors: Save As, encoding UTF-8).") from None
    if not isinstance(config, dict) or not {"distributed_type", "compute_environment"} & set(config):
        recipe = isinstance(config, dict) and {"model", "data"} <= set(config)
        raise LaunchError(f"accelerate config {path}: not an accelerate config (it has no distributed_type"
                          f"{'; it looks like a recipe' if recipe else ''}). Fix: pass a library config by name (fsdp2, "
                          "fsdp1, ddp, single_gpu, deepspeed_zero2, deepspeed_zero3) or a file `accelerate config` wrote.")
    return config


# accelerate launch copies a section's keys onto its own arguments (commands/launch.py, _validate_launch_command): an
# fsdp_config key without the `fsdp` prefix gets `fsdp_`, a dynamo_config key without `dynamo_` gets `dynamo_`; the
# other sections' keys are taken as they are. A key that matches none of its arguments is dropped without a word.
_SECTION_PREFIX = {"fsdp_config": ("fsdp", "fsdp_"), "dynamo_config": ("dynamo_", "dynamo_"),
                   "deepspeed_config": None, "parallelism_config": None}
_SECTION_EXAMPLE = {"fsdp_config": "fsdp_version: 2", "dynamo_config": "dynamo_backend: 'NO'",
                    "deepspeed_config": "zero_stage: 3", "parallelism_config": "parallelism_config_dp_shard_size: 2"}
# Sections whose contents finetune never reads (their kinds of run are not finetune's): only their shape is checked.
_OTHER_SECTIONS = ("fp8_config", "megatron_lm_config", "mpirun_config")
# Read by accelerate's launcher from its arguments without being a command-line flag (utils/launch.py, getattr).
_SECTION_EXTRA_KEYS = {"fsdp_config": {"fsdp_ignored_modules"}}


def _section_key(section: str, key) -> str:
    """The argument of accelerate launch a section's key becomes (see _SECTION_PREFIX)."""
    rule = _SECTION_PREFIX.get(section)
    key = str(key)
    return key if rule is None or key.startswith(rule[0]) else rule[1] + key


@functools.lru_cache(maxsize=1)
def _launch_defaults() -> dict:
    """accelerate launch's arguments with their defaults, from the installed accelerate's own parser."""
    from accelerate.commands.launch import launch_command_parser

    return vars(launch_command_parser().parse_args(["finetune"]))


def _top_level_keys(config: dict) -> set[str]:
    """The keys accelerate's config file takes: its config class's fields (the class `accelerate config` writes and
    `accelerate launch` loads, refusing any other key), and the two old keys it converts (fp16, dynamo_backend)."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    kind = SageMakerConfig if config.get("compute_environment") == "AMAZON_SAGEMAKER" else ClusterConfig
    return {field.name for field in dataclasses.fields(kind)} | {"fp16", "dynamo_backend"}


def accelerate_config_problems(config: dict) -> list[str]:
    """Every key accelerate does not know (with the known one it is closest to), and every section that is not a
    mapping; empty for any file `accelerate config` writes."""
    problems = []
    known = _top_level_keys(config)
    for key in config:
        if key not in known:
            problems.append(f"{key} is not a key of an accelerate config{did_you_mean(key, known)}: accelerate launch "
                            "refuses the file (\"had unknown keys\") after finetune's checks, and nothing it holds is "
                            "used. Fix: correct the key's name, or remove it.")
    arguments = set(_launch_defaults())
    for section in (*_SECTION_PREFIX, *_OTHER_SECTIONS):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            example = _SECTION_EXAMPLE.get(section, "key: value")
            problems.append(f"{section} must be a mapping of keys, each on its own indented line (e.g. `{example}`), "
                            f"found {found(value)}: accelerate would ignore it and launch with its defaults. Fix: write "
                            f"the section as `{section}:` followed by its keys indented below it (as the library's "
                            "accelerate_configs/*.yaml do), or remove it.")
            continue
        if section in _OTHER_SECTIONS:
            continue
        names = {name for name in arguments if name.startswith(_section_key(section, ""))} if _SECTION_PREFIX[section] \
            else arguments
        names |= _SECTION_EXTRA_KEYS.get(section, set())
        for key in value:
            if _section_key(section, key) not in names:
                hint = did_you_mean(_section_key(section, key), names)
                problems.append(f"{section}.{key} is not a key accelerate knows{hint}: accelerate launch drops it "
                                "without a word, so the run would go on without what it asks for. Fix: correct the "
                                "key's name, or remove it.")
    return problems


def _dynamo_backend(config: dict) -> str:
    """ACCELERATE_DYNAMO_BACKEND as accelerate launch writes it: dynamo_config's backend (or the old top-level
    dynamo_backend key), upper-case; NO where neither is set. YAML reads a bare `no` as false: that is NO too."""
    section = {_section_key("dynamo_config", key): value for key, value in (config.get("dynamo_config") or {}).items()}
    value = section.get("dynamo_backend", config.get("dynamo_backend"))
    return "NO" if value in (None, False, "") else str(value).upper()


# accelerate launch's FSDP variables (utils/launch.py, prepare_multi_gpu_env): the config key, its variable, and
# whether the value is lower-cased. The first group is written whatever the file says (accelerate's default when it
# has no such key); the second only when the file sets the key. fsdp_transformer_layer_cls_to_wrap is the one whose
# variable is not its key upper-cased: FSDP_TRANSFORMER_CLS_TO_WRAP.
_FSDP_ALWAYS = {"fsdp_sharding_strategy": ("FSDP_SHARDING_STRATEGY", False),
                "fsdp_reshard_after_forward": ("FSDP_RESHARD_AFTER_FORWARD", True),
                "fsdp_offload_params": ("FSDP_OFFLOAD_PARAMS", True), "fsdp_min_num_params": ("FSDP_MIN_NUM_PARAMS", False),
                "fsdp_forward_prefetch": ("FSDP_FORWARD_PREFETCH", True),
                "fsdp_use_orig_params": ("FSDP_USE_ORIG_PARAMS", True),
                "fsdp_cpu_ram_efficient_loading": ("FSDP_CPU_RAM_EFFICIENT_LOADING", True),
                "fsdp_sync_module_states": ("FSDP_SYNC_MODULE_STATES", True),
                "fsdp_activation_checkpointing": ("FSDP_ACTIVATION_CHECKPOINTING", True),
                "fsdp_activation_checkpointing_offload": ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", True)}
_FSDP_WHEN_SET = {"fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
                  "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
                  "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH", "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
                  "fsdp_ignored_modules": "FSDP_IGNORED_MODULES"}


def _fsdp_env(fsdp: dict) -> dict[str, str]:
    """The FSDP variables of accelerate launch for this fsdp_config (keys without the `fsdp` prefix get `fsdp_`)."""
    values = {**_launch_defaults(), **{_section_key("fsdp_config", key): value for key, value in fsdp.items()}}
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": str(values.get("fsdp_version", 1))}
    for key, (name, lower) in _FSDP_ALWAYS.items():
        env[name] = str(values.get(key)).lower() if lower else str(values.get(key))
    for key, name in _FSDP_WHEN_SET.items():
        if values.get(key) is not None:
            env[name] = str(values[key])
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

    with open(path, encoding="utf-8-sig") as handle:  # read by accelerate_config_env first, which refuses other text
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
        version = str(env.get("FSDP_VERSION") or "1").strip()
        # 1 and 2 are FSDP's versions; any other value stays as written, for checks.py to refuse (it was read as a
        # number and trained as FSDP1 without FSDP1's checks).
        settings["fsdp_version"] = int(version) if version in ("1", "2") else version
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
