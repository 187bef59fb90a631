#!/usr/bin/env bash
# The wheels a GPU machine without network needs to run this project (and `make gpu-smoke`) with its own preinstalled
# CUDA torch (Python 3.12, x86-64; the lent machine: torch 2.11, transformers 5.17, hub 1.33), made here where the
# package registries are reachable. About 47 MiB: bitsandbytes 41, DeepSpeed 2, the rest small.
#   bash benchmarks/gpu_wheels.sh [DIR]          # default .whl (git-ignored)
# Then, on the GPU machine (with DIR carried there):  WHEELS=DIR make gpu-smoke
# benchmarks/gpu_smoke.sh installs them beside that Python for the run only (pip --no-index --no-deps --target), so
# nothing checks their requirements there: they must import beside whatever pyarrow, fsspec and typing_extensions that
# image has (versions unknown; torch asks typing_extensions >= 4.10, the hub fsspec >= 2023.5). Hence the declared
# floor (constraints/floor.txt, tested with torch 2.11 / transformers 5.17 by `make test-compat`), whose requirements
# are loose, not the newest set (constraints/tested.txt), whose are not:
#   * datasets 4.0.0 (pyarrow >= 15; fsspec <= 2025.3.0 declared, imports and loads JSON with fsspec 2026.9.0) and
#     the dill / multiprocess its bounds admit; datasets 5.2.0 fails to import with pyarrow < 21 ("module 'pyarrow'
#     has no attribute 'json_'") and asks pyarrow >= 24;
#   * pydantic 2.7.0 with its pydantic-core 2.18.1 (typing_extensions >= 4.6.1); pydantic-core 2.50 (pydantic 2.14)
#     fails to import with typing_extensions < 4.16 ("cannot import name 'Sentinel'");
#   * bitsandbytes 0.50.2, not the floor's 0.50.0: the newest 0.50 (torch >= 2.4, numpy, packaging), whose
#     libbitsandbytes_cuda130.so matches torch's CUDA 13.0 build;
#   * DeepSpeed 0.19.3 (the floor) and hjson, for the smoke's ZeRO-3 run: DeepSpeed publishes only a source archive,
#     so its wheel is built here (pure Python with DS_BUILD_OPS=0: its ops compile at first use, and finetune uses none
#     of them, passing torch's AdamW); its other requirements (einops, msgpack, ninja, numpy, packaging, psutil,
#     py-cpuinfo, pydantic >= 2, tqdm) are in the image or carried here;
#   * xxhash (datasets'; the image has one too: this one wins on the path) and gguf (GGUF model sources).
# Checked (2026-12-07) with the Python 3.11 builds of the same versions under the compat floor's Python (torch 2.11):
# each module imports and datasets loads and saves JSON rows with fsspec 2026.9.0, pyarrow 18.1.0 and
# typing_extensions 4.10.0 in front of the floor's own (benchmarks/gpu_probe.py --imports is the check).
# After downloading, a dry install for the device's tags (cp312, manylinux x86-64) proves the set installs: one version
# of each package (two stop pip), every wheel for Python 3.12.
# PY_VERSION=3.11 makes the same set for this machine's Python, to check it here (a local import check).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p "$DIR"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
BINARY=(bitsandbytes==0.50.2 datasets==4.0.0 dill==0.3.8 multiprocess==0.70.16 xxhash==4.1.0 pydantic==2.7.0
        pydantic-core==2.18.1 annotated-types==0.8.0 gguf==0.19.0)
BUILT=(deepspeed==0.19.3 hjson==3.1.0)
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
TAGS=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${PLAT[@]}")
"$PY" -m pip download -q --no-deps "${TAGS[@]}" -d "$DIR" "${BINARY[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$DIR" "${BUILT[@]}"
# The install gpu_smoke.sh runs there, for the device's tags: a second version of a package, or a wheel for another
# Python, fails here instead of on the lent machine.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$check" "${TAGS[@]}" "$DIR"/*.whl
ls "$DIR"
du -sh "$DIR"
