"""Memory planner: per-GPU memory of a QLoRA recipe for every strategy, from the model's config alone.

    finetune plan RECIPE [overrides] --gpus 2 --gpu-memory 24GiB [--nodes 1] [--cpu-memory 128GiB] [--json]
    python -m finetune.planner --library-table

How it counts (docs/planner.md has the derivations and the checks against published figures):
  * parameters, tensor by tensor, from the model built on the meta device (no weights): every nn.Linear except
    the LM head becomes a packed NF4 tensor of (n + 1) // (2 * itemsize) storage elements, plus its quantization
    state (one absmax per 64 weights: uint8 with double quant plus an fp32 absmax per 256 blocks, else fp32);
    embeddings, LM head, norms and biases stay in model.dtype; LoRA A/B per target in fp32 (every strategy);
  * sharding exactly as torch does it: FSDP2 chunks every tensor along dim 0, FSDP1 pads each unit's flat
    parameter to a multiple of the world size; the quantization state is not a parameter, so every rank holds all of it;
  * gradients and AdamW state (two moments) for the LoRA parameters, sharded like them, on the CPU with offload;
  * activations per token and decoder layer, by kind (what autograd saves: fp32 norm inputs, attention q/k/v/out and
    the SDPA mask, MLP intermediates, the LoRA inputs and rank-r projections), all layers without checkpointing,
    layer inputs + one recomputed layer with it; the loss as finetune/loss.py makes it (one chunk of logits at 12
    bytes per logit, the kept gradient of the hidden states). benchmarks/memory_breakdown.py measures each kind;
    docs/benchmarks.md has the comparison;
  * framework overhead: CUDA context + cuBLAS workspace, and allocator fragmentation;
  * DeepSpeed ZeRO-3 / ZeRO-2 (`zero_parts`): the memory model of FSDP full shard / shard-grad-op, partitioned per
    tensor (each padded to the world size), plus what DeepSpeed adds: tensors under stage3_param_persistence_threshold
    stay whole on every rank, the prefetch bucket of gathered parameters, the gradient reduce bucket, and an fp32
    master copy of the LoRA weights. Listed for comparison; `strategy: auto` never picks an optional engine.
An architecture transformers cannot build gets a generic Llama-shaped estimate, labelled as such.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Literal

from finetune.engine_deepspeed import BUCKET_ELEMENTS
from finetune.errors import FinetuneError

GiB = 1024**3
GB = 1000**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCK = 64  # weights per absmax
NESTED_BLOCK = 256  # absmax values per fp32 second-level absmax (double quant)
CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # CUDA context + cuBLAS/NCCL workspaces: outside torch's allocator statistics
FRAGMENTATION = 0.05  # caching-allocator slack over the dynamic (activation + transient) part
SAFETY_MARGIN = 0.05  # a plan "fits" when its peak is at most 95% of the GPU
LOSS_BYTES_PER_LOGIT = 12  # per logit of a loss chunk: fp32 logits, log-softmax, its gradient (measured 12.1-12.4, benchmarks/memory_breakdown.py)
StrategyName = Literal["single", "ddp", "fsdp", "layer_split"]
# DeepSpeed's ZeRO-3 default persistence threshold (0.19) and finetune's bucket sizes, in elements.
ZERO_PERSISTENCE_THRESHOLD = 100_000
ZERO_PREFETCH_BUCKET = ZERO_REDUCE_BUCKET = BUCKET_ELEMENTS


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
    eager_attention: bool = False  # scores of size seq x seq are kept (attention softcapping)
    extra_norms: int = 0  # norms per layer beyond the usual two (Gemma 2 has four)
    notes: list[str] = field(default_factory=list)

    def total_bytes(self, *, trainable: bool | None = None) -> int:
        return sum(t.nbytes for t in self.tensors if trainable is None or t.trainable == trainable)

    def unit_bytes(self, unit_prefix: str) -> int:
        return sum(t.nbytes for t in self.tensors if t.unit == unit_prefix)

    @property
    def trainable_numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.trainable)


def _lora_targets(name: str, is_output: bool, target_modules) -> bool:
    """PEFT's matching: `all-linear` is every Linear but the output layer; a list matches the name's suffix."""
    if target_modules == "all-linear":
        return not is_output
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _layers_list(model) -> tuple[str, int]:
    """Dotted name and length of the longest ModuleList (the decoder layers)."""
    from torch import nn

    lists = [(n, len(m)) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "", 0
    return max(lists, key=lambda item: item[1])


def _unit_of(name: str, layers_path: str) -> str:
    match = re.match(re.escape(layers_path) + r"\.(\d+)\.", name) if layers_path else None
    return f"layer{match.group(1)}" if match else "root"


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
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001  (any architecture transformers cannot build: estimate, never crash)
        facts = generic_facts(config, recipe, name=name, fsdp_version=fsdp_version, lora_bytes=lora_bytes)
        facts.notes.append(f"generic estimate: the architecture could not be built ({type(exc).__name__}: {str(exc)[:120]})")
        return facts
    return _facts_from_model(model, config, recipe, name=name, fsdp_version=fsdp_version, lora_bytes=lora_bytes)


def _facts_from_model(model, config, recipe, *, name: str, fsdp_version: int, lora_bytes: int = 4) -> ModelFacts:
    from torch import nn

    dtype_bytes = DTYPE_BYTES[recipe.model.dtype]
    quantized = recipe.quantization.method != "none"
    storage_bytes = DTYPE_BYTES[recipe.quantization.quant_storage or recipe.model.dtype]
    layers_path, num_layers = _layers_list(model)
    output = model.get_output_embeddings()
    tensors: list[Tensor] = []
    qstate = 0
    lora_inputs: list[tuple[str, int]] = []
    linear_weights = {id(m.weight): (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unit_load: dict[str, int] = {}
    for pname, param in model.named_parameters():
        unit = _unit_of(pname, layers_path)
        unit_load[unit] = unit_load.get(unit, 0) + param.numel() * dtype_bytes  # as read, before quantization
        owner = linear_weights.get(id(param))
        is_output = owner is not None and owner[1] is output
        if owner is not None and quantized and not is_output:
            numel = param.numel()
            tensors.append(Tensor(pname, (numel + 1) // (2 * storage_bytes), 1, storage_bytes, False, unit))
            qstate += quant_state_bytes(numel, double_quant=recipe.quantization.double_quant)
        else:
            shape = tuple(param.shape) or (1,)
            tensors.append(Tensor(pname, shape[0], math.prod(shape[1:]), dtype_bytes, False, unit))
        if owner is not None and _lora_targets(owner[0], is_output, recipe.lora.target_modules):
            module, r = owner[1], recipe.lora.r
            tensors.append(Tensor(f"{owner[0]}.lora_A", r, module.in_features, lora_bytes, True, f"lora:{owner[0]}.A"))
            tensors.append(Tensor(f"{owner[0]}.lora_B", module.out_features, r, lora_bytes, True, f"lora:{owner[0]}.B"))
            if unit == "layer0":
                lora_inputs.append((owner[0].rsplit(".", 1)[-1], module.in_features))
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attn_impl = recipe.model.attn_implementation
    facts = ModelFacts(
        name=name or getattr(config, "name_or_path", "") or "model", model_type=getattr(config, "model_type", "?"),
        generic=False, num_layers=num_layers, hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size), vocab=config.vocab_size,
        heads=heads, kv_dim=kv_heads * head_dim, dtype_bytes=dtype_bytes, tensors=tensors, quant_state_bytes=qstate,
        lora_inputs=lora_inputs, lora_rank=recipe.lora.r, unit_load_bytes=max(unit_load.values(), default=0),
        eager_attention=attn_impl == "eager" or (bool(getattr(config, "attn_logit_softcapping", None)) and attn_impl != "flash_attention_2"),
        extra_norms=2 if getattr(config, "model_type", "") in ("gemma2", "gemma3", "gemma3_text") else 0,
    )
    if not layers_path:
        facts.notes.append("no decoder layer list found: FSDP units and layer split are approximate")
    return facts


def generic_facts(config, recipe, *, name: str = "", fsdp_version: int = 2, lora_bytes: int = 4) -> ModelFacts:
    """A Llama-shaped estimate from the config's sizes (attention q/k/v/o, gated MLP, two norms per layer)."""
    get = (lambda key, default=None: config.get(key, default)) if isinstance(config, dict) else \
        (lambda key, default=None: getattr(config, key, default))
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


