"""model.adapter, the adapter a run starts from: its folder checked, its LoRA layout (adapter_config.json) resolved into
the recipe's lora section or a conflicting recipe key refused (both before any weight loads), a lora.target_modules
list compared with its targets on the model's module names, and its tensors read, keyed as `init.adapter_key` keys a
PeftModel's parameters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError, RecipeError
from finetune.recipe import Recipe

# The lora keys a saved adapter fixes, with the adapter_config.json field and the PEFT default of each. A run that
# starts from an adapter keeps them: r fixes the shapes of its tensors, alpha and rslora their scaling, dora its
# magnitude vectors, bias which biases it trained; any other value would not start from the model the adapter computes.
LAYOUT = {"r": ("r", 8), "alpha": ("lora_alpha", 8), "rslora": ("use_rslora", False), "dora": ("use_dora", False),
          "bias": ("bias", "none")}


def check_adapter(recipe: Recipe) -> Path | None:
    """model.adapter's folder, checked before any weight loads (a PEFT adapter: config + safetensors), with the recipe's
    lora section resolved to its layout (`resolve_adapter_layout`)."""
    if not recipe.model.adapter:
        return None
    from finetune.files import as_trained

    folder = as_trained(Path(recipe.model.adapter).expanduser())  # a MoE run's adapter/: its as-trained twin
    missing = [name for name in ("adapter_config.json", "adapter_model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"model.adapter ({folder}): {', '.join(missing)} not found, so it is not a PEFT adapter folder. Fix: point it "
            "at the adapter/ folder of a finished run (e.g. runs/sft/adapter), or at an adapter exported by PEFT.")
    resolve_adapter_layout(recipe, folder)
    return folder


def _saved_layout(folder: Path) -> dict:
    """The adapter's value of each LAYOUT key, and train_router: whether it trained modules in full (modules_to_save)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.adapter ({folder}): adapter_config.json is unreadable ({exc}). Fix: point "
                             "model.adapter at the adapter/ folder of a finished run.") from None
    saved = {key: default if config.get(field) is None else config[field] for key, (field, default) in LAYOUT.items()}
    saved["alpha"] = float(saved["alpha"])
    saved["train_router"] = bool(config.get("modules_to_save"))
    return saved


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def resolve_adapter_layout(recipe: Recipe, folder: Path) -> None:
    """The recipe's lora layout keys (LAYOUT) from model.adapter's adapter_config.json, as model.attn_implementation:
    auto is resolved on the recipe: the plan (DoRA's loader), the resume checks and the run's recipe.yaml then say what
    the run trains. A key the recipe leaves at its default takes the adapter's value (said once, as a note); a key set
    to another value than the adapter's is refused in one paragraph, as a resume refuses a changed layout
    (outputs/resume_checks.py): silently ignored, `dora: true` trained no DoRA. lora.train_router: true is refused for
    an adapter without trained routers; false (the default) keeps the adapter's own modules_to_save."""
    saved, lora = _saved_layout(folder), recipe.lora
    default = type(lora)()
    conflicts = [(key, getattr(lora, key), value) for key, value in saved.items()
                 if getattr(lora, key) != getattr(default, key) and getattr(lora, key) != value]
    if conflicts:
        keys = [f"lora.{key}" for key, _, _ in conflicts]
        raise RecipeError(
            f"model.adapter ({folder}): the recipe's {', '.join(f'{k} {_shown(now)}' for k, (_, now, _) in zip(keys, conflicts))} "
            f"differ{'s' if len(conflicts) == 1 else ''} from the adapter's adapter_config.json "
            f"({', '.join(f'{k} {_shown(value)}' for k, (_, _, value) in zip(keys, conflicts))}). A run that starts from "
            "an adapter keeps its LoRA layout (r fixes the shapes of its tensors, alpha and rslora their scaling, dora "
            "its magnitude vectors, bias and train_router the biases and routers it trained), so it starts from the "
            f"model the adapter computes. Fix: remove {' and '.join(keys)} from the recipe (the adapter's values are "
            "then used), or set them to the adapter's values; for another layout, train a new adapter without "
            "model.adapter.")
    changed = []
    for key in LAYOUT:
        if getattr(lora, key) != saved[key]:
            changed.append(f"lora.{key} {_shown(getattr(lora, key))} -> {_shown(saved[key])}")
            setattr(lora, key, saved[key])
    from finetune.recipe import announcing
    from finetune.recipe.grpo import vllm_problems

    if changed and recipe.train.objective == "grpo" and (problems := vllm_problems(recipe)):
        raise RecipeError(f"model.adapter ({folder}): its LoRA layout ({', '.join(changed)}) is one vLLM cannot "
                          f"serve with grpo.generation: vllm: {' '.join(problems)}")
    if changed and announcing():  # `finetune train`'s pre-flight is muted: the launched rank 0 says it, once
        from finetune.distributed import print0

        print0(f"[finetune] note: model.adapter: its LoRA layout is used ({folder / 'adapter_config.json'}): "
               f"{', '.join(changed)}", file=sys.stderr)


