"""The names of the tools people port recipes from that finetune does not install (axolotl, LLaMA-Factory, Unsloth;
names.py has HF's, TRL's and PEFT's, checked against the installed libraries), the keys of an axolotl or LLaMA-Factory
dataset entry, and the answers that depend on the value given (`loss_type: sigmoid` is `dpo.loss`, `loss_type: dapo`
is `grpo.loss_type`). docs/migrating.md's tables are these answers: tests/recipe/test_foreign_names.py checks every
row there against what `finetune validate` says, and that every name here has its row.

An answer never sends a name to a key of another meaning: a name whose same-named key here means something else
(axolotl's `strict`, LLaMA-Factory's `dataset: NAME`, a dataset entry's `revision`) is answered here first, and a
value is checked against the key it is sent to (its type and choices, read from the schema, never a copy of them).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

UNSET: Any = object()  # no value at hand (an override's inner key)
# The schema's field at a dotted key (`dpo.loss`, `data.datasets[].format`); None where there is none
Fields = Callable[[str], "FieldInfo | None"]

# What a recipe key holds, read from its field: its choices, or its type
_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", list: "a list",
          dict: "a mapping"}


def join_or(items) -> str:
    items = [str(item) for item in items]
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def choices(info: FieldInfo | None) -> tuple:
    """A Literal field's values (also inside `X | None`); () for any other field."""
    annotation = info.annotation if info is not None else None
    for part in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(part) is Literal:
            return typing.get_args(part)
    return ()


def kind(info: FieldInfo | None) -> str:
    """What the key takes, in words: its choices, else its type."""
    if info is None:
        return "a value"
    if choices(info):
        return join_or(choices(info))
    union = typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
    parts = [part for part in (typing.get_args(info.annotation) if union else (info.annotation,))
             if part is not type(None)]
    return join_or(dict.fromkeys(_KINDS.get(typing.get_origin(part) or part, "a value") for part in parts))


def accepts(info: FieldInfo | None, value: Any) -> bool:
    """Whether the key's type and bounds take `value` (its own validators, which need the whole recipe, aside)."""
    if info is None:
        return False
    try:
        annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
        TypeAdapter(annotation).validate_python(value)
    except (ValidationError, TypeError, ValueError):
        return False
    return True


def shown(value: Any) -> str | None:
    """A value as a recipe writes it (None: not a scalar, or none at hand)."""
    if value is UNSET or isinstance(value, (dict, list)):
        return None
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false"}.get(value, "null")
    return str(value)


def subject(name: str, value: Any) -> str:
    return f"`{name}: {shown(value)}`" if shown(value) is not None else f"`{name}`"


