"""What this machine's stack is and does, in about ten seconds: the first thing `make gpu-smoke` runs.

    python benchmarks/gpu_probe.py [--cpu]      # one JSON object on stdout's last line, a summary on stderr
    python benchmarks/gpu_probe.py --imports    # gpu_smoke.sh's pre-check: import what a run needs, stop at the first
                                                # error (one line: the module and its error), else one line of versions

Each answer is a fact the smoke's later lines (and a reader of its JSON) depend on, measured, not assumed:
  * the versions of the libraries this Python has and where each comes from, pip show's Name, Version and Location
    (read from their metadata: nothing is imported for it): the image's pyarrow, fsspec and typing_extensions beside
    the carried wheels (benchmarks/gpu_wheels.sh); torch's CUDA build, whether torch sees a GPU, and the NVIDIA driver
    `nvidia-smi` reports;
  * the cuBLAS workspace: what the caching allocator holds after the first bf16 matmul beyond its operands and result
    (a fixed cost the planner counts: 32 MiB on sm90 by cuBLAS's documentation; the smoke gives the planner this figure);
  * whether `torch._foreach_copy_` (the copy FSDP2's all-gather uses) rewrites bf16 NaN bit patterns on this device:
    4-bit weights stored as bf16 are packed bytes, about 0.1% of which read as NaNs (finetune/parallel/byte_guard.py);
  * a 1-rank `fully_shard` with `MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32)`: does one unshard give
    back the packed bytes exactly, in a unit of mixed dtypes (bf16 payload + fp32 LoRA) and in a bf16-only unit, and
    does the fp32 LoRA get a finite fp32 gradient. At one rank FSDP2 skips its all-gather (it copies the shard with
    `Tensor.copy_`), so this is the 1-GPU path only; hence also:
  * FSDP2's multi-rank copy-in itself (`torch.ops.fsdp.all_gather_copy_in`, what each rank runs before the all-gather
    collective; no process group needed), on this device: a unit of mixed dtypes goes as uint8 views, a bf16 unit as
    bf16. These are the facts of the FSDP2 + 4-bit route on torch < 2.12 (finetune/parallel/byte_guard.py, "mixed");
  * finetune's byte guard on a real 2-rank unshard in this one process (`two_rank_unshard`): a fake 2-rank process
    group (torch.testing's, no communication: rank 0's slot of the all-gather holds rank 0's shard after FSDP2's
    copy-in, the other's holds nothing), a unit built the way finetune's guard chooses for this device's copy
    (`byte_guard.route`), sharded over the 2 ranks, unsharded through FSDP2's copy-in and copy-out; rank 0's rows
    compared by finetune's checksums (`unit_checksums`, `checksum`: what `verify_unit` compares). The same unit
    without the guard (bf16, param_dtype bf16: what finetune did before it) is reported beside it.
`--cpu` (the smoke's dry run) asks the same questions of the CPU; a question that fails is answered with its error,
the others are still asked.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "pydantic", "safetensors",
             "deepspeed")
# pip show's view of what the carried wheels (benchmarks/gpu_wheels.sh) meet there: the image's packages whose
# versions decide whether they import (datasets: pyarrow, fsspec; pydantic-core: typing_extensions), then the wheels.
PACKAGES = ("pyarrow", "fsspec", "typing_extensions", "huggingface_hub", "numpy", "torch", "bitsandbytes", "datasets",
            "dill", "multiprocess", "xxhash", "pydantic", "pydantic_core", "annotated_types", "gguf", "deepspeed", "hjson")
# What a run imports, in the order gpu_smoke.sh's pre-check tries them (`--imports`); finetune.recipe builds the
# recipe's pydantic models, so a pydantic that imports but cannot build them stops here too.
IMPORTS = ("torch", "bitsandbytes", "peft", "transformers", "accelerate", "datasets", "pydantic", "yaml", "safetensors",
           "finetune.recipe")
PAYLOAD_ELEMENTS = 1 << 20  # random bytes viewed as bf16: ~0.4% of them NaN patterns (exponent all ones)


def versions() -> dict[str, str | None]:
    """Each library's installed version, None where it is missing."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def packages(names: tuple[str, ...] = PACKAGES) -> dict[str, dict | None]:
    """pip show's Version and Location of each package (None where it is missing): which of the image's and which
    carried, and at what version, is what the run imports."""
    found: dict[str, dict | None] = {}
    for name in names:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = {"version": distribution.version, "location": str(distribution.locate_file(""))}
    return found


