"""LoRA on `RoutedExperts`: PEFT's own `lora.Linear4bit` on every expert projection, the targets a mixture-of-experts
model cannot take refused, the routers trainable in full on request, and adapters loaded one to one per expert."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.experts.routed import RoutedExperts, has_routed_experts
from finetune.model.sources.conversions import model_names


@contextmanager
def per_expert_layout():
    """PEFT 0.21 rewrites the LoRA targets of a Mixtral- or Qwen-MoE-type model for transformers 5's fused experts
    (`w1`/`gate_proj`... -> `target_parameters=gate_up_proj`, ParamWrapper, no dropout; `all-linear` -> the router's
    `gate.weight` too), and fuses a loaded adapter's per-expert tensors the same way. Split into `RoutedExperts`, the
    model has transformers 4's per-expert Linears again, so both rewrites would target parameters that no longer
    exist: PEFT is told, inside this block only, that it is not on transformers 5. PEFT before that rewrite (the
    declared floor, 0.18) has no such flag: nothing to tell it."""
    from peft.tuners import tuners_utils
    from peft.utils import save_and_load

    flagged = [module for module in (tuners_utils, save_and_load) if hasattr(module, "is_transformers_ge_v5")]
    previous = [module.is_transformers_ge_v5 for module in flagged]
    for module in flagged:
        module.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        for module, value in zip(flagged, previous):
            module.is_transformers_ge_v5 = value


def get_peft_model(model: nn.Module, config, *, train_router: bool = False, **kwargs):
    """PEFT's `get_peft_model`, with the per-expert Linears of `RoutedExperts` targeted as the Linears they are.

    On a MoE model, targets that cannot work are refused first (`check_expert_targets`), before any weight is read
    when the model is a meta skeleton; whatever else PEFT refuses becomes one paragraph naming lora.target_modules.
    `train_router` (lora.train_router): the routers become PEFT's modules_to_save (`routers_to_save`,
    `trainable_routers`)."""
    from peft import get_peft_model as peft_get_peft_model

    if train_router:
        config.modules_to_save = routers_to_save(model)
    excluded = _exclude_linear_routers(model, config)
    if not has_routed_experts(model):
        return _without_exclusion(peft_get_peft_model(model, config, **kwargs), excluded, kwargs)
    check_expert_targets(model, config)
    try:
        with per_expert_layout():
            peft_model = peft_get_peft_model(model, config, **kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"lora.target_modules {config.target_modules!r}: PEFT cannot put LoRA there on this "
                             f"mixture-of-experts model ({str(exc).splitlines()[0][:300]}). Fix: use all-linear, or "
                             f"name Linear modules (attention projections, the experts' {_expert_leaf_names(model)}).") from None
    trainable_routers(peft_model)
    return _without_exclusion(peft_model, excluded, kwargs)


def _without_exclusion(peft_model, excluded: tuple[object, set[str]] | None, kwargs: dict):
    """The adapter's config as if the excluded Linears had never matched (a reload needs no exclusion)."""
    if excluded is not None:
        resolved = peft_model.peft_config[kwargs.get("adapter_name", "default")]
        resolved.exclude_modules = excluded[0]
        if isinstance(resolved.target_modules, set):  # all-linear, expanded by PEFT to leaf names, the router's too
            resolved.target_modules -= excluded[1]
    return peft_model


def _is_router(child: nn.Module) -> bool:
    """Whether a module beside `RoutedExperts` is the router: a leaf with a weight that is no Linear (transformers 5's
    `gate`, Mixtral, Qwen-MoE), or a Linear subclass of transformers' own (Llama 4's `router`, which returns scores
    and logits). A Linear of torch or bitsandbytes there is a projection (Qwen-MoE's `shared_expert_gate`)."""
    linear_router = isinstance(child, nn.Linear) and type(child).__module__.startswith("transformers.")
    return (not isinstance(child, RoutedExperts) and (linear_router or not isinstance(child, nn.Linear))
            and not list(child.children()) and isinstance(getattr(child, "weight", None), torch.Tensor))


def _router_paths(model: nn.Module) -> list[str]:
    """The routers' full module names (`model.layers.1.mlp.gate`), one beside each layer's `RoutedExperts`.
    ModelLoadError when the model has none (lora.train_router on a dense model)."""
    paths = [f"{parent_name}.{name}" if parent_name else name for parent_name, parent in model.named_modules()
             if any(isinstance(child, RoutedExperts) for child in parent.children())
             for name, child in parent.named_children() if _is_router(child)]
    if not paths:
        raise ModelLoadError("lora.train_router: true, but this model has no router finetune can train: it trains, in "
                             "full, a router that is one module of its own beside each layer's experts split into "
                             "per-expert Linears (Mixtral-, Qwen-MoE-, DeepSeek-V3-style models), and this model is "
                             "dense, keeps its experts whole or routes in another way (DeepSeek-V4's routers hold a "
                             "scoring module and hash tables). Fix: remove lora.train_router.")
    return paths


