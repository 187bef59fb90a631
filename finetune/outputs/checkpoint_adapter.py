"""The adapter of a training checkpoint (checkpoints/step-N): the standard PEFT adapter folder the run's adapter/ would
be had the run ended at that step, so `finetune export RUN OUT --step N` and `finetune generate RUN --step N` work on
any kept step without resuming.

The LoRA tensors are read whole from the checkpoint's DCP files (every rank's shard under FSDP; read_trainable_tensors,
which runs no code from the files: step_folders.dcp_reader), named on disk as training names them (PEFT's own mapping,
computed on the base built on the meta device from the checkpoint's recipe: adapter_files.adapter_key_map), and
written by the same `save_adapter` that writes adapter/ at the end of a run (read back and compared), with the chat
template the checkpoint was trained with (trained_template.py), not the recipe's template as it is now. The export that
follows checks the result against the base as it checks a finished run's adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.errors import CheckpointError
from finetune.outputs.adapter_files import adapter_key_map, save_adapter
from finetune.outputs.checkpoint import _quiet_torch_distributed
from finetune.outputs.step_folders import TRAINER_STATE, dcp_reader
from finetune.outputs.trained_template import today_template_note, trained_template
from finetune.recipe import Recipe


def checkpoint_recipe(checkpoint: Path) -> Recipe:
    """The resolved recipe the checkpoint was written with (its own recipe.yaml: the run's may have changed since),
    read as a run's recipe (keys removed since it was written are dropped with a note: run_folder.saved_recipe)."""
    from finetune.errors import RecipeError
    from finetune.outputs.run_folder import saved_recipe

    try:
        return saved_recipe(checkpoint / "recipe.yaml")
    except RecipeError as exc:  # the whole paragraph: every problem, each at its key (not only its first line)
        raise CheckpointError(f"checkpoint {checkpoint}: its recipe.yaml is not a valid recipe for this finetune, so "
                              f"the LoRA layout cannot be known. {exc}\nNothing was written. Fix: run the same command "
                              "with the finetune that wrote the checkpoint (its manifest.json's `finetune` names it), or "
                              "export the run's finished adapter/ (without --step), or start a new run. Do not edit "
                              "that recipe.yaml: the checkpoint's manifest checks it, and an edited checkpoint is "
                              "damaged for every later resume and export.") from None


def read_trainable_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The whole LoRA tensors of checkpoint `path`, keyed by the model's parameter names, read in this process alone.

    DCP stores every tensor with its global shape, whichever ranks wrote shards of it (FSDP2's DTensors, FSDP1's
    ShardedTensors) or the whole of it (single process, DDP, layer split), and a load into full-size plain tensors
    reshards to one process: no process group, no model, no optimizer state read. DeepSpeed's own format is refused.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = path / "trainable"
    if not folder.is_dir():
        strategy = _strategy_of(path)
        raise CheckpointError(f"checkpoint {path} holds no trainable/ folder{f' (written by {strategy})' if strategy else ''}: "
                              "an adapter is read from the DCP checkpoints of single-process, DDP, FSDP and layer-split "
                              "runs; DeepSpeed writes its own format. Fix: export the finished run's adapter/, or resume "
                              "the run with train.max_steps set to this step to get its adapter.")
    reader = dcp_reader(folder)  # no code of the checkpoint runs (CheckpointError where its metadata holds some)
    with _quiet_torch_distributed():
        metadata = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
             for key, entry in metadata.items()
             if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"checkpoint {path}: trainable/ holds no model tensors; the checkpoint is damaged.")
    state = {"model": model}
    with _quiet_torch_distributed():  # no_dist: this process reads every tensor whole, process group or not
        dcp.load(state, checkpoint_id=folder, storage_reader=reader, no_dist=True)
    return state["model"]


def _strategy_of(path: Path) -> str | None:
    try:
        return json.loads((path / TRAINER_STATE).read_text(encoding="utf-8")).get("strategy")
    except (OSError, ValueError):
        return None