# -------------------------------------------------------------------------------------------- per-rank bytes
def held_parameter_bytes(facts: ModelFacts, *, strategy: str, world_size: int, rank: int = 0,
                         fsdp_version: int = 2, persistence_threshold: int = ZERO_PERSISTENCE_THRESHOLD) -> dict[str, int]:
    """Parameter bytes one rank holds after wrapping, split frozen / trainable: what parallel.local_parameter_bytes reports.

    FSDP2 shards every tensor along dim 0 in torch.chunk pieces (the last ranks may get fewer rows); FSDP1 flattens
    each unit (decoder layer, LoRA leaf, root) into one tensor padded to a multiple of the world size. ZeRO-3
    partitions each tensor flat (numel / world, padded), except those under its persistence threshold.
    """
    held = {"frozen_bytes": 0, "trainable_bytes": 0}
    key = lambda t: "trainable_bytes" if t.trainable else "frozen_bytes"
    if strategy == "zero3" and world_size > 1:
        for t in facts.tensors:
            whole = t.numel < persistence_threshold
            held[key(t)] += t.nbytes if whole else math.ceil(t.numel / world_size) * t.elem_bytes
        return held
    if strategy != "fsdp" or world_size == 1:
        for t in facts.tensors:
            held[key(t)] += t.nbytes
        return held
    if fsdp_version == 2:
        for t in facts.tensors:
            chunk = math.ceil(t.rows / world_size)
            rows = max(0, min(chunk, t.rows - rank * chunk))
            held[key(t)] += rows * t.row_elems * t.elem_bytes
        return held
    units: dict[tuple[str, bool], list[int]] = {}
    for t in facts.tensors:
        entry = units.setdefault((t.unit, t.trainable), [0, t.elem_bytes])
        entry[0] += t.numel
    for (_, trainable), (numel, elem_bytes) in units.items():
        held["trainable_bytes" if trainable else "frozen_bytes"] += math.ceil(numel / world_size) * elem_bytes
    return held