def packages_line(found: dict[str, dict | None]) -> str:
    """The packages grouped by location, as one line: `LOCATION: name version, ...; ...; missing: ...`."""
    by_place: dict[str, list[str]] = {}
    for name, package in found.items():
        place = package["location"] if package else "missing"
        by_place.setdefault(place, []).append(f"{name} {package['version']}" if package else name)
    missing = by_place.pop("missing", [])
    groups = [f"{place}: {', '.join(names)}" for place, names in by_place.items()]
    return "; ".join(groups + ([f"missing: {', '.join(missing)}"] if missing else []))


def check_imports(names: tuple[str, ...] = IMPORTS) -> tuple[bool, str]:
    """Import each module in turn (not find_spec: a module found can still fail to import); at the first that fails,
    (False, its name and error on one line), else (True, the versions). One message, once: not the same ImportError
    in every run of the smoke."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # noqa: BLE001  whatever stops the import is the message
            message = (str(exc).strip().splitlines() or [""])[0]
            return False, (f"{sys.executable} cannot import {name}: {type(exc).__name__}: {message} (versions here: "
                           f"{packages_line(packages())})")
    return True, packages_line(packages())


def cuda_facts() -> dict:
    import torch

    from finetune.devices import nvidia_smi_facts

    facts = {"torch_cuda": torch.version.cuda, "available": torch.cuda.is_available(),
             "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0, **nvidia_smi_facts()}
    if facts["available"]:
        facts.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return facts


def nan_payload(device: str):
    """Random bytes viewed as bf16 (the packed 4-bit storage), NaN patterns included."""
    import torch

    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (2 * PAYLOAD_ELEMENTS,), dtype=torch.uint8, generator=generator)
    return packed.to(device).view(torch.bfloat16)


def copy_canonicalizes_nans(device: str) -> bool:
    """Does this device's `torch._foreach_copy_` (FSDP2's all-gather copy) rewrite bf16 NaN bit patterns?"""
    import torch

    packed = nan_payload(device)
    copy = torch.empty_like(packed)
    torch._foreach_copy_([copy], [packed])
    return not torch.equal(copy.view(torch.uint8), packed.view(torch.uint8))


def cublas_workspace_bytes(device: str) -> int | None:
    """What the allocator holds after the first bf16 matmul beyond its operands and result (None on the CPU)."""
    import torch

    if device != "cuda":
        return None
    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    b = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated()
    c = a @ b
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - c.numel() * c.element_size()


def fully_shard_unit(device: str, *, with_lora: bool) -> dict:
    """One unit under a 1-rank `fully_shard(param_dtype=None, reduce_dtype=float32)`: the packed bytes after an
    unshard, and (with the fp32 LoRA beside them) the LoRA's gradient after a forward and backward."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Unit(nn.Module):
        def __init__(self):
            super().__init__()
            self.packed = nn.Parameter(nan_payload(device).clone().view(-1, 64), requires_grad=False)
            self.lora = nn.Parameter(torch.randn(64, 4, device=device)) if with_lora else None

        def forward(self, x):
            return (x @ self.lora).square().sum()

    unit = Unit()
    original = unit.packed.detach().view(torch.uint8).clone()
    mesh = init_device_mesh(device, (1,))
    fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32))
    unit.unshard()
    result = {"bitwise": torch.equal(unit.packed.detach().view(torch.uint8), original)}
    unit.reshard()
    if with_lora:
        unit(torch.randn(8, 64, device=device)).backward()
        grad = unit.lora.grad.to_local() if hasattr(unit.lora.grad, "to_local") else unit.lora.grad
        result.update(lora_grad_dtype=str(grad.dtype).replace("torch.", ""), lora_grad_finite=bool(grad.isfinite().all()))
    return result


def fully_shard_probe(device: str) -> dict:
    """Both units in a 1-rank process group of this process (NCCL on CUDA, gloo on the CPU), destroyed after."""
    import torch
    import torch.distributed as dist

    backend, extra = ("nccl", {"device_id": torch.device("cuda", 0)}) if device == "cuda" else ("gloo", {})
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    try:
        return {"mixed_unit": fully_shard_unit(device, with_lora=True),
                "bf16_only_unit": fully_shard_unit(device, with_lora=False)}
    finally:
        dist.destroy_process_group()


