"""The packed 4-bit bytes under FSDP2: checked at wrap time, never trained on silently when a copy changed them.

A 4-bit weight stored in a floating dtype (`quant_storage: bfloat16`, what FSDP needs for one dtype per unit) is
packed nibbles that FSDP2 moves as bf16 numbers: its all-gather copies them with `torch._foreach_copy_`. CUDA's copy
writes every NaN as one canonical pattern (pytorch #159333); CPU keeps the bits, which is why the CPU suite never saw
it. About 0.1% of the packed elements are NaN patterns (197 of 262,144 on a random 1024 x 1024 layer), and each
rewritten one decodes as different 4-bit values: a wrong base model, no error (bitsandbytes #1945).

What this module does, per rank, at wrap time:
  * `probe_copy`: before the first unit is sharded, copy a fixed tensor of every bit pattern of the storage dtype
    with the op FSDP2 uses, on the device training uses, and compare the bytes. When the copy rewrites them, the
    packed bytes travel as uint8 (`route`), two ways:
    - "uint8" (torch >= 2.12): every unit's packed weights are re-viewed as uint8 before sharding (the same bytes, no
      copy): FSDP2 leaves non-floating parameters out of mixed precision and all-gathers a unit of mixed dtypes as
      uint8, so nothing reinterprets them (bitsandbytes reads the bytes either way);
    - "mixed" (torch < 2.12, whose fully_shard refuses a uint8 parameter): the packed weights keep their bf16 storage
      and each decoder layer is sharded with `param_dtype=None` (`MIXED_UNIT_POLICY`), so its fp32 LoRA beside them
      makes a unit of mixed dtypes, which FSDP2 also all-gathers as uint8 views (pytorch #119302); with a param_dtype
      set, its copy-in casts every parameter to it (bf16) first and the NaNs are rewritten there. Measured on 2 CPU
      ranks with the copy patched to rewrite NaNs as CUDA's does, torch 2.11.0 and 2.13.0: the mixed unit under
      param_dtype=None keeps every byte (its one copy is of uint8); the same unit under param_dtype=bf16, and a bf16
      unit without LoRA under None, lose their NaN payloads. The LoRA (PEFT's fp32) then reaches the forward in fp32:
      the fused LoRA path computes in the input's dtype as before, so the step is the single process's.
  * `unit_checksums` before `fully_shard`, `verify_unit` after: one unshard of the unit through the path training
    uses gives back exactly the bytes it had; otherwise the run is refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from finetune.errors import LaunchError
from finetune.planner.allocator import CHECKSUM_CHUNK as _CHUNK  # bytes per step (~1 MiB: 8 MiB as float64, transient)
from finetune.planner.allocator import CHECKSUM_MODULUS as _MODULUS  # a byte's weight is (its position mod this) + 1


def packed_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The 4-bit packed weights of `module` (bitsandbytes Params4bit: they carry a quant_state)."""
    return [(name, p) for name, p in module.named_parameters() if getattr(p, "quant_state", None) is not None]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().contiguous().view(torch.uint8).reshape(-1)


def checksum(tensor: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
    """Position-weighted sum of the bytes [start, stop), sum(byte[i] * (i mod 65521 + 1)): any rewritten byte changes
    it (computed on the tensor's device). Positions are the tensor's own, so the sums of disjoint ranges add up to the
    whole tensor's. The weights repeat every 65521 positions, so each step is float64 products with one period of them
    (512 KiB, built per call: nothing stays allocated, which the tensor-bytes meter would count):
    a partial period, whole periods as a matrix-vector product, a partial period. Exact: every term and partial sum
    is an integer below 2^53 (a period at most 255 x 65521^2 < 2^41, 16 of them < 2^45), so the order of the
    additions cannot change it (measured on a 1.1B model's CPU load: 25 s of int64 arange/modulo/product became ~3 s)."""
    data, total = _bytes(tensor), 0
    stop = data.numel() if stop is None else stop
    weights = torch.arange(1, _MODULUS + 1, device=data.device, dtype=torch.float64) if stop > start else None
    for first in range(start, stop, _CHUNK):
        chunk = data[first : min(first + _CHUNK, stop)].to(torch.float64)
        offset = first % _MODULUS  # the weight of chunk[0] is weights[offset]
        head = min(chunk.numel(), (_MODULUS - offset) % _MODULUS)
        if head:
            total += int(torch.dot(chunk[:head], weights[offset : offset + head]))
        periods = (chunk.numel() - head) // _MODULUS
        if periods:
            whole = chunk[head : head + periods * _MODULUS].view(periods, _MODULUS)
            total += int((whole @ weights).sum())
        tail = chunk[head + periods * _MODULUS :]
        if tail.numel():
            total += int(torch.dot(tail, weights[: tail.numel()]))
    return total


def bit_patterns(dtype: torch.dtype, device) -> torch.Tensor:
    """A fixed tensor of `dtype` holding every 16-bit pattern (as the high half of 32-bit words): every NaN payload
    a packed bf16 weight can hold, and NaNs of every exponent/sign form in fp32."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device)
    if dtype.itemsize == 2:
        return patterns.to(torch.int16).view(dtype)
    return ((patterns << 16) | 0x1235).view(dtype)  # a mantissa that is never zero: exponent 0xFF words are NaNs


def probe_copy(dtype: torch.dtype, device) -> bool:
    """True when this device's `_foreach_copy_` (FSDP2's all-gather copy) keeps every bit pattern of `dtype` intact.

    A fixed tensor, not a layer's own bytes: a first layer whose packed bytes happen to hold no NaN pattern would pass,
    and a later layer's NaNs would then be rewritten and refused by `verify_unit` (a spurious refusal)."""
    if not dtype.is_floating_point:
        return True  # integer storage: no NaN to rewrite
    packed = bit_patterns(dtype, device)
    with torch.no_grad():
        copy = torch.empty_like(packed)
        torch._foreach_copy_([copy], [packed])
    return torch.equal(_bytes(copy), _bytes(packed))