def zero_parts(facts: ModelFacts, *, stage: int, world_size: int,
               persistence_threshold: int = ZERO_PERSISTENCE_THRESHOLD) -> dict[str, int]:
    """base / LoRA+optimizer / gathered bytes per GPU under DeepSpeed ZeRO-`stage` (same columns as FSDP's).

    ZeRO-3 partitions every tensor on its own (numel / world, padded), except those under the persistence threshold,
    which stay whole (norms; LoRA A/B of rank r x 4096 = 65k elements at r 16: whole too). Gathered: the largest
    tensor (embedding or LM head, gathered alone) + one decoder layer + the prefetch bucket. ZeRO-2 keeps every
    parameter whole like DDP and partitions the fp32 master copy, gradients and AdamW moments (16 bytes per LoRA
    element / world); both hold one gradient reduce bucket (fp32).
    """
    held = held_parameter_bytes(facts, strategy=f"zero{stage}", world_size=world_size,
                                persistence_threshold=persistence_threshold)
    frozen, trainable = held["frozen_bytes"], held["trainable_bytes"]
    lora_numel = facts.trainable_numel
    optimizer = math.ceil(16 * lora_numel / world_size)  # fp32 master + gradient + two AdamW moments, partitioned
    reduce_bucket = 4 * min(ZERO_REDUCE_BUCKET, lora_numel)
    gathered = reduce_bucket
    if stage == 3:
        layer_unit, _ = _unit_sizes(facts)
        largest = max(t.nbytes for t in facts.tensors)
        gathered += largest + layer_unit + min(ZERO_PREFETCH_BUCKET * facts.dtype_bytes, layer_unit)
    return {"base": frozen, "lora_grads_adamw": trainable + optimizer, "fsdp_unsharded": gathered}


