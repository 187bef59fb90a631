"""Pre-flight checks of a parallel plan: the recipe, the accelerate config and the FSDP + 4-bit rules agree.

The FSDP + 4-bit rules, enforced here rather than documented:
  * the packed 4-bit storage dtype = the dtype FSDP sees for every frozen base tensor = the mixed-precision param
    dtype (otherwise FSDP's cast reinterprets packed bytes as numbers);
  * FSDP1 flattens each unit into one tensor: one dtype and one requires_grad per unit, so every LoRA leaf is its
    own unit (fp32 master weights) and the base stays in model.dtype (we never upcast norms, see model/base.py);
  * FSDP1 and FSDP2 compute in model.dtype (LoRA included) and reduce gradients in fp32; FSDP1 must cast every
    unit's inputs for that (see `fsdp1_mixed_precision` in finetune/parallel/wrapping.py);
  * FSDP1 cannot wrap LoRA on an embedding layer (PEFT holds it in ParameterDicts): refused, FSDP2 and DDP train it.
"""

from __future__ import annotations

import torch

from finetune.errors import train_launch_fix
from finetune.parallel.decision import ParallelPlan
from finetune.parallel.launcher import ignored_environment_note
from finetune.recipe import Recipe

_LIBRARY_CONFIG = {"fsdp": "fsdp2", "ddp": "ddp", "deepspeed": "deepspeed_zero3", "single": "single_gpu",
                   "layer_split": "single_gpu"}  # the library's accelerate config of each strategy


def check_agreement(recipe: Recipe, launcher: dict, plan: ParallelPlan, problems: list[str]) -> None:
    """The recipe and the accelerate config must not contradict each other (neither silently wins)."""
    p = recipe.parallel
    config_kind = launcher.get("strategy")
    if launcher.get("fsdp_version") not in (None, 1, 2):
        # (accelerate's own FullyShardedDataParallelPlugin refuses it too; finetune builds the wrap itself, and took
        # any value but 2 for FSDP1 while FSDP1's refusals, which ask for version 1, let it through)
        problems.append(
            f"the accelerate config has fsdp_version: {launcher['fsdp_version']}: FSDP has two versions, 1 "
            "(FullyShardedDataParallel) and 2 (fully_shard), and no other. Fix: set fsdp_version: 2 (the default, "
            "as accelerate_configs/fsdp2.yaml) or 1 in its fsdp_config.")
    if config_kind in ("fsdp", "deepspeed") and p.strategy not in ("auto", config_kind):
        name = {"fsdp": "an FSDP", "deepspeed": "a DeepSpeed"}[config_kind]
        problems.append(
            f"parallel.strategy is `{p.strategy}` but the accelerate config is {name} config. Fix: use the accelerate config "
            f"of that strategy (the library's by name: `--accelerate-config {_LIBRARY_CONFIG.get(p.strategy, 'NAME')}`), "
            f"or set parallel.strategy: {config_kind} (or auto)."
        )
    if plan.strategy != "deepspeed" and (p.zero_stage is not None or p.deepspeed_config):
        problems.append(
            f"parallel.zero_stage / parallel.deepspeed_config are set but the strategy is {plan.strategy}. Fix: set "
            "parallel.strategy: deepspeed (or launch with a DeepSpeed accelerate config), or remove them."
        )
    # (under `auto` the choice itself offloads, or refuses a single process without a group: plan._one_process)
    if p.cpu_offload and plan.strategy in ("single", "ddp", "layer_split") and (
            p.strategy != "auto" or plan.strategy == "layer_split"):
        problems.append(
            f"parallel.cpu_offload is true but the strategy is {plan.strategy}, which has no offload: FSDP and DeepSpeed "
            "offload. Fix: set parallel.strategy: fsdp (over one process for one GPU: "
            f"{train_launch_fix('fsdp2', processes=1)}), or remove parallel.cpu_offload.")
    if plan.strategy == "single" and config_kind in ("fsdp", "deepspeed"):
        name = {"fsdp": "an FSDP", "deepspeed": "a DeepSpeed"}[config_kind]
        plan.notes.append(f"the accelerate config is {name} config, but 1 process was started: with nothing to shard "
                          "over, it trains as a single process (launch N processes to shard)")
    if plan.strategy == "fsdp":
        _check_fsdp_agreement(recipe, launcher, plan, problems)