def fsdp_copy_in(device: str) -> dict:
    """FSDP2's copy-in for rank 0 of 2, as `foreach_all_gather` calls it: the dtypes of a unit decide the buffer's
    (uint8 when they differ, pytorch #119302), and each input is copied into it with `_foreach_copy_`."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # registers torch.ops.fsdp

    payload = nan_payload(device)
    lora = torch.randn(4096, device=device)

    def rank0_part(inputs: list, dtype) -> torch.Tensor:
        sizes = [t.numel() for t in inputs]
        output = torch.empty(2 * sum(sizes), dtype=dtype, device=device)
        part, _ = torch.ops.fsdp.all_gather_copy_in(inputs, output, sizes, sum(sizes), 0)
        return part[: sizes[0]].view(torch.uint8)

    mixed = rank0_part([payload.view(torch.uint8), lora.view(torch.uint8)], torch.uint8)
    alone = rank0_part([payload], torch.bfloat16)
    original = payload.view(torch.uint8)
    return {"mixed_unit_as_uint8_bitwise": torch.equal(mixed, original), "bf16_unit_bitwise": torch.equal(alone, original)}


def two_rank_unshard(device: str) -> dict:
    """finetune's byte guard on FSDP2's real 2-rank unshard, in this one process (the module docstring): the route the
    guard picks for this device's copy, whether rank 0's packed bytes come back through FSDP2's copy-in and copy-out
    under it, and (a fact, reported) whether they would without the guard. {"skip": why} where this torch cannot make
    the 2-rank group here: no fault of finetune's."""
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    except Exception as exc:  # noqa: BLE001  a torch without it: the check cannot be made here
        return {"skip": f"no fake 2-rank process group in this torch: {type(exc).__name__}: {exc}"}
    try:
        try:
            mesh = init_device_mesh(device, (2,))
        except Exception as exc:  # noqa: BLE001
            return {"skip": f"a 2-rank {device} mesh over the fake group failed: {type(exc).__name__}: {exc}"}
        from finetune.parallel import byte_guard

        keeps = byte_guard.probe_copy(torch.bfloat16, device)
        route = byte_guard.route(keeps)
        return {"copy_keeps_bytes": keeps, "route": route, "route_keeps_bytes": _unshard_keeps_bytes(device, mesh, route),
                "unguarded_keeps_bytes": _unshard_keeps_bytes(device, mesh, "storage")}
    finally:
        dist.destroy_process_group()


def _unshard_keeps_bytes(device: str, mesh, route: str) -> bool:
    """A decoder-layer-like unit (packed bytes stored as bf16 and marked as bitsandbytes marks them, an fp32 LoRA
    beside them) prepared and sharded as finetune's FSDP2 wrap does for `route` (finetune/parallel/wrapping.py),
    unsharded once: are rank 0's rows of the packed weight the bytes it had (finetune's checksums)?"""
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from finetune.model.sources.shard_reads import dim0_chunk
    from finetune.parallel import byte_guard

    unit = nn.Module()
    unit.packed = nn.Parameter(nan_payload(device).clone().view(-1, 1), requires_grad=False)  # (n, 1) as bnb stores it
    unit.packed.quant_state = object()  # what marks a Params4bit for byte_guard.packed_parameters
    unit.lora = nn.Parameter(torch.randn(4, 64, device=device))
    if route == "uint8":
        byte_guard.store_as_bytes(unit)
    elif route == "mixed":
        byte_guard.check_mixed_unit(unit, label="the probe's unit")
    before = byte_guard.unit_checksums(unit, rank=0, world_size=2)  # rank 0's rows (the fake all-reduce adds nothing)
    param_dtype = None if route == "mixed" else torch.bfloat16
    fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    unit.unshard()
    try:
        tensor = unit.get_parameter("packed")  # unsharded: a plain tensor of every rank's rows
        row_bytes = tensor.numel() * tensor.element_size() // tensor.shape[0]
        first, last = dim0_chunk(tensor.shape[0], 0, 2)
        return byte_guard.checksum(tensor, first * row_bytes, last * row_bytes) == before["packed"]
    finally:
        unit.reshard()


