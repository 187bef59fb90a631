"""The adapter files: PEFT's on-disk keys for the trained parameters, and the adapter written and read back.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune.errors import CheckpointError
from finetune.files import AS_TRAINED, as_trained, atomic_dir, free_mb, no_room  # noqa: F401 (AS_TRAINED, as_trained: re-exported)

if TYPE_CHECKING:
    from finetune.recipe import Recipe

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


# -------------------------------------------------------------------------------------------------- adapter
class AdapterKeys(dict):
    """Model parameter name -> PEFT's on-disk key, for every trainable tensor; and `buffers`: on-disk key -> (module,
    buffer name) of the frozen buffers PEFT saves beside a modules_to_save copy (a trained router's
    `e_score_correction_bias`), which `save_adapter` writes from the module as it is then."""

    buffers: dict[str, tuple[torch.nn.Module, str]]


def adapter_key_map(peft_model) -> AdapterKeys:
    """Model parameter name -> PEFT's on-disk key, computed by PEFT itself on the unwrapped model.

    Call before the parallel wrap: PEFT finds adapter tensors by walking the module tree, and FSDP1 inserts
    `_fsdp_wrapped_module` levels into it, after which PEFT silently selects nothing (an empty adapter).
    PEFT's state dict of a modules_to_save copy is the copy's whole state dict: with lora.train_router, the routers of
    DeepSeek-V3, GLM-4.5 or Kimi K2.5 also hold a persistent buffer, the routing bias `e_score_correction_bias` (no
    gradient moves it). PEFT's loader asks for it too (a KeyError without it), so it is saved (`AdapterKeys.buffers`);
    a KeyError here stopped such runs before their first step.
    """
    from peft.utils import get_peft_model_state_dict

    trainable = {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
    buffers = _copy_buffers(peft_model)
    tagged = {name: torch.tensor([index]) for index, name in enumerate([*trainable, *buffers])}
    on_disk = get_peft_model_state_dict(peft_model, state_dict=tagged)
    names = [*trainable, *buffers]
    keys = AdapterKeys()
    keys.buffers = {}
    for key, value in on_disk.items():
        name = names[int(value.item())]
        if name in buffers:
            keys.buffers[key] = buffers[name]
        else:
            keys[name] = key
    from finetune.model.reward_head import SCORE_KEY

    if SCORE_KEY in trainable:  # a reward model's head: saved under PEFT's key of a modules_to_save head
        keys[SCORE_KEY] = SCORE_KEY
    return keys


def _copy_buffers(peft_model) -> dict[str, tuple[torch.nn.Module, str]]:
    """The persistent buffers of PEFT's modules_to_save copies: model name -> (the copy, the buffer's name)."""
    from peft.utils import ModulesToSaveWrapper

    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            for adapter, copy in module.modules_to_save.items():
                for owner_name, owner in copy.named_modules():
                    for buffer in owner._buffers:
                        if buffer not in owner._non_persistent_buffers_set:
                            prefix = f"{name}.modules_to_save.{adapter}." + (f"{owner_name}." if owner_name else "")
                            found[prefix + buffer] = (owner, buffer)
    return found


def _buffer_tensors(key_map: dict[str, str], out_dir: Path) -> dict[str, torch.Tensor]:
    """`AdapterKeys.buffers`' values from their modules now (rank 0 holds every buffer whole: FSDP shards no buffer)."""
    tensors = {}
    for key, (module, name) in getattr(key_map, "buffers", {}).items():
        value = module._buffers[name]
        if value.is_meta:
            raise CheckpointError(
                f"the adapter was not written to {out_dir}: {key}, a buffer of a router that lora.train_router trains "
                "(PEFT saves it with the router, and its loader needs it), has no value here: the model was built "
                "without weights, as `finetune export` builds it for a checkpoint step. Fix: export the run folder "
                "instead (its adapter/ holds the buffer), or train with lora.train_router: false.")
        tensors[key] = value.detach().to("cpu").contiguous()
    return tensors


def _config_to_write(peft_config, recipe: Recipe | None = None):
    """The adapter_config.json of a run's adapter: PEFT's config in inference mode, and with the run's `recipe` the base
    it trained on: base_model_name_or_path is model.name_or_path (as the recipe resolved it: a local folder absolute),
    revision model.revision. PEFT takes the name from the model's config (`_name_or_path`), which a text model built
    from a multimodal config (Llama 4) does not carry: the adapter said null, and AutoPeftModel, TRL and `finetune
    export` of the adapter alone had no base (a hub base pinned by model.revision was reloaded at main). A GGUF base
    (model.gguf_file) keeps PEFT's name: PEFT cannot load a GGUF file as the base."""
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    if recipe is not None:
        if not recipe.model.gguf_file:
            config.base_model_name_or_path = recipe.model.name_or_path
        config.revision = recipe.model.revision
    return config


def save_adapter(peft_config, key_map: dict[str, str], trainable_state: dict[str, torch.Tensor], out_dir: Path, *,
                 tokenizer=None, recipe: Recipe | None = None) -> dict:
    """Write a standard PEFT adapter folder atomically (with the tokenizer, when given: a folder is published whole or
    not at all), read it back and compare. Rank 0 only. With the run's `recipe`, adapter_config.json names its base
    (`_config_to_write`)."""
    from safetensors.torch import load_file, save_file

    missing = [name for name in key_map if name not in trainable_state]
    if not key_map or missing:
        raise RuntimeError(
            f"adapter gather is missing {len(missing)} of {len(key_map)} tensors (e.g. {missing[:2]}): refusing to write a partial adapter"
        )
    tensors = {key_map[name]: trainable_state[name].detach().to("cpu").contiguous() for name in key_map}
    tensors.update(_buffer_tensors(key_map, out_dir))
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the adapter has NaN/inf values ({bad[0]} and {len(bad) - 1} more); not written over {out_dir}.")
    config = _config_to_write(peft_config, recipe)
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

