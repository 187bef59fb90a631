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

import sys

from finetune.distributed import print0
from finetune.errors import ModelLoadError
from finetune.model import matrix
from finetune.model.classes import causal_lm_class
from finetune.recipe.checks import checkpointing
from finetune.recipe.objectives import spec_of

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
    "deepseek_v4": "DeepSeek-V4 (MoE: experts with their own clamped SwiGLU, hash routing; compressed attention)",
    "minimax": "MiniMax (hybrid lightning attention, MoE)",
    "cohere2": "Command R7B / Command A",
    "smollm3": "SmolLM3",
    "starcoder2": "StarCoder2",
    "gpt_neox": "GPT-NeoX / Pythia",
    "falcon": "Falcon",
    "gpt_oss": "gpt-oss (MoE; attention eager, chosen by model.attn_implementation: auto)",
    "phimoe": "Phi-3.5-MoE",
    "llama4_text": "Llama 4 (text: Scout, Maverick; MoE, experts stored transposed)",
    # The text of multimodal checkpoints (model/classes.py): the whole model where transformers maps it as a causal
    # LM (Gemma 4), else its own causal LM (Mistral 4) or its image-text-to-text model without the towers.
    "gemma4": "Gemma 4 (text of the multimodal checkpoints)",
    "gemma4_text": "Gemma 4 (text)",
    "mistral4": "Mistral 4 (Mistral4ForCausalLM, which AutoModelForCausalLM does not map)",
    "mistral3": "Mistral Small 3.1 / 3.2, Magistral (text of the multimodal checkpoints)",
    "mistral_large4": "Mistral Large 4 (text; MoE)",
    "kimi_k25": "Kimi K2.5 (text: DeepSeek-V3's language model; MoE)",
    "glm5_next": "GLM-5 (text; MoE with its own gating, linear attention; read by from_pretrained)",
    # Checkpoints whose tensors transformers splits, concatenates or transposes at load (CHECKPOINT_LAYOUTS): read by
    # transformers' from_pretrained, whole on every rank.
    "hrm_text": "HRM (text; read by from_pretrained)",
    "lara_mini": "LARA mini (gated delta net; read by from_pretrained)",
    "olmo_hybrid": "OLMo hybrid (linear attention; read by from_pretrained)",
    "param2moe": "Param-2 MoE (read by from_pretrained)",
    "sarvam_moe": "Sarvam MoE (read by from_pretrained)",
}
# Bases named in the fix of a reward model's refusal (sequence_classifier_problem), those transformers maps.
REWARD_BASES = {"llama": "Llama 3.x", "qwen3": "Qwen3", "qwen2": "Qwen2.5", "gemma3_text": "Gemma 3", "mistral": "Mistral"}
# model_type -> the model keys it needs besides the library's defaults (the matrix trains it with them).
MODEL_SETTINGS = {
    "gemma2": {"attn_implementation": "eager"},  # logit soft-capping: transformers refuses sdpa for it
}
# Trained, but `finetune export` says plain PEFT cannot load the exported adapter yet: the matrix expects exactly
# this, so a fix shows up as a failing row to move out of here. (None since the export writes PEFT's fused-expert
# form where PEFT does not convert per-expert LoRA itself: finetune/outputs/export_fused.py.)
ADAPTER_GAPS: tuple[str, ...] = ()
# Also launched under the shipped FSDP2 and FSDP1 configs: one dense GQA model, one with Gemma 3's norm layout
# (pre and post norms, sliding window), one mixture of experts with latent attention and shared experts (DeepSeek-V3;
# Mixtral and Qwen3-MoE run under FSDP2 in tests/parallel/test_experts_parallel.py), and DeepSeek-V4 (experts with a
# gating of their own, experts/families/own_gating.py).
SHARDED = ("qwen3", "gemma3_text", "deepseek_v3", "deepseek_v4")
# Launched under the shipped FSDP2 config only: the text of the multimodal releases, each route of model/classes.py
# (Gemma 4 whole, Mistral 4's unmapped causal LM, Kimi K2.5 without its towers, GLM-5 read by from_pretrained).
SHARDED_FSDP2 = ("gemma4", "mistral4", "mistral_large4", "kimi_k25", "glm5_next")
# model_type -> (why, as docs/models.md says it; the words `check_supported`'s refusal must contain): refused under
# the library's settings (4-bit NF4, sdpa attention), before any weight loads.
_NO_CHECKPOINTING = (("no gradient checkpointing in transformers for it (the library's train.gradient_checkpointing: "
                      "true); trains with train.gradient_checkpointing: false"), "has no gradient checkpointing")