def asked(question, *args):
    """The answer, or the error that stopped it (the other questions are still asked)."""
    try:
        return question(*args)
    except Exception as exc:  # noqa: BLE001  a probe answers every question it can
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def probe(*, cpu: bool) -> dict:
    started = time.perf_counter()
    found: dict = {"versions": versions(), "packages": packages(), "cuda": asked(cuda_facts)}
    device = "cuda" if not cpu and found["cuda"].get("available") else "cpu"
    found["device"] = device
    found["cublas_workspace_bytes"] = asked(cublas_workspace_bytes, device)
    found["foreach_copy_canonicalizes_nans"] = asked(copy_canonicalizes_nans, device)
    found["fully_shard_param_dtype_none"] = asked(fully_shard_probe, device)
    found["fsdp_copy_in"] = asked(fsdp_copy_in, device)
    found["two_rank_unshard"] = asked(two_rank_unshard, device)
    found["seconds"] = round(time.perf_counter() - started, 2)
    return found


def probe_lines(probe: dict) -> list[str]:
    """The probe's answers, one line each (an answer that failed shows its error)."""
    if "error" in probe:
        return [f"failed: {probe['error']}"]
    versions = ", ".join(f"{name} {version or '-'}" for name, version in probe["versions"].items())
    lines = [f"{probe['seconds']} s on {probe['device']}: {versions}"]
    if probe.get("packages"):
        lines.append(f"packages (pip show: version, location): {packages_line(probe['packages'])}")
    for key, say in (("cuda", _gpus_line), ("cublas_workspace_bytes", _workspace_line),
                     ("foreach_copy_canonicalizes_nans", _copy_line), ("fully_shard_param_dtype_none", _shard_line),
                     ("fsdp_copy_in", _copy_in_line), ("two_rank_unshard", _two_ranks_line)):
        answer = probe.get(key, {"error": "not asked"})
        lines.append(f"{key}: error: {answer['error']}" if isinstance(answer, dict) and "error" in answer else say(answer))
    return lines


def _gpus_line(cuda: dict) -> str:
    seen = f" ({cuda['device']}, sm {cuda['capability']})" if cuda.get("device") else ""
    return (f"torch sees {cuda['device_count']} GPU(s){seen}, built for CUDA {cuda['torch_cuda'] or '-'}; nvidia-smi "
            f"lists {len(cuda.get('gpus', []))}, driver {cuda.get('driver') or '-'} (CUDA {cuda.get('driver_cuda') or '-'})")


def _workspace_line(workspace: int | None) -> str:
    return "cuBLAS workspace: " + ("- (CPU)" if workspace is None else f"{workspace / 2**20:.1f} MiB")


def _copy_line(canonicalizes: bool) -> str:
    return "_foreach_copy_ of bf16 NaN payloads: " + ("rewrites them" if canonicalizes else "keeps the bytes")


def _copy_in_line(result: dict) -> str:
    return (f"FSDP2's 2-rank copy-in: mixed unit as uint8 bitwise {result['mixed_unit_as_uint8_bitwise']}; bf16 unit "
            f"bitwise {result['bf16_unit_bitwise']}")


def _two_ranks_line(result: dict) -> str:
    if "skip" in result:
        return f"byte guard on a 2-rank unshard: not made: {result['skip']}"
    return (f"byte guard on a 2-rank unshard (fake group): copy keeps the bytes {result['copy_keeps_bytes']} -> route "
            f"{result['route']!r}, rank 0's bytes kept {result['route_keeps_bytes']}; without the guard (bf16, "
            f"param_dtype bf16) kept {result['unguarded_keeps_bytes']}")


def _shard_line(result: dict) -> str:
    mixed, bf16 = result["mixed_unit"], result["bf16_only_unit"]
    return (f"fully_shard(param_dtype=None), 1 rank: mixed unit (bf16 payload + fp32 LoRA) bitwise {mixed['bitwise']}, "
            f"LoRA grad {mixed['lora_grad_dtype']} finite {mixed['lora_grad_finite']}; bf16-only unit bitwise "
            f"{bf16['bitwise']}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="ask the questions of the CPU (the smoke's dry run)")
    parser.add_argument("--imports", action="store_true", help="only import what a run needs (gpu_smoke.sh's "
                        "pre-check): exit 1 with the first error on one line, else 0 with the versions")
    args = parser.parse_args(argv)
    if args.imports:
        ok, line = check_imports()
        print(f"gpu-smoke: imports: {line}" if ok else f"gpu-smoke: {line}", flush=True)
        return 0 if ok else 1
    print(json.dumps(probe(cpu=args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
