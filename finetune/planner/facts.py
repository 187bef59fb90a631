"""Facts of a model for the memory model: every tensor with its stored bytes and its FSDP unit, from the config alone.

The model is built on the meta device (no weights); an architecture transformers cannot build gets a generic
Llama-shaped skeleton, labelled as such. `model_config_for` reads stored architecture numbers first (offline).
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

from finetune.errors import FinetuneError
from finetune.model.attention import attention_for

GiB = 1024**3
GB = 1000**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCK = 64  # weights per absmax
NESTED_BLOCK = 256  # absmax values per fp32 second-level absmax (double quant)


class PlanError(FinetuneError):
    """A plan input (flag, recipe or model config) cannot be used."""


# ------------------------------------------------------------------------------------------------ model facts
@dataclass
class Tensor:
    """One parameter as stored after loading: `rows` x `row_elems` elements of `elem_bytes` each."""

    name: str
    rows: int
    row_elems: int
    elem_bytes: int
    trainable: bool
    unit: str  # FSDP unit: "layer{i}", "lora:{name}" or "root"
    quantized_numel: int = 0  # a 4-bit weight: its values before packing (what the checkpoint stores); else 0
    whole_read_bytes: int = 0  # read whole by every rank in this stored form (an MXFP4 expert weight); 0: by values

    @property
    def numel(self) -> int:
        return self.rows * self.row_elems

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes


@dataclass
class ModelFacts:
    """What memory depends on, for one model + recipe (quantization, LoRA, dtype)."""

    name: str
    model_type: str
    generic: bool  # True: a Llama-shaped estimate, the architecture was not built
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_dim: int
    dtype_bytes: int
    tensors: list[Tensor]
    quant_state_bytes: int
    lora_inputs: list[tuple[str, int]]  # (target name in a layer, in_features): per-layer LoRA targets
    lora_rank: int
    unit_load_bytes: int = 0  # the largest FSDP unit (a layer, or the root) in model.dtype, before quantization
    checkpoint_dtype_bytes: int = 0  # bytes per value in the checkpoint files (config.json's dtype); 0: model.dtype's
    eager_attention: bool = False  # scores of size seq x seq are kept (attention softcapping)
    extra_norms: int = 0  # norms per layer beyond the usual two (Gemma 2 has four)
    fsdp_version: int = 2  # how FSDP would wrap it: FSDP1 pads flat parameters and runs LoRA through PEFT's forward
    notes: list[str] = field(default_factory=list)
    # Mixture of experts (finetune/model/experts/: one 4-bit Linear per expert projection): experts per layer, how
    # many each token is routed to, and an expert's intermediate size. 0: a dense model.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # Where the 4-bit bytes come from at load: "" (the checkpoint holds model.dtype values, quantized at load),
    # "checkpoint" (model.name_or_path is a bitsandbytes 4-bit checkpoint) or "cache" (model.quantized_cache: auto: a
    # later start reads the 4-bit cache entry; the first start reads the base once to write it).
    stored_4bit: str = ""
    stored_quant_state_bytes: int = 0  # the quant states as a 4-bit checkpoint stores them (stored_quant_state_bytes)
    # The checkpoint stores gpt-oss's experts in MXFP4 (config.json quantization_config.quant_method: mxfp4): read by
    # finetune's tensor-by-tensor loader only, so no layer split (transformers' from_pretrained refuses it).
    mxfp4: bool = False

    def total_bytes(self, *, trainable: bool | None = None) -> int:
        return sum(t.nbytes for t in self.tensors if trainable is None or t.trainable == trainable)

    def unit_bytes(self, unit_prefix: str) -> int:
        return sum(t.nbytes for t in self.tensors if t.unit == unit_prefix)

    @property
    def trainable_numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.trainable)


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _lora_targets(name: str, is_output: bool, target_modules) -> bool:
    """PEFT's matching: `all-linear` is every Linear but the output layer; a list matches the name's suffix."""
    if target_modules == "all-linear":
        return not is_output
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _layers_list(model) -> tuple[str, int]:
    """Dotted name and length of the longest ModuleList (the decoder layers; a layer's experts are no such list)."""
    from torch import nn

    from finetune.model.experts import RoutedExperts

    lists = [(n, len(m)) for n, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and not isinstance(m, RoutedExperts) and len(m)]
    if not lists:
        return "", 0
    return max(lists, key=lambda item: item[1])


def _unit_of(name: str, layers_path: str) -> str:
    match = re.match(re.escape(layers_path) + r"\.(\d+)\.", name) if layers_path else None
    return f"layer{match.group(1)}" if match else "root"


def stored_quant_state_bytes(numel: int, *, double_quant: bool) -> int:
    """Bytes of one 4-bit weight's quant state in a checkpoint as transformers' save_pretrained writes it (what
    `finetune quantize` and the quantized cache write): absmax (uint8 codes with double quant, else fp32), nested
    absmax (fp32), the NF4 code (16 fp32), the nested code (256 fp32) and the packed JSON of the rest (~170 bytes)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    if double_quant:
        return blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * 16 + 4 * 256 + 170
    return 4 * blocks + 4 * 16 + 130


def quant_state_bytes(numel: int, *, double_quant: bool) -> int:
    """Bytes of bitsandbytes' QuantState for one 4-bit weight (absmax, nested absmax, offset, NF4 code)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    if double_quant:
        return blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + 64
    return 4 * blocks + 64


def facts_from_config(config, recipe, *, name: str = "", fsdp_version: int = 2, lora_bytes: int = 4) -> ModelFacts:
    """Tensor-by-tensor facts from the model built on the meta device; generic facts if it cannot be built.

    `lora_bytes`: bytes per LoRA weight. 4: PEFT's fp32 master weights, which finetune keeps under every strategy
    (FSDP1 too: each LoRA leaf is a unit of its own). 2 models a peer that keeps LoRA in bf16 (published figures).
    """
    try:
        import torch

        from finetune.model.classes import from_config

        with torch.device("meta"):
            model = from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001  (any architecture transformers cannot build: estimate, never crash)
        return _generic_instead(config, recipe, exc, "could not be built", name=name, fsdp_version=fsdp_version,
                                lora_bytes=lora_bytes)
    try:
        return _facts_from_model(model, config, recipe, name=name, fsdp_version=fsdp_version, lora_bytes=lora_bytes)
    except FinetuneError:
        raise
    except Exception as exc:  # noqa: BLE001  (a config whose numbers this reader does not know: estimate, never crash)
        return _generic_instead(config, recipe, exc, "was built, but its facts could not be read", name=name,
                                fsdp_version=fsdp_version, lora_bytes=lora_bytes)


def _generic_instead(config, recipe, exc: Exception, why: str, **kwargs) -> ModelFacts:
    """The generic estimate, with a note saying why the built model's own facts are not used."""
    facts = generic_facts(config, recipe, **kwargs)
    facts.notes.append(f"generic estimate: the architecture {why} ({type(exc).__name__}: {str(exc)[:120]})")
    return facts


def _split_experts(model, quantized: bool) -> tuple[int, int]:
    """Fused MoE experts split as the loaders split them (one Linear per expert projection, so the loop below counts
    them at 4 bits with a LoRA each); returns (experts per layer, an expert's intermediate size), (0, 0) if dense."""
    from finetune.model.experts import RoutedExperts, fused_expert_modules, split_experts

    fused = fused_expert_modules(model)
    if not fused:
        return 0, 0
    split_experts(model, dtype=fused[0][1].gate_up_proj.dtype, quantized=quantized)
    routed = next((m for m in model.modules() if isinstance(m, RoutedExperts)), None)
    if routed is None:  # left fused (quantization none, a layout that is not split): counted as the tensors they are
        return fused[0][1].gate_up_proj.shape[0], fused[0][1].down_proj.shape[-1]
    return len(routed), getattr(routed[0], routed[0].names.gate_up[0]).out_features


def _facts_from_model(model, config, recipe, *, name: str, fsdp_version: int, lora_bytes: int = 4) -> ModelFacts:
    from torch import nn

    experts, expert_intermediate = _split_experts(model, recipe.quantization.method != "none")
    dtype_bytes = DTYPE_BYTES[recipe.model.dtype]
    quantized = recipe.quantization.method != "none"
    storage_bytes = DTYPE_BYTES[recipe.quantization.quant_storage or recipe.model.dtype]
    layers_path, num_layers = _layers_list(model)
    output = model.get_output_embeddings()
    tensors: list[Tensor] = []
    qstate = stored_qstate = 0
    lora_inputs: list[tuple[str, int]] = []
    # Exactly nn.Linear, as transformers' bnb quantizer converts: a subclass (Llama 4's router) stays in model.dtype.
    linear_weights = {id(m.weight): (n, m) for n, m in model.named_modules() if type(m) is nn.Linear}
    mxfp4 = _mxfp4_expert_weights(model) if quantized and _stored_mxfp4(config) else set()
    unit_load: dict[str, int] = {}
    for pname, param in model.named_parameters():
        unit = _unit_of(pname, layers_path)
        unit_load[unit] = unit_load.get(unit, 0) + param.numel() * dtype_bytes  # as read, before quantization
        owner = linear_weights.get(id(param))
        is_output = owner is not None and owner[1] is output
        if owner is not None and quantized and not is_output:
            numel = param.numel()
            tensors.append(Tensor(pname, (numel + 1) // (2 * storage_bytes), 1, storage_bytes, False, unit, numel,
                                  whole_read_bytes=mxfp4_bytes(numel) if id(param) in mxfp4 else 0))
            qstate += quant_state_bytes(numel, double_quant=recipe.quantization.double_quant)
            stored_qstate += stored_quant_state_bytes(numel, double_quant=recipe.quantization.double_quant)
        else:
            shape = tuple(param.shape) or (1,)
            tensors.append(Tensor(pname, shape[0], math.prod(shape[1:]), dtype_bytes, False, unit))
        if owner is not None and _lora_targets(owner[0], is_output, recipe.lora.target_modules):
            module, r = owner[1], recipe.lora.r
            tensors.append(Tensor(f"{owner[0]}.lora_A", r, module.in_features, lora_bytes, True, f"lora:{owner[0]}.A"))
            tensors.append(Tensor(f"{owner[0]}.lora_B", module.out_features, r, lora_bytes, True, f"lora:{owner[0]}.B"))
            expert = re.search(r"\.experts\.(\d+)\.", owner[0])
            if unit == "layer0" and (expert is None or expert.group(1) == "0"):  # one expert stands for each routed
                target = owner[0].rsplit(".", 1)[-1]
                lora_inputs.append((f"expert:{target}" if expert else target, module.in_features))
    if experts and recipe.lora.train_router:
        tensors += _trainable_router_copies(model)
    text, heads, kv_dim = _text_shape(config)
    attn_impl = attention_for(recipe, config)  # auto (a stored config skips load_config): what the run will pick
    facts = ModelFacts(
        name=name or getattr(config, "name_or_path", "") or "model", model_type=getattr(config, "model_type", "?"),
        generic=False, num_layers=num_layers, hidden=text.hidden_size, intermediate=_intermediate_size(text),
        vocab=text.vocab_size,
        heads=heads, kv_dim=kv_dim, dtype_bytes=dtype_bytes, tensors=tensors, quant_state_bytes=qstate,
        lora_inputs=lora_inputs, lora_rank=recipe.lora.r, unit_load_bytes=max(unit_load.values(), default=0),
        checkpoint_dtype_bytes=_stored_dtype_bytes(config),
        eager_attention=attn_impl == "eager" or (bool(getattr(text, "attn_logit_softcapping", None)) and attn_impl != "flash_attention_2"),
        extra_norms=2 if getattr(text, "model_type", "") in ("gemma2", "gemma3", "gemma3_text") else 0,
        experts=experts, experts_per_token=(getattr(text, "num_experts_per_tok", None)  # Gemma 4: top_k_experts
                                            or getattr(text, "top_k_experts", None) or 0) if experts else 0,
        expert_intermediate=expert_intermediate, fsdp_version=fsdp_version,
        stored_4bit=_stored_4bit(config, recipe) if quantized else "", stored_quant_state_bytes=stored_qstate,
        mxfp4=bool(mxfp4),
    )
    facts.notes += _notes(facts, layers_path)
    return facts


def _notes(facts: ModelFacts, layers_path: str) -> list[str]:
    notes = []
    if facts.mxfp4 and not facts.stored_4bit:
        notes.append("the experts are stored in MXFP4: read as stored (blocks + scales, 17/32 byte a value), one "
                     "expert's slab at a time, whole on every rank; no layer split (it loads through transformers' "
                     "from_pretrained, which cannot turn MXFP4 into NF4)")
    if facts.stored_4bit == "cache":
        notes.append("model.quantized_cache: auto: the read figures are a later start's, from the 4-bit cache entry; "
                     "the first start reads the whole base once to write the entry")
    if not layers_path:
        notes.append("no decoder layer list found: FSDP units and layer split are approximate")
    return notes


def _text_shape(config) -> tuple[object, int, int]:
    """(text config, attention heads, key/value width). A multimodal checkpoint (Gemma 3 12B/27B: the language model in
    `text_config`, a vision tower beside it) is counted whole, tensor by tensor; its text numbers (the activations, the
    logits) come from its text config. Layers that differ (`_layer_configs`): the widest layer's, an upper bound."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shapes = []
    for layer in _layer_configs(text):
        heads = getattr(layer, "num_attention_heads", None) or 1
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        shapes.append((heads, (getattr(layer, "num_key_value_heads", None) or heads) * head_dim))
    return text, max(heads for heads, _ in shapes), max(kv_dim for _, kv_dim in shapes)


def _layer_configs(text) -> list:
    """The config of each decoder layer. A heterogeneous config (transformers' `per_layer_config`: Gemma 4's
    full-attention layers have a head_dim of 512, its sliding ones 256) raises on reading such a per-layer attribute
    from the global config; each layer's own config answers it. Any other config: itself, for every layer."""
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)
    return [text]