def activation_parts_per_token_layer(facts: ModelFacts, recipe, *, seq_len: int, dropout_mask_bytes: int = 1) -> dict[str, int]:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing), by kind.

    norms: fp32 copies of the norm inputs (RMSNorm upcasts); attention: q/k/v/out and the log-sum-exp (+ seq x seq
    scores when attention is eager); mlp: the three MLP intermediates; lora: per LoRA target the input cast to the LoRA
    dtype (+ dropout mask) and the rank-r output. The 4-bit matmul saves only its weight (bitsandbytes' MatMul4Bit).
    With a mask (padded micro-batches, packed rows; not flash-attention, which takes sequence lengths), transformers'
    sdpa path repeats k/v to every query head (no GQA kernel with a mask) and SDPA keeps its own copy of the
    (batch, 1, seq, seq) mask in each layer. SDPA's output is what o_proj reads: saved once, under attention.
    With the fused LoRA path (lora.fused, finetune/lora_fused.py) a target keeps the layer input in model.dtype,
    shared by the targets that read the same tensor (q/k/v, gate/up), and its rank-r projection; no fp32 copy, no
    dropout mask. (FSDP1 and ZeRO-3 fall back to PEFT's forward at run time; the estimate counts the fused path for
    them too.) benchmarks/memory_breakdown.py measures the same kinds with autograd's saved-tensor hooks.
    `dropout_mask_bytes`: PEFT's dropout mask per element; 1 on GPUs (CUDA's fused dropout keeps a bool mask), the
    LoRA dtype's size on CPU (torch multiplies by a mask of the input's dtype there).
    """
    a = facts.dtype_bytes
    lora_bytes = 4 if a == 2 else a
    dropout = recipe.lora.dropout > 0
    flash = recipe.model.attn_implementation.startswith("flash")
    masked = not flash and (recipe.data.packing or recipe.train.micro_batch_size > 1)
    kv = facts.hidden if masked and not facts.eager_attention else facts.kv_dim
    parts = {"norms": (2 + facts.extra_norms) * 4 * facts.hidden,
             "attention": a * (2 * facts.hidden + 2 * kv) + 4 * facts.heads + (a * seq_len if masked else 0)
             + (3 * a * facts.heads * seq_len if facts.eager_attention else 0),  # scores, capped scores, probabilities
             "mlp": 3 * a * facts.intermediate, "lora": 0}
    # o_proj's input is the attention output (saved there) unless eager attention makes a transposed copy.
    shared_inputs: set[str] = set() if facts.eager_attention else {"o_proj"}
    for target, in_features in facts.lora_inputs:
        group = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}.get(target, target)
        if getattr(recipe.lora, "fused", False):
            parts["lora"] += a * facts.lora_rank + (0 if group in shared_inputs else a * in_features)
            shared_inputs.add(group)
            continue
        if lora_bytes == a and not dropout and group in shared_inputs:
            parts["lora"] += 4 * facts.lora_rank  # same input tensor as a sibling target: saved once
            continue
        shared_inputs.add(group)
        parts["lora"] += lora_bytes * in_features + (dropout_mask_bytes * in_features if dropout else 0) + 4 * facts.lora_rank
    return parts


def activation_bytes_per_token_layer(facts: ModelFacts, recipe, *, seq_len: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing): the sum of the parts above."""
    return sum(activation_parts_per_token_layer(facts, recipe, seq_len=seq_len).values())


@dataclass
class Estimate:
    """Peak memory of one strategy, per GPU, in bytes; `parts` says where it goes."""

    strategy: str
    label: str
    world_size: int
    parts: dict[str, int]
    cpu_bytes_per_node: int
    fits: bool = False
    margin_bytes: int = 0
    load_peak_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())


def _batch_terms(facts: ModelFacts, recipe, *, micro_batch: int, checkpointing: bool) -> dict[str, int]:
    """Activations and logits/loss buffers for one micro-batch at data.max_length."""
    seq = recipe.data.max_length
    tokens = micro_batch * seq
    per_layer = tokens * activation_bytes_per_token_layer(facts, recipe, seq_len=seq)
    if checkpointing:
        # Each layer keeps its input; backward recomputes one layer at a time (its activations + their grads).
        activations = facts.num_layers * tokens * facts.hidden * facts.dtype_bytes + int(1.5 * per_layer)
    else:
        activations = facts.num_layers * per_layer + int(0.5 * per_layer)
    return {"activations": activations, "logits_loss": loss_bytes(tokens, facts)}


