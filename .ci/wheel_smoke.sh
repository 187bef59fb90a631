#!/usr/bin/env bash
# The path of a user who installs the wheel: build it, check that it holds every recipe, accelerate config and
# module of the checkout (.ci/wheel_contents.py), install it into a fresh venv (runtime dependencies only, the
# versions of the dev venv, --no-deps from local wheels: no second resolution), then from an empty folder outside
# the checkout: list and copy library recipes, a tiny training run (the quickstart, without the optional extras), a
# 2-process run started with a library accelerate config by name, and an export. Usage: .ci/wheel_smoke.sh DEV_PYTHON [WORKDIR]
set -euo pipefail
dev_python=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${2:-}" ]; then
  work=$2  # kept for a look afterwards
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT  # 1.6 GB of venv: not left behind in /tmp at every run
fi
start=$(date +%s)
step() { echo "[wheel-check] $(( $(date +%s) - start ))s: $*"; }

step "building the wheel"
rm -rf "$repo/build" "$work/dist"  # a stale build/lib would put deleted modules into the wheel
"$dev_python" -m pip wheel -q --no-deps -w "$work/dist" "$repo"
rm -rf "$repo/build"
wheel=$(ls "$work"/dist/finetune-*.whl)
"$dev_python" "$repo/.ci/wheel_contents.py" "$wheel"  # every recipe, accelerate config and module is in it
"$dev_python" "$repo/.ci/wheel_closure.py" "$wheel" > "$work/requirements.txt"

step "installing it into a fresh venv ($(wc -l < "$work/requirements.txt") runtime packages, --no-deps)"
rm -rf "$work/venv"
# The dev venv's own interpreter (its closure holds wheels for that Python), not whatever python3 is on PATH.
base_python=$("$dev_python" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
"$base_python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --no-deps)
if ! "${pip[@]}" -r "$work/requirements.txt" "$wheel" 2>"$work/pip.err"; then
  # torch's CPU build (a +cpu version) may only be on PyTorch's CPU index, as in the Makefile.
  "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu -r "$work/requirements.txt" "$wheel"
fi
"$work/venv/bin/python" -m pip check
bin=$work/venv/bin

mkdir -p "$work/empty" && cd "$work/empty"
unset PYTHONPATH
export OMP_NUM_THREADS=1
export FINETUNE_CACHE="$work/cache"  # the runs below tokenize and convert into the check's own cache, not the user's
installed=$("$bin/python" -c "import finetune; print(finetune.__file__)")
case $installed in "$work"/venv/*) ;; *) echo "finetune imported from $installed, not the wheel" >&2; exit 1 ;; esac

step "the named chat templates travel in the wheel (model.chat_template: qwen3, ...)"
"$bin/python" -c "from finetune.chat_templates import named_templates as n; t = n(); assert len(t) == 8 and 'qwen3' in t, sorted(t)"

step "finetune recipes"
"$bin/finetune" recipes | tee recipes.txt
grep -q "^quickstart " recipes.txt && grep -q "fsdp2" recipes.txt

step "finetune recipes copy (twice: the second must refuse)"
"$bin/finetune" recipes copy quickstart mine.yaml
echo "# edited" >> mine.yaml
if "$bin/finetune" recipes copy quickstart mine.yaml 2>copy.err; then echo "copy overwrote mine.yaml" >&2; exit 1; fi
grep -q "already exists" copy.err && tail -1 mine.yaml | grep -q "# edited"

step "finetune quickstart --tiny (a tiny training run of the library's quickstart recipe)"
# matplotlib and gguf are optional extras (plot, gguf), not installed here: the tiny run needs neither, writes no
# plot.png and says once what to install; the real quickstart's GGUF model needs `finetune[gguf]`.
"$bin/python" -c "import matplotlib" 2>/dev/null && { echo "matplotlib came with the runtime dependencies" >&2; exit 1; }
"$bin/finetune" quickstart --tiny --out runs/quickstart 2>&1 | tee quickstart.log
test -f runs/quickstart/adapter/adapter_model.safetensors
test ! -f runs/quickstart/plot.png && grep -q "pip install 'finetune\[plot\]'" quickstart.log

step "finetune train mine.yaml --accelerate-config ddp (a library config by name, 2 processes; CPU switch only)"
ACCELERATE_USE_CPU=true "$bin/finetune" train mine.yaml --accelerate-config ddp model.name_or_path=runs/quickstart/tiny-model \
  model.gguf_file=null model.dtype=bfloat16 train.max_steps=2 train.warmup_steps=0 train.micro_batch_size=2 \
  eval.generation_rows=0 output.dir=runs/ddp
test -f runs/ddp/adapter/adapter_model.safetensors

step "finetune export"
"$bin/finetune" export runs/quickstart exported
test -f exported/adapter_model.safetensors
step "wheel check passed"
