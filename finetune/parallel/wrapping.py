"""Applying the plan: FSDP2 (`fully_shard` per decoder layer), FSDP1 (`FullyShardedDataParallel` with the transformer
auto-wrap policy), DDP, DeepSpeed (finetune/parallel/zero.py), layer split (placed at load time), and unwrapping.

Wrapping uses torch's own APIs, so the code the CPU tests run with gloo is the code that runs on GPUs with NCCL.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from finetune.distributed import DistInfo, any_rank, doing, print0
from finetune.model.reward_head import SCORE
from finetune.model.sources.shard_reads import RankShard
from finetune.parallel import byte_guard, zero
from finetune.parallel.decision import ParallelPlan
from finetune.parallel.engines import engine_of


# ------------------------------------------------------------------------------------------------ wrapping
def wrap(model: nn.Module, plan: ParallelPlan, dist: DistInfo, *,
         materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply the plan; returns the module the training loop calls (the PeftModel itself under FSDP2).

    `materialize` (sharded loading): `model` is a meta-device skeleton and `materialize(unit)` builds a unit's
    tensors from the checkpoint. Each unit is built right before FSDP shards it, so a rank holds at most its shard
    plus one unit: FSDP2 builds and shards each decoder layer, then the root; FSDP1 calls it as `param_init_fn`,
    which FSDP runs for each unit just before flattening and sharding it.
    """
    doing(f"the wrap of the model ({plan.describe()})")  # named if a peer is lost meanwhile
    if plan.strategy == "fsdp" and plan.fsdp_version == 2:
        return _wrap_fsdp2(model, plan, dist, materialize)
    if plan.strategy == "fsdp" and plan.fsdp_version == 1:
        return _wrap_fsdp1(model, plan, dist, materialize)
    if plan.strategy == "fsdp":  # the checks refuse it first; never FSDP1's wrap without FSDP1's checks (bb28)
        raise ValueError(f"FSDP version {plan.fsdp_version!r} is neither 1 nor 2")
    if materialize is not None:
        raise ValueError("a meta-device skeleton can only be built by the FSDP wrap")
    if plan.strategy == "ddp":
        return _wrap_ddp(model, plan, dist)
    if plan.strategy == "deepspeed":
        return zero.initialize(model, plan.zero, device_type=dist.device.type)  # ZeRO-3 partitions it
    return model


def _wrap_ddp(model: nn.Module, plan: ParallelPlan, dist: DistInfo) -> nn.Module:
    """DDP, looking for unused parameters at every step only on a model that leaves some without a gradient."""
    from torch.nn.parallel import DistributedDataParallel

    # Every rank loaded the same weights and seeded the same LoRA init: no start-up broadcast needed (init_sync).
    device_ids = [dist.device] if dist.device.type == "cuda" else None
    # DDP's reducer waits for a gradient of every trainable parameter and stops the run at the next step ("Expected
    # to have finished reduction in the prior iteration ... did not receive grad") when one got none on any rank,
    # unless it looks for unused parameters, which it then does at every step (a walk of the autograd graph). Which
    # models leave some without a gradient is decided from the model itself, by a probe step (`unused_by_a_probe`).
    unused = unused_by_a_probe(model, dist.device)
    if unused:
        plan.notes.append(f"DDP looks for unused parameters at every step (a walk of the autograd graph per step): "
                          f"{len(unused)} trainable tensors got no gradient in a probe step ({_some(unused)})")
        print0(f"[finetune] note: {plan.notes[-1]}")
    return DistributedDataParallel(model, device_ids=device_ids, init_sync=False, find_unused_parameters=bool(unused))


