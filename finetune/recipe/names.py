"""The names users bring from HF's TrainingArguments, TRL's configs and PEFT's LoraConfig (axolotl's, LLaMA-Factory's
and Unsloth's: finetune/recipe/foreign_names.py): the recipe key each one means, or why finetune has none. The
recipe's unknown-key error reads it ("`gradient_accumulation_steps` is `train.grad_accum` here"), ahead of any
spelling guess, so a guess never points to a key of another meaning; only the families of names by prefix
(`eval_...`, `fsdp_...`: managed_family) come after the guess, as finetune's own keys start so too.

They are not accepted as aliases: a recipe is a closed schema with one name per setting, so two recipes that say the
same thing read the same, and a name whose meaning differs here (HF's `warmup_steps` takes a ratio below 1, ours an
integer; TRL's `max_length` is per sequence of a pair, ours per row; HF's schedules decay to 0, ours to
train.min_lr_ratio) is never silently taken for ours. The error names the key and the unit. tests/test_recipe_names.py
checks the table against the installed TrainingArguments, TRL configs and LoraConfig, so a field they add, or a
recipe key that moves, shows up there; docs/migrating.md shows these answers per tool.
"""

from __future__ import annotations

from typing import Any

from finetune.recipe import foreign_names
from finetune.recipe.foreign_names import (
    FALSE_FRIENDS,
    UNSET,
    VALUE_ANSWERS,
    Fields,
    accepts,
    entry_answer,
    kind,
    shown,
)
from finetune.recipe.objectives import OBJECTIVES

# name -> the recipe key it means (with what differs, after a semicolon).
MEANS: dict[str, str] = {
    # HF TrainingArguments
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "num_train_epochs": "train.num_epochs",
    "warmup_ratio": "train.warmup_ratio",
    "lr_scheduler_type": "train.lr_schedule",  # answered by its value first (foreign_names.VALUE_ANSWERS), as optim
    "optim": "train.optimizer",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "save_steps": "train.save_every",
    "save_total_limit": "train.keep_last",
    "load_best_model_at_end": "train.keep_best; it keeps the best checkpoint, `finetune export --step` exports it",
    "resume_from_checkpoint": "train.resume; `auto` or a checkpoint folder",
    "output_dir": "output.dir",
    "overwrite_output_dir": "output.overwrite",
    "report_to": "train.trackers; tensorboard, mlflow, wandb",
    "project": "train.wandb_project or train.mlflow_experiment",
    "bf16": "model.dtype: bfloat16; `auto` picks it where the device computes it",
    "tf32": "model.dtype; TF32 matmuls follow torch's own setting on the GPU",
    "deepspeed": "parallel.strategy: deepspeed; with parallel.zero_stage, or its JSON file as parallel.deepspeed_config",
    "fsdp": "parallel.strategy: fsdp; with parallel.fsdp_version, reshard_after_forward and cpu_offload",
    "fsdp_config": "parallel.strategy; fsdp, with the parallel section's keys and the accelerate config's fsdp_* keys",
    "ddp_timeout": "parallel.collective_timeout_s",
    "label_smoothing_factor": "dpo.label_smoothing; an SFT loss has none",
    "activation_checkpointing": "train.gradient_checkpointing (or parallel.activation_checkpointing, which decides where set)",
    # TRL
    "max_seq_length": "data.max_length",
    # (not `max_prompt_length`: TRL 1.16 has none. Its DPO keeps the start of prompt + response and drops a pair whose
    # prompt alone fills max_length; `dpo.max_prompt_length` is finetune's own floor for a cut prompt, and a recipe
    # that names it elsewhere is told its section by the recipe's keys, docs/preference.md says the difference.)
    "dataset_text_field": "data.datasets[].columns; `{text: YOUR_FIELD}`, with format: text",
    "dataset_num_proc": "data.num_proc",
    "chat_template_path": "model.chat_template; a file, a named template or the text",
    "precompute_ref_log_probs": "dpo.reference: precomputed",
    "reward_funcs": "grpo.reward_functions; `module:function`, TRL's signature",
    "use_vllm": "grpo.generation: vllm; a vLLM server with the adapter hot-loaded, TRL's server mode",
    "vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max; TRL's deprecated name of it",
    # PEFT LoraConfig
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "use_rslora": "lora.rslora",
    "use_dora": "lora.dora",
    "lora_bias": "lora.bias",
    # TRL's ModelConfig (its lora_* and load_in_* names are axolotl's too)
    "torch_dtype": "model.dtype",
    **foreign_names.AXOLOTL_MEANS, **foreign_names.LLAMA_FACTORY_MEANS, **foreign_names.UNSLOTH_MEANS,
}

