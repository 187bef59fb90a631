#!/usr/bin/env bash
# `make gpu-smoke`: the CUDA path on one GPU in one run of at most ~8 minutes (--deadline-s, default 480: a lent GPU
# machine cuts a command at 10; benchmarks/gpu_smoke.py says what it checks). Exits with its code: 0 when no check
# failed, 1 when one did; on a machine without a GPU it says so in one line and exits 2.
#   bash benchmarks/gpu_smoke.sh [--json FILE] [--hidden N --layers N --steps N] [--deadline-s S]
#   WHEELS=.whl make gpu-smoke ARGS="--deadline-s 420"     # on a lent machine: the JSON goes to $OUT/gpu_smoke.json
# Without a GPU, `python benchmarks/gpu_smoke.py --dry-run --work DIR` rehearses the same runs and checks on the CPU.
# The JSON: --json FILE, else $GPU_SMOKE_JSON, else $OUT/gpu_smoke.json where OUT is set (the lent machine brings back
# only $OUT), else benchmarks/gpu_smoke.json. Every early exit here (no Python with CUDA torch, the wheels not
# installed, a module that does not import) writes one line of JSON there, {"error": ..., "stage": ..., "exit_code": ...},
# besides its one line of output.
# Python, first that imports a CUDA build of torch: $PY; .venv/bin/python; python3 (a machine with CUDA torch
# preinstalled and no network: pass WHEELS=DIR with the wheels of what it lacks, made where the registries are by
# `bash benchmarks/gpu_wheels.sh DIR`: bitsandbytes, datasets, pydantic, gguf, and DeepSpeed + hjson for the ZeRO-3 run).
# Nothing is installed from a registry here (a lent machine has no network): with none of them, it says what to do.
# A relative path given (--json FILE, GPU_SMOKE_JSON, WHEELS, PY, OUT) is the caller's: resolved against the folder it
# was run from before the script moves to the checkout.
set -euo pipefail
CALLER=$PWD
absolute() { case "$1" in /* | "") printf '%s' "$1" ;; *) printf '%s/%s' "$CALLER" "$1" ;; esac; }
args=()
JSON=
while [ $# -gt 0 ]; do
  case "$1" in
    --json) args+=("$1"); shift; [ $# -gt 0 ] && { JSON=$(absolute "$1"); args+=("$JSON"); shift; } ;;
    --json=*) JSON=$(absolute "${1#--json=}"); args+=("--json=$JSON"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "${GPU_SMOKE_JSON:-}" ]; then GPU_SMOKE_JSON=$(absolute "$GPU_SMOKE_JSON"); export GPU_SMOKE_JSON; fi
if [ -n "${OUT:-}" ]; then OUT=$(absolute "$OUT"); export OUT; fi
WHEELS=$(absolute "${WHEELS:-}")
case "${PY:-}" in */*) PY=$(absolute "$PY") ;; esac  # a bare name (python3.11) is looked up on PATH
cd "$(dirname "$0")/.."
# Where gpu_smoke.py writes its JSON (its default_json), for the early exits below
JSON=${JSON:-${GPU_SMOKE_JSON:-${OUT:+$OUT/gpu_smoke.json}}}
JSON=${JSON:-$PWD/benchmarks/gpu_smoke.json}

json_string() {  # $1 as a JSON string: control characters dropped, backslash, quote, newline and tab escaped
  local text
  text=$(printf '%s' "$1" | tr -d '\000-\010\013-\037')
  text=${text//\\/\\\\}; text=${text//\"/\\\"}; text=${text//$'\n'/\\n}; text=${text//$'\t'/\\t}
  printf '"%s"' "$text"
}
stop() {  # exit code, stage, reason: one line out, one line of JSON where the smoke's JSON would go, exit
  echo "gpu-smoke: $3"
  if mkdir -p "$(dirname "$JSON")" 2>/dev/null; then
    printf '{"error": %s, "stage": "%s", "exit_code": %d}\n' "$(json_string "$3")" "$2" "$1" > "$JSON" || true
  fi
  exit "$1"
}

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
    # Never `make install` from here: on a machine without network (a lent GPU machine) it cannot succeed and would
    # spend the rest of the command.
    stop 2 python "an NVIDIA GPU is here but no Python that imports a CUDA build of torch (tried: ${PY:+$PY, }.venv/bin/python, python3). Fix: where the package registries are reachable, \`make install\` (it installs the CUDA build into .venv); else PY=/path/to/python whose torch sees the GPU, with WHEELS=DIR for what it lacks (bash benchmarks/gpu_wheels.sh DIR where the registries are)."
  fi
  stop 2 python "no CUDA GPU on this machine (no NVIDIA driver, and no torch here sees one); run it on a GPU machine."
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -n "${WHEELS:-}" ]; then  # what the preinstalled Python lacks, installed beside it for this run only
  wheels=("$WHEELS"/*.whl)
  [ -e "${wheels[0]}" ] || stop 1 wheels "WHEELS=$WHEELS holds no .whl file. Fix: bash benchmarks/gpu_wheels.sh DIR where the package registries are, and carry DIR here."
  if ! log=$("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "${wheels[@]}" 2>&1); then
    stop 1 wheels "pip could not install the wheels of $WHEELS into $PYTHON's run: $(printf '%s' "$log" | grep -v '^WARNING' | tail -n 5 | tr '\n' ' ')Fix: one version of each package, every wheel for this Python (bash benchmarks/gpu_wheels.sh DIR makes such a set)."
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # finetune from this checkout, whichever Python runs it
# Each module a run needs, imported (a module found can still fail to import): the first error, once, with the
# versions of what it met (pip show: the image's pyarrow, fsspec, typing_extensions and the carried wheels)
if ! imports=$("$PYTHON" benchmarks/gpu_probe.py --imports 2>"$WORK/imports.err"); then
  why=$(printf '%s\n' "$imports" | grep '^gpu-smoke: ' | tail -n 1 | sed 's/^gpu-smoke: //' || true)
  [ -n "$why" ] || why="benchmarks/gpu_probe.py --imports ended without its message: $(tail -n 3 "$WORK/imports.err" | tr '\n' ' ')"
  stop 1 imports "$why Fix: carry the missing or matching wheels (WHEELS=DIR, made by bash benchmarks/gpu_wheels.sh DIR where the registries are), or, where the registries are reachable, make install."
fi
echo "$imports"
# Not `exec`: the EXIT trap above must still remove $WORK (the runs' folders, the wheels) when Python ends.
status=0
"$PYTHON" benchmarks/gpu_smoke.py --work "$WORK" ${args[@]+"${args[@]}"} || status=$?
exit "$status"
