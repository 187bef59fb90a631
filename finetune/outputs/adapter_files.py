"""The adapter files: PEFT's on-disk keys for the trained parameters, and the adapter written and read back.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from finetune.errors import CheckpointError
from finetune.files import AS_TRAINED, as_trained, atomic_dir, free_mb, no_room  # noqa: F401 (AS_TRAINED, as_trained: re-exported)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


# -------------------------------------------------------------------------------------------------- adapter
def adapter_key_map(peft_model) -> dict[str, str]:
    """Model parameter name -> PEFT's on-disk key, computed by PEFT itself on the unwrapped model.

    Call before the parallel wrap: PEFT finds adapter tensors by walking the module tree, and FSDP1 inserts
    `_fsdp_wrapped_module` levels into it, after which PEFT silently selects nothing (an empty adapter).
    """
    from peft.utils import get_peft_model_state_dict

    trainable = {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
    tagged = {name: torch.tensor([index]) for index, name in enumerate(trainable)}
    on_disk = get_peft_model_state_dict(peft_model, state_dict=tagged)
    names = list(trainable)
    keys = {names[int(value.item())]: key for key, value in on_disk.items()}
    from finetune.model.reward_head import SCORE_KEY

    if SCORE_KEY in trainable:  # a reward model's head: saved under PEFT's key of a modules_to_save head
        keys[SCORE_KEY] = SCORE_KEY
    return keys


def save_adapter(peft_config, key_map: dict[str, str], trainable_state: dict[str, torch.Tensor], out_dir: Path, *,
                 tokenizer=None) -> dict:
    """Write a standard PEFT adapter folder atomically (with the tokenizer, when given: a folder is published whole or
    not at all), read it back and compare. Rank 0 only."""
    from safetensors.torch import load_file, save_file

    missing = [name for name in key_map if name not in trainable_state]
    if not key_map or missing:
        raise RuntimeError(
            f"adapter gather is missing {len(missing)} of {len(key_map)} tensors (e.g. {missing[:2]}): refusing to write a partial adapter"
        )
    tensors = {key_map[name]: trainable_state[name].detach().to("cpu").contiguous() for name in key_map}
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the adapter has NaN/inf values ({bad[0]} and {len(bad) - 1} more); not written over {out_dir}.")
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    try:
        with atomic_dir(out_dir) as tmp:
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            config.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            _verify_adapter_files(tmp, tensors, load_file)
    except Exception as exc:  # safetensors raises its own error type for a full disk
        if not no_room(exc):
            raise
        size = sum(value.numel() * value.element_size() for value in tensors.values())
        before = "the adapter already there is unchanged" if out_dir.exists() else "nothing was left there"
        raise CheckpointError(
            f"the adapter was not written to {out_dir}: no space left on that filesystem ({free_mb(out_dir)} free; "
            f"{str(exc).splitlines()[0][:200]}); the temporary files were removed and {before}. It needs about "
            f"{size / 1e6:,.1f} MB{' and the tokenizer files' if tokenizer is not None else ''}. Free that much there, "
            "then run the same command with train.resume=auto added: the run "
            "continues from its newest checkpoint (after the last step it trains nothing again) and writes the adapter."
        ) from None
    return tensors


def _verify_adapter_files(folder: Path, tensors: dict[str, torch.Tensor], load_file) -> None:
    written = load_file(str(folder / ADAPTER_WEIGHTS))
    if written.keys() != tensors.keys():
        raise RuntimeError(f"adapter read back with {len(written)} tensors, {len(tensors)} were saved")
    for key, value in tensors.items():
        if not torch.equal(written[key], value):
            raise RuntimeError(f"adapter tensor {key} differs after reading it back")
    if not (folder / ADAPTER_CONFIG).exists():
        raise RuntimeError("adapter_config.json was not written")

