"""The parallel plan: which strategy this run uses, chosen and checked before any weight loads.

`resolve_plan` reads the recipe, the launcher's environment (finetune/parallel/launcher.py) and the model's config on
the meta device; with GPUs in sight the memory planner (finetune/planner/) decides `strategy: auto` and warns when an
explicit strategy will not fit. Every refusal names its fix (the checks are finetune/parallel/checks.py).
"""

from __future__ import annotations

import torch

from finetune.distributed import DistInfo, print0
from finetune.errors import LaunchError, train_launch_fix
from finetune.parallel import accelerate_keys, zero
from finetune.parallel.checks import check_agreement, check_fsdp_rules, layer_class_names
from finetune.parallel.decision import ParallelPlan, Strategy
from finetune.parallel.launcher import launcher_config_file, launcher_settings
from finetune.parallel.layers import decoder_layer_class, layer_split_device_map, meta_model
from finetune.recipe import Recipe
from finetune.recipe.checks import checkpointing


def detect_gpus(dist: DistInfo) -> tuple[int, int] | None:
    """(GPUs per node, bytes per GPU) when this process runs on CUDA, else None (nothing to plan memory for)."""
    if dist.device.type != "cuda":
        return None
    per_node = dist.local_world_size if dist.world_size > 1 else torch.cuda.device_count()
    return per_node, torch.cuda.get_device_properties(dist.device).total_memory


def resolve_plan(recipe: Recipe, dist: DistInfo, model_config, *, launcher: dict | None = None,
                 gpus: tuple[int, int] | None = None, config_file: str | None = None) -> ParallelPlan:
    """Choose and check the strategy before any weight loads; every refusal names its fix.

    `gpus` = (GPUs per node, bytes per GPU) turns on the memory planner: `strategy: auto` then follows its decision,
    and an explicit strategy it says will not fit gets a warning with the figures (an error with `parallel.strict`).
    `config_file`: the accelerate config `launcher` was read from, for a refusal (a rank reads its launcher's).
    """
    from finetune.model import torch_dtype

    launcher = launcher_settings() if launcher is None else launcher
    problems: list[str] = []
    gpus = gpus or detect_gpus(dist)
    decision, planner_notes = _planner_decision(recipe, dist, model_config, gpus) if gpus else (None, [])
    strategy = _choose_strategy(recipe, dist, launcher, problems, decision)
    p = recipe.parallel
    plan = ParallelPlan(
        strategy=strategy,
        world_size=dist.world_size,
        fsdp_version=p.fsdp_version or launcher.get("fsdp_version", 2),
        reshard_after_forward=p.reshard_after_forward if p.reshard_after_forward is not None else launcher.get("reshard_after_forward", True),
        cpu_offload=bool(p.cpu_offload if p.cpu_offload is not None else launcher.get("cpu_offload", False)),
        activation_checkpointing=checkpointing(recipe),  # the setting the architecture check reads too
        param_dtype=torch_dtype(recipe.model.dtype),
    )
    plan.notes += planner_notes
    plan.replicas = _hybrid_replicas(recipe, dist, launcher, plan, problems)
    if decision is not None:
        _apply_decision(recipe, plan, decision, launcher, problems)
    check_agreement(recipe, launcher, plan, problems)  # (and notes a sharding config launched as one process)
    check_fsdp_rules(recipe, launcher, plan, problems)
    accelerate_keys.check(launcher, plan, problems)
    if strategy == "deepspeed":
        plan.zero = zero.resolve(recipe, launcher, world_size=dist.world_size, device_type=dist.device.type,
                                             problems=problems, notes=plan.notes)
        plan.cpu_offload = plan.zero.offload_params
    if problems:
        raise _refusal(problems, config_file or (launcher_config_file() if launcher else None))
    if strategy in ("fsdp", "layer_split") or p.layer_class:
        meta = meta_model(model_config, trust_remote_code=recipe.model.trust_remote_code)
        layer_cls = _unit_class(meta, p.layer_class, launcher.get("layer_class"), plan, config_file)
        plan.layer_class = layer_cls.__name__
        if strategy == "layer_split":
            count = torch.cuda.device_count() if dist.device.type == "cuda" else 0
            devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
            plan.device_map = layer_split_device_map(meta, layer_cls, devices)
    if plan.cpu_offload and dist.device.type == "cpu" and strategy == "fsdp":
        if plan.fsdp_version == 2:
            # Kept on: FSDP2's offload code (CPU-resident shards and gradients, the norm over them) runs as on GPUs,
            # unpinned, so the CPU suite exercises it; it only saves memory where the compute device is a GPU.
            plan.notes.append("parameter offload on a CPU-only machine: the offload code runs, but saves no memory here")
        else:  # FSDP1's CPUOffload always pins host memory, which needs an accelerator
            plan.notes.append("parameter offload asked for, but FSDP1 pins offloaded memory and this machine has no "
                              "GPU: offload off (the parameters already live in CPU memory)")
            plan.cpu_offload = False
    plan.sharded_loading = strategy == "fsdp" and p.sharded_loading and not recipe.lora.dora
    if strategy == "fsdp" and not plan.sharded_loading:
        why = "lora.dora: DoRA's magnitudes come from the full weights" if recipe.lora.dora else "parallel.sharded_loading: false"
        plan.notes.append(f"{why}: every rank loads and quantizes the full base before FSDP shards it")
    return plan


