"""The memory model: per-rank bytes of a QLoRA recipe for every strategy, the load peak and the CPU RAM.

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
    layer inputs + one recomputed layer with it; the loss as finetune/training/loss.py makes it (one chunk of logits at 12
    bytes per logit, the kept gradient of the hidden states). benchmarks/memory_breakdown.py measures each kind;
    docs/benchmarks.md has the comparison;
  * the step's peak: the largest of the moments of a step (the loss, the top and the bottom layer's backward, the
    optimizer step: `_step_terms`), not the sum of activations, loss and gradients, which are never alive together;
    checked op by op on 2-rank runs (tests/training/test_tensor_bytes.py);
  * what the caching allocator holds beyond tensors (allocator.py): the cuBLAS workspace, in the step and the load;
    the load's fp32 LoRA and the FSDP2 byte guard's float64 chunk; outside it: the CUDA context, and fragmentation;
  * DeepSpeed ZeRO-3 / ZeRO-2 (`zero_parts`): the memory model of FSDP full shard / shard-grad-op, partitioned per
    tensor (each padded to the world size), plus what DeepSpeed adds: tensors under stage3_param_persistence_threshold
    stay whole on every rank, the prefetch bucket of gathered parameters, the gradient reduce bucket, and an fp32
    master copy of the LoRA weights. Listed for comparison; `strategy: auto` never picks an optional engine.
An architecture transformers cannot build gets a generic Llama-shaped estimate, labelled as such.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from finetune.planner.allocator import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, largest_layer_lora, load_peak
from finetune.planner.facts import GiB, ModelFacts, gib
from finetune.planner.objectives import grpo_note, preference_note, swaps_reference, trained_together, with_generation
from finetune.planner.reads import DEFAULT_READ_BANDWIDTH, CheckpointReads, checkpoint_reads
from finetune.planner.shards import ZERO_PERSISTENCE_THRESHOLD, held_parameter_bytes
from finetune.recipe.objectives import spec_of

FRAGMENTATION = 0.05  # caching-allocator slack over the dynamic (activation + transient) part
SAFETY_MARGIN = 0.05  # a plan "fits" when its peak is at most 95% of the GPU
LOSS_BYTES_PER_LOGIT = 12  # per logit of a loss chunk: fp32 logits, log-softmax, its gradient (measured 12.1-12.4, benchmarks/memory_breakdown.py)


StrategyName = Literal["single", "ddp", "fsdp", "layer_split"]

# Sizes chosen for memory that the engines use as they are and the memory model counts: the loss works on chunks of
# at most CHUNK_LOGIT_ELEMENTS logits (finetune/training/loss.py), DeepSpeed's gather and reduce buckets hold
# BUCKET_ELEMENTS elements (finetune/parallel/zero.py). Defined here so that the model and the engines cannot drift.
CHUNK_LOGIT_ELEMENTS = 2**24
BUCKET_ELEMENTS = 50_000_000
ZERO_PREFETCH_BUCKET = ZERO_REDUCE_BUCKET = BUCKET_ELEMENTS


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


def activation_parts_per_token_layer(facts: ModelFacts, recipe, *, seq_len: int, dropout_mask_bytes: int = 1,
                                     lora_path: str | None = None) -> dict[str, int]:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing), by kind.

    norms: fp32 copies of the norm inputs (RMSNorm upcasts); attention: q/k/v/out and the log-sum-exp (+ seq x seq
    scores when attention is eager); mlp: the three MLP intermediates; lora: per LoRA target the input cast to the LoRA
    dtype (+ dropout mask) and the rank-r output. The 4-bit matmul saves only its weight (bitsandbytes' MatMul4Bit).
    With a mask (padded micro-batches, packed rows; not flash-attention, which takes sequence lengths), transformers'
    sdpa path repeats k/v to every query head (no GQA kernel with a mask) and SDPA keeps its own copy of the
    (batch, 1, seq, seq) mask in each layer. SDPA's output is what o_proj reads: saved once, under attention.
    With the fused LoRA path (lora.fused, finetune/model/lora/fused.py) a target keeps the layer input in model.dtype,
    shared by the targets that read the same tensor (q/k/v, gate/up), and its rank-r projection; no fp32 copy, no
    dropout mask. FSDP1 falls back to PEFT's forward at run time (its LoRA leaves gather in their own forward), in
    model.dtype (lora_path "peft_compute"); ZeRO-3 falls back too, and is still counted with the fused path.
    benchmarks/memory_breakdown.py measures the same kinds with autograd's saved-tensor hooks.
    `dropout_mask_bytes`: PEFT's dropout mask per element; 1 on GPUs (CUDA's fused dropout keeps a bool mask), the
    LoRA dtype's size on CPU (torch multiplies by a mask of the input's dtype there).
    `lora_path` (`lora_path_for`): "fused"; "peft" (PEFT's forward, its input cast to the fp32 master weights);
    "peft_compute" (PEFT's forward in model.dtype: under FSDP's mixed precision the weights it casts to are the
    gathered ones, in param_dtype, so no fp32 copy is made). Default: the recipe's lora.fused.
    """
    a = facts.dtype_bytes
    lora_path = lora_path or ("fused" if getattr(recipe.lora, "fused", False) else "peft")
    lora_bytes = 4 if a == 2 and lora_path == "peft" else a
    dropout = recipe.lora.dropout > 0
    flash = recipe.model.attn_implementation.startswith("flash")
    masked = not flash and (recipe.data.packing or recipe.train.micro_batch_size > 1)
    kv = facts.hidden if masked and not facts.eager_attention else facts.kv_dim
    parts = {"norms": (2 + facts.extra_norms) * 4 * facts.hidden,
             "attention": a * (2 * facts.hidden + 2 * kv) + 4 * facts.heads + (a * seq_len if masked else 0)
             + (3 * a * facts.heads * seq_len if facts.eager_attention else 0),  # scores, capped scores, probabilities
             "mlp": 3 * a * facts.intermediate, "lora": 0}
    top_k = facts.experts_per_token
    if top_k:  # a token's copy for each of its top-k experts, their three intermediates and routed output; the router's
        # fp32 logits and probabilities (every layer of a MoE model: dense layers between them are not modelled)
        parts["mlp"] = top_k * a * (3 * facts.expert_intermediate + 2 * facts.hidden) + 2 * 4 * facts.experts
    # o_proj's input is the attention output (saved there) unless eager attention makes a transposed copy.
    shared_inputs: set[str] = set() if facts.eager_attention else {"o_proj"}
    expert_targets = [(t.removeprefix("expert:"), n) for t, n in facts.lora_inputs if t.startswith("expert:")]
    if expert_targets:  # one expert's projections stand for the top-k experts each token reaches
        one_expert = dataclasses.replace(facts, lora_inputs=expert_targets, experts=0, experts_per_token=0)
        parts["lora"] += top_k * activation_parts_per_token_layer(one_expert, recipe, seq_len=seq_len,
                                                                  dropout_mask_bytes=dropout_mask_bytes)["lora"]
    for target, in_features in facts.lora_inputs:
        if target.startswith("expert:"):
            continue
        group = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp",
                 "w1": "mlp", "w3": "mlp"}.get(target, target)
        if lora_path == "fused":
            parts["lora"] += a * facts.lora_rank + (0 if group in shared_inputs else a * in_features)
            shared_inputs.add(group)
            continue
        if lora_bytes == a and not dropout and group in shared_inputs:
            parts["lora"] += 4 * facts.lora_rank  # same input tensor as a sibling target: saved once
            continue
        shared_inputs.add(group)
        parts["lora"] += lora_bytes * in_features + (dropout_mask_bytes * in_features if dropout else 0) + 4 * facts.lora_rank
    return parts


