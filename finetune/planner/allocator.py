"""What CUDA's caching allocator holds beyond the model's tensors and the step's: the cuBLAS workspace, the LoRA built
at load, the FSDP2 byte guard's float64 chunk; and the load peak they go into (memory.py's `estimate` reads it).

Each is a fixed cost, small beside a large model and much of a small one's peak: the GPU smoke's load check
(benchmarks/gpu_smoke.py) was predicted at 1.6x the planner without them on the 1024 x 8 model it used then (issue 57,
finding 3); its 2048 x 8 model now keeps them near 15% of the load term, and the smoke gives the planner the cuBLAS
workspace its probe measured on the GPU (Hardware.cublas_workspace_bytes, `load_parts`' workspace_bytes):
  * the cuBLAS workspace. torch gives every (cuBLAS handle, stream) pair that runs a cuBLAS kernel a workspace from its
    caching allocator and never frees it (torch docs, notes/cuda.rst, "cuBLAS workspaces"): CUBLAS_WORKSPACE_CONFIG's
    default is ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB = 8 MiB + 128 KiB, the 8,519,680-byte block users find in
    memory snapshots), and ":4096:8" (32 MiB) from sm90 on (aten/src/ATen/cuda/CublasHandlePool.cpp; 32 MiB is
    NVIDIA's recommendation for Hopper, cuBLAS docs `cublasSetWorkspace`, pytorch #120925). cuBLASLt shares it
    (torch.backends.cuda.blas_workspace_size: TORCH_CUBLASLT_UNIFIED_WORKSPACE, the default of CUDA builds). A step
    runs its matmuls on one stream (FSDP's side streams only copy), so one workspace; benchmarks/gpu_probe.py measures
    it on the device;
  * the LoRA at load: PEFT's A/B are fp32 (4 bytes an element) and are built on the GPU with their unit, then sharded
    like it; the base's term never had them;
  * the byte guard's checksum (finetune/parallel/byte_guard.py): every packed 4-bit tensor of an FSDP2 unit is summed
    on the device before `fully_shard` and after one unshard, CHECKSUM_CHUNK bytes at a time as float64 (8 bytes a
    byte; two chunks at the hand-over), beside one period of float64 weights: ~17 MiB on a tensor over 1 MiB. Its
    float64 dot and matrix-vector product are cuBLAS calls, so the workspace is allocated while loading too.
"""

from __future__ import annotations

import re

from finetune.planner.facts import ModelFacts
from finetune.planner.shards import held_parameter_bytes

KiB, MiB = 1024, 1024**2
CUDA_CONTEXT_BYTES = int(0.75 * 1024**3)  # CUDA context, CUDA/NCCL library state: outside the allocator's statistics
CUBLAS_WORKSPACE_BYTES = 8 * 4096 * KiB  # ":4096:8", sm90 and later (H100, H200, B200): 32 MiB
CUBLAS_WORKSPACE_BYTES_BEFORE_SM90 = 2 * 4096 * KiB + 8 * 16 * KiB  # ":4096:2:16:8": 8 MiB + 128 KiB
# The byte guard's checksum (byte_guard.checksum): weights repeat every CHECKSUM_MODULUS positions, CHECKSUM_CHUNK bytes
# are summed per step. Defined here, where their memory is counted, so that the guard and the planner cannot drift.
CHECKSUM_MODULUS = 65_521
CHECKSUM_CHUNK = 16 * CHECKSUM_MODULUS  # ~1 MiB of bytes, 8 MiB as float64


def cublas_workspace_bytes(compute_capability_major: int = 9) -> int:
    """Bytes of torch's default cuBLAS workspace on a GPU of this compute capability (CUBLAS_WORKSPACE_CONFIG unset)."""
    return CUBLAS_WORKSPACE_BYTES if compute_capability_major >= 9 else CUBLAS_WORKSPACE_BYTES_BEFORE_SM90


