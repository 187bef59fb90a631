"""The training dtype a device computes fast: `model.dtype: auto` resolved, and a warning where bf16 is emulated.

bf16 is the QLoRA dtype (the packed 4-bit storage, FSDP's param dtype, the LoRA compute) wherever the hardware has
bf16 arithmetic: NVIDIA GPUs from Ampere on (compute capability >= 8.0) and CPUs with AVX512-BF16 or AMX. Elsewhere
torch runs bf16 matmuls through its reference GEMM: measured on an AVX2-only CPU, a 2048x576 @ 576x1536 matmul took
3,250 ms in bf16 and 113 ms in fp32 (29x), and the quickstart trained at 6 tokens/s instead of finishing in ~2 min.
There `auto` is fp32. fp16 is never chosen (no loss scaler: recipe.py refuses it).

A leaf: torch is imported inside the functions, so `import finetune.recipe` stays light.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# "1"/"0" overrides the CPU probe: a test (or a user who measured otherwise) can take the other kind of CPU's branch.
NATIVE_BF16_ENV = "FINETUNE_NATIVE_BF16"
# Measured (see the module docstring and benchmarks/bench_dtype.py): bf16 against fp32 matmuls on an AVX2-only CPU.
EMULATED_BF16_SLOWDOWN = "~30x"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" | "float32" | "float16" (float16 is refused by the recipe's own check)
    requested: str  # what the recipe said: "auto" or an explicit dtype
    reason: str  # one clause: why this dtype (the device's bf16 support, or the accelerate config)
    warning: str | None = None  # an explicit bf16 on a device without native bf16


def target_device() -> tuple[str, int]:
    """("cuda", local index) when this process will train on a GPU, else ("cpu", 0): the launcher's LOCAL_RANK picks
    the GPU, as distributed.init_distributed does (called before the process group forms)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return "cuda", local % torch.cuda.device_count()
    return "cpu", 0


def cpu_bf16_flags() -> list[str]:
    """The bf16 arithmetic flags this x86 CPU reports (amx_bf16, avx512_bf16); empty elsewhere or unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]
    except OSError:
        pass
    return []


def cpu_summary() -> str:
    """`2 cores, Intel(R) Xeon(R) Processor, AMX`: what a CPU timing depends on most (benchmarks, the durations
    record)."""
    import platform
    import re

    name, units = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            found = re.search(r"model name\s*:\s*(.*)", handle.read())
        name = found.group(1).strip() if found else name
    except OSError:
        pass
    flags = cpu_bf16_flags()
    units = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if flags else "no bf16 matmul units"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ", ".join(part for part in (f"{cores} cores", name, units) if part)


def native_bf16(device_type: str, index: int = 0) -> tuple[bool, str]:
    """Whether `device_type` computes bf16 natively, and the fact that says so (for the one [finetune] line)."""
    import torch

    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        if (major, minor) >= (8, 0):
            return True, f"{name}, compute capability {major}.{minor} >= 8.0, computes bf16 natively"
        return False, f"{name}, compute capability {major}.{minor} < 8.0, has no bf16 arithmetic"
    override = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1", f"{NATIVE_BF16_ENV}={override}"
    flags = cpu_bf16_flags()
    # oneDNN (torch's fast CPU kernels) must take bf16 too; on non-x86 CPUs (Arm with BF16) it is the whole answer.
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    import platform

    if platform.machine() in ("x86_64", "AMD64", "i686"):
        if flags and onednn:
            return True, f"this CPU has {' and '.join(flag.upper().replace('_', '-') for flag in flags)}"
        return False, (f"this CPU has neither AVX512-BF16 nor AMX: bf16 matmuls would take torch's reference kernel, "
                       f"{EMULATED_BF16_SLOWDOWN} slower than fp32")
    if onednn:
        return True, f"this {platform.machine()} CPU computes bf16 through oneDNN"
    return False, f"this {platform.machine()} CPU has no bf16 arithmetic oneDNN uses"


# What `accelerate launch` writes for every process it starts, whatever its config (accelerate/utils/launch.py): its
# simple and torch elastic launchers the dynamo settings, its DeepSpeed launcher ACCELERATE_CONFIG_DS_FIELDS. A shell
# that exports ACCELERATE_MIXED_PRECISION (or another of its settings) has neither.
LAUNCH_MARKERS = ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_CONFIG_DS_FIELDS")


def started_by_accelerate(env=None) -> bool:
    """Whether this process (or `env`) was started by `accelerate launch`: its ACCELERATE_* / FSDP_* variables are then
    its config's. Outside a launch (`finetune train` in this process, `finetune validate`, `python run.py`, torchrun)
    they are the shell's, which a launch would have replaced with its config's (accelerate always writes
    mixed_precision and the dynamo settings): finetune ignores them there too, so that one shell trains the same run
    with and without a launcher, and names them (parallel/launcher.py, ignored_environment_note)."""
    env = os.environ if env is None else env
    return any(name in env for name in LAUNCH_MARKERS)


def launcher_mixed_precision() -> str | None:
    """bf16/fp16/fp8 when `accelerate launch` was given a config that states it (its workers' environment); else None
    ("no" is what accelerate writes when the config says nothing; outside a launch the variable is the shell's and
    ignored: started_by_accelerate)."""
    if not started_by_accelerate():
        return None
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    return value if value and value != "no" else None


def choose_dtype(requested: str, *, device: str = "here") -> DtypeChoice:
    """The dtype a run trains in. `requested` is model.dtype; `device` is "here" (this process's device) or "gpu"
    (planning for GPUs of compute capability >= 8.0 from any machine: `finetune plan`)."""
    if device == "gpu":
        native, fact = True, "planned for GPUs of compute capability >= 8.0"
        device_type = "cuda"
    else:
        device_type, index = target_device()
        native, fact = native_bf16(device_type, index)
    if requested != "auto":
        warning = None
        if requested == "bfloat16" and not native:
            warning = (f"model.dtype: bfloat16 on a device without native bf16 ({fact}). Fix: model.dtype=auto (or "
                       "float32) trains in fp32 here at full speed; keep bfloat16 only to reproduce a GPU run bit for bit.")
        return DtypeChoice(requested, requested, "set in the recipe", warning)
    mixed = launcher_mixed_precision()
    if mixed == "bf16":
        warning = None if native else (f"the accelerate config's mixed_precision: bf16 chose bfloat16 on a device without "
                                       f"native bf16 ({fact}). Fix: remove mixed_precision from the config (or set it "
                                       "to no) so that model.dtype: auto picks float32 here.")
        return DtypeChoice("bfloat16", "auto", "the accelerate config's mixed_precision: bf16", warning)
    if native:
        return DtypeChoice("bfloat16", "auto", fact)
    return DtypeChoice("float32", "auto", fact)