# name -> why there is no counterpart (what finetune does instead).
NO_COUNTERPART: dict[str, str] = {
    "use_cpu": "a machine without a GPU runs on the CPU by itself (accelerate: ACCELERATE_USE_CPU=true)",
    # (it pointed to model.dtype: float16, which is refused for training: bug bash bb59 #3)
    "fp16": "float16 training with loss scaling is not built (without it LoRA gradients underflow); model.dtype: "
            "bfloat16 (or auto, which picks it where the device computes it), float32 on GPUs without bf16",
    "hub_model_id": "`finetune export` writes the adapter (or a merged model); `hf upload` publishes it",
    "assistant_only_loss": "chat rows always train the assistant turns only, each in its inference context",
    "completion_only_loss": "completion rows always train the completion only",
    "train_on_inputs": "prompts are never trained; format: text trains everything",
    "neftune_noise_alpha": "NEFTune embedding noise is not built",
    "per_device_eval_batch_size": "evaluation uses train.micro_batch_size",
    "eval_strategy": "evaluations run every train.eval_every steps (0: at the end)",
    "evaluation_strategy": "evaluations run every train.eval_every steps (0: at the end)",
    "save_strategy": "checkpoints are written every train.save_every steps, at the end and on SIGTERM",
    "logging_strategy": "metrics are logged every train.log_every steps",
    # (hub_strategy, hub_revision: named here, not left to the hub_ family, as the near spellings of model.revision
    # and parallel.strategy would be guessed for them first: managed_family)
    **dict.fromkeys(("push_to_hub", "hub_strategy", "hub_revision"),
                    "`finetune export` writes the adapter (or a merged model); `hf upload` publishes it"),
    "torch_compile": "torch.compile is not built in: compiled graphs and FSDP's per-layer wraps of 4-bit layers are "
                     "not tested together",
    "use_liger_kernel": "Liger kernels are not built in",
    "auto_find_batch_size": "`finetune plan` computes the largest micro-batch that fits before the run",
    "packing_strategy": "data.packing packs by best fit (streaming: in order), with position ids restarting per example",
    "padding_free": "data.packing puts several examples in a row (position ids restart per example); micro-batches pad to their longest row",
    "gradient_checkpointing_kwargs": "checkpointing is non-reentrant, chosen per strategy",
    "special_tokens": "the tokenizer's own special tokens are used; new ones would need trained embeddings",
    "modules_to_save": "PEFT LoraConfig's full trained copies of modules are not offered (routers: lora.train_router); "
                       "to train the embeddings or the head, list them in lora.target_modules (`[..., embed_tokens, "
                       "lm_head]`: LoRA on them)",
    "trainable_token_indices": "PEFT LoraConfig's trained token rows are not offered (finetune adds no tokens); LoRA "
                               "on the embeddings is lora.target_modules `[..., embed_tokens]`",
    "lr_scheduler_kwargs": "train.lr_schedule and train.min_lr_ratio are the schedule's settings",
    "adam_beta1": "AdamW's betas are torch's defaults (0.9, 0.999)",
    "adam_beta2": "AdamW's betas are torch's defaults (0.9, 0.999)",
    "adam_epsilon": "AdamW's epsilon is torch's default (1e-8)",
    "use_weighting": "not built (WPO weighting)",
    "sync_ref_model": "the reference is the adapter switched off, or precomputed (dpo.reference)",
    "steps_per_generation": "each optimizer step samples its own completions (grpo.num_iterations reuses them)",
    # TRL fields once listed as "a setting finetune makes itself" (bug bash): finetune does not make them, it lacks them
    "chat_template_kwargs": "chat template arguments for every row are not a recipe setting (a row's own "
                            "`chat_template_kwargs` column is passed to its renderings, as TRL does: docs/data.md; the "
                            "generation eval and `finetune generate` render with none). For "
                            "Qwen3's or Qwen3.5's thinking-off serving (enable_thinking: false), rows without "
                            "reasoning already train the empty `<think></think>` block that such a prompt ends with, "
                            "and their answer after it. For another template (GLM-4.5's adds `/nothink`), give "
                            "model.chat_template a copy of the template (a .jinja file) that sets the argument itself "
                            "as its first line (`{%- set enable_thinking = false %}`), and serve with that copy too",
    "eos_token": "each row ends with the tokenizer's own EOS (a chat row: its template's end-of-turn token); set "
                 "`eos_token` in the tokenizer's tokenizer_config.json, or pick another with model.tokenizer",
    "pad_token": "batches are padded with the tokenizer's pad token (its EOS where it has none; padding is never "
                 "trained); set `pad_token` in the tokenizer's tokenizer_config.json, or pick another with model.tokenizer",
    "truncation_mode": "a row longer than data.max_length keeps its start (TRL's keep_start; a preference pair loses "
                       "its prompt's beginning first, docs/preference.md); data.overlong: drop or error instead of cutting",
    "activation_offloading": "activations are not offloaded to the CPU; train.gradient_checkpointing recomputes them "
                             "instead of keeping them",
    "max_tool_calling_iterations": "GRPO samples each completion in one go: a tool-calling loop (agent training) is "
                                   "not built",
    **dict.fromkeys(("top_k", "min_p", "repetition_penalty", "generation_kwargs"),
                    "GRPO samples with grpo.temperature and grpo.top_p only; top-k, min-p, a repetition penalty and "
                    "other generation settings are not offered"),
    "use_peft": "every run trains a LoRA adapter",
    **foreign_names.AXOLOTL_NO_COUNTERPART, **foreign_names.LLAMA_FACTORY_NO_COUNTERPART,
    **foreign_names.UNSLOTH_NO_COUNTERPART,
}