def unused_by_a_probe(model: nn.Module, device: torch.device) -> list[str]:
    """The trainable parameters that get no gradient from a forward and backward of a two-token text row, in training
    mode: the ones a DDP step may leave without a gradient on some rank.

    Found so: all-linear LoRA on a multimodal checkpoint's vision tower trained on text rows (Gemma 3 12B/27B);
    DeepSeek-V4's lightning indexer, whose output is top-k indices (no gradient ever reaches its projections), and its
    KV compressors, which compress whole windows of `compress_rates` tokens and get nothing from a shorter row. Two
    tokens is the shortest row that trains (one input, one target), so a branch only longer rows reach is found too;
    experts are never in the list (all of them run on every step: finetune/model/experts/routed.py). The probe leaves
    the model as it was: gradients, training flags and the random state (dropout, router jitter) are restored, so a
    DDP run trains the same numbers as one process.
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return []
    modes = [(module, module.training) for module in model.modules()]
    grads = [p.grad for _, p in trainable]
    ids = torch.tensor([ordinary_token_ids(getattr(model, "config", None), 2)], device=device)
    try:
        model.train()
        for _, p in trainable:
            p.grad = None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            outputs = model(input_ids=ids, use_cache=False)
            logits = outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]
            logits.float().sum().backward()
        # A reward model's score head is run in place of the LM head by its objective, not by a plain forward
        return [name for name, p in trainable if p.grad is None and name.split(".")[-2:-1] != [SCORE]]
    finally:
        for (_, p), grad in zip(trainable, grads, strict=True):
            p.grad = grad
        for module, training in modes:
            module.training = training


def ordinary_token_ids(config, count: int) -> list[int]:
    """`count` token ids of the vocabulary that no `*token*` field of the config names (an image, audio or BOI token
    would make a multimodal model look for pixels the probe has not got)."""
    special, configs = set(), [config]
    while configs:
        current = configs.pop()
        for key, value in (vars(current) if current is not None else {}).items():
            if hasattr(value, "to_dict"):
                configs.append(value)
            elif "token" in key and isinstance(value, int):
                special.add(value)
            elif "token" in key and isinstance(value, list | tuple):
                special.update(v for v in value if isinstance(v, int))
    text = getattr(config, "text_config", None) if config is not None else None
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 1 << 16
    return list(itertools.islice((i for i in range(1, vocab) if i not in special), count))


def _some(names: list[str], shown: int = 3) -> str:
    """A few names, shortened to their module path without the adapter's suffix."""
    short = [name.removeprefix("base_model.model.").split(".lora_")[0] for name in names]
    unique = list(dict.fromkeys(short))
    return ", ".join(unique[:shown]) + (f" and {len(unique) - shown} more modules" if len(unique) > shown else "")


def _layer_modules(model: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == plan.layer_class]


def _wrap_fsdp2(model: nn.Module, plan: ParallelPlan, dist: DistInfo, materialize=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if plan.replicas > 1:
        # HSDP: a 2-D mesh, rows = nodes (replicas), columns = a node's ranks (the shard group). fully_shard shards
        # every parameter over "shard" and replicates over "replicate": a layer's all-gather and reduce-scatter stay
        # within a node, and only the reduce-scattered gradient shards are all-reduced across nodes.
        mesh = init_device_mesh(dist.device.type, (plan.replicas, plan.shard_size), mesh_dim_names=("replicate", "shard"))
        shard_group = mesh.get_group("shard")
    else:
        mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        shard_group = None
    shard = RankShard(dist.rank % plan.shard_size, plan.shard_size)  # this rank's place in its shard group
    options = {
        "mesh": mesh,
        "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=torch.float32),
        # Pinned host memory needs an accelerator; on a CPU-only machine the same policy runs unpinned.
        "offload_policy": CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if plan.cpu_offload else OffloadPolicy(),
    }
    # On torch < 2.12 (route "mixed") each decoder layer is sharded with param_dtype None: see byte_guard.
    mixed_options = {**options, "mp_policy": MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)}
    route = None  # how the packed 4-bit bytes travel: decided on the first unit that has them (byte_guard.route)
    checksums = []
    for index, layer in enumerate(_layer_modules(model, plan)):
        if materialize is not None:
            materialize(layer)  # read + quantize this layer only; fully_shard then keeps this rank's shard
        packed = byte_guard.packed_parameters(layer)
        label = f"decoder layer {index} ({plan.layer_class})"
        if route is None and packed:
            route = _packed_bytes_route(packed[0][1].dtype, plan, dist)
        if route == "uint8":
            byte_guard.store_as_bytes(layer)
        elif route == "mixed":
            byte_guard.check_mixed_unit(layer, label=label)
        checksums.append((label, layer, byte_guard.unit_checksums(layer, rank=shard.rank, world_size=shard.world_size,
                                                                  group=shard_group)))
        fully_shard(layer, **(mixed_options if route == "mixed" else options))
    if plan.forward_prefetch:  # the accelerate config's fsdp_forward_prefetch: gather the next layer during this one
        layers = _layer_modules(model, plan)
        for layer, following in itertools.pairwise(layers):
            layer.set_modules_to_forward_prefetch([following])
    if materialize is not None:
        materialize(model)  # what is left: embeddings, final norm, LM head
    fully_shard(model, **options)
    for label, layer, before in checksums:  # one unshard per unit through the copy path training uses
        byte_guard.verify_unit(layer, before, label=label)
    return model