# fully_shard takes a uint8 parameter from torch 2.12 on (pytorch #177844; measured with a uint8 parameter under
# fully_shard: 2.11.0 raises "only Tensors of floating point dtype can require gradients", 2.12.0, 2.13.0 and 2.15.0
# take it). Before that the packed bytes travel in units of mixed dtypes (the module docstring).
UINT8_PARAMETERS_TORCH = (2, 12)


def route(copy_keeps_bytes: bool, torch_version: str | None = None) -> str:
    """How the packed 4-bit weights travel under FSDP2 on this device and torch: "storage" (their own dtype: the copy
    keeps every bit pattern, as on CPUs), "uint8" (uint8 parameters) or "mixed" (bf16 in units of mixed dtypes)."""
    if copy_keeps_bytes:
        return "storage"
    version = torch_version or torch.__version__
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    return "uint8" if numbers >= UINT8_PARAMETERS_TORCH else "mixed"


def check_mixed_unit(module: nn.Module, *, label: str) -> None:
    """The "mixed" route needs a parameter of another dtype beside the packed weights in each unit (the layer's LoRA):
    a unit of one dtype would be all-gathered in it, through the copy that rewrites NaN bit patterns."""
    packed = packed_parameters(module)
    if packed and len({p.dtype for p in module.parameters()}) == 1:
        raise LaunchError(
            f"{label} holds 4-bit weights but no parameter of another dtype (no LoRA in it): on torch "
            f"{torch.__version__} FSDP2 would all-gather it in {packed[0][1].dtype} through this device's copy, which "
            "rewrites NaN bit patterns of the packed bytes (a wrong base model). Fix: put LoRA on every decoder layer "
            "(lora.target_modules), install torch>=2.12 (which shards the packed bytes as uint8 parameters), or use "
            "FSDP1 (parallel.fsdp_version: 1)."
        )


def store_as_bytes(module: nn.Module) -> int:
    """Re-view every floating-point packed weight of `module` as uint8 (same memory, same bytes); returns the count."""
    count = 0
    for _, param in packed_parameters(module):
        if param.data.is_floating_point():
            # (n, 1) as bitsandbytes stores packed weights (it asserts the trailing 1): n bf16 -> 2n bytes
            param.data = param.data.view(torch.uint8).reshape(-1, 1)
            count += 1
    return count


def unit_checksums(module: nn.Module, *, rank: int = 0, world_size: int = 1, group=None) -> dict[str, int]:
    """The checksum of each packed weight of `module` before `fully_shard` (a collective when world_size > 1).

    `rank` / `world_size` / `group`: the rank's place in its shard group and that group (hybrid shard: a node's ranks;
    None: every rank), so the sum covers each chunk once.

    Each rank sums the bytes of the chunk FSDP2 will keep on it (dim 0, torch.chunk pieces) and the sums are added
    over the ranks: the whole tensor's checksum, which `verify_unit` compares after an unshard. Under FSDP2 sharded
    loading a rank reads only its own chunk (finetune/model/sources/shard_reads.py), so only that part of its tensor is data.
    """
    from finetune.model.sources.shard_reads import dim0_chunk

    names, sums = [], []
    for name, param in packed_parameters(module):
        row_bytes = _bytes(param).numel() // max(1, param.shape[0])
        first, last = dim0_chunk(param.shape[0], rank, world_size)
        names.append(name)
        sums.append(checksum(param, first * row_bytes, last * row_bytes))
    if world_size > 1 and names:
        import torch.distributed as dist

        totals = torch.tensor(sums, dtype=torch.int64, device=packed_parameters(module)[0][1].device)
        dist.all_reduce(totals, group=group)
        sums = totals.tolist()
    return dict(zip(names, sums))


def verify_unit(unit: nn.Module, before: dict[str, int], *, label: str) -> None:
    """Unshard `unit` once (a collective: every rank calls it), compare its packed bytes with `before`, reshard."""
    if not before:
        return
    unit.unshard()
    try:  # by name: an unsharded parameter is a plain tensor, without the quant_state that marks the packed ones
        after = {name: checksum(unit.get_parameter(name)) for name in before}
    finally:
        unit.reshard()
    changed = sorted(name for name, value in before.items() if after.get(name) != value)
    if changed:
        raise LaunchError(
            f"FSDP2 changed the packed 4-bit bytes of {label} when gathering it ({len(changed)} of {len(before)} "
            f"tensors, e.g. {changed[0]}): training would run on a different base model, so it does not start. This "
            "device's copies rewrite bit patterns even as uint8, which finetune cannot work around. Fix: train with "
            "FSDP1 (accelerate_configs/fsdp1.yaml, or parallel.fsdp_version: 1) and report this with your torch and "
            "GPU versions (docs/distributed.md, 'The 4-bit bytes under FSDP2')."
        )
