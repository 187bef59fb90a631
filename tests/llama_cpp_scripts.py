"""llama.cpp's converter scripts, the oracle of tests/outputs/test_llama_cpp_converter.py, fetched at install time.

    python tests/llama_cpp_scripts.py        (`make install` runs it: the suite itself downloads nothing)

They come from the llama-cpp-python sdist on PyPI (77 MB, ~100 s with pip; only the scripts are extracted, ~3 MB,
nothing is built) into the Python environment that runs it: `<sys.prefix>/llama.cpp-<LLAMA_CPP_PYTHON>`, so a fresh
venv has them and a deleted one takes them along.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f
WANTED = ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE",
          "src/llama-adapter.cpp", "src/llama-adapter.h")


def folder() -> Path:
    return Path(sys.prefix) / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def present() -> bool:
    return (folder() / "convert_lora_to_gguf.py").is_file()


def fetch() -> Path:
    """Download the sdist and extract the scripts (once: an existing folder is kept)."""
    target = folder()
    if present():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", scratch], check=True, timeout=900)
        (sdist,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
        staging = Path(scratch) / "llama.cpp"
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                inner = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and member.isfile() and inner.startswith(WANTED):
                    path = staging / inner
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(archive.extractfile(member).read())
        os.replace(staging, target)
    return target


if __name__ == "__main__":
    print(f"llama.cpp's converter (llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist): {fetch()}")