def _packed_bytes_route(storage_dtype: torch.dtype, plan: ParallelPlan, dist: DistInfo) -> str:
    """byte_guard.route, decided together (a unit's dtypes must be the same on every rank), on a fixed tensor of every
    bit pattern of the storage dtype: the same answer for every layer, whatever bytes its weights hold."""
    route = byte_guard.route(not any_rank(not byte_guard.probe_copy(storage_dtype, dist.device)))
    if route != "storage":
        how = ("as uint8 parameters" if route == "uint8" else
               f"as uint8 views of units of mixed dtypes (torch {torch.__version__}: decoder layers sharded with "
               "param_dtype None, the LoRA in fp32 beside the bf16 bytes)")
        plan.notes.append("this device's copies rewrite NaN bit patterns (CUDA does, pytorch #159333): the packed "
                          f"4-bit weights are all-gathered as uint8 under FSDP2, {how} (same bytes, no copy)")
        print0(f"[finetune] note: {plan.notes[-1]}")
    return route


def _wrap_fsdp1(model: nn.Module, plan: ParallelPlan, dist: DistInfo, materialize=None) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    layer_cls = {type(m) for m in _layer_modules(model, plan)}
    keep_lora_inputs_in_compute_dtype(model)

    base_dtype = model.get_input_embeddings().weight.dtype

    # A module with children that owns parameters of another dtype (DeepSeek-V4's fp32 attention sinks and
    # compressor position biases) is a unit of its direct parameters alone: each of its children is a unit too.
    mixed = [m for m in model.modules() if list(m.children()) and any(p.dtype != base_dtype for p in m.parameters(recurse=False))]
    beside_mixed = {id(child) for parent in mixed for child in parent.children()}
    mixed_ids = {id(m) for m in mixed}

    def is_trainable_leaf(module: nn.Module) -> bool:
        # Own unit, so every flat parameter has one dtype and one requires_grad: LoRA A/B (and DoRA magnitude) leaves,
        # and frozen leaves transformers keeps in another dtype than the base (DeepSeek-V3's and GLM-4.5's fp32 router
        # weight, `_keep_in_fp32_modules_strict`: "Must flatten tensors with uniform dtype" inside the layer's unit).
        if id(module) in mixed_ids or (id(module) in beside_mixed and any(True for _ in module.parameters())):
            return True
        if list(module.named_children()):
            return False
        own = list(module.parameters(recurse=False))
        return any(p.requires_grad for p in own) or any(p.dtype != base_dtype for p in own)

    policy = functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=is_trainable_leaf),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls),
        ],
    )
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD if plan.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=fsdp1_mixed_precision(plan),
        cpu_offload=CPUOffload(offload_params=plan.cpu_offload),
        device_id=dist.device,  # required on CPU too ("FSDP needs a non-CPU accelerator device" otherwise)
        limit_all_gathers=True,
        # The accelerate config's prefetch keys (finetune/parallel/accelerate_keys.py); unset: FSDP1's defaults.
        backward_prefetch=_fsdp1_backward_prefetch(plan.backward_prefetch),
        forward_prefetch=plan.forward_prefetch,
        use_orig_params=False,
        param_init_fn=materialize,  # sharded loading: called per unit, on its modules, before the unit is flattened
    )