def meta_peft_model(recipe: Recipe, *, on_indexers: bool = False):
    """The PeftModel of the recipe on the meta device (no weights): the parameter names and the PEFT config training had.
    `on_indexers`: LoRA on sparse-attention indexers too, as finetune put it before 2026-12-07 (lora.attach.indexer_linears)."""
    from finetune.model import load_config, with_score_head
    from finetune.model.experts import get_peft_model
    from finetune.model.lora.attach import lora_config
    from finetune.outputs.export_experts import split_meta_model

    config = load_config(recipe)
    try:
        model = split_meta_model(config)  # MoE experts split as training split them
    except ValueError as exc:  # transformers' AutoModelForCausalLM knows no model of this config class (a traceback)
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"model.name_or_path `{recipe.model.name_or_path}` of the checkpoint's recipe.yaml: "
                              f"transformers builds no causal language model from its config ({reason}), so the LoRA "
                              "layout cannot be known. Nothing was written. Fix: set model.name_or_path in that "
                              "recipe.yaml to the base the run trained on.") from None
    with torch.device("meta"):
        peft_model = get_peft_model(model, lora_config(recipe, None if on_indexers else model),
                                    train_router=recipe.lora.train_router)
    return with_score_head(peft_model, recipe, torch.device("meta"))  # a reward model's head


def write_checkpoint_adapter(checkpoint: Path, folder: Path, *, base: str | None = None) -> Recipe:
    """Write the adapter of `checkpoint` into `folder` (+ the run's tokenizer); returns the checkpoint's recipe, with
    `base` as its model where given (`export --base`: the base folder moved since; bug bash: --base was ignored with
    --step, and the checkpoint's recipe.yaml cannot be edited, its manifest checks it)."""
    recipe = checkpoint_recipe(checkpoint)
    if base is not None:
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name_or_path": str(base)})})
    tensors = read_trainable_tensors(checkpoint)
    peft_model = meta_peft_model(recipe)
    key_map = adapter_key_map(peft_model)
    if set(tensors) - set(key_map):  # a checkpoint of an earlier finetune, which put LoRA on indexers too
        peft_model = meta_peft_model(recipe, on_indexers=True)
        key_map = adapter_key_map(peft_model)
    missing, unexpected = sorted(set(key_map) - set(tensors)), sorted(set(tensors) - set(key_map))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint}: its LoRA tensors do not match the layout of its recipe.yaml "
            f"({len(missing)} missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. {unexpected[:1]}). "
            "The checkpoint or its recipe.yaml was changed; export another kept step.")
    from finetune.model import adapter_config

    save_adapter(adapter_config(peft_model, recipe), key_map, tensors, folder, recipe=recipe)
    _copy_tokenizer(checkpoint, recipe, folder)
    return recipe


def _copy_tokenizer(checkpoint: Path, recipe: Recipe, folder: Path) -> None:
    """The tokenizer training saved next to the run's adapter, else the recipe's (as training loads it), with the chat
    template the checkpoint was trained with (trained_template.py). A checkpoint that records none (an earlier
    finetune's) keeps the adapter's template, else gets today's, and says so."""
    from transformers import AutoTokenizer

    from finetune.model import load_tokenizer

    finished = checkpoint.parent.parent / "adapter"
    found = (finished / "tokenizer_config.json").is_file()
    tokenizer = None
    if found:
        try:
            tokenizer = AutoTokenizer.from_pretrained(finished)
        except Exception as exc:  # noqa: BLE001 (a damaged copy beside the adapter: json's, tokenizers', transformers')
            print(f"[finetune] note: the tokenizer saved beside the run's adapter ({finished}) does not load "
                  f"({type(exc).__name__}); the step's adapter gets the recipe's, as training loaded it", flush=True)
            found = False
    tokenizer = tokenizer or load_tokenizer(recipe)
    recorded, template = trained_template(checkpoint)
    if recorded:
        tokenizer.chat_template = template
    elif not found:
        print(today_template_note(checkpoint, recipe), flush=True)
    tokenizer.save_pretrained(folder)