def checksum_bytes(tensor_bytes: int) -> int:
    """Device bytes `byte_guard.checksum` holds at once for a tensor of `tensor_bytes` bytes: one period of float64
    weights and two chunks as float64 (the next chunk is made while the previous one is still bound), with the float64
    scalars and per-period sums of a chunk's products. Measured op by op on CPU tensors (tests/planner/test_allocator.py)."""
    if tensor_bytes <= 0:
        return 0
    first = min(tensor_bytes, CHECKSUM_CHUNK)
    second = min(tensor_bytes - first, CHECKSUM_CHUNK)
    return 8 * (first + second) + 8 * CHECKSUM_MODULUS + 8 * (first // CHECKSUM_MODULUS + 3)


def byte_guard_bytes(facts: ModelFacts) -> int:
    """The byte guard's transient on the device, at the largest packed 4-bit tensor (0: nothing is packed)."""
    return checksum_bytes(max((t.nbytes for t in facts.tensors if t.quantized_numel), default=0))


def guarded(facts: ModelFacts, key: str) -> bool:
    """Whether wrapping runs the byte guard: FSDP2 (full shard, offload, hybrid) over packed 4-bit weights."""
    fsdp = key.startswith("fsdp") or key == "hsdp"
    return fsdp and facts.fsdp_version == 2 and any(t.quantized_numel for t in facts.tensors)


def unit_lora_bytes(facts: ModelFacts) -> int:
    """Bytes of the largest decoder layer's LoRA as built (fp32 from PEFT), whole."""
    return largest_layer_lora(facts, lambda t: t.nbytes)


def largest_layer_lora(facts: ModelFacts, size) -> int:
    """`size(tensor)` summed over the LoRA tensors of each decoder layer: the largest layer's."""
    per_layer: dict[str, int] = {}
    for t in facts.tensors:
        match = re.search(r"\.(\d+)\.", t.unit) if t.trainable else None
        if match:
            per_layer[match.group(1)] = per_layer.get(match.group(1), 0) + size(t)
    return max(per_layer.values(), default=0)


def load_parts(facts: ModelFacts, key: str, devices: int, world: int, *, sharded: bool,
               workspace_bytes: int = CUBLAS_WORKSPACE_BYTES) -> dict[str, int]:
    """GPU bytes while loading and wrapping, by part (`load_peak` is their sum).

    Per-rank loader: the whole 4-bit base and its quant state + the largest tensor before quantization + the LoRA.
    Sharded loading (finetune/model/loading.py): this rank's shard (none on the GPU with CPU offload) + the quant state
    (not a parameter: whole on every rank) + the largest unit as read in model.dtype (a layer, or the embeddings
    and LM head), which is built and quantized on the GPU and then sharded; the LoRA likewise: the rank's shards + the
    unit's own, whole. Under FSDP2 over packed weights, the byte guard's chunk and the cuBLAS workspace it allocates.
    """
    offload = key == "fsdp_offload"
    if sharded:
        lora_shards = 0 if offload else held_parameter_bytes(facts, strategy="fsdp", world_size=world,
                                                              fsdp_version=facts.fsdp_version)["trainable_bytes"]
        parts = {"base": 0 if offload else facts.total_bytes(trainable=False) // world,
                 "quant_state": facts.quant_state_bytes, "unit_read": facts.unit_load_bytes,
                 "lora": lora_shards + unit_lora_bytes(facts)}
    else:
        parts = {"base": (facts.total_bytes(trainable=False) + facts.quant_state_bytes) // devices, "quant_state": 0,
                 "unit_read": max(t.numel for t in facts.tensors) * facts.dtype_bytes,
                 "lora": facts.total_bytes(trainable=True) // devices}
    guard = guarded(facts, key)
    parts["byte_guard"] = byte_guard_bytes(facts) if guard else 0
    parts["cublas_workspace"] = workspace_bytes if guard else 0
    parts["cuda_context"] = CUDA_CONTEXT_BYTES
    return parts


def load_peak(facts: ModelFacts, key: str, devices: int, world: int, *, sharded: bool,
              workspace_bytes: int = CUBLAS_WORKSPACE_BYTES) -> int:
    """GPU bytes while loading (`load_parts`, summed)."""
    return sum(load_parts(facts, key, devices, world, sharded=sharded, workspace_bytes=workspace_bytes).values())