def _fsdp1_backward_prefetch(name: str | None):
    from torch.distributed.fsdp import BackwardPrefetch

    if name is None:
        return BackwardPrefetch.BACKWARD_PRE  # FSDP1's own default
    return None if name == "NO_PREFETCH" else BackwardPrefetch[name]


def keep_lora_inputs_in_compute_dtype(model: nn.Module) -> None:
    """Under FSDP1, PEFT must not cast a LoRA layer's input to `lora_A.weight.dtype` before dropout.

    That dtype is not fixed under FSDP1: in the forward the LoRA leaf's unit shows its fp32 flat parameter, so the
    input goes to dropout in fp32; when activation checkpointing recomputes the layer in the backward, the unit is
    unsharded in the compute dtype, so the same input goes to dropout in bf16. torch's checkpoint then refuses the
    recomputation ("Recomputed values ... have different metadata": saved float32, recomputed bfloat16), in the first
    backward of every FSDP1 run with lora.dropout > 0 and checkpointing on. Without PEFT's cast the input stays in
    the compute dtype both times (it is the base layer's input) and the unit's own forward casts it for lora_A as
    before (`cast_forward_inputs`), so nothing else changes.
    """
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):  # PEFT's LoRA layers (peft.helpers.disable_input_dtype_casting)
            module.cast_input_dtype_enabled = False


def fsdp1_mixed_precision(plan: ParallelPlan):
    """FSDP1's precision, the same as FSDP2's: fp32 LoRA master weights, compute in model.dtype, fp32 reductions.

    The LoRA leaves keep PEFT's fp32 (their own units, so one dtype per flat parameter): the optimizer updates fp32
    shards, and small updates are not rounded away in bf16. Each unit's forward runs on its parameters cast to
    `param_dtype` (the 4-bit storage dtype; a no-op for the base), and gradients are reduced in fp32.

    `cast_forward_inputs=True` is what makes a bf16 run work at all: PEFT's 4-bit LoRA layer casts its input to
    `lora_A.weight.dtype` before calling lora_A. Outside the unit's own forward FSDP1 shows the fp32 flat parameter,
    so the input becomes fp32, and inside the forward the weight is bf16: F.linear fails with "expected m1 and m2 to
    have the same dtype, but got: float != c10::BFloat16" (the training loop uses no autocast, on any device). FSDP1
    casts only the root's inputs by default; FSDP2's MixedPrecisionPolicy casts every unit's, which is why FSDP2 ran.
    Casting every unit's floating inputs to `param_dtype` computes the LoRA path in bf16 exactly as FSDP2 does (and
    as autocast would), so FSDP1 and FSDP2 train the same loss curve (tests/parallel/test_shipped.py).
    """
    from torch.distributed.fsdp import MixedPrecision

    # buffer_dtype None: buffers keep their own dtype. A bf16 rotary `inv_freq` is off by ~0.2% per frequency, ~1.7
    # rad of angle at position 1000; FSDP2 (and a single process) never cast buffers.
    return MixedPrecision(param_dtype=plan.param_dtype, reduce_dtype=torch.float32, buffer_dtype=None,
                          cast_forward_inputs=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The PeftModel inside DDP / FSDP1 / DeepSpeed wrappers (FSDP2 wraps in place)."""
    return engine_of(model).unwrap(model)
