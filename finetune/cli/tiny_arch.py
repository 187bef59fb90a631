"""Tiny models of every text causal LM transformers ships, built from transformers' own config class (its defaults,
shrunk): the architecture matrix of the suite (tests/model/test_arch_matrix.py) and `finetune tiny-model --arch` (any type
of `tiny_arch_types`: text causal LMs, and multimodal models whose language model finetune trains).

Each config keeps its model_type and every switch of the defaults (norm layout, activation, rope, biases, soft-capping,
the kind of each layer); only the sizes shrink: 2 layers, hidden 64, 4 heads of 16 (2 key/value heads where the
default groups them), 4 experts with 2 per token, the tiny tokenizer's vocabulary. A per-layer list (`layer_types`)
keeps one layer of each of its first two kinds, so a hybrid model (linear + full attention) keeps both.
"""

from __future__ import annotations

from pathlib import Path

HIDDEN = 64
LAYERS = 2
# Key -> its tiny value, wherever a default config has the key (ints only; None leaves the default).
_SIZES = {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "embed_dim": HIDDEN, "word_embed_proj_dim": HIDDEN,
    "intermediate_size": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN,
    "moe_intermediate_size": 2 * HIDDEN, "shared_expert_intermediate_size": 2 * HIDDEN,
    "intermediate_size_mlp": 2 * HIDDEN, "expert_intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "head_dim": HIDDEN // 4,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "max_position_embeddings": 512, "n_positions": 512, "sliding_window": 32, "attention_chunk_size": 32,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_dt_rank": 8,
    "mamba_headdim": 16, "state_size": 8, "time_step_rank": 8, "conv_kernel": 4, "mamba_chunk_size": 16,
    "chunk_size": 16, "block_size": 16,
}
# Per architecture, what the generic shrink gets wrong (sizes that must agree with each other).
_OVERRIDES: dict[str, dict] = {
    "gpt_oss": {"intermediate_size": HIDDEN},
    # Compression windows a short row spans (defaults 4 and 128 tokens) and fewer kept positions than the compressed
    # ones (default 512), so that the compressors and the sparse-attention indexer run (and their LoRA trains).
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                    "index_topk": 2},
}


def _hash_routes(model) -> None:
    """Hash-routed MoE layers (DeepSeek-V4's first layers: token id -> experts, a table the checkpoint ships, zeros at
    init) get a random table, as a real checkpoint has: every expert sees tokens."""
    import torch

    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.config.get_text_config().num_local_experts
            buffer.copy_(torch.randint(0, experts, buffer.shape, dtype=buffer.dtype))


# Causal-LM classes that are no standalone text decoder: the decoder half of an encoder-decoder (BERT generation,
# TrOCR's text decoder for an image encoder) and XLNet's permutation language model.
NOT_DECODERS = ("bert-generation", "trocr", "xlnet")


def text_causal_lm_types() -> list[str]:
    """The model types transformers maps to a causal LM that are text decoders: no encoder (masked-LM or seq2seq
    models), no vision or audio sub-config."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    encoders = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    found = []
    for model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type in encoders or model_type in NOT_DECODERS or model_type not in CONFIG_MAPPING:
            continue
        config_class = CONFIG_MAPPING[model_type]
        subs = getattr(config_class, "sub_configs", None) or {}
        if getattr(config_class, "is_encoder_decoder", False) or any(
                word in name for name in subs for word in ("text", "vision", "audio", "encoder", "decoder")):
            continue
        found.append(model_type)
    return sorted(found)


def matrix_model_types() -> list[str]:
    """Every model type of the installed transformers with a causal-LM or an image-text-to-text class: what the models
    matrix walks (`make models-matrix`) and `finetune models` lists."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    names = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(name for name in names if name in CONFIG_MAPPING)


def tiny_arch_types() -> list[str]:
    """What `finetune tiny-model --arch` builds: every model type of `matrix_model_types` that `decoder_kind` calls a
    decoder (the text causal LMs, and the multimodal models whose language model finetune trains: Mistral 4, GLM-5,
    Kimi K2.5, Gemma 4, ...): the model types docs/models.md lists as trained."""
    return [model_type for model_type in matrix_model_types() if decoder_kind(model_type) == "decoder"]


def decoder_kind(model_type: str) -> str:
    """"decoder" for a model the matrix trains (a text decoder, or a multimodal model whose language model is one),
    else why not: an encoder with a causal-LM head, an encoder-decoder, or no text model."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or getattr(
            CONFIG_MAPPING[model_type], "is_encoder_decoder", False):
        return "an encoder-decoder model (finetune trains decoder-only causal LMs)"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in NOT_DECODERS:
        return "an encoder with a language-model head, or no standalone decoder (finetune trains decoder-only LMs)"
    return "decoder"


def multimodal_class(config):
    """The class a checkpoint of `config` is saved from: its causal LM, else (a multimodal model transformers maps to
    no causal LM: Mistral Large 4, Kimi K2.5, GLM-5) its image-text-to-text model, as the hub's checkpoint is."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto as auto

    if config.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def _two_layers(values: list) -> list[int]:
    """Which layers of a per-layer list to keep: the first, and the first of another kind (else the second)."""
    other = next((index for index, value in enumerate(values) if value != values[0]), 1)
    return [0, other]


