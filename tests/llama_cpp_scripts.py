"""llama.cpp's converter scripts, the oracle of tests/outputs/test_llama_cpp_converter.py, fetched at install time.

    python tests/llama_cpp_scripts.py        (`make install` runs it: the suite itself downloads nothing)

They come from the llama-cpp-python sdist on PyPI (77 MB, ~100 s with pip; only the scripts are extracted, ~3 MB,
nothing is built) into the Python environment that runs it: `<sys.prefix>/llama.cpp-<LLAMA_CPP_PYTHON>`, so a fresh
venv has them and a deleted one takes them along.

pip downloads it first (it honours the machine's pip configuration: mirrors, proxies, certificates). Where that
fails, the file is read from PyPI in 8 MB ranges, each retried, and checked against SDIST_SHA256: a CI run once lost
its landing when pip's download of this file broke at 64.5 of 76.6 MB six times in a row (2026-12-06).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
CHUNK = 8 << 20
TRIES = 8
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
        sdist = download(Path(scratch))
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


def download(scratch: Path) -> Path:
    """The sdist in `scratch`: pip's download, else PyPI's file read in ranges; its sha256 checked either way."""
    pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                          f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(scratch)], timeout=900, check=False)
    sdist = scratch / SDIST
    if pip.returncode == 0 and sdist.is_file() and sha256(sdist) == SDIST_SHA256:
        return sdist
    print(f"pip's download of {SDIST} failed (exit {pip.returncode}): reading it from PyPI in ranges", flush=True)
    sdist.unlink(missing_ok=True)
    ranged_download(sdist_url(), sdist)
    if (digest := sha256(sdist)) != SDIST_SHA256:
        raise SystemExit(f"{SDIST}: sha256 {digest}, expected {SDIST_SHA256}: the download is not PyPI's file")
    return sdist


def _context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)


def _retry(what: str, call):
    for attempt in range(1, TRIES + 1):
        try:
            return call()
        except (OSError, http.client.HTTPException) as error:  # URLError, resets, timeouts, IncompleteRead
            if attempt == TRIES:
                raise SystemExit(f"{what}: failed {TRIES} times, last with {error!r}") from error
            time.sleep(min(2 ** attempt, 30))


def sdist_url() -> str:
    """The sdist's address, from PyPI's simple index (JSON, PEP 691)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})

    def read() -> dict:
        with urllib.request.urlopen(request, timeout=60, context=_context()) as response:
            return json.load(response)

    files = _retry(f"reading {INDEX}", read)["files"]
    return next(entry["url"] for entry in files if entry["filename"] == SDIST)


def ranged_download(url: str, path: Path) -> None:
    """Read `url` into `path` CHUNK bytes at a time (HTTP Range), each range retried on its own."""
    def size() -> int:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60, context=_context()) as head:
            return int(head.headers["Content-Length"])

    def read(first: int, last: int) -> bytes:
        request = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
        with urllib.request.urlopen(request, timeout=120, context=_context()) as response:
            body = response.read()
        if response.status != 206 or len(body) != last - first + 1:
            raise ConnectionError(f"bytes {first}-{last}: status {response.status}, {len(body)} bytes")
        return body

    total = _retry(f"the size of {url}", size)
    with path.open("wb") as out:
        for first in range(0, total, CHUNK):
            last = min(first + CHUNK, total) - 1
            out.write(_retry(f"{url} bytes {first}-{last}", lambda first=first, last=last: read(first, last)))


def sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


if __name__ == "__main__":
    print(f"llama.cpp's converter (llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist): {fetch()}")
