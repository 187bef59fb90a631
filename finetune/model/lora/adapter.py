"""model.adapter, the adapter a run starts from: its folder checked (a config field finetune would not apply as PEFT
loads it refused), its LoRA layout (adapter_config.json) resolved into the recipe's lora section or a conflicting
recipe key refused (all before any weight loads), a lora.target_modules list compared with its targets on the model's
module names, and its tensors read (safetensors, or PEFT's older .bin), keyed as `init.adapter_key` keys a PeftModel's
parameters. A resume, export or generate of a run reads the copy the run kept of it (kept.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError, RecipeError
from finetune.model.lora.kept import WEIGHTS, start_folder
from finetune.recipe import Recipe

# The lora keys a saved adapter fixes, with the adapter_config.json field and the PEFT default of each. A run that
# starts from an adapter keeps them: r fixes the shapes of its tensors, alpha and rslora their scaling, dora its
# magnitude vectors, bias which biases it trained; any other value would not start from the model the adapter computes.
LAYOUT = {"r": ("r", 8), "alpha": ("lora_alpha", 8), "rslora": ("use_rslora", False), "dora": ("use_dora", False),
          "bias": ("bias", "none")}

# WEIGHTS (kept.py): PEFT's file, or its older pickle, read as plain tensors only (torch.load weights_only).
# adapter_config.json fields that narrow target_modules to some of the modules it names: with any of them set, the
# recipe's lora.target_modules stays all-linear ("the adapter's targets"), as a list of names would select more.
NARROWING = ("exclude_modules", "layers_to_transform", "layers_pattern", "target_parameters")

# init_lora_weights values whose saved adapter is W + BA on the base as its checkpoint holds it: PEFT's init at load
# touches only A and B (then overwritten by the saved ones) or nothing. A save that PEFT converted to plain LoRA
# (save_pretrained's path_initial_model_for_weight_conversion) says true: that is how PEFT marks it.
INIT_APPLIED = (None, True, False, "gaussian", "orthogonal", "eva")
_RESIDUAL = ("PEFT turns each targeted base weight into its residual whenever it loads the adapter, while finetune "
             "starts from the weights the checkpoint holds, so the part split off into the adapter would count twice. "
             "Convert it to plain LoRA first: PEFT's save_pretrained(..., path_initial_model_for_weight_conversion="
             "<the adapter as initialized, saved with init_lora_weights true>) writes one (its r doubles)")
# init_lora_weights values (prefixes) that PEFT applies to the base weights or the training itself, and why.
INIT_REWRITES_BASE = {
    "pissa": f"PiSSA: {_RESIDUAL}", "olora": f"OLoRA: {_RESIDUAL}", "corda": f"CorDA: {_RESIDUAL}",
    "lora_ga": f"LoRA-GA: {_RESIDUAL}",
    "loftq": ("LoftQ: PEFT replaces each targeted base weight with its LoftQ-quantized form when it loads the adapter, "
              "so the adapter pairs with the base LoftQ wrote; set model.name_or_path to that base and "
              "init_lora_weights to true in adapter_config.json, as PEFT's LoftQ guide saves it"),
    "mica": "MiCA, a LoRA variant that keeps B frozen and trains A alone; finetune trains both",
}
_VARIANT = "a LoRA variant finetune does not train (it trains LoRA and DoRA)"
# adapter_config.json fields of PEFT 0.21's LoraConfig that finetune does not apply (a value other than None/false/
# empty is refused before any weight loads): they passed `validate`, then training ended in an error blaming the base
# checkpoint, or started from another model than PEFT loads.
UNAPPLIED = {
    "trainable_token_indices": "PEFT's trainable token rows (TrainableTokens), which finetune neither loads nor "
                               "trains (its loaders took their tensors for base tensors missing from the checkpoint)",
    "layer_replication": "layers PEFT stacks anew from the base's, which finetune's loaders do not build",
    "alora_invocation_tokens": f"Activated LoRA, {_VARIANT}", "velora_config": f"VeLoRA, {_VARIANT}",
    "monteclora_config": f"MonteCLoRA, {_VARIANT}", "use_bdlora": f"BD-LoRA, {_VARIANT}",
    "arrow_config": f"Arrow routing, {_VARIANT}", "kasa_config": f"KaSA, {_VARIANT}",
    "megatron_config": "Megatron's parallel layers, which finetune does not build",
}


def check_adapter(recipe: Recipe) -> Path | None:
    """model.adapter's folder, checked before any weight loads (a PEFT LoRA adapter: config + weights, every config
    field one finetune applies), with the recipe's lora section resolved to its layout (`resolve_adapter_layout`)."""
    if not recipe.model.adapter:
        return None
    folder = start_folder(recipe)  # the run's kept copy (a resume, an export), or the folder (MoE: as trained)
    missing = [name for name in ("adapter_config.json",) if not (folder / name).is_file()]
    if not any((folder / name).is_file() for name in WEIGHTS):
        missing.append(f"{WEIGHTS[0]} (or PEFT's older {WEIGHTS[1]})")
    if missing:
        raise ModelLoadError(
            f"model.adapter ({folder}): {', '.join(missing)} not found, so it is not a PEFT adapter folder. Fix: point it "
            "at the adapter/ folder of a finished run (e.g. runs/sft/adapter), or at an adapter exported by PEFT.")
    from finetune.model.lora import saved_adapter

    if problem := saved_adapter.config_problem(folder) or (
            (folder / WEIGHTS[0]).is_file() and saved_adapter.weights_problem(folder)):
        raise ModelLoadError(
            f"model.adapter ({folder}): {problem}. Fix: copy the adapter folder again from where it was made, or point "
            "model.adapter at another (`finetune export RUN OUT --step N` writes one from a kept checkpoint).")
    if problems := unapplied_fields(_saved_config(folder)):
        raise ModelLoadError(
            f"model.adapter ({folder}): its adapter_config.json {'; '.join(problems)}. A run starts from an adapter only "
            "where finetune builds the model PeftModel.from_pretrained loads from it. Fix: start from a plain LoRA or "
            "DoRA adapter, or merge this one into its base with PEFT (PeftModel.from_pretrained(base, adapter)"
            ".merge_and_unload(), then save_pretrained) and set model.name_or_path to the merged model, without "
            "model.adapter.")
    resolve_adapter_layout(recipe, folder)
    return folder


