"""The accelerate config's other keys: each one honoured or refused with its reason, none ignored in silence.

`accelerate launch` hands its workers the config as environment variables (ACCELERATE_*, FSDP_*, PARALLELISM_CONFIG_*),
and writes several of them whether the file has the key or not, with accelerate's own default (see DEFAULTS): a value
equal to that default says nothing about the file, so only other values are judged. The keys the plan is built from
(version, sharding, offload, layer class, wrap policy, checkpointing, mixed precision) are read in launcher.py and
checked in checks.py; the table of every key is in docs/distributed.md ("Every accelerate key").

Honoured here: fsdp_backward_prefetch and fsdp_forward_prefetch (FSDP1 takes them as arguments; FSDP2 has
BACKWARD_PRE only and forward prefetch by an explicit list of the next layer, finetune/parallel/wrapping.py),
fsdp_state_dict_type (the sharded kind is what checkpoints are; the
full kind is what the adapter is). Without effect, by construction (said in the docs, not on every run):
fsdp_sync_module_states (every rank loads the same bytes itself, the loader invariant), fsdp_use_orig_params (FSDP1
flat parameters never mix a frozen and a trained tensor: each LoRA leaf is a unit of its own), fsdp_min_num_params
(only read by the size-based wrap, which checks.py refuses). Refused: the rest that would change the run.
"""

from __future__ import annotations

# accelerate launch's defaults for the keys it always writes (accelerate/commands/launch.py).
DEFAULTS = {"FSDP_FORWARD_PREFETCH": "false", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
            "ACCELERATE_DYNAMO_BACKEND": "NO"}
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT")