# ------------------------------------------------------------------------------------------------ the tools' names
# name -> the recipe key it means (with what differs, after a semicolon), as names.MEANS
AXOLOTL_MEANS: dict[str, str] = {
    "base_model": "model.name_or_path", "base_model_config": "model.name_or_path",
    "tokenizer_config": "model.tokenizer", "tokenizer_type": "model.tokenizer; AutoTokenizer picks the class",
    "lora_model_dir": "model.adapter; the adapter folder to start from",
    "chat_template_jinja": "model.chat_template; the template's text or a .jinja file",
    "flash_attention": "model.attn_implementation: flash_attention_2",
    "sdp_attention": "model.attn_implementation: sdpa",
    "xformers_attention": "model.attn_implementation; auto, sdpa, eager or flash_attention_2, not xformers",
    "load_in_4bit": "quantization.method: nf4; the default",
    "load_in_8bit": "quantization.method; nf4 or fp4 are 4 bits, none is no quantization: 8 bits are not offered",
    "bnb_4bit_quant_type": "quantization.method", "bnb_4bit_use_double_quant": "quantization.double_quant",
    "bnb_4bit_compute_dtype": "quantization.compute_dtype", "bnb_4bit_quant_storage": "quantization.quant_storage",
    "lora_r": "lora.r", "lora_target_modules": "lora.target_modules",
    "lora_target_linear": "lora.target_modules: all-linear", "peft_use_rslora": "lora.rslora",
    "peft_use_dora": "lora.dora", "sequence_len": "data.max_length", "sample_packing": "data.packing",
    "val_set_size": "data.eval_fraction", "test_datasets": "data.eval_datasets",
    "pretraining_dataset": "data.datasets; each with format: text, and data.streaming: true to read them lazily",
    "dataset_processes": "data.num_proc",
    "dataset_prepared_path": "data.cache; tokenized data is kept in $FINETUNE_CACHE",
    "default_system_message": "data.system_prompt", "reward_model": "train.objective: reward",
    "auto_resume_from_checkpoints": "train.resume: auto", "cosine_min_lr_ratio": "train.min_lr_ratio",
    "evals_per_epoch": "train.eval_every; in steps", "saves_per_epoch": "train.save_every; in steps",
    "weight_decay_rate": "train.weight_decay", "wandb_name": "train.run_name",
    "mlflow_experiment_name": "train.mlflow_experiment", "max_prompt_len": "dpo.max_prompt_length",
    "rl_beta": "dpo.beta; kto.beta with train.objective kto", "dpo_beta": "dpo.beta",
}
AXOLOTL_NO_COUNTERPART: dict[str, str] = {
    "strict": "a recipe is always checked whole (an unknown key is an error) and `key=value` overrides are always "
              "taken (parallel.strict is another setting: refuse a strategy the planner says will not fit)",
    "lora_fan_in_fan_out": "PEFT sets fan_in_fan_out itself for Conv1D layers",
    "lora_modules_to_save": "PEFT's full trained copies of modules are not offered (routers: lora.train_router); LoRA "
                            "on the embeddings is lora.target_modules `[..., embed_tokens]`",
    "unfrozen_parameters": "a run trains a LoRA adapter only (lora.target_modules)",
    "tokens": "the tokenizer's own tokens are used; new ones would need trained embeddings",
    "eot_tokens": "each trained assistant turn ends with its chat template's end-of-turn token, which is trained; "
                  "another token needs a template that writes it (model.chat_template)",
    "pad_to_sequence_len": "a micro-batch is padded to its longest row (data.packing fills rows up to data.max_length)",
    "group_by_length": "rows are shuffled (train.seed), not grouped by length",
    "shuffle_merged_datasets": "the rows of every dataset are shuffled together (train.seed); data.streaming: true "
                               "reads them in order",
    "dataset_exact_deduplication": "rows are not deduplicated; eval rows equal to training rows are counted and "
                                   "warned about",
    "early_stopping_patience": "a run trains to its end (train.max_steps or num_epochs); train.keep_best keeps the "
                               "checkpoint of the lowest eval loss",
    "plugins": "axolotl's plugins (Liger kernels, Cut Cross Entropy, ...) are not built in",
    "vllm": "GRPO's vLLM is grpo.generation: vllm with the grpo.vllm_* keys",
}
LLAMA_FACTORY_MEANS: dict[str, str] = {
    "model_name_or_path": "model.name_or_path",
    "adapter_name_or_path": "model.adapter; the adapter folder to start from", "model_revision": "model.revision",
    "template": "model.chat_template; a template finetune names in finetune/templates/SOURCES.md, a .jinja file or "
                "its text, not LLaMA-Factory's names; leave it out for the tokenizer's own",
    "flash_attn": "model.attn_implementation; auto, sdpa, eager or flash_attention_2 (LLaMA-Factory's disabled is "
                  "eager, fa2 flash_attention_2)",
    "quantization_method": "quantization.method; bitsandbytes 4-bit only, nf4 or fp4",
    "quantization_type": "quantization.method", "double_quantization": "quantization.double_quant",
    "lora_rank": "lora.r", "cutoff_len": "data.max_length", "val_size": "data.eval_fraction",
    "max_samples": "data.datasets[].max_rows", "preprocessing_num_workers": "data.num_proc",
    "tokenized_path": "data.cache; tokenized data is kept in $FINETUNE_CACHE",
    "neat_packing": "data.packing; examples never attend to each other", "interleave_probs": "data.datasets[].weight",
    "mix_strategy": "data.datasets[].weight; the rows of every dataset are shuffled together",
    "moe_aux_loss_coef": "train.router_aux_loss_coef",
    "disable_gradient_checkpointing": "train.gradient_checkpointing: false",
    "pref_beta": "dpo.beta; kto.beta with train.objective kto", "dpo_label_smoothing": "dpo.label_smoothing",
    "kto_chosen_weight": "kto.desirable_weight", "kto_rejected_weight": "kto.undesirable_weight",
}
LLAMA_FACTORY_NO_COUNTERPART: dict[str, str] = {
    "dataset_dir": "LLaMA-Factory's dataset_info.json is not read; each data.datasets entry names its file, folder or "
                   "hub dataset",
    "train_on_prompt": "prompts are never trained; format: text trains everything",
    "mask_history": "every assistant turn of a conversation is trained, each in its inference context",
    "overwrite_cache": "the cache is keyed by the rows, the tokenizer and every setting that changes the tokens, so it "
                       "is never stale; data.cache: false does not keep it",
    "pref_ftx": "DPO with an added SFT loss is not built",
    "ref_model": "the reference is the model with the trained adapter off (the base, or base + model.adapter), or "
                 "precomputed (dpo.reference)",
    "additional_target": "PEFT's full trained copies of modules are not offered; LoRA on the embeddings is "
                         "lora.target_modules `[..., embed_tokens]`",
    "loraplus_lr_ratio": "LoRA+ is not built: A and B share train.learning_rate",
    "rope_scaling": "the model config's own RoPE settings are used",
    "use_unsloth": "Unsloth's kernels are not built in (lora.fused is finetune's own fused LoRA)",
    "enable_liger_kernel": "Liger kernels are not built in",
    "plot_loss": "a finished run draws plot.png (loss and learning rate) itself, with matplotlib installed; "
                 "`finetune plot RUN` draws it any time",
    "use_swanlab": "SwanLab is not a tracker here (train.trackers: tensorboard, mlflow, wandb)",
}
UNSLOTH_MEANS: dict[str, str] = {
    "model_name": "model.name_or_path", "random_state": "train.seed",
    "use_gradient_checkpointing": "train.gradient_checkpointing; true or false, not Unsloth's `unsloth`: offloaded "
                                  "activations are not built",
    "fast_inference": "grpo.generation: vllm", "gpu_memory_utilization": "grpo.vllm_gpu_memory_utilization",
}
UNSLOTH_NO_COUNTERPART: dict[str, str] = {
    "full_finetuning": "a run trains a LoRA adapter only",
    "train_on_responses_only": "chat rows always train the assistant turns only, each in its inference context",
    **dict.fromkeys(("instruction_part", "response_part"),
                    "the chat template's own turns mark what is trained, found by rendering each row"),
    "max_lora_rank": "the vLLM server finetune starts takes the least vLLM rank that holds lora.r",
}
# Names whose tool meaning wins over a same-named key of another section, which means something else
FALSE_FRIENDS = frozenset({"strict"})