def unapplied_fields(config: dict) -> list[str]:
    """What in an adapter_config.json finetune does not apply as PEFT 0.21's PeftModel.from_pretrained does: another
    adapter type than LoRA, an init that PEFT redoes on the base at load (INIT_REWRITES_BASE), a field of UNAPPLIED.
    Each is said with its value and why (one clause each); empty when finetune starts from the model PEFT loads."""
    said = []
    if str(config.get("peft_type") or "LORA").upper() != "LORA":
        said.append(f"says peft_type: {config['peft_type']}, and finetune trains and reads LoRA adapters only")
    init = config.get("init_lora_weights")  # absent or null: no init at all (as false)
    if init not in INIT_APPLIED:
        family = next((name for name in INIT_REWRITES_BASE if str(init).lower().startswith(name)), None)
        said.append(f"says init_lora_weights: {json.dumps(init)}, "
                    + (INIT_REWRITES_BASE[family] if family else "an initialization finetune does not apply"))
    for field, why in UNAPPLIED.items():
        if config.get(field):
            said.append(f"sets {field} ({json.dumps(config[field])[:80]}): {why}")
    return said


def _saved_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.adapter ({folder}): adapter_config.json is unreadable ({exc}). Fix: point "
                             "model.adapter at the adapter/ folder of a finished run.") from None


def _saved_layout(folder: Path) -> dict:
    """The adapter's value of each LAYOUT key, train_router (whether it trained modules in full: modules_to_save), and
    target_modules: its list of module names, sorted, or None where a name list cannot say them (a regex, or a field
    of NARROWING set): the recipe then keeps all-linear, which with model.adapter means the adapter's targets."""
    config = _saved_config(folder)
    saved = {key: default if config.get(field) is None else config[field] for key, (field, default) in LAYOUT.items()}
    saved["alpha"] = float(saved["alpha"])
    saved["train_router"] = bool(config.get("modules_to_save"))
    names = config.get("target_modules")
    listed = isinstance(names, list) and names and all(isinstance(name, str) for name in names)
    plain = listed and "all-linear" not in names and all(config.get(field) in (None, [], "", {}) for field in NARROWING)
    saved["target_modules"] = sorted(set(names)) if plain else None
    return saved