# Fields that finetune sets by itself (devices, processes, loaders, logging, the hub) or that belong to features it
# does not have; one reason for all. A prefix covers a family of fields (vLLM's, the hub's, DDP's ...).
MANAGED_REASON = ("a setting of HF's Trainer or TRL's trainers that finetune makes itself (the launch, devices, "
                  "loaders, logging) or that has no use here")
MANAGED_PREFIXES = ("vllm_", "hub_", "trackio_", "ddp_", "dataloader_", "torch_compile_", "log_", "logging_",
                    "eval_", "save_", "entropy_", "vespo_", "sapo_", "fsdp_", "mlflow_", "wandb_", "liger_",
                    "include_", "model_init_", "ds3_", "use_transformers_", "transformers_", "use_bias_", "lora_ga",
                    "alora_", "megatron_", "qalora_", "use_qalora", "use_adaptive", "off_policy_", "f_alpha_", "f_diver")
MANAGED: frozenset[str] = frozenset({
    # TrainingArguments
    "accelerator_config", "activation_checkpointing_kwargs", "average_tokens_across_devices", "batch_eval_metrics",
    "bf16_full_eval", "data_seed", "debug", "disable_tqdm", "do_eval", "do_predict", "do_train", "enable_jit_checkpoint",
    "fp16_full_eval", "full_determinism", "greater_is_better", "ignore_data_skip", "label_names", "length_column_name",
    "local_rank", "metric_for_best_model", "optim_args", "optim_target_modules", "parallelism_config",
    "prediction_loss_only", "remove_unused_columns", "restore_callback_states_from_checkpoint", "skip_memory_metrics",
    "torch_empty_cache_steps", "train_sampling_strategy", "use_cache",
    # TRL
    "dataset_kwargs", "pad_to_multiple_of", "shuffle_dataset", "discopop_tau", "ld_alpha", "loss_weights",
    "precompute_ref_batch_size", "ref_model_mixup_alpha", "ref_model_sync_steps", "cache_implementation",
    "cast_lm_head_to_fp32", "delta", "generation_batch_size", "multi_objective_aggregation",
    "num_completions_to_print", "num_generations_eval", "top_entropy_quantile", "use_transformers_paged",
    # PEFT LoraConfig (set by finetune from the lora section, or not used with QLoRA)
    "alpha_pattern", "arrow_config", "auto_mapping", "base_model_name_or_path", "corda_config", "ensure_weight_tying",
    "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode", "init_lora_weights", "kasa_config",
    "layer_replication", "layers_pattern", "layers_to_transform", "loftq_config",
    "monteclora_config", "peft_type", "peft_version", "rank_pattern", "runtime_config", "target_parameters",
    "task_type", "use_bdlora", "velora_config",
})