# Speakers read as each role (finetune/data/conversations.py ROLE_ALIASES; the test compares them)
ROLE_NAMES = ("user: user, human; assistant: assistant, gpt, model, bot, function_call; system: system, developer; "
              "tool: tool, function, ipython, observation")

# ------------------------------------------------------------------------------------ a dataset entry's keys
# axolotl's (a `datasets:` entry) and LLaMA-Factory's (dataset_info.json): the column a field names (`columns:` here)
ENTRY_COLUMNS: dict[str, str] = {
    "field_messages": "messages", "field_tools": "tools", "field_thinking": "reasoning", "field_system": "system",
    "field": "text", "text_column": "text", "message_field_role": "role", "message_field_content": "content",
}
# The field_* keys of axolotl's `type: {...}` (a prompt of your own, SFT, DPO or KTO): the column each names
TYPE_COLUMNS: dict[str, str] = {
    "field_system": "system", "field_instruction": "instruction", "field_input": "input", "field_output": "output",
    "field_prompt": "prompt", "field_chosen": "chosen", "field_rejected": "rejected", "field_completion": "completion",
    "field_label": "label",
}
ENTRY_MEANS: dict[str, str] = {
    "data_files": "path; a file or a folder: several files are their folder, or an entry each", "file_name": "path",
    "hf_hub_url": "path; a hub dataset id", "name": "subset", "num_samples": "max_rows; the first N rows",
    "chat_template": "model.chat_template; one template renders every dataset",
    "chat_template_jinja": "model.chat_template; the template's text or a .jinja file",
}
ENTRY_NO_COUNTERPART: dict[str, str] = {
    "ds_type": "a file's type is read from its suffix (.jsonl, .json, .csv, .tsv, .parquet, .arrow, .txt)",
    "roles": f"speakers are read by one table ({ROLE_NAMES}); rename others in the rows",
    "roles_to_train": "every assistant turn is trained; system, user and tool turns are context",
    "train_on_eos": "each trained assistant turn's end-of-turn token is trained (axolotl's `turn`)",
    "drop_system_message": "a row's system turn is rendered as the row has it",
    "split_thinking": "a leading <think>...</think> block is an assistant turn's reasoning by itself (data.reasoning)",
    "template_thinking_key": "the reasoning goes to the field the chat template reads by itself",
    "revision": "a hub dataset is read at its default revision; to pin one, download it and give the folder as path "
                "(model.revision is the model's)",
    "trust_remote_code": "hub datasets are read from their data files (no loading scripts); model.trust_remote_code "
                         "is the model's code",
    **dict.fromkeys(("shards", "shards_idx"), "a dataset is read whole (max_rows: its first N rows)"),
    "conversation": "FastChat's conversation templates are not read: chat rows go through model.chat_template",
    "message_field_training": "a message's own `training`, `train` or `weight` key is read by itself (docs/data.md)",
    "message_field_training_detail": "a message's `training_detail` spans are not read: a turn trains whole or not "
                                     "at all (docs/data.md)",
    "temperature": "distillation from stored log-probs is not built (grpo.temperature is GRPO's sampling)",
    "logprobs_field": "distillation from stored log-probs is not built",
}
# axolotl's `type` and LLaMA-Factory's `formatting` -> format here (the other values: no counterpart)
ENTRY_FORMATS = {"chat_template": "chat", "sharegpt": "chat", "alpaca": "alpaca", "completion": "text",
                 "pretrain": "text"}
