"""The host allocator setting of FSDP ranks on CPU (finetune/host_memory.py), checked on glibc itself: after a large
block was freed, glibc's own dynamic threshold serves a 2 MiB block from the heap (kept by the process once freed);
with the setting it is mmapped (given back to the OS when freed). Run in a fresh interpreter each: the setting is
process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune import host_memory

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