def loss_bytes(tokens: int, facts: ModelFacts) -> int:
    """Memory of the loss as finetune/loss.py computes it: one chunk of fp32 logits at a time (never the full
    batch x length x vocabulary), plus the fp32 gradient w.r.t. the hidden states of every trained position, kept for
    backward (all positions counted: an upper bound, instruction data trains only the answers)."""
    from finetune.loss import CHUNK_LOGIT_ELEMENTS

    chunk_tokens = min(tokens, max(16, CHUNK_LOGIT_ELEMENTS // max(1, facts.vocab)))
    return LOSS_BYTES_PER_LOGIT * chunk_tokens * facts.vocab + 4 * tokens * facts.hidden


def _unit_sizes(facts: ModelFacts) -> tuple[int, int]:
    """(bytes of the largest decoder-layer unit incl. its LoRA, bytes of the root unit), unsharded."""
    layers: dict[str, int] = {}
    root = 0
    for t in facts.tensors:
        if t.unit.startswith("layer"):
            layers[t.unit] = layers.get(t.unit, 0) + t.nbytes
        elif t.unit.startswith("lora:"):
            match = re.search(r"\.(\d+)\.", t.unit)
            if match:
                layers[f"layer{match.group(1)}"] = layers.get(f"layer{match.group(1)}", 0) + t.nbytes
            else:
                root += t.nbytes
        else:
            root += t.nbytes
    return (max(layers.values()) if layers else 0), root


# ------------------------------------------------------------------------------------------------ strategies
STRATEGIES: dict[str, str] = {
    "single": "single GPU",
    "ddp": "DDP",
    "fsdp": "FSDP full shard",
    "fsdp_grad_op": "FSDP shard-grad-op",
    "fsdp_offload": "FSDP + CPU offload",
    "layer_split": "layer split",
    "zero3": "DeepSpeed ZeRO-3",
    "zero2": "DeepSpeed ZeRO-2",
}

PROCESS_CPU_BYTES = 3 * GiB  # python + torch + CUDA host libraries + tokenizer/data, per process


@dataclass
class Hardware:
    gpus_per_node: int
    gpu_memory_bytes: int
    nodes: int = 1
    cpu_memory_bytes: int | None = None

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def estimate(facts: ModelFacts, recipe, key: str, hw: Hardware, *, micro_batch: int | None = None,
             per_rank_full_load: bool | None = None) -> Estimate:
    """Peak bytes per GPU of strategy `key` (a STRATEGIES key) for the recipe's micro-batch and sequence length.

    Loading counts too (`_load_peak`): FSDP strategies load sharded (parallel.sharded_loading, the default), the others
    load a full copy per rank. `per_rank_full_load`: True counts a full copy for every strategy (the v1 loader),
    False leaves loading out (training peak only).
    """
    world = {"single": 1, "layer_split": 1}.get(key, hw.total_gpus)
    devices = hw.gpus_per_node if key == "layer_split" else 1
    fsdp = key.startswith("fsdp")
    offload = key == "fsdp_offload"
    checkpointing = recipe.parallel.activation_checkpointing
    checkpointing = recipe.train.gradient_checkpointing if checkpointing is None else checkpointing
    batch = _batch_terms(facts, recipe, micro_batch=micro_batch or recipe.train.micro_batch_size, checkpointing=checkpointing)
    held = held_parameter_bytes(facts, strategy="fsdp" if fsdp else key, world_size=world)
    layer_unit, root_unit = _unit_sizes(facts)
    parts = {
        "base": 0 if offload else (held["frozen_bytes"] - root_unit) // devices + root_unit if key == "layer_split"
        else 0 if offload else held["frozen_bytes"],
        "quant_state": facts.quant_state_bytes // devices,
        "lora_grads_adamw": 0 if offload else 4 * held["trainable_bytes"] // devices + (held["trainable_bytes"] if key == "ddp" else 0),
        "fsdp_unsharded": 0,
        "activations": batch["activations"] // devices,
        "logits_loss": batch["logits_loss"],  # on the last device under layer split
    }
    if key.startswith("zero"):
        parts.update(zero_parts(facts, stage=int(key[-1]), world_size=world))
    if fsdp:
        # Full shard: the root unit (embeddings, head) stays gathered; two layer units in flight (current + prefetch).
        # Shard-grad-op keeps every gathered unit until backward ends: the whole model, unsharded.
        parts["fsdp_unsharded"] = facts.total_bytes() if key == "fsdp_grad_op" else root_unit + 2 * layer_unit
    dynamic = parts["activations"] + parts["logits_loss"] + parts["fsdp_unsharded"]
    parts["overhead"] = CUDA_CONTEXT_BYTES + int(FRAGMENTATION * dynamic)
    result = Estimate(key, STRATEGIES[key], world if key != "layer_split" else devices, parts,
                      cpu_bytes_per_node=_cpu_bytes_per_node(facts, key, hw, held))
    sharded = fsdp and recipe.parallel.sharded_loading and not recipe.lora.dora and not per_rank_full_load
    load_peak = 0 if per_rank_full_load is False else _load_peak(facts, key, devices, world, sharded=sharded)
    result.load_peak_bytes = load_peak
    usable = int(hw.gpu_memory_bytes * (1 - SAFETY_MARGIN))
    result.margin_bytes = usable - max(result.peak_bytes, load_peak)
    result.fits = result.margin_bytes >= 0
    if load_peak > result.peak_bytes:
        how = ("its shard + one layer being quantized + the quant state" if sharded
               else "each rank quantizes a full copy of the base on its GPU")
        result.notes.append(f"loading needs {_gib(load_peak)} per GPU ({how})")
    if hw.cpu_memory_bytes and result.cpu_bytes_per_node > hw.cpu_memory_bytes:
        result.fits = False
        result.notes.append(f"needs {_gib(result.cpu_bytes_per_node)} CPU RAM per node, {_gib(hw.cpu_memory_bytes)} available")
    return result


def _load_peak(facts: ModelFacts, key: str, devices: int, world: int, *, sharded: bool) -> int:
    """GPU bytes while loading.

    Per-rank loader: the whole 4-bit base and its quant state + the largest tensor before quantization.
    Sharded loading (finetune/loading.py): this rank's shard (none on the GPU with CPU offload) + the quant state
    (not a parameter: whole on every rank) + the largest unit as read in model.dtype (a layer, or the embeddings
    and LM head), which is built and quantized on the GPU and then sharded.
    """
    if sharded:
        shard = 0 if key == "fsdp_offload" else facts.total_bytes(trainable=False) // world
        return shard + facts.quant_state_bytes + facts.unit_load_bytes + CUDA_CONTEXT_BYTES
    largest = max(t.numel for t in facts.tensors) * facts.dtype_bytes
    frozen = facts.total_bytes(trainable=False) + facts.quant_state_bytes
    return frozen // devices + largest + CUDA_CONTEXT_BYTES


def _cpu_bytes_per_node(facts: ModelFacts, key: str, hw: Hardware, held: dict[str, int]) -> int:
    """CPU RAM per node: each process's runtime + one tensor being loaded, plus offloaded shards and optimizer."""
    processes = 1 if key in ("single", "layer_split") else hw.gpus_per_node
    largest = max(t.numel for t in facts.tensors) * facts.dtype_bytes
    per_process = PROCESS_CPU_BYTES + 2 * largest
    if key == "fsdp_offload":
        per_process += held["frozen_bytes"] + 4 * held["trainable_bytes"]
    return processes * per_process


def estimates_for(facts: ModelFacts, recipe, hw: Hardware, **kwargs) -> list[Estimate]:
    """Every strategy that this hardware can run (DDP/FSDP need 2+ GPUs, layer split 2+ GPUs in one node)."""
    keys = ["single"]
    if hw.total_gpus > 1:
        keys += ["ddp", "fsdp", "fsdp_grad_op", "fsdp_offload", "zero3", "zero2"]
    if hw.gpus_per_node > 1:
        keys.append("layer_split")
    return [estimate(facts, recipe, key, hw, **kwargs) for key in keys]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def format_table(estimates: list[Estimate], hw: Hardware) -> str:
    """Fixed-width table: one row per strategy, the parts of the peak, margin and verdict."""
    head = ["strategy", "GPUs", "base", "qstate", "LoRA+opt", "gathered", "activ.", "logits", "overhead", "peak/GPU",
            "load/GPU", "CPU/node", "margin", "fits"]
    rows = []
    for e in estimates:
        p = e.parts
        cells = [p["base"], p["quant_state"], p["lora_grads_adamw"], p["fsdp_unsharded"], p["activations"],
                 p["logits_loss"], p["overhead"], e.peak_bytes, e.load_peak_bytes, e.cpu_bytes_per_node]
        verdict = "yes" if e.fits else "NO"
        rows.append([e.label, str(e.world_size), *[f"{c / GiB:.1f}" for c in cells], f"{e.margin_bytes / GiB:+.1f}", verdict])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    notes = [f"  {e.label}: {n}" for e in estimates for n in e.notes]
    unit = f"GiB per GPU; {hw.total_gpus} x {_gib(hw.gpu_memory_bytes)}, fits = peak <= {100 - SAFETY_MARGIN * 100:.0f}% of a GPU"
    return "\n".join([*lines, f"({unit})", *notes])


# ------------------------------------------------------------------------------------------------- decision
@dataclass
class Decision:
    """The planner's choice for `parallel.strategy: auto`, with the figures behind it."""

    strategy: StrategyName
    cpu_offload: bool
    reshard_after_forward: bool
    fits: bool
    table: str
    summary: str
    max_micro_batch: int = 0
    estimates: list[Estimate] = field(default_factory=list)
    generic: bool = False


_PREFERENCE = ["ddp", "fsdp", "fsdp_offload", "layer_split"]  # the order: DDP, else FSDP, else offload


def choose(estimates: list[Estimate], hw: Hardware) -> Estimate:
    """DDP when the model fits on one GPU (single with one GPU), else FSDP, else FSDP + offload, else layer split.

    When nothing fits, the strategy with the smallest deficit, so its figures say how far off it is.
    """
    by_key = {e.strategy: e for e in estimates}
    order = ["single"] if hw.total_gpus == 1 else _PREFERENCE
    for key in order:
        if key in by_key and by_key[key].fits:
            return by_key[key]
    candidates = [by_key[k] for k in order if k in by_key] or estimates
    return max(candidates, key=lambda e: e.margin_bytes)


def largest_micro_batch(facts: ModelFacts, recipe, key: str, hw: Hardware, *, limit: int = 512, **kwargs) -> int:
    """The largest micro-batch at data.max_length for which strategy `key` fits (0: not even 1)."""
    fits = lambda b: estimate(facts, recipe, key, hw, micro_batch=b, **kwargs).fits
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def decide(recipe, model_config, *, gpus_per_node: int, gpu_memory_bytes: int, nodes: int = 1,
           cpu_memory_bytes: int | None = None, per_rank_full_load: bool | None = None) -> Decision:
    """Choose the strategy for `parallel.strategy: auto` from the model's config and the GPUs present."""
    hw = Hardware(gpus_per_node, gpu_memory_bytes, nodes, cpu_memory_bytes)
    fsdp_version = recipe.parallel.fsdp_version or 2
    facts = facts_from_config(model_config, recipe, name=recipe.model.name_or_path, fsdp_version=fsdp_version)
    estimates = estimates_for(facts, recipe, hw, per_rank_full_load=per_rank_full_load)
    chosen = choose(estimates, hw)
    strategy: StrategyName = "fsdp" if chosen.strategy.startswith("fsdp") else chosen.strategy  # type: ignore[assignment]
    max_batch = largest_micro_batch(facts, recipe, chosen.strategy, hw, per_rank_full_load=per_rank_full_load)
    decision = Decision(strategy=strategy, cpu_offload=chosen.strategy == "fsdp_offload",
                        reshard_after_forward=chosen.strategy != "fsdp_grad_op", fits=chosen.fits,
                        table=format_table(estimates, hw), summary="", max_micro_batch=max_batch, estimates=estimates,
                        generic=facts.generic)
    decision.summary = _summary(facts, recipe, chosen, max_batch, hw)
    return decision


def _summary(facts: ModelFacts, recipe, chosen: Estimate, max_batch: int, hw: Hardware) -> str:
    name = f"{facts.name} ({facts.model_type}{', GENERIC ESTIMATE: architecture not built' if facts.generic else ''})"
    shape = f"micro-batch {recipe.train.micro_batch_size} x {recipe.data.max_length} tokens"
    if chosen.fits:
        text = (f"{name}: {chosen.label} on {chosen.world_size} GPU(s) fits, {_gib(chosen.peak_bytes)} of "
                f"{_gib(hw.gpu_memory_bytes)} per GPU and {_gib(chosen.cpu_bytes_per_node)} of CPU RAM per node at "
                f"{shape}; largest micro-batch that fits: {max_batch}.")
    else:
        text = (f"{name}: nothing fits on {hw.total_gpus} x {_gib(hw.gpu_memory_bytes)} at {shape}; closest is "
                f"{chosen.label} at {_gib(chosen.peak_bytes)} per GPU ({_gib(-chosen.margin_bytes)} short).")
        if max_batch == 0:
            text += " Fix: lower data.max_length or train.micro_batch_size, turn on train.gradient_checkpointing, or add GPUs."
    return text + "".join(f" Note: {n}." for n in chosen.notes + facts.notes)


# ------------------------------------------------------------------------------------------------------ CLI
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": GiB, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": GB, "gb": GB, "gib": GiB, "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ki": 1024, "mi": 1024**2,
          "gi": GiB, "ti": 1024**4}


def parse_size(text: str, flag: str) -> int:
    """`24GiB`, `80GB`, `80G` (decimal), `24` (GiB) -> bytes; anything else is a PlanError naming the flag."""
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r}: not a memory size. Fix: write a number with a unit, e.g. {flag} 24GiB or "
                        f"{flag} 80GB (GB = 10^9 bytes, GiB = 2^30; a bare number means GiB).")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_count(text: str, flag: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise PlanError(f"{flag} {text!r}: expected a whole number of at least 1. Fix: e.g. {flag} 2.")
    return value


def model_config_for(recipe):
    """The model's config: stored architecture numbers first (offline), else the local folder or the hub."""
    from finetune.architectures import stored_config, stored_names

    name = recipe.model.name_or_path
    from finetune import model as model_stage

    if not model_stage.is_local(name):
        stored = stored_config(name)
        if stored is not None:
            return stored
    try:
        return model_stage.load_config(recipe)
    except FinetuneError as exc:
        raise PlanError(f"{exc} The planner also has stored numbers for: {', '.join(stored_names())}.") from None


def cli_plan(args: argparse.Namespace) -> int:
    """`finetune plan RECIPE [overrides] --gpus N --gpu-memory 24GiB --nodes M --cpu-memory 128GiB [--json]`."""
    from finetune.library import resolve_recipe_path
    from finetune.recipe import load_recipe

    gpus = parse_count(args.gpus, "--gpus")
    gpu_memory = parse_size(args.gpu_memory, "--gpu-memory")
    nodes = parse_count(args.nodes, "--nodes")
    cpu_memory = parse_size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None
    recipe = load_recipe(resolve_recipe_path(args.recipe), list(args.overrides))
    decision = decide(recipe, model_config_for(recipe), gpus_per_node=gpus, gpu_memory_bytes=gpu_memory, nodes=nodes,
                      cpu_memory_bytes=cpu_memory)
    if args.json:
        payload = asdict(decision)
        payload.pop("table")
        for item in payload["estimates"]:
            item["peak_bytes"] = sum(item["parts"].values())
        print(json.dumps(payload, indent=2))
    else:
        print(decision.table)
        print()
        print(decision.summary)
    return 0


# -------------------------------------------------------------------------------------------- library table
LIBRARY_HARDWARE = [("1x24 GB", 1, 24 * GB), ("2x24 GB", 2, 24 * GB), ("4x24 GB", 4, 24 * GB), ("8x24 GB", 8, 24 * GB),
                    ("4x48 GB", 4, 48 * GB), ("8x80 GB", 8, 80 * GB)]
TYPICAL_RECIPE = {"lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                  "data": {"max_length": 2048}, "train": {"micro_batch_size": 1, "gradient_checkpointing": True}}


def _library_entries() -> list[tuple[str, object]]:
    """(label, recipe) for every recipes/*.yaml, or a typical QLoRA recipe per stored architecture if there are none."""
    from pathlib import Path

    from finetune.architectures import stored_names
    from finetune.recipe import load_recipe, validate_recipe

    recipes_dir = Path(__file__).resolve().parent.parent / "recipes"
    entries = []
    for path in sorted(recipes_dir.glob("*.yaml")):
        try:
            entries.append((path.stem, load_recipe(path)))
        except FinetuneError as exc:
            print(f"skipped {path.name}: {str(exc).splitlines()[0]}", file=sys.stderr)
    if entries:
        return entries
    for name in stored_names():
        raw = {"model": {"name_or_path": name}, "data": {"datasets": [{"path": "train.jsonl"}]}}
        for section, values in TYPICAL_RECIPE.items():
            raw.setdefault(section, {}).update(values)
        entries.append((name, validate_recipe(raw, source=f"typical QLoRA recipe for {name}")))
    return entries


def library_table() -> str:
    """Markdown: for each library recipe, the strategy the planner picks on 1, 2, 4 and 8 x 24 GB, 4x48 and 8x80 GB
    (with CPU offload, the CPU RAM per machine too)."""
    header = "| recipe | model | " + " | ".join(label for label, _, _ in LIBRARY_HARDWARE) + " |"
    lines = [header, "|" + "---|" * (2 + len(LIBRARY_HARDWARE))]
    for label, recipe in _library_entries():
        try:
            config = model_config_for(recipe)
        except FinetuneError as exc:
            lines.append(f"| {label} | {recipe.model.name_or_path} | " + f"config not readable: {str(exc)[:60]} |")
            continue
        cells = []
        for _, gpus, memory in LIBRARY_HARDWARE:
            d = decide(recipe, config, gpus_per_node=gpus, gpu_memory_bytes=memory)
            chosen = next(e for e in d.estimates if STRATEGIES[e.strategy] in d.summary) if d.fits else None
            ram = f", {chosen.cpu_bytes_per_node / GiB:.0f} GiB RAM" if chosen and chosen.strategy == "fsdp_offload" else ""
            cells.append(f"{chosen.label}, {chosen.peak_bytes / GiB:.1f} GiB{ram}, mb<={d.max_micro_batch}" if chosen
                         else "does not fit")
        lines.append(f"| {label} | {recipe.model.name_or_path} | " + " | ".join(cells) + " |")
    shape = "micro-batch 1 x 2048 tokens, LoRA r=16 all-linear, gradient checkpointing"
    lines.append(f"\nPeak per GPU at the recipe's shape ({shape} for the typical recipe), loading included; with CPU "
                 "offload, the CPU RAM the machine needs; mb<=N: largest micro-batch that fits.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--library-table", action="store_true", help="print the docs table for the recipe library")
    args = parser.parse_args(argv)
    if args.library_table:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # stored numbers or local folders only: never wait on the hub
        print(library_table())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