_MAMBA = (("Mamba layers: PEFT refuses LoRA on a Mamba mixer's out_proj, which all-linear targets; trains with "
           "lora.target_modules listing the other projections"), "PEFT refuses LoRA on")
_CONV1D = (("its attention and MLP layers are transformers' Conv1D, whose weights are stored (in, out), transposed to "
            "nn.Linear's; finetune's 4-bit loader reads each weight as stored into a bitsandbytes Linear4bit of "
            "shape (out, in) and does not transpose it as from_pretrained does; trains with quantization.method: "
            "none (LoRA on Conv1D: PEFT sets fan_in_fan_out)"), "Conv1D")
# model_type -> how its checkpoint stores tensors that transformers' conversion mapping (transformers/
# conversion_mapping.py) splits, concatenates or transposes at load: finetune's loaders apply its renames only
# (finetune/model/sources/conversions.py), so the model's tensors are missing from the checkpoint with any
# settings (tried: 4-bit and quantization.method: none). Checked against the installed transformers' mapping by
# tests/model/test_arch_matrix.py.
CHECKPOINT_LAYOUTS = {
    "bailing_hybrid": "it stores each linear-attention layer's short convolution as three tensors (self_attn.q_conv1d, "
                      "k_conv1d, v_conv1d), which transformers concatenates into self_attn.conv1d at load (its experts "
                      "are missing from the checkpoint too under finetune's names)",
    "ergo": "it stores the router (feed_forward.gate_kernel) and the shared expert (feed_forward.shared_up_proj, "
            "shared_down_proj) as (in, out), which transformers transposes at load",
    "hrm_text": "it fuses each layer's gate, q, k and v projections into one attn.gqkv_proj and the MLP's gate and up "
                "into mlp.gate_up_proj, which transformers splits at load",
    "kimi_linear": "it stores each linear-attention layer's short convolution as three tensors (self_attn.q_conv1d, "
                   "k_conv1d, v_conv1d), which transformers concatenates into self_attn.conv1d at load",
    "lara_mini": "it fuses the gated delta net's input projections into one linear_attn.in_proj (rows q|k|v|z|b|a), "
                 "which transformers splits into in_proj_qkv, in_proj_z, in_proj_b and in_proj_a at load",
    "olmo_hybrid": "it stores each linear-attention layer's short convolution as three tensors (linear_attn.q_conv1d, "
                   "k_conv1d, v_conv1d), which transformers concatenates into linear_attn.conv1d at load",
    "param2moe": "it fuses attention's q, k and v into one attention.query_key_value, which transformers splits at load",
    "sarvam_moe": "it fuses attention's q, k and v into one attention.query_key_value, which transformers splits at "
                  "load",
    "glm5_next": "it stores each linear-attention layer's short convolution as three tensors (self_attn.q_conv1d, "
                 "k_conv1d, v_conv1d), which transformers concatenates into self_attn.conv1d at load",
}
REFUSED: dict[str, tuple[str, str]] = {
    "cpmant": _NO_CHECKPOINTING, "ctrl": _NO_CHECKPOINTING, "gpt_neox_japanese": _NO_CHECKPOINTING,
    "jetmoe": _NO_CHECKPOINTING, "falcon_h1": _MAMBA, "falcon_mamba": _MAMBA,
    "mamba": (("Mamba layers: its mixer multiplies dt_proj.weight itself (the packed bytes under 4 bits), and PEFT "
               "refuses LoRA on out_proj, which all-linear targets; trains with quantization.method: none and "
               "lora.target_modules listing the other projections"), "multiplies dt_proj.weight"),
    "xlstm": (("its chunkwise mLSTM kernel multiplies fp32 states with bf16 inputs (model.dtype: bfloat16, what auto "
               "picks on GPUs from Ampere on); trains with model.dtype: float32"), "fp32 states with bf16 inputs"),
    "nemotron_h": (("finetune's loaders cannot read its experts (non-gated, 3-D in the model, per expert in the "
                    "checkpoint) with any settings; PEFT also refuses LoRA on its Mamba mixers' out_proj"),
                   "cannot read its experts"),
    "ergo": (("its routed experts are non-gated and held whole (ErgoExperts: 3-D up_proj and down_proj), which "
              "finetune/model/experts/ does not split: under 4 bits they would stay in model.dtype without LoRA, and "
              "all-linear would put LoRA on its router's gate.linear (bug bash bb67: trained so in silence); trains "
              "with quantization.method: none, the routed experts frozen"), "routed experts are non-gated"),
    "gpt2": _CONV1D, "gpt-sw3": _CONV1D,
    "openai-gpt": ((f"{_CONV1D[0]}; and no gradient checkpointing in transformers for it (the library's "
                    "train.gradient_checkpointing: true); trains with both fixes"), "Conv1D"),
}
KNOWN_NAMES: dict[str, str] = {
    "cpmant": "CPM-Ant", "ctrl": "CTRL", "gpt_neox_japanese": "GPT-NeoX-Japanese", "jetmoe": "JetMoE",
    "falcon_h1": "Falcon-H1 (Mamba hybrid)", "falcon_mamba": "Falcon Mamba", "mamba": "Mamba",
    "nemotron_h": "Nemotron-H (Mamba hybrid, MoE)", "xlstm": "xLSTM",
    "gpt2": "GPT-2", "gpt-sw3": "GPT-SW3", "openai-gpt": "OpenAI GPT (GPT-1)", "ergo": "Ergo (MoE)",
    "hrm_text": "HRM-Text", "kimi_linear": "Kimi Linear (hybrid linear attention, MoE)",
    "lara_mini": "Lara Mini (hybrid gated delta net)", "olmo_hybrid": "OLMo Hybrid (hybrid linear attention)",
    "param2moe": "Param2-MoE", "sarvam_moe": "Sarvam-MoE", "bailing_hybrid": "Bailing hybrid (linear attention, MoE)",
}
# PEFT's own rule (peft/tuners/tuners_utils.py `_check_lora_target_modules_mamba`, checked against the installed PEFT
# by tests/model/test_arch_matrix.py): LoRA on these module names of these model types raises inside get_peft_model.
PEFT_MAMBA_MODEL_TYPES = ("falcon_h1", "falcon_mamba", "mamba", "mamba2", "nemotron_h")
PEFT_MAMBA_MODULES = ("conv1d", "out_proj")
# model_type -> why its layers break under 4 bits (they read a quantized Linear's weight themselves, or the loader
# cannot fill them).
_CONV1D_4BIT = ("its attention and MLP layers are transformers' Conv1D (GPT-2's layout), whose weights are stored "
                "(in_features, out_features), transposed to nn.Linear's; under 4 bits each becomes a bitsandbytes "
                "Linear4bit of shape (out, in), and finetune's per-tensor loader reads the weight as stored, without "
                "the transpose transformers' from_pretrained makes. Fix: set quantization.method: none (the base in "
                "model.dtype; LoRA on Conv1D works, PEFT sets fan_in_fan_out)")
