#!/usr/bin/env bash
# `make gpu-smoke`: the CUDA path on one GPU in one run of at most ~8 minutes (--deadline-s, default 480: a lent GPU
# machine cuts a command at 10; benchmarks/gpu_smoke.py says what it checks). Exits with its code: 0 when no check
# failed, 1 when one did; on a machine without a GPU it says so in one line and exits 2.
#   bash benchmarks/gpu_smoke.sh [--json FILE] [--hidden N --layers N --steps N] [--deadline-s S]
#   make gpu-smoke ARGS="--json $OUT/gpu_smoke.json --deadline-s 420"   # or GPU_SMOKE_JSON / GPU_SMOKE_DEADLINE_S set
# Without a GPU, `python benchmarks/gpu_smoke.py --dry-run --work DIR` rehearses the same runs and checks on the CPU.
# Python, first that imports a CUDA build of torch: $PY; .venv/bin/python; python3 (a machine with CUDA torch
# preinstalled and no network: pass WHEELS=DIR with the wheels of what it lacks, made where the registries are by
# `bash benchmarks/gpu_wheels.sh DIR`: bitsandbytes, datasets, pydantic, gguf, and DeepSpeed + hjson for the ZeRO-3 run).
# With none of them but an NVIDIA driver present, `make install` sets up .venv with the CUDA build first.
# A relative path given (--json FILE, GPU_SMOKE_JSON, WHEELS, PY) is the caller's: resolved against the folder it was
# run from before the script moves to the checkout.
set -euo pipefail
CALLER=$PWD
absolute() { case "$1" in /* | "") printf '%s' "$1" ;; *) printf '%s/%s' "$CALLER" "$1" ;; esac; }
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --json) args+=("$1"); shift; [ $# -gt 0 ] && { args+=("$(absolute "$1")"); shift; } ;;
    --json=*) args+=("--json=$(absolute "${1#--json=}")"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "${GPU_SMOKE_JSON:-}" ]; then GPU_SMOKE_JSON=$(absolute "$GPU_SMOKE_JSON"); export GPU_SMOKE_JSON; fi
WHEELS=$(absolute "${WHEELS:-}")
case "${PY:-}" in */*) PY=$(absolute "$PY") ;; esac  # a bare name (python3.11) is looked up on PATH
cd "$(dirname "$0")/.."

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
pick_python() {
  for candidate in "${PY:-}" .venv/bin/python python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

if ! PYTHON=$(pick_python); then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "gpu-smoke: no Python with a CUDA build of torch yet: make install (the CUDA build of torch, into .venv)"
    make install
    PYTHON=.venv/bin/python
    has_cuda "$PYTHON" || { echo "gpu-smoke: .venv's torch does not see the GPU (torch.cuda.is_available() is False)"; exit 1; }
  else
    echo "gpu-smoke: no CUDA GPU on this machine (no NVIDIA driver, and no torch here sees one); run it on a GPU machine."
    exit 2
  fi
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -n "${WHEELS:-}" ]; then  # what the preinstalled Python lacks, installed beside it for this run only
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$WORK/site" "$WHEELS"/*.whl
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$("$PYTHON" -c "
import importlib.util
print(' '.join(m for m in ('bitsandbytes', 'peft', 'transformers', 'accelerate', 'datasets', 'pydantic', 'yaml',
                            'safetensors') if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "gpu-smoke: $PYTHON lacks: $missing. Install them (make install), or pass WHEELS=DIR with their wheels."
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # finetune from this checkout, whichever Python runs it
# Not `exec`: the EXIT trap above must still remove $WORK (the runs' folders, the wheels) when Python ends.
status=0
"$PYTHON" benchmarks/gpu_smoke.py --work "$WORK" ${args[@]+"${args[@]}"} || status=$?
exit "$status"