def read(env) -> dict:
    """The settings of these keys that the environment states (values other than accelerate's defaults)."""
    settings: dict = {}
    fsdp = (env.get("ACCELERATE_USE_FSDP") or "").lower() in ("1", "true", "yes")
    if fsdp:
        if env.get("FSDP_BACKWARD_PREFETCH"):
            settings["backward_prefetch"] = env["FSDP_BACKWARD_PREFETCH"].upper()
        forward = (env.get("FSDP_FORWARD_PREFETCH") or DEFAULTS["FSDP_FORWARD_PREFETCH"]).lower()
        if forward != DEFAULTS["FSDP_FORWARD_PREFETCH"]:
            settings["forward_prefetch"] = forward in ("1", "true", "yes")
        if env.get("FSDP_STATE_DICT_TYPE"):
            settings["state_dict_type"] = env["FSDP_STATE_DICT_TYPE"].upper()
        offload = (env.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD") or "false").lower()
        if offload in ("1", "true", "yes"):
            settings["activation_checkpointing_offload"] = True
        if env.get("FSDP_IGNORED_MODULES"):
            settings["ignored_modules"] = env["FSDP_IGNORED_MODULES"]
    dynamo = (env.get("ACCELERATE_DYNAMO_BACKEND") or "NO").upper()
    if dynamo != DEFAULTS["ACCELERATE_DYNAMO_BACKEND"]:
        settings["dynamo_backend"] = dynamo
    if (env.get("ACCELERATE_USE_PARALLELISM_CONFIG") or "").lower() == "true":
        sizes = {key: env.get(f"PARALLELISM_CONFIG_{key.upper()}_SIZE", "1") for key in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
        settings["parallelism_config"] = {key: int(value) for key, value in sizes.items()
                                          if value not in ("", "None", "-1") and value.lstrip("-").isdigit()}
    return settings


def check(launcher: dict, plan, problems: list[str]) -> None:
    """Refuse what these keys ask for and this run cannot do; keep in the plan what it honours."""
    fsdp = plan.strategy == "fsdp"
    prefetch = launcher.get("backward_prefetch")
    if prefetch is not None and fsdp:
        if prefetch not in BACKWARD_PREFETCH:
            problems.append(f"the accelerate config has fsdp_backward_prefetch: {prefetch}, not one of "
                            f"{', '.join(BACKWARD_PREFETCH)}. Fix: use one of those, or remove the key.")
        elif prefetch != "BACKWARD_PRE" and plan.fsdp_version == 2:
            problems.append(
                f"the accelerate config has fsdp_backward_prefetch: {prefetch}, which FSDP2 does not have: it always "
                "gathers the next layer of the backward before the current layer's gradients are computed (FSDP1's "
                "BACKWARD_PRE), with no switch. Fix: set BACKWARD_PRE or remove the key, or train with FSDP1 "
                "(accelerate_configs/fsdp1.yaml), which takes all three.")
        else:
            plan.backward_prefetch = prefetch
    if launcher.get("forward_prefetch") is not None and fsdp:
        plan.forward_prefetch = launcher["forward_prefetch"]
    kind = launcher.get("state_dict_type")
    if kind is not None and fsdp:
        if kind == "LOCAL_STATE_DICT":
            problems.append(
                "the accelerate config has fsdp_state_dict_type: LOCAL_STATE_DICT: a rank's flat shard, which cannot be "
                "loaded at another world size. finetune's checkpoints are sharded per tensor (torch distributed "
                "checkpointing: SHARDED_STATE_DICT), resumable at any world size, and its adapter is written whole. "
                "Fix: set SHARDED_STATE_DICT or FULL_STATE_DICT, or remove the key.")
        elif kind not in STATE_DICT_TYPES:
            problems.append(f"the accelerate config has fsdp_state_dict_type: {kind}, not one of "
                            f"{', '.join(STATE_DICT_TYPES)}. Fix: use SHARDED_STATE_DICT, or remove the key.")
        elif kind == "FULL_STATE_DICT":
            plan.notes.append("fsdp_state_dict_type FULL_STATE_DICT: the adapter is written whole (adapter/, and "
                              "`finetune export RUN --step N` from any checkpoint); checkpoints stay sharded, which "
                              "resume at any world size")
    if launcher.get("activation_checkpointing_offload") and fsdp:
        problems.append(
            "the accelerate config has fsdp_activation_checkpointing_offload: true. finetune checkpoints activations "
            "itself (non-reentrant, on the device) and does not move them to CPU memory. Fix: remove the key (or set it "
            "false); for less memory see `finetune plan` (CPU offload of parameters, a smaller micro-batch).")
    if launcher.get("ignored_modules") and fsdp:
        problems.append(
            f"the accelerate config has fsdp_ignored_modules: {launcher['ignored_modules']}. finetune wraps every decoder "
            "layer and shards everything else with the root: a module left out of FSDP would be replicated and trained "
            "without its gradients reduced. Fix: remove the key.")
    _check_engine_keys(launcher, problems)


def _check_engine_keys(launcher: dict, problems: list[str]) -> None:
    """Keys outside fsdp_config: torch.compile and accelerate's ParallelismConfig."""
    if launcher.get("dynamo_backend"):
        problems.append(
            f"the accelerate config has dynamo_backend: {launcher['dynamo_backend']}. finetune does not torch.compile the "
            "model (4-bit layers and FSDP hooks break graphs into many pieces; nothing measured was faster). Fix: set "
            "dynamo_backend: 'NO', or remove dynamo_config.")
    sizes = launcher.get("parallelism_config")
    if sizes:
        extra = {key: value for key, value in sizes.items() if key in ("tp", "cp", "sp") and value > 1}
        if extra:
            problems.append(
                f"the accelerate config's parallelism_config asks for {', '.join(f'{k}_size: {v}' for k, v in extra.items())}: "
                "tensor, context and sequence parallelism are not strategies of finetune (data-parallel FSDP, DDP, "
                "DeepSpeed ZeRO, layer split). Fix: remove parallelism_config.")
        if sizes.get("dp_replicate", 1) > 1:
            problems.append(
                f"the accelerate config's parallelism_config asks for dp_replicate_size: {sizes['dp_replicate']} (replicas "
                "of a sharded group, FSDP's hybrid sharding). finetune takes that as fsdp_sharding_strategy: HYBRID_SHARD "
                "in fsdp_config (docs/distributed.md). Fix: remove parallelism_config and set the strategy there.")