def _intermediate_size(text) -> int:
    """The MLP's inner width, the largest layer's. Unset or None means the model's default, 4 x hidden: GPT-Neo's
    config ships `intermediate_size: None` (GPTNeoBlock: `4 * hidden_size` then), GPT-2's family says `n_inner`."""
    for key in ("intermediate_size", "n_inner"):
        sizes = [size for layer in _layer_configs(text) if (size := getattr(layer, key, None))]
        if sizes:
            return max(sizes)
    return 4 * text.hidden_size


def _trainable_router_copies(model) -> list[Tensor]:
    """lora.train_router: PEFT's modules_to_save copy of every router, trained in fp32 (experts.trainable_routers), as
    PEFT matches them (every module whose name ends in a router's name); the frozen original stays as counted."""
    from finetune.model.experts import router_names

    wanted = set(router_names(model))
    copies = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in wanted:
            continue
        for pname, param in module.named_parameters():
            shape = tuple(param.shape) or (1,)
            copy = f"{name}.modules_to_save.{pname}"  # FSDP1 wraps each copy as a unit of its own, as a LoRA leaf
            copies.append(Tensor(copy, shape[0], math.prod(shape[1:]), 4, True, f"lora:{copy}"))
    return copies


def _stored_4bit(config, recipe) -> str:
    """"checkpoint": config.json names a bitsandbytes 4-bit quantization; "cache": model.quantized_cache is on; else ""."""
    quant = getattr(config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant if isinstance(quant, dict) else {}
    if quant.get("load_in_4bit") or quant.get("_load_in_4bit"):
        return "checkpoint"
    return "cache" if recipe.model.quantized_cache == "auto" else ""


def _stored_mxfp4(config) -> bool:
    """config.json says the checkpoint stores MXFP4 (`quantization_config.quant_method: mxfp4`, openai/gpt-oss-*)."""
    quant = getattr(config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant if isinstance(quant, dict) else {}
    return str(quant.get("quant_method", "")).lower() == "mxfp4"


def _mxfp4_expert_weights(model) -> set[int]:
    """ids of the expert weights an MXFP4 checkpoint stores as blocks + scales: gpt-oss's split experts."""
    from finetune.model.experts import RoutedExperts

    return {id(linear.weight) for module in model.modules()
            if isinstance(module, RoutedExperts) and getattr(module, "family", "") == "gpt_oss"
            for expert in module for linear in expert.children() if hasattr(linear, "weight")}


def mxfp4_bytes(numel: int) -> int:
    """Bytes of `numel` values in MXFP4: two e2m1 values a byte (`*_blocks`) and one e8m0 scale per 32 (`*_scales`)."""
    return numel // 2 + -(-numel // 32)


def _stored_dtype_bytes(config) -> int:
    """Bytes per value of the checkpoint as config.json states it (`dtype`, formerly `torch_dtype`, which transformers
    reads into `dtype`: asking for `torch_dtype` only logs its deprecation); 0 if unstated."""
    dtype = getattr(config, "dtype", None)
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 0) if dtype is not None else 0


def generic_facts(config, recipe, *, name: str = "", fsdp_version: int = 2, lora_bytes: int = 4) -> ModelFacts:
    """A Llama-shaped estimate from the config's sizes (attention q/k/v/o, gated MLP, two norms per layer)."""
    get = _config_getter(config)
    hidden = get("hidden_size") or get("n_embd") or get("d_model")
    layers = get("num_hidden_layers") or get("n_layer") or get("num_layers")
    vocab = get("vocab_size")
    if not (hidden and layers and vocab):
        raise PlanError(
            f"model `{name}`: its config has no hidden_size / num_hidden_layers / vocab_size (or n_embd / n_layer), so not "
            "even a generic estimate is possible. Fix: point model.name_or_path at a causal LM whose config.json has them."
        )
    heads = get("num_attention_heads") or get("n_head") or max(1, hidden // 128)
    kv_dim = (get("num_key_value_heads") or heads) * (get("head_dim") or hidden // heads)
    inter = get("intermediate_size") or get("n_inner") or 4 * hidden
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_dim, hidden), "self_attn.v_proj": (kv_dim, hidden),
              "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    config_dict = {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab, "num_attention_heads": heads,
                   "intermediate_size": inter, "tie_word_embeddings": bool(get("tie_word_embeddings", False))}
    model = _generic_meta_model(shapes, layers, vocab, hidden, config_dict["tie_word_embeddings"])
    fake_config = argparse.Namespace(**config_dict, num_key_value_heads=kv_dim // (hidden // heads), head_dim=hidden // heads,
                                     model_type=get("model_type", "unknown"), name_or_path=name)
    facts = _facts_from_model(model, fake_config, recipe, name=name, fsdp_version=fsdp_version, lora_bytes=lora_bytes)
    facts.generic = True
    return facts


def _config_getter(config):
    """get(key, default) of a config (a dict or an object): a multimodal one's text config (its language model's sizes);
    a number that differs per layer (`_layer_configs`), the largest layer's."""
    if isinstance(config, dict):
        text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        return lambda key, default=None: text.get(key, default)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(key, default=None):
        values = [value for layer in _layer_configs(text) if (value := getattr(layer, key, None)) is not None]
        return max(values) if values else default

    return get


def _generic_meta_model(shapes: dict, layers: int, vocab: int, hidden: int, tied: bool):
    """A Llama-shaped module tree on the meta device (no storage), named like transformers' models."""
    import torch
    from torch import nn

    class GenericCausalLM(nn.Module):
        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    def block() -> nn.Module:
        layer = nn.Module()
        for key, (out_f, in_f) in shapes.items():
            group, proj = key.split(".")
            if not hasattr(layer, group):
                layer.add_module(group, nn.Module())
            getattr(layer, group).add_module(proj, nn.Linear(in_f, out_f, bias=False))
        layer.input_layernorm = nn.Parameter(torch.empty(hidden))
        layer.post_attention_layernorm = nn.Parameter(torch.empty(hidden))
        return layer

    with torch.device("meta"):
        root = GenericCausalLM()
        root.model = nn.Module()
        root.model.embed_tokens = nn.Embedding(vocab, hidden)
        root.model.layers = nn.ModuleList([block() for _ in range(layers)])
        root.model.norm = nn.Parameter(torch.empty(hidden))
        root.lm_head = nn.Linear(hidden, vocab, bias=False)
    if tied:
        root.lm_head.weight = root.model.embed_tokens.weight
    return root


def model_config_for(recipe):
    """The model's config: stored architecture numbers first (offline), else the local folder or the hub."""
    from finetune import hub
    from finetune import model as model_stage
    from finetune.model.architectures import stored_config, stored_names

    name = recipe.model.name_or_path
    if not model_stage.is_local(name):
        stored = stored_config(name)
        if stored is not None:
            return stored
    try:
        return model_stage.load_config(recipe)
    except FinetuneError as exc:
        # A hub id missing from the cache while the hub did not answer: finetune itself read the cache only
        # (finetune/hub.py), so the loader's "HF_HUB_OFFLINE is set" is not why.
        unreachable = not model_stage.is_local(name) and not recipe.model.gguf_file and hub.unreachable_and_not_cached(
            name, revision=recipe.model.revision)
        problem = f"model.name_or_path `{name}`: cannot load the config: {hub.unreachable_fix(name)}" if unreachable else exc
        raise PlanError(f"{problem} The planner also has stored numbers for: {', '.join(stored_names())}.") from None