# section -> {name: the key of that section it means}: what people write in a section for one of its own keys, asked
# before the other sections' keys (`output.path` means output.dir, not data.datasets[].path).
SECTION_MEANS: dict[str, dict[str, str]] = {
    "model": {**dict.fromkeys(("path", "model", "name", "model_path", "model_name", "model_id", "model_name_or_path",
                                "pretrained_model_name_or_path", "base_model", "id"), "name_or_path"),
              "tokenizer_name": "tokenizer", "tokenizer_path": "tokenizer", "torch_dtype": "dtype",
              "template": "chat_template"},
    "output": {**dict.fromkeys(("path", "output_dir", "out_dir", "folder", "directory", "save_dir", "dir_path",
                                 "output_path"), "dir"), "overwrite_output_dir": "overwrite"},
    "train": {"lr": "learning_rate", "batch_size": "micro_batch_size", "epochs": "num_epochs", "steps": "max_steps",
              "gradient_accumulation": "grad_accum", "grad_accum_steps": "grad_accum", "warmup": "warmup_steps",
              "scheduler": "lr_schedule"},
    "lora": {"rank": "r", "lora_r": "r", "lora_rank": "r", "target": "target_modules", "targets": "target_modules",
             "modules": "target_modules"},
    "data": {"dataset": "datasets", "max_len": "max_length", "seq_len": "max_length"},
    # TRL's DPOConfig / KTOConfig `loss_type` (not GRPO's, a key of another objective)
    "dpo": {"loss_type": "loss"},
    "kto": {"loss_type": "loss"},
}

# section -> {name: why that section has no such key}: asked before the other sections' keys, like SECTION_MEANS.
SECTION_NO_COUNTERPART: dict[str, dict[str, str]] = {
    "reward": {"loss_type": "a reward model trains with TRL RewardTrainer's Bradley-Terry loss only "
                            "(reward.center_rewards_coefficient adds its centering term); DPO's losses are "
                            "train.objective: dpo with dpo.loss"},
}

# What people call a section at the top level of a recipe (HF's, PEFT's and bitsandbytes' names, plurals).
TOP_LEVEL_MEANS: dict[str, str] = {
    **dict.fromkeys(("training", "trainer", "training_args", "training_arguments", "trainer_args", "optimization"),
                    "train"),
    **dict.fromkeys(("dataset", "datas"), "data"),
    **dict.fromkeys(("peft", "peft_config", "lora_config", "adapter_config"), "lora"),
    **dict.fromkeys(("quant", "quantisation", "quantization_config", "bnb", "bnb_config", "bitsandbytes"),
                    "quantization"),
    **dict.fromkeys(("evaluation", "evaluate", "evals"), "eval"),
    **dict.fromkeys(("distributed", "parallelism", "fsdp_config"), "parallel"),
    **dict.fromkeys(("outputs", "out", "save"), "output"),
    **dict.fromkeys(("models", "base"), "model"),
    "trl": "grpo",  # axolotl's trl: holds GRPO's settings, by TRL's names
}


def section_of(path) -> str | None:
    """The section a key path's parent names, as foreign_name takes it: `train` for ("train",), `data.datasets[]` for
    a dataset entry (("data", "datasets", 0) or an override's ["data", "datasets", "0"]); None elsewhere."""
    names = [str(part) for part in path if not str(part).lstrip("-").isdigit()]
    if len(names) == 1 and len(path) == 1:
        return names[0]
    return f"{names[0]}.{names[1]}[]" if len(names) == 2 and len(path) == 3 else None