def adapter_targets_problem(recipe: Recipe, model: nn.Module) -> str | None:
    """With model.adapter, a lora.target_modules list that puts LoRA on other modules of `model` (PEFT's rule) than the
    adapter's own targets (adapter_config.json: its names, exclusions and layers); None when they agree or the recipe
    keeps the default all-linear, which with model.adapter means the adapter's targets. `model`: the base, no LoRA yet
    (it may be on the meta device: only its module names are read)."""
    targets = recipe.lora.target_modules
    if not recipe.model.adapter or targets == "all-linear":
        return None
    from types import SimpleNamespace

    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    folder = check_adapter(recipe)
    saved = LoraConfig.from_pretrained(str(folder))
    wanted = SimpleNamespace(target_modules=list(targets), exclude_modules=None, modules_to_save=None,
                             target_parameters=None, layers_to_transform=None, layers_pattern=None)
    leaves = [name for name, module in model.named_modules() if name and not list(module.children())]
    ours = {name for name in leaves if check_target_module_exists(wanted, name)}
    theirs = {name for name in leaves if check_target_module_exists(saved, name)}
    if ours == theirs:
        return None
    only_ours, only_theirs = sorted(ours - theirs), sorted(theirs - ours)
    said = [f"{len(names)} only by {whose} (e.g. {', '.join(names[:3])})"
            for names, whose in ((only_ours, "the recipe's"), (only_theirs, "the adapter's")) if names]
    return (f"lora.target_modules {list(targets)} selects other modules than model.adapter's adapter_config.json "
            f"({folder}): {'; '.join(said)}. A run that starts from an adapter keeps its targets (they decide which "
            "modules hold its LoRA tensors). Fix: remove lora.target_modules from the recipe (with model.adapter the "
            "default, all-linear, means the adapter's own targets), or list the modules the adapter targets.")


def adapter_start(recipe: Recipe, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """model.adapter's tensors (LoRA, DoRA magnitudes, biases, modules_to_save copies), keyed as `init.adapter_key` keys
    a PeftModel's parameters: without `base_model.model.` and `.base_layer.`. On a mixture-of-experts `model`, keys
    named as the checkpoint names them (an adapter from `finetune export`) are renamed to the model's names
    (transformers' renames, finetune/model/conversions.py)."""
    folder = check_adapter(recipe)
    if folder is None:
        return None
    from safetensors.torch import load_file

    from finetune.model.experts.routed import has_routed_experts
    from finetune.model.lora.init import lora_tensor_name
    from finetune.model.sources.conversions import model_names

    tensors = {lora_tensor_name(key): value
               for key, value in load_file(str(folder / "adapter_model.safetensors")).items()}
    if model is None or not has_routed_experts(model):
        return tensors
    names = model_names(model, list(tensors))
    return {names[key]: value for key, value in tensors.items()}
