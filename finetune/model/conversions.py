"""transformers' checkpoint key conversions, applied to a checkpoint's index so that the per-tensor readers find each
model tensor: the renames `from_pretrained` applies (Mixtral's `block_sparse_moe.` -> `mlp.`, legacy LayerNorm names,
...), read from the installed transformers' conversion mapping for the model, and the expert tensors of `RoutedExperts`
(finetune/model/experts.py): per-expert in the checkpoint (as hub checkpoints and transformers 5's `save_pretrained`
store them) they map one to one after the renames; fused 3-D in the checkpoint, each is read as its expert's slice.
"""

from __future__ import annotations

from torch import nn

from finetune.model.checkpoint_files import CheckpointIndex


def convert_index(index: CheckpointIndex, model: nn.Module) -> int:
    """Add to `index` (its `views`, files and shapes) every model tensor stored under another name or inside a fused
    tensor; `model` is the (Peft) model being loaded. Returns the number of views added."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    renamings = [t for t in get_model_conversion_mapping(base) if isinstance(t, WeightRenaming)]
    added = 0
    for stored in list(index.shapes):
        renamed, _ = rename_source_key(stored, renamings, [])
        if renamed != stored and renamed not in index.shapes:
            _add(index, renamed, (stored, None, 0, 1), index.shapes[stored])
            added += 1
    return added + _fused_expert_views(index, base)


def _add(index: CheckpointIndex, name: str, view: tuple, shape: tuple[int, ...]) -> None:
    index.views[name] = view
    index.files[name] = index.files[view[0]]
    index.shapes[name] = shape


def _fused_expert_views(index: CheckpointIndex, base: nn.Module) -> int:
    """Per-expert weights of `RoutedExperts` missing from the checkpoint but stored fused (experts x out x in):
    expert e's part i of n is rows i/n of the fused tensor's slice e (transformers' `Concatenate(dim=1)` order)."""
    from finetune.model.experts import RoutedExperts

    added = 0
    for name, module in base.named_modules():
        if not isinstance(module, RoutedExperts) or not len(module):
            continue
        names = module[0].names
        for fused, parts in ((f"{name}.gate_up_proj", names.gate_up), (f"{name}.down_proj", names.down)):
            if fused not in index.shapes:
                continue
            stored = index.views.get(fused, (fused,))[0]
            shape = index.shapes[fused]
            for expert in range(shape[0]):
                for part, part_name in enumerate(parts):
                    key = f"{name}.{expert}.{part_name}.weight"
                    if key not in index.shapes:
                        _add(index, key, (stored, expert, part, len(parts)), (shape[1] // len(parts), *shape[2:]))
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