def _unit_class(meta, recipe_class: str | None, config_classes: str | None, plan: ParallelPlan,
                config_file: str | None) -> type:
    """The FSDP unit (layer split's layer): parallel.layer_class, else the accelerate config's
    fsdp_transformer_layer_cls_to_wrap, else the model's decoder layer. The config's key is a comma-separated list in
    accelerate (a multimodal model's decoder and vision blocks): each name must be a class of the model (refused
    naming the file otherwise); the unit is the model's decoder layer where the list holds it, else the first name.
    finetune wraps one class, so the others are sharded with the unit that holds them, which a note says."""
    names = [] if recipe_class else layer_class_names(config_classes)
    if not names:
        return decoder_layer_class(meta, recipe_class)
    try:
        classes = list(dict.fromkeys(decoder_layer_class(meta, name) for name in names))
    except LaunchError as exc:
        raise _refusal([str(exc)], config_file or launcher_config_file()) from None
    default = decoder_layer_class(meta)
    unit = default if default in classes else classes[0]
    if len(classes) > 1:
        others = [cls.__name__ for cls in classes if cls is not unit]
        why = " (the model's decoder layer)" if unit is default else ""
        plan.notes.append(f"fsdp_transformer_layer_cls_to_wrap lists {', '.join(names)}: the FSDP unit is "
                          f"{unit.__name__}{why}; finetune wraps one class, so {', '.join(others)} "
                          f"{'is' if len(others) == 1 else 'are'} sharded with the unit that holds "
                          f"{'it' if len(others) == 1 else 'them'} (a decoder layer, or the root)")
    return unit


