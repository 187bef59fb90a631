"""transformers' checkpoint key conversions, applied to a checkpoint's index so that the per-tensor readers find each
model tensor: the renames `from_pretrained` applies (Mixtral's `block_sparse_moe.` -> `mlp.`, legacy LayerNorm names,
...), read from the installed transformers' conversion mapping for the model. The expert tensors of `RoutedExperts`
(finetune/model/experts/), per-expert in the checkpoint (as hub checkpoints and transformers 5's `save_pretrained`
store them), map one to one after these renames; fused 3-D in the checkpoint, each is read as its expert's slice
(`fused_expert_views` in finetune/model/experts/split.py: the experts know their layout, the checkpoint does not).
"""

from __future__ import annotations

from torch import nn

from finetune.model.sources.files import CheckpointIndex


def convert_index(index: CheckpointIndex, model: nn.Module) -> int:
    """Add to `index` (its `views`, files and shapes) every model tensor stored under another name; `model` is the
    (Peft) model being loaded. Returns the number of views added. (Expert tensors stored fused get their per-expert
    views from finetune/model/experts/split.py, `fused_expert_views`.)"""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    renamings = [t for t in get_model_conversion_mapping(base) if isinstance(t, WeightRenaming)]
    # A causal LM loaded from its multimodal checkpoint (Llama 4 Scout / Maverick: Llama4ForCausalLM, whose
    # base_model_prefix is `language_model`, from `language_model.model.*` next to a vision tower): as
    # from_pretrained does, the prefix the model itself does not have is stripped; the vision tower's tensors match
    # nothing in the model and are never read.
    prefix = f"{base.base_model_prefix}." if base.base_model_prefix and not hasattr(base, base.base_model_prefix) else None
    added = 0
    for stored in list(index.shapes):
        source = stored.removeprefix(prefix) if prefix else stored
        renamed, _ = rename_source_key(source, renamings, [])
        if renamed != stored and renamed not in index.shapes:
            index.add_view(renamed, (stored, None, 0, 1), index.shapes[stored])
            added += 1
    return added


def _renamings(model: nn.Module, *, reverse: bool) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # As transformers' own save does (revert_weight_conversion): no legacy renames, no prefix changes, reverse order.
    found = [t for t in get_model_conversion_mapping(base, add_legacy=not reverse)
             if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)]
    return [t.reverse_transform() for t in reversed(found)] if reverse else found


def checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Model tensor name -> the name the model's checkpoint format uses (transformers' renames reversed, as its
    `save_pretrained` writes them: Mixtral's `mlp.` back to `block_sparse_moe.`). Adapter keys named so match the base
    checkpoint's tensor names, which vLLM's and llama.cpp's model definitions follow; PEFT renames them on load."""
    from transformers.core_model_loading import rename_source_key

    renamings = _renamings(model, reverse=True)
    return {key: rename_source_key(key, renamings, [])[0] for key in keys}


def model_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Checkpoint-format tensor name -> the model's (transformers' renames, as `from_pretrained` applies them); names
    already in the model's form stay as they are."""
    from transformers.core_model_loading import rename_source_key

    renamings = _renamings(model, reverse=False)
    return {key: rename_source_key(key, renamings, [])[0] for key in keys}