def check_train_router(recipe, config) -> None:  # a finetune.recipe.Recipe, the model's transformers config
    """lora.train_router against `config`'s model, built on the meta device with its experts split as the loaders
    split them (no weight read): `_router_paths`' refusal of a model with no router to train, before any weight loads
    (`finetune validate`, and the run's loads through `from_pretrained`, which attach LoRA only after every weight is
    loaded and quantized). Bug bash bb64 #1: validate said "recipe OK" and the run refused it at LoRA attach."""
    if not recipe.lora.train_router:
        return
    from finetune.model.classes import from_config
    from finetune.model.experts.split import split_experts
    from finetune.model.settings import torch_dtype

    dtype = torch_dtype(recipe.model.dtype)
    try:
        with torch.device("meta"):
            model = from_config(config, dtype=dtype, trust_remote_code=recipe.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - a model only from_pretrained builds: refused at LoRA attach, after loading
        return
    split_experts(model, dtype=dtype, quantized=recipe.quantization.method != "none")
    _router_paths(model)


def router_names(model: nn.Module) -> list[str]:
    """The routers' leaf names (`gate`, `router`), one beside each layer's `RoutedExperts` (`_is_router`).
    ModelLoadError when the model has none (lora.train_router on a dense model)."""
    return sorted({path.rsplit(".", 1)[-1] for path in _router_paths(model)})


def routers_to_save(model: nn.Module) -> list[str]:
    """lora.train_router's `modules_to_save`: names that select the routers and nothing else by PEFT's rule, which
    takes every module whose name merely ends with one (no dot boundary: the bare `gate` also took Qwen-MoE's,
    Qwen3-Next's and Qwen3.5-MoE's `shared_expert_gate`, a 4-bit Linear or a LoRA layer that PEFT then fails to copy).
    Each router as its parent's name and its own (`mlp.gate`, `feed_forward.router`: short, and the same under a
    multimodal model's prefix), or by its full name where those would take another module too."""
    paths = _router_paths(model)
    short = sorted({".".join(path.split(".")[-2:]) for path in paths})
    taken = {name for name, _ in model.named_modules() if name.endswith(tuple(short))}
    return short if taken == set(paths) else sorted(paths)


def _own_forward_linear(child: nn.Module) -> bool:
    """An `nn.Linear` subclass of transformers' whose own forward is no linear map of the last dimension (DeepSeek-V4's
    grouped output projection `o_a_proj`: one block per head group, outputs groups x rank), so PEFT's `lora.Linear`
    would add a plain x @ A @ B of another shape to it. Told by running its forward on the meta device: a subclass
    that computes x @ W.T (+ b) as nn.Linear does (Falcon's FalconLinear) keeps its LoRA."""
    import copy

    if not (isinstance(child, nn.Linear) and type(child).__module__.startswith("transformers.")
            and type(child).forward is not nn.Linear.forward):
        return False
    probe = copy.copy(child)  # the same attributes, meta tensors instead of the weights
    probe._parameters = {k: None if v is None else torch.empty_like(v, device="meta") for k, v in child._parameters.items()}
    try:
        out = probe(torch.empty(3, child.in_features, device="meta", dtype=child.weight.dtype))
    except Exception:  # noqa: BLE001 - a forward that cannot take (tokens, in_features) is no Linear
        return True
    return not isinstance(out, torch.Tensor) or tuple(out.shape) != (3, child.out_features)  # Llama 4's router: a tuple


def _exclude_linear_routers(model: nn.Module, config) -> tuple[object, set[str]] | None:
    """Keep LoRA off a router that is an `nn.Linear` subclass (Llama 4's returns scores and logits, which PEFT's
    `lora.Linear` cannot add to) and off any Linear of transformers' with its own forward (`_own_forward_linear`):
    all-linear (or a regex) would wrap them. Added to the config's exclude_modules by full name; returns the previous
    exclude_modules and the excluded leaf names (None when nothing was added). A list of targets naming the router is
    refused before (`check_expert_targets`)."""
    routers = [f"{parent_name}.{name}" for parent_name, parent in model.named_modules()
               if any(isinstance(child, RoutedExperts) for child in parent.children())
               for name, child in parent.named_children() if isinstance(child, nn.Linear) and _is_router(child)]
    routers += [name for name, child in model.named_modules() if _own_forward_linear(child) and name not in routers]
    if not routers or not isinstance(config.target_modules, str):
        return None
    excluded = config.exclude_modules
    if isinstance(excluded, str):  # a regex: add the routers' names as alternatives
        config.exclude_modules = "|".join([f"(?:{excluded})", *(f"(?:{name.replace('.', '[.]')})" for name in routers)])
    else:
        config.exclude_modules = sorted({*(excluded or ()), *routers})
    return excluded, {name.rsplit(".", 1)[-1] for name in routers}


def trainable_routers(peft_model: nn.Module) -> int:
    """The trainable copies PEFT made of the routers (modules_to_save): fp32 master weights like the LoRA tensors, and
    their input cast to the weight's dtype, as the router's own `F.linear` needs one dtype (fp32 on a single process
    or DDP; the compute dtype inside FSDP's mixed precision). The frozen original stays in model.dtype."""
    from peft.utils import ModulesToSaveWrapper

    count = 0
    for module in peft_model.modules():
        if not isinstance(module, ModulesToSaveWrapper):
            continue
        for copy in module.modules_to_save.values():
            copy.float().requires_grad_(True)
            copy.register_forward_pre_hook(_input_in_weight_dtype)
            count += 1
    return count


def _input_in_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])