def _hybrid_replicas(recipe: Recipe, dist: DistInfo, launcher: dict, plan: ParallelPlan, problems: list[str]) -> int:
    """Replica groups under hybrid shard (parallel.hybrid_shard, or the accelerate config's HYBRID_SHARD): one per node.

    The node count is the launcher's: WORLD_SIZE // LOCAL_WORLD_SIZE (accelerate's num_machines and torchrun's
    --nnodes both set LOCAL_WORLD_SIZE to the processes of one machine). Shard groups are the ranks of one node, so
    the all-gathers and reduce-scatters of every layer stay inside a machine and only the gradient all-reduce crosses
    machines. A hybrid shard asked for on one node is FSDP full shard (one group), said in a note.
    """
    asked = recipe.parallel.hybrid_shard
    hybrid = asked if asked is not None else bool(launcher.get("hybrid_shard"))
    if launcher.get("unsupported_sharding"):
        problems.append(f"{launcher['unsupported_sharding']}. Fix: set fsdp_sharding_strategy (or "
                        "fsdp_reshard_after_forward) to FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, or remove it.")
    if not hybrid:
        return 1
    if plan.strategy != "fsdp":
        problems.append(f"parallel.hybrid_shard is true but the strategy is {plan.strategy}: hybrid shard is an FSDP "
                        "sharding. Fix: set parallel.strategy: fsdp (or launch with an FSDP accelerate config), or "
                        "remove parallel.hybrid_shard.")
        return 1
    if plan.fsdp_version == 1:
        # FSDP1's HYBRID_SHARD needs its own process groups through every FSDP1 path here (the LoRA units' sharded
        # state dicts for DCP checkpoints, the per-unit gathers of the adapter): not built or tested. Refused rather
        # than trained as full shard.
        problems.append("hybrid shard (HYBRID_SHARD) is implemented for FSDP2 only: FSDP1's hybrid sharding would need "
                        "its own process groups in the checkpoint and adapter code, which is not built, and it is not "
                        "trained as full shard behind your back. Fix: use FSDP2 (fsdp_version: 2 in the accelerate "
                        "config, e.g. accelerate_configs/multi_node.yaml, or parallel.fsdp_version: 2), or drop "
                        "HYBRID_SHARD / parallel.hybrid_shard to shard over every rank.")
        return 1
    per_node = dist.local_world_size
    if dist.world_size % per_node:
        problems.append(f"hybrid shard needs the same number of processes on every node, but {dist.world_size} "
                        f"processes do not split into nodes of {per_node} (LOCAL_WORLD_SIZE). Fix: start the same "
                        "number of processes on each machine, or drop hybrid shard.")
        return 1
    if dist.num_nodes == 1:
        plan.notes.append(f"hybrid shard asked for on one node: sharded over its {dist.world_size} processes, as "
                          "FSDP full shard (replicas need several nodes)")
    return dist.num_nodes


def _planner_decision(recipe: Recipe, dist: DistInfo, model_config, gpus: tuple[int, int]) -> tuple[object, list[str]]:
    """(the memory planner's decision on these GPUs, []), or (None, a one-line note) when it cannot make an estimate:
    the plan is advice (auto's choice, a fit warning), and a config it cannot read must never stop a run that trains."""
    from finetune.planner import decide

    per_node, memory = gpus
    try:
        return decide(recipe, model_config, gpus_per_node=per_node, gpu_memory_bytes=memory, nodes=dist.num_nodes), []
    except Exception as exc:  # noqa: BLE001  (any failure of the estimate: a note, never the run's end)
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        note = (f"no memory plan: the planner could not estimate this model ({type(exc).__name__}: {reason}); "
                "the strategy is chosen without it, and no fit check was made")
        return None, [note]


def _choose_strategy(recipe: Recipe, dist: DistInfo, launcher: dict, problems: list[str], decision=None) -> Strategy:
    asked = recipe.parallel.strategy
    world = dist.world_size
    if asked == "auto":
        if world == 1:
            # One process: the planner may spread layers over the GPUs it sees when one GPU is not enough.
            if decision is not None and decision.strategy == "layer_split":
                return "layer_split"
            return _one_process(recipe, dist, launcher, problems)
        if launcher.get("strategy") in ("fsdp", "deepspeed"):
            return launcher["strategy"]
        if recipe.parallel.zero_stage is not None or recipe.parallel.deepspeed_config:
            return "deepspeed"  # torchrun / the deepspeed launcher: the recipe's DeepSpeed keys say which engine
        if recipe.parallel.cpu_offload:
            return "fsdp"  # offload is FSDP's (or DeepSpeed's): DDP has none, and dropped it without a word
        if decision is None:
            return "ddp"
        ddp = next((e for e in decision.estimates if e.strategy == "ddp"), None)
        return "ddp" if ddp is not None and ddp.fits else "fsdp"  # DDP when it fits (faster), else shard
    if asked in ("ddp", "fsdp", "deepspeed") and world == 1 and dist.backend is None:
        # (with a group, one process is a run of world size 1: `--accelerate-config fsdp2 --num-processes 1`)
        config = {"fsdp": "fsdp2", "ddp": "ddp", "deepspeed": "deepspeed_zero3"}[asked]
        problems.append(
            f"parallel.strategy is `{asked}` but only 1 process was started, without a process group. Fix: launch N "
            f"processes, {train_launch_fix(config)}, or set parallel.strategy: single."
        )
    if asked in ("single", "layer_split") and world > 1:
        problems.append(
            f"parallel.strategy is `{asked}` but {world} processes were started: each would train its own copy. Fix: launch one "
            "process (`finetune train RECIPE.yaml --num-processes 1`), or set parallel.strategy: ddp, fsdp or "
            "deepspeed."
        )
    return asked