FOUR_BIT_GAPS = {
    # GPT-SW3's config class is GPT2Config (config.model_type "gpt2"): the gpt2 row refuses it.
    "gpt2": _CONV1D_4BIT, "openai-gpt": _CONV1D_4BIT,
    "mamba": "MambaMixer multiplies dt_proj.weight itself, which under 4 bits is the packed NF4 bytes (a shape error "
             "at the first step). Fix: set quantization.method: none",
    "ergo": "its routed experts are non-gated and held whole (ErgoExperts: 3-D up_proj and down_proj), which "
            "finetune/model/experts/ does not split into Linears: under 4 bits they would stay in model.dtype without "
            "LoRA while the run said 4 bits, and all-linear put LoRA on the router's gate.linear (bug bash bb67). Fix: "
            "set quantization.method: none (the routed experts then stay whole and frozen; LoRA trains attention, the "
            "dense and shared MLPs)",
}
# model_type -> why it breaks in bf16 (tried: trains in fp32 with the library's other settings).
BF16_GAPS = {
    "xlstm": "xLSTM's chunkwise mLSTM kernel (modeling_xlstm.mlstm_chunkwise_recurrent_fw_C) multiplies fp32 states "
             "with bf16 inputs (a dtype error at the first step). Fix: set model.dtype: float32",
}
# model_type -> why finetune's per-tensor loaders cannot read it with any settings (tried: 4-bit and quantization
# none, LoRA targets PEFT takes): refused before loading instead of the loader's "checkpoint does not match".
UNREADABLE = {
    "nemotron_h": "finetune's loaders cannot read its experts (NemotronHExperts: non-gated experts held as 3-D up_proj "
                  "and down_proj, which finetune/model/experts/ does not split, stored per expert in the checkpoint). "
                  "Fix: none in finetune yet; use a model `finetune models` lists as trained",
}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Architectures whose positions index a fixed table (learned, or CTRL's sinusoids computed once): a longer sequence is an
# IndexError at the first forward (GPT-Neo's causal-bias buffer too, even with packing's restarted positions).
FIXED_POSITIONS = ("gpt2", "gpt_neo", "opt", "gpt_bigcode", "biogpt", "ctrl")


def refusals(config, *, quantized: bool, attn_implementation: str, gradient_checkpointing: bool = False,
             lora_targets: list[str] | str = "all-linear", dtype: str = "bfloat16") -> list[str]:
    """Every reason `config`'s architecture cannot train with these settings, each with its fix; [] when none is known
    (an untried architecture is not refused). From the config alone: nothing is read but config.json."""
    model_class = causal_lm_class(config)
    reasons = [UNREADABLE[config.model_type]] if config.model_type in UNREADABLE else []
    if quantized and config.model_type in FOUR_BIT_GAPS:
        reasons.append(FOUR_BIT_GAPS[config.model_type])
    if dtype == "bfloat16" and config.model_type in BF16_GAPS:
        reasons.append(BF16_GAPS[config.model_type])
    if gradient_checkpointing and model_class is not None and not model_class.supports_gradient_checkpointing:
        reasons.append(f"{model_class.__name__} has no gradient checkpointing in transformers (train."
                       "gradient_checkpointing: true, or parallel.activation_checkpointing: true, would stop at the "
                       "first step). Fix: set train.gradient_checkpointing: false and leave parallel."
                       "activation_checkpointing unset (every layer's activations kept: `finetune plan` counts them)")
    if config.model_type in PEFT_MAMBA_MODEL_TYPES:
        targeted = ["out_proj"] if lora_targets == "all-linear" else [t for t in lora_targets if t in PEFT_MAMBA_MODULES]
        if targeted:
            reasons.append(f"PEFT refuses LoRA on {', '.join(targeted)} of a {config.model_type} model (its Mamba "
                           "mixers' projections; lora.target_modules: all-linear includes out_proj). Fix: list "
                           "lora.target_modules without out_proj and conv1d, e.g. [q_proj, k_proj, v_proj, o_proj, "
                           "in_proj, gate_proj, up_proj, down_proj]")
    if attn_implementation == "sdpa" and model_class is not None and getattr(model_class, "_supports_sdpa", True) is False:
        reasons.append(f"transformers refuses sdpa attention for {model_class.__name__} (what its layers compute, "
                       "such as logit soft-capping or learned sinks, sdpa cannot). Fix: set model.attn_implementation: "
                       "eager")
    if attn_implementation == "flash_attention_2" and model_class is not None and not model_class._supports_flash_attn:
        reasons.append(f"transformers has no flash attention for {model_class.__name__}. Fix: set "
                       "model.attn_implementation: auto")
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
            # A multimodal config whose causal LM is its text model (Llama 4: Llama4Config -> Llama4ForCausalLM, as
            # AutoModelForCausalLM builds it) gets the text config, as from_config gives it.
            text = config if isinstance(config, model_class.config_class) else config.get_text_config()
            skeleton = model_class._from_config(text)
    finally:
        transformers_logging.set_verbosity(verbosity)
    reasons: dict[str, str] = {}
    for _, module in fused_expert_modules(skeleton):
        family, why = family_for(module)
        reason = "; ".join(why) if family is None else _routing_outside(module) if family in ("concatenated", "own_gating") \
            else None
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


_WARNED: set[str] = set()


def check_supported(config, recipe) -> None:
    """ModelLoadError (one paragraph: the model, every reason with its fix) for an architecture that cannot train
    with the recipe's settings: before any weight is read."""
    reasons = refusals(config, quantized=recipe.quantization.method != "none",
                       attn_implementation=recipe.model.attn_implementation,
                       gradient_checkpointing=checkpointing(recipe),
                       lora_targets=recipe.lora.target_modules, dtype=recipe.model.dtype)
    if spec_of(recipe.train.objective).head == "score" and (problem := sequence_classifier_problem(config)):
        reasons.append(problem)  # a reward model: its adapter loads on the base's sequence classifier alone
    if not reasons and config.model_type not in _WARNED and (warning := matrix.failed_warning(config.model_type)):
        _WARNED.add(config.model_type)  # load_config runs this at every stage that reads the config: say it once
        print0(f"[finetune] warning: {warning}", file=sys.stderr)
    reasons += _position_problems(config, recipe)
    if not reasons and (note := _beyond_context(config, recipe)) and note not in _WARNED:
        _WARNED.add(note)
        print0(f"[finetune] warning: {note}", file=sys.stderr)
    if reasons:
        raise ModelLoadError(
            f"model.name_or_path `{recipe.model.name_or_path}` is a {config.model_type} model, which finetune cannot "
            f"train with these settings: {'; '.join(reasons)}. (`finetune models` lists the architectures checked.)")


def sequence_classifier_problem(config) -> str | None:
    """Why nothing can load a reward model's adapter (task_type SEQ_CLS) of `config`'s model: transformers maps no
    AutoModelForSequenceClassification for its config (nor its remote code's auto_map), the class docs/reward.md,
    grpo.reward_models and `finetune export` load it on (bb68: cohere2, granite, Gemma 4, Llama 4 trained, then
    export crashed). None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as classifiers

    if config.model_type in classifiers or "AutoModelForSequenceClassification" in (getattr(config, "auto_map", {}) or {}):
        return None
    bases = ", ".join(name for model_type, name in REWARD_BASES.items() if model_type in classifiers)
    return (f"train.objective: reward trains a sequence classifier's adapter (task_type SEQ_CLS, docs/reward.md), and "
            f"transformers has no sequence classifier for {config.model_type} (AutoModelForSequenceClassification "
            f"maps no {type(config).__name__}): nothing could load the trained adapter, not PEFT onto "
            "AutoModelForSequenceClassification, not grpo.reward_models, not `finetune export`. Fix: train the "
            f"reward model from a base of a family that has one, e.g. {bases}")


def _position_problems(config, recipe) -> list[str]:
    """A sequence longer than the position table of a FIXED_POSITIONS model: data.max_length (a packed row is that long
    too), and a generation eval's prompt (up to max_length) plus its answer."""
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if config.model_type not in FIXED_POSITIONS or not limit:
        return []
    longest, what = recipe.data.max_length, "data.max_length"
    if recipe.eval.generation_rows:
        longest += recipe.eval.max_new_tokens
        what = (f"data.max_length {recipe.data.max_length} + eval.max_new_tokens {recipe.eval.max_new_tokens} (the "
                "generation eval's prompt and answer)")
    if longest <= limit:
        return []
    key = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    room = limit - (recipe.eval.max_new_tokens if recipe.eval.generation_rows else 0)
    reason = (f"its positions are a table of {limit} (config.json's {key}), and {what} is {longest}: a longer "
              f"sequence fails at the first step. Fix: set data.max_length to {room} or less")
    return [reason]


def _beyond_context(config, recipe) -> str | None:
    """data.max_length past the context a rotary model was trained for, with no RoPE scaling in its config: it trains
    (rotary positions have no table), at positions the base never saw. A warning, as TRL gives none."""
    context = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or {}
    if config.model_type in FIXED_POSITIONS or not context or not rope or recipe.data.max_length <= context:
        return None
    if rope.get("rope_type", "default") != "default":
        return None
    return (f"data.max_length {recipe.data.max_length} is past the model's context of {context} tokens "
            "(config.json's max_position_embeddings) and the config has no RoPE scaling: rows that long train at "
            "positions the base never saw. Lower data.max_length, or start from a config with rope_scaling")


def support_rows() -> list[tuple[str, str, str]]:
    """(model_type, name, status) for the docs and `finetune models`: trained, trained + FSDP, or refused + why."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as classifiers

    rows = []
    for model_type, name in sorted(TRAINED.items()):
        status = ("trained; FSDP2 and FSDP1 launched" if model_type in SHARDED else "trained; FSDP2 launched"
                  if model_type in SHARDED_FSDP2 else "trained (one process)")
        status += "".join(f"; needs model.{key}: {value}" for key, value in MODEL_SETTINGS.get(model_type, {}).items())
        if model_type in ADAPTER_GAPS:
            status += "; its exported adapter does not load in plain PEFT yet"
        if model_type not in classifiers:
            status += "; no reward model (transformers has no sequence classifier for it)"
        rows.append((model_type, name, status))
    for model_type in sorted(REFUSED):
        rows.append((model_type, KNOWN_NAMES.get(model_type, model_type), f"refused: {REFUSED[model_type][0]}"))
    listed = {row[0] for row in rows}
    rows += [(model_type, KNOWN_NAMES.get(model_type, model_type), matrix.status(model_type))
             for model_type in sorted(matrix.record()["rows"]) if model_type not in listed]
    return rows


def support_table() -> str:
    """The rows as a Markdown table (docs/models.md, `finetune models`)."""
    lines = ["| model_type | models | status |", "| --- | --- | --- |"]
    lines += [f"| `{model_type}` | {name} | {status} |" for model_type, name, status in support_rows()]
    return "\n".join(lines)


def converted_at_load(config) -> str | None:
    """How `config`'s checkpoint stores tensors transformers converts at load (CHECKPOINT_LAYOUTS), else None: such a
    model is loaded by transformers' from_pretrained (model/base.py), whole on every rank, not by finetune's
    per-tensor and sharded loaders, which apply transformers' key renames only."""
    return CHECKPOINT_LAYOUTS.get(config.model_type)
