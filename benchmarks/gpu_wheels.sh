#!/usr/bin/env bash
# The wheels a GPU machine without network needs to run this project (and `make gpu-smoke`) with its own preinstalled
# CUDA torch (Python 3.12, x86-64), made here where the package registries are reachable; versions as tested
# (constraints/tested.txt). About 48 MiB: bitsandbytes 41, DeepSpeed 2.1, the rest small.
#   bash benchmarks/gpu_wheels.sh [DIR]          # default .whl (git-ignored)
# Then, on the GPU machine (with DIR carried there):  WHEELS=DIR make gpu-smoke
# benchmarks/gpu_smoke.sh installs them beside that Python for the run only (pip --no-index --no-deps --target).
#   * binary wheels downloaded for Python 3.12: bitsandbytes, datasets (+ dill, multiprocess, xxhash), pydantic (+ its
#     core, annotated-types, typing-inspection), gguf;
#   * DeepSpeed and hjson, for the smoke's ZeRO-3 run: DeepSpeed publishes only a source archive, so its wheel is built
#     here (pure Python with DS_BUILD_OPS=0: its ops compile at first use, and finetune uses none of them, passing
#     torch's AdamW); hjson is pure Python. DeepSpeed's other requirements (einops, msgpack, ninja, numpy, packaging,
#     psutil, py-cpuinfo, tqdm) are in the GPU machines' image already (the device tool's KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
pins() {  # name==version of each package, as constraints/tested.txt pins it (case and - / _ as written there)
  for name in "$@"; do
    line=$(grep -i -E "^${name//[-_]/[-_]}==" constraints/tested.txt | head -1)
    [ -n "$line" ] || { echo "gpu_wheels: $name is not pinned in constraints/tested.txt" >&2; exit 1; }
    echo "$line"
  done
}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# pydantic and pydantic-core must be a matching pair (pydantic refuses to import otherwise): both as tested.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d "$DIR" \
  $(pins bitsandbytes datasets dill multiprocess xxhash pydantic pydantic-core annotated-types typing-inspection gguf)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$DIR" $(pins deepspeed hjson)
ls "$DIR"
du -sh "$DIR"