def _shown(value) -> str:
    if isinstance(value, list):  # target_modules: PEFT's all-linear saves every module's full name
        leaves = sorted({name.rsplit(".", 1)[-1] for name in value})
        return f"[{', '.join(value)}]" if len(value) <= 8 else f"{len(value)} modules ({', '.join(leaves)})"
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def resolve_adapter_layout(recipe: Recipe, folder: Path) -> None:
    """The recipe's lora layout keys (LAYOUT) and targets from model.adapter's adapter_config.json, as
    model.attn_implementation: auto is resolved on the recipe: the plan (DoRA's loader), the resume checks and the run's
    recipe.yaml then say what the run trains. A key the recipe does not set takes the adapter's value (said once, as a
    note), and so does target_modules: all-linear (the adapter's targets, as a list where one says them); a key the
    recipe sets to another value than the adapter's is refused in one paragraph, as a resume refuses a changed layout
    (outputs/resume_checks.py): silently ignored, `dora: true` trained no DoRA, and a set `r: 16` (the default) was
    replaced as if not set. lora.train_router: true is refused for an adapter without trained routers; false (the
    default) keeps the adapter's own modules_to_save. A target_modules list is compared by `adapter_targets_problem`."""
    saved, lora = _saved_layout(folder), recipe.lora
    given = lora.model_fields_set  # the keys the recipe (or an override, or a run's recipe.yaml) sets
    conflicts = [(key, getattr(lora, key), saved[key]) for key in (*LAYOUT, "train_router")
                 if (key in given if key != "train_router" else lora.train_router) and getattr(lora, key) != saved[key]]
    if conflicts:
        raise RecipeError(_conflict(folder, conflicts))
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
    if lora.target_modules == "all-linear" and saved["target_modules"] is not None:
        changed.append(f"lora.target_modules all-linear -> {_shown(saved['target_modules'])}")
        lora.target_modules = saved["target_modules"]
    if changed and announcing():  # `finetune train`'s pre-flight is muted: the launched rank 0 says it, once
        from finetune.distributed import print0

        print0(f"[finetune] note: model.adapter: its LoRA layout is used ({folder / 'adapter_config.json'}): "
               f"{', '.join(changed)}", file=sys.stderr)


def _conflict(folder: Path, conflicts: list[tuple]) -> str:
    """The paragraph refusing lora keys the recipe sets to other values than the adapter's: both values, the fix."""
    keys = [f"lora.{key}" for key, _, _ in conflicts]
    return (f"model.adapter ({folder}): the recipe's {', '.join(f'{k} {_shown(now)}' for k, (_, now, _) in zip(keys, conflicts))} "
            f"differ{'s' if len(conflicts) == 1 else ''} from the adapter's adapter_config.json "
            f"({', '.join(f'{k} {_shown(value)}' for k, (_, _, value) in zip(keys, conflicts))}). A run that starts from "
            "an adapter keeps its LoRA layout (r fixes the shapes of its tensors, alpha and rslora their scaling, dora "
            "its magnitude vectors, bias and train_router the biases and routers it trained), so it starts from the "
            f"model the adapter computes. Fix: remove {' and '.join(keys)} from the recipe (the adapter's values are "
            "then used), or set them to the adapter's values (on the command line: "
            f"{' '.join(f'{k}={_shown(value).lower()}' for k, (_, _, value) in zip(keys, conflicts))}); for another "
            "layout, train a new adapter without model.adapter.")


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
    from finetune.model.experts.routed import has_routed_experts
    from finetune.model.lora.init import lora_tensor_name
    from finetune.model.sources.conversions import model_names

    tensors = {lora_tensor_name(key): value for key, value in _saved_tensors(folder).items()}
    if model is None or not has_routed_experts(model):
        return tensors
    names = model_names(model, list(tensors))
    return {names[key]: value for key, value in tensors.items()}


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors as saved: adapter_model.safetensors, else PEFT's older adapter_model.bin, unpickled as
    plain tensors only (torch.load weights_only: no code in the file runs)."""
    if (folder / WEIGHTS[0]).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / WEIGHTS[0]))
    try:
        tensors = torch.load(folder / WEIGHTS[1], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (pickle's, zipfile's and torch's own errors: all say the same to the user)
        tensors = exc
    if not isinstance(tensors, dict) or not all(isinstance(value, torch.Tensor) for value in tensors.values()):
        from finetune.files import refused_pickle  # the global torch refused, not its page of advice (bb26)

        why = refused_pickle(tensors) if isinstance(tensors, Exception) else "not a dict of tensors"
        raise ModelLoadError(
            f"model.adapter ({folder}): {WEIGHTS[1]} cannot be read as plain tensors ({why}); finetune reads a .bin "
            f"adapter only that way. Fix: re-save the adapter with PEFT as safetensors (PeftModel.from_pretrained(base, "
            f"folder).save_pretrained(new_folder), safe_serialization on, PEFT's default), and point model.adapter there.")
    return tensors
