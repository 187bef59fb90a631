"""The model class finetune builds for a config, and building or loading it.

transformers' AutoModelForCausalLM takes the configs its causal-LM mapping lists. Some releases ship a causal LM it
does not map (Mistral 4's `Mistral4ForCausalLM`, mapped as image-text-to-text only), or only a multimodal model
(Kimi K2.5, Mistral 3, Mistral Large 4, GLM-5, GLM-4.5V: an image-text-to-text class with the vision tower beside the
language model). finetune trains the text of those through that class, by the model's own names (no prefix to map):
text rows go through its language model; the vision tower and projector are removed from the model finetune builds
(`without_towers`), so their tensors are never read, and LoRA is never put on them.
"""

from __future__ import annotations

import importlib
import inspect


def causal_lm_class(config):
    """The class for `config`: transformers' causal LM for it; else a `*ForCausalLM` of the config's own modeling
    module that transformers does not map (Mistral 4); else its image-text-to-text model (the multimodal releases);
    None for remote code or a config with none of these."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, None, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        found = _unmapped_causal_lm(config) if mapping is None else _mapped(mapping, config)
        if found is not None:
            return found
    return None


def _mapped(mapping, config):
    try:
        return mapping[type(config)]
    except (KeyError, ValueError):
        return None


def _unmapped_causal_lm(config):
    """A `*ForCausalLM` class of the module that defines `config`'s class, built from exactly that config class."""
    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    if not module_name.startswith("transformers.models."):
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return next((cls for name, cls in inspect.getmembers(module, inspect.isclass) if name.endswith("ForCausalLM")
                 and cls.__module__ == module_name and getattr(cls, "config_class", None) is type(config)), None)


def is_mapped_causal_lm(config) -> bool:
    """Whether AutoModelForCausalLM itself builds `config` (else `causal_lm_class` names the class to use)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return _mapped(MODEL_FOR_CAUSAL_LM_MAPPING, config) is not None


def from_config(config, **kwargs):
    """The model of `config` (random init, or on the meta device under init_empty_weights), as
    AutoModelForCausalLM.from_config builds it where it can."""
    from transformers import AutoModelForCausalLM

    cls = None if is_mapped_causal_lm(config) else causal_lm_class(config)
    if cls is None:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    kwargs.pop("trust_remote_code", None)
    return without_towers(cls._from_config(config, **kwargs))


def without_towers(model):
    """An image-text-to-text model (not one transformers maps as a causal LM) with its vision tower and projector
    removed: text rows never call them, finetune's per-tensor loaders do not read their checkpoint tensors (some
    are stored in a layout transformers permutes at load), and the memory is the language model's. A model of
    another kind is returned as it is. `from_pretrained` keeps them (a merged export saves the whole model); the
    training model drops them after it (model/base.py: build_model)."""
    for name in tower_names(model):
        model.model._modules[name.removeprefix("model.")] = None
    return model


def tower_names(model) -> list[str]:
    """The module names (`model.visual`, `model.multi_modal_projector`) of what `without_towers` removes from `model`:
    everything beside the language model inside an image-text-to-text model that transformers maps to no causal LM;
    [] for any other model. A model loaded whole (export, generate) keeps them, and LoRA must stay off them there
    too: an adapter's targets are leaf names (`gate_proj`), which the vision tower's blocks also have."""
    if is_mapped_causal_lm(model.config):  # Gemma 3 and 4: trained whole, as transformers maps them
        return []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    inner = getattr(model, "model", None)
    if decoder is None or inner is None or not any(child is decoder for child in inner.children()):
        return []
    return [f"model.{name}" for name, child in inner.named_children() if child is not decoder]


def from_pretrained(name: str, config=None, **kwargs):
    """The model of the folder or hub id `name` (its config `config`, else read from `name`), as
    AutoModelForCausalLM.from_pretrained loads it where it can."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        config = AutoConfig.from_pretrained(name, trust_remote_code=kwargs.get("trust_remote_code", False))

    cls = None if is_mapped_causal_lm(config) else causal_lm_class(config)
    if cls is None:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    kwargs.pop("trust_remote_code", None)
    return cls.from_pretrained(name, **kwargs)