def _check_fsdp_agreement(recipe: Recipe, launcher: dict, plan: ParallelPlan, problems: list[str]) -> None:
    """The FSDP keys set both in the recipe and in the accelerate config must be equal."""
    p = recipe.parallel
    pairs = [
        ("fsdp_version", p.fsdp_version, "fsdp_version"),
        ("reshard_after_forward", p.reshard_after_forward, "fsdp_reshard_after_forward"),
        ("cpu_offload", p.cpu_offload, "fsdp_offload_params"),
        ("layer_class", p.layer_class, "fsdp_transformer_layer_cls_to_wrap"),
    ]
    for key, recipe_value, config_key in pairs:
        config_value = launcher.get(key)
        if key == "fsdp_version" and config_value not in (None, 1, 2):
            continue  # refused above
        if key == "layer_class" and recipe_value in layer_class_names(config_value):
            continue  # one of the config's comma-separated classes: the recipe picks it as the unit
        if recipe_value is not None and config_value is not None and recipe_value != config_value:
            problems.append(
                f"parallel.{key} is {recipe_value!r} in the recipe but the accelerate config has {config_key}: {config_value!r}. "
                f"Fix: make them equal, or remove parallel.{key} from the recipe to follow the config."
            )
    if p.hybrid_shard is False and launcher.get("hybrid_shard"):
        problems.append(
            "parallel.hybrid_shard is false in the recipe but the accelerate config asks for HYBRID_SHARD "
            "(fsdp_sharding_strategy / fsdp_reshard_after_forward). Fix: make them agree: remove parallel.hybrid_shard "
            "to follow the config, or set the config's strategy to FULL_SHARD."
        )
    config_ckpt = launcher.get("activation_checkpointing")
    if config_ckpt is not None and config_ckpt != plan.activation_checkpointing:
        key = ("parallel.activation_checkpointing" if recipe.parallel.activation_checkpointing is not None
               else "train.gradient_checkpointing")
        problems.append(
            f"the accelerate config has fsdp_activation_checkpointing: {config_ckpt} but the recipe has "
            f"train.gradient_checkpointing / parallel.activation_checkpointing: {plan.activation_checkpointing}. Checkpointing "
            "is applied once, by this tool, non-reentrant (reentrant recompute under FSDP re-runs the all-gathers). Fix: "
            f"set {key}: {str(config_ckpt).lower()} in the recipe, or "
            f"fsdp_activation_checkpointing: {str(plan.activation_checkpointing).lower()} in the accelerate config."
        )


def layer_class_names(value: str | None) -> list[str]:
    """The class names of fsdp_transformer_layer_cls_to_wrap: accelerate takes a comma-separated list (and the
    string of a YAML list, as its launcher writes one, is read the same way)."""
    names = [name.strip().strip("[]'\" ") for name in (value or "").split(",")]
    return list(dict.fromkeys(name for name in names if name))