_NO_FORMAT = {"input_output": "segments that each say whether they are trained are not read (prompt and completion "
                              "text is format: completion); "}
_FORMAT_NOTES = {"chat": "`messages` or ShareGPT's `conversations`; the template is model.chat_template",
                 "alpaca": "finetune's Alpaca prompt", "text": "every token trained; data.overlong: split cuts long "
                                                               "rows into pieces"}


def entry_answer(name: str, value: Any, field: Fields, section: str) -> str | None:
    """What a data.datasets (or eval_datasets: `section`) entry's unknown key `name` means here, given its `value`."""
    if name in ENTRY_COLUMNS:
        column = shown(value) if isinstance(value, str) else "..."
        return f"{subject(name, value)} is `columns: {{{ENTRY_COLUMNS[name]}: {column}}}` here."
    if name in ("message_property_mappings", "tags") and not isinstance(value, dict):
        return f"`{name}` is `columns: {{role: ..., content: ...}}` here (the keys of a message's role and content)."
    if name in ("message_property_mappings", "tags"):
        mapped = {ours: value[key] for key, ours in (("role", "role"), ("content", "content"), ("role_tag", "role"),
                                                    ("content_tag", "content"), ("reasoning_content", "reasoning"),
                                                    ("thinking", "reasoning")) if isinstance(value.get(key), str)}
        shown_map = ", ".join(f"{ours}: {column}" for ours, column in mapped.items())
        return (f"`{name}` is `columns: {{{shown_map}}}` here (a message's other keys keep their names; speakers are "
                f"read by one table: {ROLE_NAMES}).")
    if name in ("type", "formatting"):
        return _entry_format(name, value, field)
    if name == "ranking":
        return f"{subject(name, value)} is `format: preference` here (train.objective: dpo or reward)." if value \
            else f"{subject(name, value)} is the default here: leave it out."
    if name in ENTRY_MEANS:
        key, _, note = ENTRY_MEANS[name].partition("; ")
        return f"`{name}` is `{section}.{key}` here{f' ({note})' if note else ''}." if "." not in key \
            else f"`{name}` is `{key}` here{f' ({note})' if note else ''}."
    if name in ENTRY_NO_COUNTERPART:
        return f"`{name}` has no counterpart here: {ENTRY_NO_COUNTERPART[name]}."
    return None


def _entry_format(name: str, value: Any, field: Fields) -> str:
    formats = choices(field("data.datasets[].format"))
    if isinstance(value, dict):  # axolotl's prompt of your own (SFT, DPO or KTO): its field_* keys name the columns
        columns = ", ".join(f"{TYPE_COLUMNS[key]}: {column}" for key, column in value.items() if key in TYPE_COLUMNS)
        meant = "preference" if "field_chosen" in value else "unpaired_preference" if "field_label" in value else \
            "alpaca"
        note = "finetune's Alpaca prompt; " if meant == "alpaca" else ""
        return (f"`{name}` is `format: {meant}` with `columns: {{{columns}}}` here (its field_* keys; {note}a format "
                "string of your own is not read).")
    if not isinstance(value, str):
        return f"`{name}` is `data.datasets[].format` here ({join_or(formats)})."
    if value in ENTRY_FORMATS:
        meant = ENTRY_FORMATS[value]
        return f"`{name}: {value}` is `format: {meant}` here ({_FORMAT_NOTES[meant]})."
    if "." in value:  # axolotl's DPO/KTO prompt strategies (chatml.intel, llama3.argilla, ...)
        return (f"`{name}: {value}` is `format: preference` here (prompt, chosen and rejected, other names mapped "
                "with columns; KTO rows: format: unpaired_preference).")
    return (f"`{name}: {value}` has no counterpart here: {_NO_FORMAT.get(value, '')}the formats are "
            f"{join_or(formats)} (docs/data.md); write the rows in one of them.")