def activation_bytes_per_token_layer(facts: ModelFacts, recipe, *, seq_len: int, lora_path: str | None = None) -> int:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing): the sum of the parts above."""
    return sum(activation_parts_per_token_layer(facts, recipe, seq_len=seq_len, lora_path=lora_path).values())


def lora_path_for(recipe, key: str, *, fsdp_version: int = 2) -> str:
    """How the LoRA layers run under strategy `key` (see activation_parts_per_token_layer): FSDP1 always through PEFT's
    forward (finetune/model/lora/fused.py falls back there), in the compute dtype (finetune/parallel/wrapping.py keeps
    the inputs uncast); FSDP2 fused or PEFT's forward, in the compute dtype (the gathered LoRA weights are in
    param_dtype); every other strategy fused or PEFT's forward with its fp32 copies."""
    fsdp = key.startswith("fsdp") or key == "hsdp"
    if fsdp and fsdp_version == 1:
        return "peft_compute"
    if getattr(recipe.lora, "fused", False):
        return "fused"
    return "peft_compute" if fsdp else "peft"


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
    sharded_load: bool = False  # a rank loads its shard + one unit at a time, not a full copy of the base
    peak_moment: str = ""  # when in the step the peak is reached (`_step_terms`)
    gradient_bytes: int = 0  # of lora_grads_adamw: the gradients alive at the peak and DDP's buckets
    reads: CheckpointReads | None = None  # checkpoint bytes read at load per rank and per node, and the time
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def load_how(self) -> str:
        return ("its shard + one layer being quantized + the quant state" if self.sharded_load
                else "each rank quantizes a full copy of the base on its GPU")

    def needs(self, of: str = "") -> str:
        """What a GPU must hold, said whole: the training peak, or the load peak (named, with why) when it is larger;
        `of`: words after the figure ("of 22.4 GiB")."""
        if self.load_peak_bytes > self.peak_bytes:
            return (f"{gib(self.load_peak_bytes)}{of} per GPU to load ({self.load_how}; the training peak is "
                    f"{gib(self.peak_bytes)})")
        return f"{gib(self.peak_bytes)}{of} per GPU"