def _refusal(problems: list[str], config: str | None) -> LaunchError:
    return LaunchError(f"the parallel setup cannot work{f' (the accelerate config: {config})' if config else ''}:\n"
                       + "\n".join(f"  - {p}" for p in problems))


def _offload_asked(recipe: Recipe, launcher: dict) -> str | None:
    """Which key asks for CPU offload (the recipe's or the accelerate config's), or None."""
    if recipe.parallel.cpu_offload:
        return "parallel.cpu_offload: true"
    if launcher.get("cpu_offload"):
        return "the accelerate config's fsdp_offload_params: true"
    for key in ("offload_optimizer_device", "offload_param_device"):
        if launcher.get(key) not in (None, "none"):
            return f"the accelerate config's {key}: {launcher[key]}"
    return None


def _one_process(recipe: Recipe, dist: DistInfo, launcher: dict, problems: list[str]) -> Strategy:
    """`auto` with one process: a single process, unless CPU offload is asked for (FSDP or ZeRO over one rank is the
    one-GPU route for a model larger than the GPU), which needs a process group; it was dropped without a word."""
    offload = _offload_asked(recipe, launcher)
    engine = launcher.get("strategy") if launcher.get("strategy") in ("fsdp", "deepspeed") else "fsdp"
    if offload and dist.backend is not None:
        return engine
    if offload:
        problems.append(
            f"{offload} asks for CPU offload, which FSDP or DeepSpeed does, over a process group, and this single process "
            "has none (a run in this process, or accelerate's single_gpu config or --cpu, starts one without a group; "
            "an FSDP or DeepSpeed config forms one at any process count). Fix: start it as one process with a group, "
            f"over which FSDP offloads: {train_launch_fix('fsdp2', processes=1)}; or remove the offload.")
    return "single"


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
        key = "hsdp" if key == "fsdp" and plan.replicas > 1 and "hsdp" in by_key else key
    chosen = by_key.get(key)
    if chosen is None or chosen.fits:
        return
    text = (f"the memory planner estimates {chosen.label} needs {chosen.needs()}, more than fits "
            f"({-chosen.margin_bytes / 2**30:.1f} GiB short). {decision.summary}")
    if recipe.parallel.strict:
        problems.append(f"{text} Fix: pick the strategy it recommends, {_smaller_need(chosen)}, or set "
                        "parallel.strict: false to try anyway.")
    else:
        plan.notes.append("WARNING: " + text)


def _smaller_need(chosen) -> str:
    """What lowers the figure that does not fit: the load peak (a batch or a sequence length does not change it) or
    the training peak."""
    if chosen.load_peak_bytes <= chosen.peak_bytes:
        return "lower the batch or sequence length"
    if chosen.sharded_load:
        return "use more GPUs (each loads a smaller shard)"
    return ("load a shard per GPU instead of a full copy (parallel.strategy: fsdp with parallel.sharded_loading: true, "
            "the default; lora.dora turns it off)")


def report(plan: ParallelPlan) -> None:
    print0(f"[finetune] parallel: {plan.describe()}")
    for note in plan.notes:
        print0(f"[finetune] note: {note}")