def check_fsdp_rules(recipe: Recipe, launcher: dict, plan: ParallelPlan, problems: list[str]) -> None:
    if note := ignored_environment_note():  # the shell's ACCELERATE_MIXED_PRECISION (...), not a launch's: said once
        plan.notes.append(note)
    mixed = launcher.get("mixed_precision")
    if mixed:
        mixed_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed, mixed)
        if mixed_dtype != recipe.model.dtype:
            # The recipe decides the dtype (model.dtype: auto follows a config that says bf16); a config that states
            # another one than an explicit model.dtype is refused in the words of the config's own engine.
            engine = {"fsdp": f"FSDP{plan.fsdp_version or ''} would cast the packed 4-bit storage and every frozen "
                              "weight to the mixed-precision dtype",
                      "deepspeed": "DeepSpeed would build its engine in one dtype while the base is stored in another",
                      "ddp": "under DDP finetune trains in model.dtype and the config's mixed_precision would be a "
                             "statement the run does not keep",
                      }.get(plan.strategy, "finetune trains in model.dtype and the config's mixed_precision would be "
                                           "a statement the run does not keep")
            fix_config = "bf16" if recipe.model.dtype == "bfloat16" else "no (or remove the key)"
            if mixed == "bf16":
                fix = (f"set model.dtype: auto (it follows a config that says bf16) or bfloat16, or mixed_precision: "
                       f"{fix_config} in the config")
            else:  # fp16 / fp8: no loss scaler here, never a training dtype of this tool
                fix = f"set mixed_precision: {fix_config} in the config ({mixed} is not a training dtype of finetune)"
            problems.append(
                f"the accelerate config has mixed_precision: {mixed} but the recipe has model.dtype: {recipe.model.dtype}: "
                f"{engine}. Fix: {fix}."
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
    if plan.fsdp_version == 1 and recipe.lora.bias != "none":
        # The trainable bias sits in the frozen 4-bit layer: FSDP1 flattens a unit's tensors into one, and a flat
        # tensor has one requires_grad ("Must flatten tensors with uniform requires_grad", after the whole load).
        problems.append(
            f"lora.bias: {recipe.lora.bias} under FSDP1: the trained biases sit beside the frozen 4-bit weights of "
            "the same layers, and FSDP1 flattens a unit's tensors into one, trained or frozen. Fix: use FSDP2 "
            "(accelerate_configs/fsdp2.yaml, or parallel.fsdp_version: 2) or DDP, or set lora.bias: none."
        )
    if plan.fsdp_version == 1 and (problem := _fsdp1_embedding_lora_problem(recipe)):
        problems.append(problem)
    policy = launcher.get("auto_wrap_policy")
    if policy and policy != "TRANSFORMER_BASED_WRAP":
        problems.append(
            f"the accelerate config has fsdp_auto_wrap_policy: {policy}. With a frozen 4-bit base and trainable LoRA, FSDP units "
            "must follow decoder layers (and FSDP1 needs the LoRA leaves apart). Fix: set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP."
        )


def _fsdp1_embedding_lora_problem(recipe: Recipe) -> str | None:
    """LoRA on an embedding layer under FSDP1, refused: PEFT keeps an embedding's LoRA A/B in ParameterDicts that its
    forward indexes (`lora_embedding_A[name]`) without calling them. As units of their own (one dtype and one
    requires_grad per flat parameter) FSDP1's wrapper hides the dict ("Index given to ParameterDict cannot be used as a
    key" at the first step) and they would never be gathered; as part of the LoRA layer's unit, beside their frozen
    base layer's own unit, they train as FSDP2 does, but FSDP1's checkpoints of LoRA units (parallel/engines/fsdp1.py)
    read a unit's own tensors only, by plain names. The model's module names come from its config on the meta device."""
    if recipe.lora.target_modules == "all-linear" and not recipe.model.adapter:
        return None  # Linear layers only: PEFT's all-linear leaves embeddings (and the output head) out
    from finetune.model import load_config
    from finetune.model.lora.attach import embedding_targets
    from finetune.parallel.layers import meta_model

    model = meta_model(load_config(recipe), trust_remote_code=recipe.model.trust_remote_code)
    named = embedding_targets(recipe, model)
    if not named:
        return None
    whose = ("model.adapter's LoRA (its adapter_config.json targets)" if recipe.model.adapter
             else "lora.target_modules")
    drop = ("" if recipe.model.adapter else
            f", or drop {', '.join(sorted({name.rsplit('.', 1)[-1] for name in named}))} from lora.target_modules")
    return (f"{whose} puts LoRA on the embedding layer{'s' if len(named) > 1 else ''} {', '.join(named)} under FSDP1: "
            "PEFT keeps an embedding's LoRA in ParameterDicts, which FSDP1 cannot wrap (the run would stop at its "
            "first step: \"Index given to ParameterDict cannot be used as a key\"). Fix: use FSDP2 "
            f"(accelerate_configs/fsdp2.yaml, or parallel.fsdp_version: 2) or DDP{drop}.")
