"""train.router_aux_loss_coef against the model: whether its forward returns a mixture-of-experts load-balancing loss,
the coefficient a run weights it with, and the refusal of a weight for a model that returns none.

TRL 1.16's trainers decide the same way (SFTTrainer.__init__): `router_aux_loss_coef` unset takes the model config's
own (0 where the config declares none), 0 turns the loss off, and a non-zero value for a model whose config has no
`output_router_logits` is refused. finetune also refuses (and leaves off) what TRL would crash on in the first step:
a config with router logits whose transformers class computes no load-balancing loss (DeepSeek-V3, GLM-4.5 balance
their experts by a bias instead; Llama 4's forward returns none), told apart by the modeling module transformers
computes the loss in (`load_balancing_loss_func`, which every such class calls).

Asked before any weight loads (`router_aux_problem`, with the config) and again by the run with the model's own class
(training/router_aux.py).
"""

from __future__ import annotations

import sys

from finetune.errors import RecipeError


def text_config(config):
    """The language model's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def causal_lm_class(config) -> type | None:
    """transformers' causal-LM class for `config` (None: none known, e.g. remote code)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    for candidate in (config, text_config(config)):
        try:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(candidate)]
        except (KeyError, ValueError, ImportError, AttributeError):
            continue
    return None


def returns_aux_loss(config, model_class: type | None = None) -> bool:
    """Whether the model's forward returns a load-balancing loss when asked for its router logits. A class whose module
    transformers did not write (remote code) is taken at its config's word; the run checks its first forward."""
    if not hasattr(text_config(config), "output_router_logits"):
        return False
    model_class = model_class or causal_lm_class(config)
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    if module is None or not module.__name__.startswith("transformers."):
        return True
    return hasattr(module, "load_balancing_loss_func")


def router_aux_problem(recipe, config, model_class: type | None = None) -> str | None:
    """Why train.router_aux_loss_coef cannot weight this model's loss (one paragraph with the fix), or None."""
    coef = recipe.train.router_aux_loss_coef
    if not coef or returns_aux_loss(config, model_class):
        return None
    model_class = model_class or causal_lm_class(config)
    name = model_class.__name__ if model_class is not None else "the model"
    model_type = getattr(text_config(config), "model_type", "?")
    why = (f"{name} ({model_type}) is not a mixture-of-experts model that returns its router logits"
           if not hasattr(text_config(config), "output_router_logits") else
           f"{name} ({model_type}) returns no load-balancing loss (transformers computes none for this architecture: "
           "its experts are balanced without one, e.g. by a routing bias)")
    return (f"train.router_aux_loss_coef ({coef:g}): {why}, so there is no auxiliary loss to weight. Fix: remove "
            "train.router_aux_loss_coef (or set it to 0).")


def check_router_aux(recipe, config) -> None:
    """The pre-flight refusal (before any weight loads) of `router_aux_problem`."""
    if problem := router_aux_problem(recipe, config):
        raise RecipeError(problem)


def declared_coef(config) -> float:
    """The model config's own router_aux_loss_coef (0.0 where it declares none, as TRL reads it)."""
    return float(getattr(text_config(config), "router_aux_loss_coef", 0.0) or 0.0)