def foreign_name(name: str, schema_keys: dict[str, list[str]], section: str | None = None, *,
                 top_level: bool = False, value: Any = UNSET, field: Fields | None = None) -> str | None:
    """What to tell a user who wrote `name` where the recipe has no such key (in `section`, when it is one of the
    recipe's sections or `data.datasets[]`; `top_level`: where the sections are): the key it means there, where it
    belongs (a key of another section), or why there is none. `value`: what was written for it, checked against the
    key an answer names (`field`: the schema's field at a dotted key). None: not a name the table knows (the caller
    may guess)."""
    field = field or (lambda dotted: None)
    if name != name.lower() and name.lower() not in (k for keys in schema_keys.values() for k in keys):
        found = foreign_name(name.lower(), schema_keys, section, top_level=top_level, value=value, field=field)
        return found.replace(f"`{name.lower()}", f"`{name}", 1) if found else None  # `LORA`, `Learning_Rate`
    if section in ("data.datasets[]", "data.eval_datasets[]") and (found := entry_answer(name, value, field, section)):
        return found
    answer_by_value = VALUE_ANSWERS.get(name, lambda *_: None)
    if top_level and name in TOP_LEVEL_MEANS:  # (LLaMA-Factory's `dataset: NAME` is a dataset, not the section)
        return (answer_by_value(name, value, field, schema_keys)
                or f"`{name}` is the `{TOP_LEVEL_MEANS[name]}:` section here.")
    if name in SECTION_MEANS.get(section or "", {}):
        target = f"{section}.{SECTION_MEANS[section][name]}"
        if shown(value) is None or field(target) is None or accepts(field(target), value):
            return f"`{name}` is `{target}` here."
        elsewhere = answer_by_value(name, value, field, schema_keys)  # `kto.loss_type: ipo`: DPO's loss
        return (f"`{name}` is `{target}` here. It takes {kind(field(target))}, not `{shown(value)}`"
                f"{': ' + elsewhere if elsewhere else '.'}")
    if name in SECTION_NO_COUNTERPART.get(section or "", {}):
        return f"`{section}.{name}` has no counterpart here: {SECTION_NO_COUNTERPART[section][name]}."
    if found := answer_by_value(name, value, field, schema_keys):
        return found
    sections = [section for section, keys in schema_keys.items() if name in keys]
    if sections and name not in FALSE_FRIENDS:
        return _elsewhere(name, sections, section, value, field)
    if name in MEANS:
        key, _, note = MEANS[name].partition("; ")
        return f"`{name}` is `{key}` here{f' ({note})' if note else ''}."
    if name in NO_COUNTERPART:
        return f"`{name}` has no counterpart here: {NO_COUNTERPART[name]}."
    if name in MANAGED:
        return f"`{name}` is {MANAGED_REASON}; leave it out."
    return None  # (a name of a MANAGED_PREFIXES family: managed_family, asked after the near spellings of our keys)


def managed_family(name: str) -> str | None:
    """The answer for a name of a family of HF's or TRL's settings that finetune makes itself (MANAGED_PREFIXES:
    `vllm_`, `eval_`, `save_` ...), or None. Asked after the near spellings of finetune's own keys, never before:
    several of them start so too (train.eval_every, data.eval_max_rows, parallel.fsdp_version), and `eval_max_row`,
    told "a setting of HF's Trainer ...; leave it out", lost the user's setting with it (bug bash bb56)."""
    if name.lower().startswith(MANAGED_PREFIXES):
        return f"`{name}` is {MANAGED_REASON}; leave it out."
    return None


def _elsewhere(name: str, sections: list[str], section: str | None, value: Any, field: Fields) -> str:
    """`name` is a key of other sections: those whose key takes `value` (all, when none does), each with the
    objective it is for when there are several (`beta`: DPO's, KTO's and GRPO's)."""
    fitting = [home for home in sections if value is not UNSET and accepts(field(f"{home}.{name}"), value)]
    sections = fitting or sections
    named = [f"`{home}.{name}`" + (f" (train.objective {' or '.join(_readers(home, name))})"
                                   if home in OBJECTIVES and len(sections) > 1 else "") for home in sections]
    where = " or ".join(named)
    reads = dict(OBJECTIVES[section].reads) if section in OBJECTIVES else None
    if reads is not None and all(other in OBJECTIVES and other not in reads for other in sections):
        # `dpo.temperature`: GRPO's, which a DPO run never reads; moving it would not set anything for DPO
        return (f"`{name}` is {where} here, a setting of train.objective {' or '.join(sections)}; the {section}: "
                "section has no such key.")
    if shown(value) is not None and not fitting and len(sections) == 1:  # `gradient_checkpointing: offload`
        return (f"`{name}` is {where} here: move it to that section (it takes {kind(field(f'{sections[0]}.{name}'))}, "
                f"not `{shown(value)}`).")
    return f"`{name}` is {where} here: move it to that section."


def _readers(section: str, key: str) -> list[str]:
    """The objectives that read `section.key` (`dpo.disable_dropout`: dpo's, and kto's, which reads it too)."""
    return [name for name, spec in OBJECTIVES.items() if name == section or key in dict(spec.reads).get(section, ())]