def _shrunk(defaults: dict, config_class=None) -> dict:
    """The fields of one (sub-)config's defaults that shrink (module docstring)."""
    layers = next((defaults[key] for key in ("num_hidden_layers", "n_layer", "num_layers") if key in defaults), None)
    fields = {key: value for key, value in _SIZES.items() if isinstance(defaults.get(key), int)
              and not isinstance(defaults.get(key), bool) and defaults.get(key) != 0}  # 0: none (no rotary part)
    heads = defaults.get("num_attention_heads") or defaults.get("n_head") or 4
    kv_heads = defaults.get("num_key_value_heads")
    if isinstance(kv_heads, int):
        fields["num_key_value_heads"] = 2 if kv_heads < heads else 4
    keep = _two_layers(defaults.get("layer_types") or [0] * (layers or LAYERS))
    for key, value in defaults.items():  # per-layer lists: keep two layers
        if isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
            keep = _two_layers(defaults.get("layer_types") or value)
            fields[key] = [value[index] for index in keep]
    for key, value in defaults.items():  # per-layer settings keyed by layer index (Gemma 4's per_layer_config)
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            fields[key] = {f"{new:0{len(str(k))}d}": value[k] for k in value for new, old in enumerate(keep)
                           if int(k) == old}
    if "qk_rope_head_dim" in fields and defaults.get("head_dim") == defaults["qk_rope_head_dim"]:
        fields["head_dim"] = fields["qk_rope_head_dim"]  # multi-head latent attention: rotary part = head_dim
    if isinstance(defaults.get("num_experts_per_tok"), int):
        fields["num_experts_per_tok"] = min(2, defaults["num_experts_per_tok"])
    fields.update(_mrope(defaults, fields, config_class))
    return fields


def _mrope(defaults: dict, fields: dict, config_class) -> dict:
    """Multimodal rotary sections (Qwen2-VL, GLM-4V: `mrope_section`, defaulted in the model's code for a head of 128)
    that sum to the tiny head's rotary half: (1/4, 3/8, 3/8) of it, as the defaults' (16, 24, 24)."""
    rope = defaults.get("rope_parameters")
    if "mrope_section" not in getattr(config_class, "ignore_keys_at_rope_validation", ()) or not isinstance(rope, dict):
        return {}
    partial = rope.get("partial_rotary_factor") or defaults.get("partial_rotary_factor") or 1.0
    half = int(fields.get("head_dim", HIDDEN // 4) * partial) // 2
    first = half // 4
    second = (half - first) // 2
    return {"rope_parameters": {**rope, "mrope_section": [first, second, half - first - second]}}


def tiny_config(model_type: str, *, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """transformers' default config of `model_type`, shrunk (module docstring). A multimodal config (a text_config
    beside vision or audio ones) shrinks each of them: its towers too, so the tiny checkpoint holds them as the hub's
    does."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    tokens = {"vocab_size": vocab_size, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "bos_token_id": None}
    if isinstance(defaults.get("text_config"), dict):
        classes = getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}
        fields = {key: {**value, **_shrunk(value, classes.get(key)), **(tokens if key == "text_config" else {})}
                  for key, value in defaults.items() if key.endswith("_config") and isinstance(value, dict)}
        fields["text_config"].update(_OVERRIDES.get(fields["text_config"].get("model_type"), {}))
        fields.update(_OVERRIDES.get(model_type, {}))
        return CONFIG_MAPPING[model_type](**fields)
    fields = _shrunk(defaults, CONFIG_MAPPING[model_type])
    fields.update(tokens, tie_word_embeddings=defaults.get("tie_word_embeddings", False))
    fields.update(_OVERRIDES.get(model_type, {}))
    return CONFIG_MAPPING[model_type](**fields)


def build_tiny_arch(model_type: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16",
                    force: bool = False) -> Path:
    """Save a random-init tiny `model_type` (in `dtype`, as hub checkpoints ship) plus the tiny tokenizer into
    `out_dir` (new or empty; `force`: replaced, finetune/cli/tiny.py model_folder)."""
    import torch

    from finetune.cli.tiny import build_tokenizer, model_folder, model_folder_problem
    from finetune.errors import FinetuneError

    out_dir = Path(out_dir)
    if problem := model_folder_problem(out_dir, force=force):  # before the seconds of building
        raise FinetuneError(problem)
    tokenizer = build_tokenizer()
    config = tiny_config(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = multimodal_class(config).from_config(config, dtype=getattr(torch, dtype))
    _hash_routes(model)
    with model_folder(out_dir, force=force) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return out_dir