# ------------------------------------------------------------------------------------------------ by value
def _loss(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """TRL's `loss_type` (also LLaMA-Factory's `pref_loss`): the loss key of the objective whose values take it."""
    if isinstance(value, list) and len(value) == 1:  # DPOConfig's loss_type is a list
        value = value[0]
    if isinstance(value, list):
        return f"`{name}` ({', '.join(map(str, value))}) has no counterpart here: a run trains one loss (dpo.loss)."
    if value == "nll":  # SFTConfig's
        return f"`{name}: nll` is what train.objective sft trains here: leave it out."
    if value == "dft":
        return f"`{name}: dft` has no counterpart here: train.objective sft trains the negative log-likelihood (nll)."
    homes = [f"{section}.{key}" for section in sections for key in ("loss", "loss_type") if key in sections[section]
             and choices(field(f"{section}.{key}"))]
    fitting = [home for home in homes if value is not UNSET and accepts(field(home), value)]
    if len(fitting) == 1:
        objective = fitting[0].split(".")[0]
        return f"`{name}: {value}` is `{fitting[0]}: {value}` here (train.objective: {objective})."
    each = "; ".join(f"`{home}` for train.objective {home.split('.')[0]} ({kind(field(home))})" for home in homes)
    miss = f"; `{value}` is none of them" if isinstance(value, str) and not fitting else ""
    return f"`{name}` is the loss of one objective here, each in its section: {each}{miss}."


_STAGES = {"pt": "sft", "rm": "reward"}  # LLaMA-Factory's stage names that are not objective names
_NO_OBJECTIVE = {"ppo": "; online RL here is grpo (docs/grpo.md)"}


def _objective(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """axolotl's `rl`, LLaMA-Factory's `stage`: train.objective, or an objective with its loss (`rl: orpo`)."""
    objectives = choices(field("train.objective"))
    if not isinstance(value, str):
        return f"`{name}` is `train.objective` here ({join_or(objectives)})."
    meant = _STAGES.get(value, value)
    if meant in objectives:
        note = " (rows of format: text: continued pretraining)" if value == "pt" else ""
        return f"`{name}: {value}` is `train.objective: {meant}` here{note}."
    for objective in objectives:
        for key in ("loss", "loss_type"):
            if accepts(field(f"{objective}.{key}"), value):
                return f"`{name}: {value}` is `train.objective: {objective}` with `{objective}.{key}: {value}` here."
    return (f"`{name}: {value}` has no counterpart here: train.objective is {join_or(objectives)}"
            f"{_NO_OBJECTIVE.get(value, '')}.")


def _schedule(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """HF's `lr_scheduler_type`, axolotl's `lr_scheduler`: finetune's decay ends at train.min_lr_ratio, theirs at 0."""
    schedules, floor = choices(field("train.lr_schedule")), field("train.min_lr_ratio").default
    decay = (f"it decays to train.min_lr_ratio of the peak, default {floor}; HF's and axolotl's decay to 0: set "
             "train.min_lr_ratio: 0 for theirs")
    if not isinstance(value, str):
        return f"`{name}` is `train.lr_schedule` here ({join_or(schedules)}; {decay})."
    meant = {"constant_with_warmup": "constant", "cosine_with_min_lr": "cosine"}.get(value, value)
    if meant == "constant":
        return f"`{name}: {value}` is `train.lr_schedule: constant` here."
    if meant in schedules:
        extra = "; its min_lr_rate is train.min_lr_ratio" if value == "cosine_with_min_lr" else ""
        return f"`{name}: {value}` is `train.lr_schedule: {meant}` here ({decay}{extra})."
    return f"`{name}: {value}` has no counterpart here: train.lr_schedule is {join_or(schedules)}."


def _optimizer(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """HF's `optim`, axolotl's `optimizer`: their AdamW names are adamw or adamw_8bit here."""
    optimizers = choices(field("train.optimizer"))
    if not isinstance(value, str):
        return f"`{name}` is `train.optimizer` here ({join_or(optimizers)})."
    meant = None if "adamw" not in value or "4bit" in value else "adamw_8bit" if "8bit" in value else "adamw"
    if meant in optimizers:
        return f"`{name}: {value}` is `train.optimizer: {meant}` here."
    return f"`{name}: {value}` has no counterpart here: train.optimizer is {join_or(optimizers)}."


def _bits(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """LLaMA-Factory's `quantization_bit` (not the quantization: section, which takes the method)."""
    methods = choices(field("quantization.method"))
    if value == 4:
        return f"`{name}: 4` is `quantization.method: nf4` here (the default; fp4 is the other 4-bit type)."
    if not isinstance(value, int):
        return f"`{name}` is `quantization.method` here ({join_or(methods)})."
    return (f"`{name}: {value}` has no counterpart here: the base is quantized to 4 bits or not at all "
            f"(quantization.method: {join_or(methods)}).")


def _adapter(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """axolotl's `adapter: lora | qlora` (the kind of adapter); a folder is model.adapter, the same-named key."""
    if isinstance(value, str) and value not in ("lora", "qlora"):
        return None
    return (f"{subject(name, value)} has no counterpart here: every run trains a LoRA adapter on a 4-bit base (QLoRA); "
            "quantization.method: none for plain LoRA (model.adapter is an adapter folder to start from).")


def _dataset(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """LLaMA-Factory's `dataset: NAME[,NAME]` (a name in dataset_info.json), not the data: section."""
    if not isinstance(value, str):
        return None
    key = "eval_datasets" if name == "eval_dataset" else "datasets"
    several = ", an entry each" if "," in value else ""
    return (f"`{name}: {value}` is `data.{key}[].path` here (LLaMA-Factory's dataset_info.json is not read: "
            f"`data: {{{key}: [{{path: FILE_OR_HUB_ID, format: ...}}]}}`{several}).")


def _lora_target(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    if value == "all":
        return f"`{name}: all` is `lora.target_modules: all-linear` here."
    if isinstance(value, str):
        return f"`{name}: {value}` is `lora.target_modules: [{', '.join(m.strip() for m in value.split(','))}]` here."
    return f"`{name}` is `lora.target_modules` here (all: all-linear; module names: a list)."


def _finetuning_type(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    if value == "lora":
        return (f"`{name}: lora` is what every run trains here: leave it out (on a 4-bit base; quantization.method: "
                "none for plain LoRA).")
    return f"{subject(name, value)} has no counterpart here: a run trains a LoRA adapter only."


def _warmup_steps(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """HF's `warmup_steps` below 1 is a share of the run (train.warmup_ratio); a whole number is train.warmup_steps."""
    if isinstance(value, float) and 0 < value < 1:
        return (f"`{name}: {value}` is `train.warmup_ratio: {value}` here (HF's warmup_steps below 1 is a share of the "
                "run).")
    return None


def _chat_template(name: str, value: Any, field: Fields, sections: dict[str, list[str]]) -> str | None:
    """axolotl's `chat_template: tokenizer_default | jinja`; a template's name is model.chat_template's (the key's own
    check names the templates finetune has)."""
    if isinstance(value, str) and value.startswith("tokenizer_default"):
        return f"`{name}: {value}` is the default here: leave model.chat_template out (the tokenizer's own template)."
    if value == "jinja":
        return f"`{name}: jinja` is `model.chat_template` here (the template's text or a .jinja file)."
    return None


# name -> its answer given the value (None: the name's other answers)
VALUE_ANSWERS: dict[str, Callable[[str, Any, Fields, dict[str, list[str]]], str | None]] = {
    "loss_type": _loss, "pref_loss": _loss, "rl": _objective, "stage": _objective, "lr_scheduler_type": _schedule,
    "lr_scheduler": _schedule, "optim": _optimizer, "optimizer": _optimizer, "quantization_bit": _bits,
    "adapter": _adapter, "dataset": _dataset, "eval_dataset": _dataset, "lora_target": _lora_target,
    "finetuning_type": _finetuning_type, "warmup_steps": _warmup_steps, "chat_template": _chat_template,
}