def _step_terms(facts: ModelFacts, recipe, *, micro_batch: int, checkpointing: bool, lora_path: str,
                gradients: int, layer_gradients: int, optimizer_temporary: int) -> dict[str, int]:
    """Activations, the loss and the gradients alive at the step's peak, for one micro-batch at data.max_length.

    They are not alive at the same moment, so the peak is the largest of four moments, not their sum (measured op by
    op on 2-rank runs, tests/training/test_tensor_bytes.py; the sum was 15-26% above the measured peak):
      * the loss (forward's end): every layer's saved activations (with checkpointing: every layer's input) + the loss
        chunk and the kept gradient of the hidden states. No gradient exists yet (zero_grad sets them to None);
      * backward of the top layer: the same saved activations + the layer recomputed (with checkpointing) and its
        gradients (1.5 x one layer's activations; 0.5 x without checkpointing, the layer's own are already counted)
        + that layer's gradients being reduced (`layer_gradients`); the loss is gone (its saved gradient was used first);
      * backward of the bottom layer: every gradient + that layer's activations and their gradients (1.5 x one layer).
        Between the two ends a layer's input is freed as its gradients are made: linear in the layer index, so the
        ends bound every layer;
      * the optimizer step: every gradient + AdamW's temporaries (`optimizer_temporary`).
    DPO: a pair is two sequences, the chosen and the rejected, in one forward; the reference pass runs without grad,
    one layer's activations at a time, which is below the backward's recomputation and adds nothing to the peak.
    """
    seq = recipe.data.max_length
    tokens = micro_batch * seq * (2 if spec_of(recipe.train.objective).pairs else 1)  # pairs: two sequences
    per_layer = tokens * activation_bytes_per_token_layer(facts, recipe, seq_len=seq, lora_path=lora_path)
    if checkpointing:
        saved, top = facts.num_layers * tokens * facts.hidden * facts.dtype_bytes, int(1.5 * per_layer)
    else:
        saved, top = facts.num_layers * per_layer, int(0.5 * per_layer)
    loss = loss_bytes(tokens, facts)
    moments = {"the loss": {"activations": saved, "logits_loss": loss, "gradients": 0},
               "the top layer's backward": {"activations": saved + top, "logits_loss": 0, "gradients": layer_gradients},
               "the bottom layer's backward": {"activations": int(1.5 * per_layer), "logits_loss": 0,
                                               "gradients": gradients + layer_gradients},
               "the optimizer step": {"activations": 0, "logits_loss": 0, "gradients": gradients + optimizer_temporary}}
    name, peak = max(moments.items(), key=lambda item: sum(item[1].values()))
    return {**peak, "moment": name}


