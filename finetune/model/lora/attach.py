"""The adapters attached to the base: PEFT's LoraConfig from the recipe's lora: section (or model.adapter's own), the
adapter a run starts from (model.adapter, checked before any weight loads), and `attach_lora`: the PeftModel with
every LoRA initialized from its seed (init.py) and, with lora.fused, the fused forward (fused.py). Experts get LoRA per
expert projection through the experts family interface (model/experts/lora.py: get_peft_model)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.lora.init import init_lora_weights
from finetune.recipe import Recipe


def lora_config(recipe: Recipe):
    """The LoRA layout: the recipe's lora section, or model.adapter's own (r, alpha, targets) with the recipe's dropout."""
    from peft import LoraConfig

    lora = recipe.lora
    if recipe.model.adapter:
        config = LoraConfig.from_pretrained(str(check_adapter(recipe)))
        config.lora_dropout, config.inference_mode = lora.dropout, False
        return config
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        bias=lora.bias,
        task_type="CAUSAL_LM",
    )


def check_adapter(recipe: Recipe) -> Path | None:
    """model.adapter's folder, checked before any weight loads (a PEFT adapter: config + safetensors)."""
    if not recipe.model.adapter:
        return None
    from finetune.files import as_trained

    folder = as_trained(Path(recipe.model.adapter).expanduser())  # a MoE run's adapter/: its as-trained twin
    missing = [name for name in ("adapter_config.json", "adapter_model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"model.adapter ({folder}): {', '.join(missing)} not found, so it is not a PEFT adapter folder. Fix: point it "
            "at the adapter/ folder of a finished run (e.g. runs/sft/adapter), or at an adapter exported by PEFT.")
    return folder


def adapter_start(recipe: Recipe, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """model.adapter's tensors, keyed as `lora_tensor_name` keys a model's LoRA parameters without the adapter name.
    On a mixture-of-experts `model`, keys named as the checkpoint names them (an adapter from `finetune export`) are
    renamed to the model's names (transformers' renames, finetune/model/conversions.py)."""
    folder = check_adapter(recipe)
    if folder is None:
        return None
    from safetensors.torch import load_file

    from finetune.model.experts.routed import has_routed_experts
    from finetune.model.sources.conversions import model_names

    tensors = {key.removeprefix("base_model.model."): value
               for key, value in load_file(str(folder / "adapter_model.safetensors")).items()}
    if model is None or not has_routed_experts(model):
        return tensors
    names = model_names(model, list(tensors))
    return {names[key]: value for key, value in tensors.items()}


def target_modules_problem(model: nn.Module, target_modules) -> str | None:
    """Which names of a lora.target_modules list match no module of `model` (PEFT's rule: the whole name or its last
    parts), with the Linear names the model has; None when each matches. PEFT itself fails only when no name matches,
    with a traceback: a misspelled name beside good ones is dropped without a word, and training has fewer LoRAs."""
    if target_modules == "all-linear" or target_modules is None:
        return None
    from types import SimpleNamespace

    from finetune.model.experts.lora import check_expert_targets, has_routed_experts

    if has_routed_experts(model):  # a router or transformers 5's fused expert name: its own message, with the fix
        try:
            check_expert_targets(model, SimpleNamespace(target_modules=list(target_modules), target_parameters=None))
        except ModelLoadError as exc:
            return str(exc)
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and module is not model.get_output_embeddings()})
    return (f"lora.target_modules: {', '.join(f'`{t}`' for t in missing)} match{'es' if len(missing) == 1 else ''} no "
            f"module of this model, so {'it' if len(missing) == 1 else 'they'} would get no LoRA. Its Linear layers: "
            f"{', '.join(linear)}. Fix the names, or use `all-linear`.")


def check_target_modules(recipe: Recipe, model: nn.Module) -> None:
    """RecipeError with `target_modules_problem`'s paragraph (the one `finetune validate` prints) when lora.target_modules
    names a module `model` lacks. `model` may be on the meta device: only its module names are read. model.adapter's
    targets are its own config's (the adapter was trained on them), not checked here."""
    from finetune.errors import RecipeError

    if not recipe.model.adapter and (problem := target_modules_problem(model, recipe.lora.target_modules)):
        raise RecipeError(problem)


def attach_lora(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Wrap the base in a PeftModel; only LoRA parameters require grad afterwards. LoRA starts from `init_lora_weights`
    (or from model.adapter's values)."""
    from finetune.model.experts.lora import get_peft_model

    check_target_modules(recipe, model)  # (the loaders said it before any weight loaded: model/loading.py)
    peft_model = get_peft_model(model, lora_config(recipe), train_router=recipe.lora.train_router)
    init_lora_weights(peft_model, recipe.train.seed, start=adapter_start(recipe, model))
    if recipe.lora.fused:
        from finetune.model.lora.fused import use_fused_lora

        use_fused_lora(peft_model)  # falls back to PEFT's forward per call where it does not apply (lora_fused.py)
    return peft_model
