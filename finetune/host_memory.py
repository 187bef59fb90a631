"""The training process's own (host, CPU) memory allocator: glibc malloc, on Linux.

Where an FSDP rank's training memory went on CPU (issue 25): glibc raises its mmap threshold to the size of each large
block it frees (up to 32 MiB), so after the first frees every 1-8 MiB tensor comes from the heap: FSDP's all-gather
outputs and unsharded parameters, bitsandbytes' dequantized weights, each allocated and freed per layer and pass.
Those blocks interleave with longer-lived ones and the heap only grows: a 2-rank FSDP2 run of a 226M-parameter Qwen2
rose to 893 MiB RssAnon per rank by step 8 (DDP: 774) while the tensors alive did not grow; `malloc_trim` after each
step or layer does not give it back (fragmented pages are partly in use). A fixed threshold of 1 MiB serves those
tensors with mmap, returned to the OS at once: 500 MiB, flat from step 2, at 39 instead of 64 tokens/s on 2 cores
(each mmapped block is page-faulted in again). On GPUs those tensors live in CUDA's caching allocator, so this is a
CPU-only effect; the setting is applied only where a rank trains on the CPU under FSDP (sharding is chosen for memory).
`FINETUNE_CPU_ALLOCATOR=default` keeps glibc's own behaviour (faster, more memory). Measured with
benchmarks/bench_train_peak.py; docs/benchmarks.md has the table.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter; setting it also turns glibc's dynamic threshold off
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to set
        return None


def bound_heap_growth() -> bool:
    """Serve allocations of 1 MiB and more with mmap from now on (see the module doc). True when it took effect."""
    if os.environ.get("FINETUNE_CPU_ALLOCATOR", "").strip().lower() == "default":
        return False
    libc = _libc()
    try:
        return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except AttributeError:
        return False


def bound_heap_growth_for(strategy: str, device) -> bool:
    """`bound_heap_growth` where a rank trains on the CPU under FSDP; says so once."""
    if strategy != "fsdp" or device.type != "cpu" or not bound_heap_growth():
        return False
    from finetune.distributed import print0

    print0("[finetune] note: FSDP on CPU: tensors of 1 MiB and more are mmapped, so freed ones leave the process "
           "(docs/distributed.md); FINETUNE_CPU_ALLOCATOR=default keeps glibc's faster, larger heap")
    return True


def release_freed_memory(device=None) -> None:
    """Give the memory of freed tensors back to the OS (glibc `malloc_trim`; a no-op elsewhere), and on a CUDA `device`
    the blocks CUDA's caching allocator still reserves for them (the sharded load's full-shape staging tensors, freed
    once fully_shard cut them: reserved but unused, they would count against every later allocation's headroom).

    Where the load's extra memory went (issue 11): glibc raises its mmap threshold each time a large mmapped block
    is freed, so after the first freed tensors later large allocations (the model.dtype copies read before
    quantization, the unsharded tensors FSDP copies from) come from the heap, and freed heap pages stay in the
    process. RssAnon then grows by whatever was transiently allocated, differently on each rank (it depends on the
    order of frees). Measured on the hidden-512 x 16-layer benchmark model at 2 ranks: the per-rank loader's ranks
    grew by 72 and 191 MiB, 59-61 MiB with the threshold fixed (MALLOC_MMAP_THRESHOLD_=65536). Trimming after each
    unit keeps the freed copies from accumulating without changing how training allocates.
    """
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()