def loss_bytes(tokens: int, facts: ModelFacts) -> int:
    """Memory of the loss as finetune/training/loss.py computes it: one chunk of fp32 logits at a time (never the full
    batch x length x vocabulary), plus the fp32 gradient w.r.t. the hidden states of every trained position, kept for
    backward (all positions counted: an upper bound, instruction data trains only the answers)."""

    chunk_tokens = min(tokens, max(16, CHUNK_LOGIT_ELEMENTS // max(1, facts.vocab)))
    return LOSS_BYTES_PER_LOGIT * chunk_tokens * facts.vocab + 4 * tokens * facts.hidden


def _unit_sizes(facts: ModelFacts, *, lora_elem_bytes: int | None = None) -> tuple[int, int]:
    """(bytes of the largest decoder-layer unit incl. its LoRA, bytes of the root unit), unsharded.

    `lora_elem_bytes`: bytes per LoRA element as gathered (FSDP's mixed precision casts the fp32 shards to param_dtype
    before the all-gather, so a gathered unit holds its LoRA in model.dtype); default: as stored."""
    layers: dict[str, int] = {}
    root = 0
    for t in facts.tensors:
        nbytes = t.numel * lora_elem_bytes if t.trainable and lora_elem_bytes else t.nbytes
        if t.unit.startswith("layer"):
            layers[t.unit] = layers.get(t.unit, 0) + nbytes
        elif t.unit.startswith("lora:"):
            match = re.search(r"\.(\d+)\.", t.unit)
            if match:
                layers[f"layer{match.group(1)}"] = layers.get(f"layer{match.group(1)}", 0) + nbytes
            else:
                root += nbytes
        else:
            root += nbytes
    return (max(layers.values()) if layers else 0), root


def _layer_lora_numel(facts: ModelFacts) -> int:
    """LoRA elements of one decoder layer (the largest)."""
    return largest_layer_lora(facts, lambda t: t.numel)


# ------------------------------------------------------------------------------------------------ strategies
STRATEGIES: dict[str, str] = {
    "single": "single GPU",
    "ddp": "DDP",
    "fsdp": "FSDP full shard",
    "fsdp_grad_op": "FSDP shard-grad-op",
    "fsdp_offload": "FSDP + CPU offload",
    "hsdp": "FSDP hybrid shard",
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
    read_bytes_per_s: float = DEFAULT_READ_BANDWIDTH  # one node's checkpoint storage (finetune plan --read-bandwidth)
    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_BYTES  # torch's default on sm90+ (allocator.cublas_workspace_bytes)

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def estimate(facts: ModelFacts, recipe, key: str, hw: Hardware, *, micro_batch: int | None = None,
             per_rank_full_load: bool | None = None) -> Estimate:
    """Peak bytes per GPU of strategy `key` (a STRATEGIES key) for the recipe's micro-batch and sequence length.

    Loading counts too (`_load_peak`): FSDP strategies load sharded (parallel.sharded_loading, the default), the others
    load a full copy per rank. `per_rank_full_load`: True counts a full copy for every strategy (the v1 loader),
    False leaves loading out (training peak only).

    Hybrid shard (HSDP): sharded over the GPUs of one node, replicated across nodes. A rank holds and loads what FSDP
    full shard over `gpus_per_node` ranks holds; the cross-node gradient all-reduce runs in place on the
    reduce-scattered shard, so it adds no memory.
    """
    world = {"single": 1, "layer_split": 1}.get(key, hw.total_gpus)
    devices = hw.gpus_per_node if key == "layer_split" else 1
    fsdp = key.startswith("fsdp") or key == "hsdp"
    shard_world = hw.gpus_per_node if key == "hsdp" else world
    offload = key == "fsdp_offload"
    checkpointing = next(c for c in (recipe.parallel.activation_checkpointing, recipe.train.gradient_checkpointing) if c is not None)
    held = held_parameter_bytes(facts, strategy="fsdp" if fsdp else key, world_size=shard_world,
                                fsdp_version=facts.fsdp_version)
    trainable = 0 if offload else held["trainable_bytes"] // devices
    micro_batch = micro_batch or recipe.train.micro_batch_size
    step = _step_terms(facts, recipe, micro_batch=trained_together(recipe, micro_batch),
                       checkpointing=checkpointing, lora_path=lora_path_for(recipe, key, fsdp_version=facts.fsdp_version),
                       gradients=trainable, layer_gradients=_layer_gradient_bytes(facts, key, shard_world),
                       optimizer_temporary=trainable)
    parts = _parts(facts, recipe, key, held=held, step=step, trainable=trainable, devices=devices, world=world)
    parts["cublas_workspace"] = hw.cublas_workspace_bytes  # the allocator's from the first matmul on (allocator.py)
    moment = step["moment"]
    if recipe.train.objective == "grpo":  # generating is a moment of its own (planner/objectives.py)
        parts, moment = with_generation(facts, recipe, key, parts, rows=micro_batch, step_gradients=step["gradients"],
                                        moment=moment)
    dynamic = parts["activations"] + parts["logits_loss"] + parts["fsdp_unsharded"] + parts.get("kv_cache", 0)
    parts["overhead"] = CUDA_CONTEXT_BYTES + int(FRAGMENTATION * dynamic)
    result = Estimate(key, STRATEGIES[key], world if key != "layer_split" else devices, parts,
                      cpu_bytes_per_node=_cpu_bytes_per_node(facts, key, hw, held))
    sharded = fsdp and recipe.parallel.sharded_loading and not recipe.lora.dora and not per_rank_full_load
    _loading(result, facts, recipe, key, hw, devices=devices, shard_world=shard_world, sharded=sharded,
             counted=per_rank_full_load is not False)
    result.peak_moment = moment
    result.gradient_bytes = (trainable if key == "ddp" else 0) + (step["gradients"] if moment != "generation" else 0)
    if recipe.train.objective == "grpo":
        result.notes.append(grpo_note(facts, recipe, key, moment=moment))
    if key == "hsdp":
        result.notes.append(f"sharded over the {hw.gpus_per_node} GPUs of a node, replicated across {hw.nodes} nodes "
                            "(parallel.hybrid_shard, or fsdp_sharding_strategy: HYBRID_SHARD): per-layer gathers stay "
                            "within a node")
    _verdict(result, recipe, hw, sharded=sharded)
    return result


def _parts(facts: ModelFacts, recipe, key: str, *, held: dict[str, int], step: dict, trainable: int, devices: int,
           world: int) -> dict[str, int]:
    """The parts of the step's peak (`estimate`), before the overhead."""
    offload = key == "fsdp_offload"
    _, root_unit = _unit_sizes(facts)
    parts = {
        "base": 0 if offload else (held["frozen_bytes"] - root_unit) // devices + root_unit if key == "layer_split"
        else 0 if offload else held["frozen_bytes"],
        "quant_state": facts.quant_state_bytes // devices,
        # LoRA weights and AdamW's two moments; DDP's gradient buckets (fp32, as large as the gradients, kept from
        # step to step); the gradients alive at the step's peak (`_step_terms`).
        "lora_grads_adamw": 3 * trainable + (trainable if key == "ddp" else 0) + step["gradients"],
        "fsdp_unsharded": 0,
        "activations": step["activations"] // devices,
        "logits_loss": step["logits_loss"],  # on the last device under layer split
    }
    if key.startswith("zero"):
        parts.update(zero_parts(facts, stage=int(key[-1]), world_size=world))
    if swaps_reference(recipe):  # the starting adapter's values kept, and the trained ones while they are swapped out
        parts["dpo_reference_copy"] = 2 * held["trainable_bytes"] // devices
    if key.startswith("fsdp") or key == "hsdp":
        parts["fsdp_unsharded"] = _gathered_bytes(facts, key)
    return parts


def _loading(result: Estimate, facts: ModelFacts, recipe, key: str, hw: Hardware, *, devices: int, shard_world: int,
             sharded: bool, counted: bool) -> None:
    """The load's peak (0 when not `counted`) and the checkpoint reads of each process."""
    result.load_peak_bytes = load_peak(facts, key, devices, shard_world, sharded=sharded,
                                       workspace_bytes=hw.cublas_workspace_bytes) if counted else 0
    own_shard = sharded and (recipe.parallel.fsdp_version or 2) == 2  # FSDP2 reads ranges; FSDP1 whole units
    result.reads = checkpoint_reads(facts, processes=shard_world, per_node=min(shard_world, hw.gpus_per_node),
                                    own_shard=own_shard, read_bytes_per_s=hw.read_bytes_per_s)


def _verdict(result: Estimate, recipe, hw: Hardware, *, sharded: bool) -> None:
    """Whether the estimate fits the GPU (training or loading peak) and the node's CPU RAM, with the notes that say why."""
    usable = int(hw.gpu_memory_bytes * (1 - SAFETY_MARGIN))
    result.margin_bytes = usable - max(result.peak_bytes, result.load_peak_bytes)
    result.fits = result.margin_bytes >= 0
    if note := preference_note(recipe):
        result.notes.append(note)
    result.sharded_load = sharded
    if result.load_peak_bytes > result.peak_bytes:
        result.notes.append(f"loading needs {gib(result.load_peak_bytes)} per GPU ({result.load_how})")
    if hw.cpu_memory_bytes and result.cpu_bytes_per_node > hw.cpu_memory_bytes:
        result.fits = False
        result.notes.append(f"needs {gib(result.cpu_bytes_per_node)} CPU RAM per node, {gib(hw.cpu_memory_bytes)} available")


def _gathered_bytes(facts: ModelFacts, key: str) -> int:
    """FSDP's unsharded units at the step's peak, with their LoRA in param_dtype (mixed precision casts the fp32 shards
    before the all-gather).

    Full shard: the root unit (embeddings, head) stays gathered. FSDP2: two decoder layers in flight, the current one
    and the next one's all-gather output (its backward prefetch is the next decoder layer). FSDP1: one. It prefetches
    the unit that ran before the current one in the forward, and finetune wraps every LoRA A/B as a unit of its own
    (finetune/parallel/wrapping.py), so before a decoder layer comes a LoRA leaf of the layer below (kB), not that
    layer; a layer is resharded when its backward ends, before the next one is recomputed. Both follow the execution
    order, not streams: the same on GPUs. Shard-grad-op keeps every gathered unit until backward ends: the whole
    model, unsharded.
    """
    if key == "fsdp_grad_op":
        return facts.total_bytes()
    layer_unit, root_unit = _unit_sizes(facts, lora_elem_bytes=facts.dtype_bytes)
    return root_unit + (1 if facts.fsdp_version == 1 else 2) * layer_unit


def _layer_gradient_bytes(facts: ModelFacts, key: str, world: int) -> int:
    """Bytes of one layer's gradients while they are reduced, beyond the gradients kept: FSDP reduce-scatters a unit's
    LoRA gradients made in param_dtype from an fp32 copy (reduce_dtype) into an fp32 shard; DDP, single and layer split
    write them straight into the kept gradients (DDP copies them into its buckets, counted with the model state)."""
    if not (key.startswith("fsdp") or key == "hsdp"):  # (with CPU offload too: the reduce-scatter runs on the GPU)
        return 0
    numel = _layer_lora_numel(facts)
    return numel * facts.dtype_bytes + 4 * numel + math.ceil(4 * numel / world)


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
    if hw.nodes > 1 and hw.gpus_per_node > 1:
        keys.append("hsdp")  # listed beside FSDP over every GPU; chosen only when asked (parallel.hybrid_shard)
    if hw.gpus_per_node > 1 and not facts.mxfp4:  # MXFP4 goes through finetune's loader only: no layer split
        keys.append("layer_split")
    return [estimate(facts, recipe, key, hw, **kwargs) for key in keys]

