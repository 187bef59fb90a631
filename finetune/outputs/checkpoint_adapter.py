"""The adapter of a training checkpoint (checkpoints/step-N): the standard PEFT adapter folder the run's adapter/ would
be had the run ended at that step, so `finetune export RUN OUT --step N` and `finetune generate RUN --step N` work on
any kept step without resuming.

The LoRA tensors are read whole from the checkpoint's DCP files (every rank's shard under FSDP; checkpoint.py
read_trainable_tensors), named on disk as training names them (PEFT's own mapping, computed on the base built on the
meta device from the checkpoint's recipe: adapter_files.adapter_key_map), and written by the same `save_adapter` that
writes adapter/ at the end of a run (read back and compared). The export that follows checks the result against the
base as it checks a finished run's adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.errors import CheckpointError
from finetune.outputs.adapter_files import adapter_key_map, save_adapter
from finetune.outputs.checkpoint import read_trainable_tensors
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
                              f"the LoRA layout cannot be known. {exc}\nFix: correct those keys in "
                              f"{checkpoint / 'recipe.yaml'} (the recipe the checkpoint was written with), then run the "
                              "command again.") from None


def meta_peft_model(recipe: Recipe):
    """The PeftModel of the recipe on the meta device (no weights): the parameter names and the PEFT config training had."""
    from finetune.model import load_config, with_score_head
    from finetune.model.experts import get_peft_model
    from finetune.model.lora.attach import lora_config
    from finetune.outputs.export_experts import split_meta_model

    model = split_meta_model(load_config(recipe))  # MoE experts split as training split them
    with torch.device("meta"):
        peft_model = get_peft_model(model, lora_config(recipe), train_router=recipe.lora.train_router)
    return with_score_head(peft_model, recipe, torch.device("meta"))  # a reward model's head


def write_checkpoint_adapter(checkpoint: Path, folder: Path) -> Recipe:
    """Write the adapter of `checkpoint` into `folder` (+ the run's tokenizer); returns the checkpoint's recipe."""
    recipe = checkpoint_recipe(checkpoint)
    tensors = read_trainable_tensors(checkpoint)
    peft_model = meta_peft_model(recipe)
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
    """The tokenizer training saved next to the run's adapter, else the recipe's (as training loads it)."""
    from transformers import AutoTokenizer

    from finetune.model import load_tokenizer

    finished = checkpoint.parent.parent / "adapter"
    if (finished / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(finished).save_pretrained(folder)
    else:
        load_tokenizer(recipe).save_pretrained(folder)