def load_adapter(model: nn.Module, folder: str | Path):
    """`PeftModel.from_pretrained` for a model with `RoutedExperts`: the adapter's expert tensors (under the model's
    names or the checkpoint's, `conversions.model_names`) are loaded one to one into the per-expert LoRA layers, not
    fused for transformers 5's experts as PEFT would. Any key the model has no place for is refused."""
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from finetune.files import as_trained

    folder = as_trained(Path(folder))  # a MoE run's adapter/ (PEFT's form): the adapter as trained beside it
    config = PeftConfig.from_pretrained(str(folder))
    config.inference_mode = True
    exclude_towers(config, model)
    if not has_routed_experts(model):
        return PeftModel.from_pretrained(model, str(folder), config=config)
    peft_model = get_peft_model(model, config)
    weights = load_peft_weights(str(folder), device="cpu")
    names = model_names(model, list(weights))
    with per_expert_layout():
        result = set_peft_model_state_dict(peft_model, {names[key]: value for key, value in weights.items()})
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing:
        raise ModelLoadError(f"{folder}: the adapter does not fit this mixture-of-experts model "
                             f"({len(result.unexpected_keys)} unexpected, {len(missing)} missing LoRA tensors, e.g. "
                             f"{(list(result.unexpected_keys) or missing)[0]}). Fix: use the adapter of a run on this base.")
    return peft_model.eval()


def exclude_towers(config, model: nn.Module) -> None:
    """Keep LoRA off the vision tower and projector of a multimodal model loaded whole (export, generate): training
    removed them (model/classes.py: without_towers), but the adapter's leaf-name targets match their Linears too.
    Added to the config's exclude_modules as a regex (PEFT full-matches a string against each module name)."""
    import re

    from finetune.model.classes import tower_names

    towers = [rf"{re.escape(name)}(?:\..*)?" for name in tower_names(model)]
    if not towers:
        return
    excluded = config.exclude_modules
    if isinstance(excluded, str):
        towers.insert(0, excluded)
    elif excluded:  # a list: PEFT's rule for one, each name whole or as the last parts of a module's name
        towers[:0] = [rf"(?:.*\.)?{re.escape(name)}" for name in excluded]
    config.exclude_modules = "|".join(f"(?:{pattern})" for pattern in towers)


def _expert_leaf_names(model: nn.Module) -> str:
    names = next((module[0].names for module in model.modules() if isinstance(module, RoutedExperts) and len(module)), None)
    return "/".join((*names.gate_up, *names.down)) if names else "projections"


def check_expert_targets(model: nn.Module, config) -> None:
    """Refuse LoRA targets a MoE model cannot take, naming the key and the fix: the router (not a Linear in
    transformers 5; it stays frozen), the fused expert names of transformers 5 (`gate_up_proj`), and an adapter
    trained on the fused experts (PEFT's `target_parameters`, ParamWrapper: no dropout, bf16 experts)."""
    if getattr(config, "target_parameters", None):
        raise ModelLoadError(
            f"model.adapter: it puts LoRA on transformers 5's fused expert tensors (target_parameters, e.g. "
            f"{min(config.target_parameters)}), which finetune keeps as one 4-bit Linear per expert. Fix: start "
            "from the run folder's adapter-as-trained/ (per expert), or its adapter/ (taken as that), where `finetune "
            "export` or the run wrote this form for plain PEFT; "
            "else train a new adapter with finetune (target_modules all-linear puts LoRA on every expert's "
            f"{_expert_leaf_names(model)}).")
    targets = config.target_modules
    if targets is None or isinstance(targets, str):
        return  # all-linear (or a regex) matches Linears only: the experts' projections, never the router
    routers = {name.rsplit(".", 1)[-1] for parent_name, parent in model.named_modules()
               if any(isinstance(child, RoutedExperts) for child in parent.children())
               for name, child in parent.named_children() if _is_router(child)}
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in routers:
            raise ModelLoadError(
                f"lora.target_modules: `{target}` is the experts' router, which stays unquantized and takes no LoRA (it "
                "is no Linear in transformers 5). Fix: remove it from lora.target_modules; to train the routers, set "
                "lora.train_router: true (each router trained in full, as PEFT's modules_to_save).")
        if leaf in ("gate_up_proj", "down_proj") and leaf not in leaves:
            raise ModelLoadError(
                f"lora.target_modules: `{target}` is transformers 5's fused expert tensor; finetune keeps one Linear per "
                f"expert projection. Fix: name them as the checkpoint does ({_expert_leaf_names(model)}), or use all-linear.")
