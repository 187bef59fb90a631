"""The host allocator setting of FSDP ranks on CPU (finetune/host_memory.py). On glibc itself: after a large block was
freed, glibc's own dynamic threshold serves a 2 MiB block from the heap (kept by the process once freed); with the
setting it is mmapped (given back to the OS when freed); each in a fresh interpreter, the setting is process-wide.
And on a real 2-rank FSDP2 run (this file is the worker): glibc's own accounting (mallinfo2) after each step, the
bytes in use (every live tensor included) and the free bytes the heap keeps. Without the setting the heap kept
95-114 MiB free on this 3-layer model (1.0 GiB on 24 layers) while the bytes in use were flat: that is where an FSDP2
rank's training memory went on CPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if __name__ != "__main__":
    from conftest import addition_rows, child_env, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe

from finetune import host_memory  # the editable install: importable in the worker too

CHECK = """
import ctypes, sys
sys.path.insert(0, {repo!r})
from finetune import host_memory

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
print(host_memory.bound_heap_growth())
libc.free(libc.malloc(16 << 20))  # glibc raises its mmap threshold to 16 MiB here, unless it is fixed
before = libc.mallinfo2().hblkhd
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - before >= 2 << 20)  # mmapped
libc.free(block)
"""


@pytest.mark.skipif(host_memory._libc() is None or not hasattr(host_memory._libc(), "mallinfo2"), reason="glibc only")
@pytest.mark.parametrize("setting,expected", [("", ["True", "True"]), ("default", ["False", "False"])])
def test_large_blocks_are_mmapped_once_the_setting_is_on(setting, expected, monkeypatch):
    from conftest import REPO

    monkeypatch.setenv("FINETUNE_CPU_ALLOCATOR", setting)
    result = subprocess.run([sys.executable, "-c", CHECK.format(repo=str(REPO))], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected


@pytest.mark.slow
@pytest.mark.skipif(host_memory._libc() is None or not hasattr(host_memory._libc(), "mallinfo2"), reason="glibc only")
def test_an_fsdp2_rank_on_cpu_keeps_no_freed_heap_and_flat_memory(tmp_path):
    from finetune.cli.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", family="qwen2", hidden_size=1024, num_layers=3)  # 1-4 MiB tensors
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(model_dir, data, tmp_path / "run", model={"dtype": "bfloat16"},
                                                          lora={"r": 4, "alpha": 8, "dropout": 0.05},
                                                          train={"max_steps": 4, "micro_batch_size": 1}))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            __file__, str(recipe), "parallel.strategy=fsdp", "parallel.fsdp_version=2"]
    result = run_cmd(args, env=child_env(REPORT_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"heap{rank}.json").read_text())
        assert len(steps) == 4, steps
        assert max(step["free_in_heap"] for step in steps) <= 48 << 20, steps  # measured 11-16 MiB; 95-114 before
        # From step 2 on the heap grows only with the bytes in use (those may step up once by a 16 MiB block).
        assert steps[-1]["heap"] - steps[1]["heap"] <= steps[-1]["in_use"] - steps[1]["in_use"] + (8 << 20), steps


if __name__ == "__main__":
    import ctypes
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from finetune.run import main
    from finetune.training import loop

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    steps, optimizer_step = [], loop.optimizer_step

    def recorded_step(*args, **kwargs):
        result = optimizer_step(*args, **kwargs)
        info = libc.mallinfo2()
        steps.append({"in_use": info.uordblks + info.hblkhd, "free_in_heap": info.fordblks, "heap": info.arena})
        return result

    loop.optimizer_step = recorded_step
    code = main(sys.argv[1:] + [f"output.dir={os.environ['REPORT_DIR']}/run"])
    (Path(os.environ["REPORT_DIR"]) / f"heap{os.environ['RANK']}.json").write_text(json.dumps(steps))
    sys.exit(code)


def test_release_after_the_load_empties_cudas_cache_on_a_gpu_only(monkeypatch):
    """After the sharded load and wrap, the staging tensors' blocks leave CUDA's caching allocator. Simulated: no CUDA
    here, so torch.cuda.empty_cache (the one op) is patched to count its calls."""
    import torch

    from finetune import host_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    host_memory.release_freed_memory(torch.device("cpu"))
    host_memory.release_freed_memory()
    assert calls == []
    host_memory.release_freed_memory(torch.device("cuda", 0))
    assert calls == [1]
