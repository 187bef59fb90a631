"""Which transformers architectures finetune trains, and the refusal, before any weight loads, of one it cannot.

The tables below are what the architecture matrix (tests/model/test_arch_matrix.py) checks on every run: each
TRAINED architecture, built tiny from transformers' own config class, trains in one process through the library's
model path (4-bit NF4, LoRA with dropout, checkpointing) and its adapter loads with plain PEFT; each SHARDED one also
trains under the shipped accelerate_configs/fsdp2.yaml and fsdp1.yaml; each REFUSED one is refused by
`check_supported` with the reason below, never a traceback. docs/models.md and `finetune models` are generated from
these tables (`make models-doc`), so they say only what the matrix checked.

An architecture in none of the tables is not refused: it has not been tried (a new transformers release, remote code).
"""

from __future__ import annotations

from finetune.errors import ModelLoadError

# model_type -> a name users know. Trained single-process by the matrix.
TRAINED = {
    "llama": "Llama 2 / 3 / 3.1 / 3.2 / 3.3",
    "mistral": "Mistral",
    "ministral3": "Ministral 3",
    "mixtral": "Mixtral (MoE)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "qwen3_next": "Qwen3-Next (hybrid linear attention, MoE)",
    "qwen3_5_text": "Qwen3.5 (text)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (text)",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi": "Phi-1 / Phi-2",
    "phi3": "Phi-3 / Phi-4",
    "olmo": "OLMo",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3",
    "olmoe": "OLMoE (MoE)",
    "glm": "GLM",
    "glm4": "GLM-4",
    "glm4_moe": "GLM-4.5 (MoE)",
    "granite": "Granite 3",
    "granitemoe": "Granite-MoE",
    "deepseek_v3": "DeepSeek-V3 / R1 (MoE, MLA)",
    "minimax": "MiniMax (hybrid lightning attention, MoE)",
    "cohere2": "Command R7B / Command A",
    "smollm3": "SmolLM3",
    "starcoder2": "StarCoder2",
    "gpt_neox": "GPT-NeoX / Pythia",
    "falcon": "Falcon",
    "gpt_oss": "gpt-oss (MoE; attention eager, chosen by model.attn_implementation: auto)",
    "llama4_text": "Llama 4 (text: Scout, Maverick; MoE, experts stored transposed)",
}
# model_type -> the model keys it needs besides the library's defaults (the matrix trains it with them).
MODEL_SETTINGS = {
    "gemma2": {"attn_implementation": "eager"},  # logit soft-capping: transformers refuses sdpa for it
}
# Trained, but `finetune export` says plain PEFT cannot load the exported adapter yet (PEFT's loader leaves tensors
# unplaced: dense or shared-expert MLPs beside the routed experts, granite's fused-input experts): the matrix expects
# exactly this, so a fix shows up as a failing row to move out of here.
ADAPTER_GAPS = ("deepseek_v3", "glm4_moe", "gpt_oss", "granitemoe", "llama4_text", "qwen2_moe", "qwen3_5_moe_text", "qwen3_next")
# Also launched under the shipped FSDP2 and FSDP1 configs: one dense GQA model, one with Gemma 3's norm layout
# (pre and post norms, sliding window), one mixture of experts with latent attention and shared experts (DeepSeek-V3;
# Mixtral and Qwen3-MoE run under FSDP2 in tests/parallel/test_experts_parallel.py).
SHARDED = ("qwen3", "gemma3_text", "deepseek_v3")
# model_type -> (why, as docs/models.md says it; the words `check_supported`'s refusal must contain): refused under
# the library's settings (4-bit NF4, sdpa attention), before any weight loads.
REFUSED: dict[str, tuple[str, str]] = {}
KNOWN_NAMES: dict[str, str] = {}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def causal_lm_class(config):
    """transformers' causal LM class for `config`, or None (remote code, or no causal LM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def refusals(config, *, quantized: bool, attn_implementation: str) -> list[str]:
    """Every reason `config`'s architecture cannot train with these settings, each with its fix; [] when none is known
    (an untried architecture is not refused). From the config alone: nothing is read but config.json."""
    model_class = causal_lm_class(config)
    reasons = []
    if attn_implementation == "sdpa" and model_class is not None and getattr(model_class, "_supports_sdpa", True) is False:
        reasons.append(f"transformers refuses sdpa attention for {model_class.__name__} (what its layers compute, "
                       "such as logit soft-capping or learned sinks, sdpa cannot). Fix: set model.attn_implementation: "
                       "eager")
    if quantized and model_class is not None and _has_experts(config):
        reasons += _expert_refusals(config, model_class)
    return reasons


def _has_experts(config) -> bool:
    configs = [config, getattr(config, "text_config", None)]
    return any(getattr(c, key, None) for c in configs if c is not None for key in EXPERT_COUNT_KEYS)


def _expert_refusals(config, model_class) -> list[str]:
    """The fused experts modules finetune cannot split into 4-bit Linears (finetune/model/experts/), found on a
    meta-device model built from the config: the check the loader makes, made before any weight is read."""
    import torch
    from transformers.utils import logging as transformers_logging

    from finetune.model.experts.families import covered_models, family_for
    from finetune.model.experts.split import fused_expert_modules

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            skeleton = model_class._from_config(config)
    finally:
        transformers_logging.set_verbosity(verbosity)
    reasons: dict[str, str] = {}
    for _, module in fused_expert_modules(skeleton):
        family, why = family_for(module)
        reason = "; ".join(why) if family is None else _routing_outside(module) if family == "concatenated" else None
        if reason is not None:
            reasons.setdefault(type(module).__name__, reason)
    return [f"the experts of {name} cannot be stored in 4 bits by finetune yet: {reason} (bitsandbytes quantizes "
            "nn.Linear only, and these are one fused tensor). Fix: set quantization.method: none (experts in "
            f"model.dtype), or use a model whose experts finetune splits ({covered_models()})"
            for name, reason in sorted(reasons.items())]


def _routing_outside(module) -> str | None:
    """A fused experts layout the concatenated family's `why_not` (finetune/model/experts/families/) does not name but the split would
    get wrong: gate_up stored (experts, hidden, 2 x inter) instead of (experts, 2 x inter, hidden), as down_proj's
    shape shows, or a forward that takes no routing (Llama 4 routes the tokens before its experts)."""
    import inspect

    hidden = module.down_proj.shape[1]
    if module.gate_up_proj.shape[2] != hidden:
        return "its expert weights are stored transposed (in x out)"
    if len(inspect.signature(type(module).forward).parameters) < 4:  # self, hidden_states, top_k_index, top_k_weights
        return "it takes tokens already routed (no top-k index and weights)"
    return None


def check_supported(config, recipe) -> None:
    """ModelLoadError (one paragraph: the model, every reason with its fix) for an architecture that cannot train
    with the recipe's settings: before any weight is read."""
    reasons = refusals(config, quantized=recipe.quantization.method != "none",
                       attn_implementation=recipe.model.attn_implementation)
    if reasons:
        raise ModelLoadError(
            f"model.name_or_path `{recipe.model.name_or_path}` is a {config.model_type} model, which finetune cannot "
            f"train with these settings: {'; '.join(reasons)}. (`finetune models` lists the architectures checked.)")


def support_rows() -> list[tuple[str, str, str]]:
    """(model_type, name, status) for the docs and `finetune models`: trained, trained + FSDP, or refused + why."""
    rows = []
    for model_type, name in sorted(TRAINED.items()):
        status = "trained; FSDP2 and FSDP1 launched" if model_type in SHARDED else "trained (one process)"
        status += "".join(f"; needs model.{key}: {value}" for key, value in MODEL_SETTINGS.get(model_type, {}).items())
        if model_type in ADAPTER_GAPS:
            status += "; its exported adapter does not load in plain PEFT yet"
        rows.append((model_type, name, status))
    for model_type in sorted(REFUSED):
        rows.append((model_type, KNOWN_NAMES.get(model_type, model_type), f"refused: {REFUSED[model_type][0]}"))
    return rows


def support_table() -> str:
    """The rows as a Markdown table (docs/models.md, `finetune models`)."""
    lines = ["| model_type | models | status |", "| --- | --- | --- |"]
    lines += [f"| `{model_type}` | {name} | {status} |" for model_type, name, status in support_rows()]
    return "\n".join(lines)
