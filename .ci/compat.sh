#!/usr/bin/env bash
# `make test-compat`: the two ends of the range pyproject.toml declares, each installed in a venv of its own from
# constraints/floor.txt and constraints/newest.txt, run through a representative subset of the suite on tiny models
# (single, DDP, FSDP1, FSDP2 with sharded loading, ZeRO-3, DPO, kill -9 and resume, export, model.dtype: auto).
#
# PyPI's torch for other versions than the dev venv's is a CUDA build (with its nvidia-* wheels); it runs on the CPU.
# Each venv holds the dependencies only (the checkout is put on PYTHONPATH, never installed into it), so it is kept
# under $FINETUNE_COMPAT_DIR (default ~/.cache/finetune/compat), keyed by the constraints file and pyproject's requirements:
# a rerun with neither changed installs and downloads nothing. Usage: .ci/compat.sh [SET ...]  (default: floor newest);
# INSTALL_ONLY=1 installs the venvs and runs nothing (.ci/run starts it beside the suite: the downloads take the
# network's time, not the CPU's).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${FINETUNE_COMPAT_DIR:-$HOME/.cache/finetune/compat}
python=${PYTHON:-python3}
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(floor newest)
mkdir -p "$root"
start=$(date +%s)
say() { echo "[test-compat] $(( $(date +%s) - start ))s: $*"; }
# pip, tried three times: a download broken mid-file fails the install (seen in CI: a 77 MB file broke at the same byte
# six times in one pip run); the files a failed try completed stay in pip's cache, so a retry fetches only the rest.
pip_retry() {
  local try
  for try in 1 2 3; do
    "$@" && return 0
    [ "$try" -lt 3 ] && { echo "[test-compat] pip failed (try $try of 3): again in $((30 * try)) s" >&2; sleep $((30 * try)); }
  done
  return 1
}

# What the subset runs, as wide as the features: every objective (SFT, DPO, KTO, GRPO) in real runs, every strategy
# as shipped (single, DDP, FSDP1, FSDP2 with sharded loading, ZeRO-3) and HSDP's 2-D mesh, exact resume after kill -9,
# the data store (ranks tokenizing once) and streaming, one MoE (Mixtral's experts in 4 bits under single, DDP and
# FSDP2), export, the dtype choice, the library API names, and TRL's own losses as the oracle where TRL installs.
subset=(
  "tests/parallel/test_shipped.py::test_shipped_accelerate_config_trains[single_gpu-llama-ckpt]"
  "tests/parallel/test_shipped.py::test_shipped_accelerate_config_trains[ddp-llama-ckpt]"
  "tests/parallel/test_shipped.py::test_shipped_accelerate_config_trains[fsdp1-llama-ckpt]"
  "tests/parallel/test_shipped.py::test_shipped_accelerate_config_trains[fsdp2-llama-ckpt]"
  "tests/parallel/test_shipped.py::test_shipped_accelerate_config_trains[deepspeed_zero3-llama-ckpt]"
  "tests/parallel/test_hybrid_shard.py::test_hybrid_shard_runs_as_two_nodes_of_two"
  "tests/parallel/test_experts_parallel.py::test_moe_trains_the_same_curve_single_ddp_fsdp2[mixtral-configs0-False]"
  "tests/outputs/test_checkpoint.py::test_sigkill_then_resume_gives_the_same_adapter_bitwise[fsdp2]"
  # FSDP2 + 4-bit with the copy rewriting NaNs as CUDA's: on the floor (torch 2.11) the units-of-mixed-dtypes route
  "tests/parallel/test_byte_guard.py::test_below_torch_2_12_the_packed_bytes_travel_in_units_of_mixed_dtypes"
  "tests/training/test_preference.py::test_each_loss_equals_the_plain_implementation[sigmoid]"
  "tests/training/test_preference.py::test_step_one_is_ln2_and_the_precomputed_reference_matches_adapter_off[adapter]"
  "tests/training/test_kto.py::test_step_one_is_half_the_mean_weight_and_it_learns"
  # GRPO: a real run killed and resumed (decoding with the KV cache, whose names transformers changed in 5.25: a raw
  # AttributeError on the floor until training/rollout.py named them by version), and sampling against generate
  "tests/training/test_grpo_runs.py::test_kill_then_resume_is_bitwise_with_the_sampling_seeded_by_step"
  "tests/training/test_grpo.py::test_near_zero_temperature_is_transformers_greedy_generate"
  "tests/training/test_grpo.py::test_a_completion_depends_on_its_seed_not_on_the_other_rows"
  "tests/training/test_reward.py::test_a_reward_model_trains_under_every_engine_and_exports_with_its_head"
  "tests/training/test_reward.py::test_grpo_scores_completions_with_a_trained_reward_model"
  "tests/data/test_store.py::test_a_ddp_launch_tokenizes_in_worker_processes_forked_after_the_process_group"
  "tests/data/test_store.py::test_two_processes_started_together_tokenize_once_and_map_the_same_rows"
  "tests/data/test_streaming.py::test_streaming_packed_run_trains_on_the_streams_tokens"
  "tests/outputs/test_export.py::test_clean_adapter_loads_in_plain_peft"
  "tests/outputs/test_export.py::test_merged_model_matches_base_plus_adapter"
  "tests/test_precision.py"
  "tests/test_library_apis.py"
  "tests/test_warm.py::test_the_launches_of_this_module_were_warm"
)
# TRL's losses, where TRL installs at that end of the range (trl 1.16 needs accelerate >= 1.10.1: not on the floor)
oracles=(tests/training/test_preference_oracle.py tests/training/test_kto_oracle.py tests/training/test_grpo_oracle.py)

# The project's runtime, dev and deepspeed requirements, read from pyproject.toml (the checkout itself is not installed).
# Less trl, installed after them where it can be (`trl` below): trl 1.16 needs accelerate >= 1.10.1, above the floor;
# it must not move any pinned version.
requirements=$("$python" - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
dev = [r for r in project["optional-dependencies"]["dev"] if not r.startswith("trl")]
print("\n".join(project["dependencies"] + dev + project["optional-dependencies"]["deepspeed"]))
EOF
)
trl=$("$python" -c 'import sys, tomllib; print(next(r for r in tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["dev"] if r.startswith("trl")))' "$repo/pyproject.toml")

status=0
for set in "${sets[@]}"; do
  constraints="$repo/constraints/$set.txt"
  [ -f "$constraints" ] || { echo "[test-compat] no constraints file $constraints" >&2; exit 2; }
  # what the venv holds, nothing else: trl's pin too (installed once per venv below; left out, a new pin kept the old
  # trl, or none, and the oracle tests ran against it or were skipped: bb63)
  key=$( (cat "$constraints"; echo "$requirements"; echo "$trl") | sha256sum | cut -c1-12)
  venv="$root/$set-$key"
  if [ ! -f "$venv/.installed" ]; then
    rm -rf "$root/$set"-*  # an older venv of this set (other constraints): replaced, not accumulated
    say "$set: installing $(grep -c '==' "$constraints") pinned packages and their dependencies into $venv"
    "$python" -m venv "$venv"
    echo "$requirements" >"$venv.requirements.txt"  # a file, not <(...): a retry reads it again
    # PIP_CONSTRAINT replaces a machine-wide pip `constraint` setting (some machines cap torch at the releases on
    # their disk): the venv takes exactly the versions of the constraints file, every other pip setting stays.
    if ! PIP_CONSTRAINT="$constraints" pip_retry "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        -r "$venv.requirements.txt" 2>"$venv.pip.err"; then
      grep -v "^WARNING: Location" "$venv.pip.err" >&2; echo "[test-compat] $set: pip install failed" >&2; exit 2
    fi
    "$venv/bin/python" -m pip check >/dev/null || { echo "[test-compat] $set: pip check failed" >&2; "$venv/bin/python" -m pip check; exit 2; }
    touch "$venv/.installed"
  fi
  if [ ! -f "$venv/.trl-tried" ]; then  # once per venv: TRL where it installs without moving a pin
    if PIP_CONSTRAINT="$constraints" "$venv/bin/python" -m pip install -q --disable-pip-version-check "$trl" \
        2>"$venv.trl.err"; then
      touch "$venv/.trl"
    fi
    touch "$venv/.trl-tried"
  fi
  [ -f "$venv/.trl" ] || say "$set: $trl does not install with these pins: TRL's oracle tests are left out ($venv.trl.err)"
  [ "${INSTALL_ONLY:-0}" = 1 ] && { say "$set: installed"; continue; }
  tests=("${subset[@]}")
  [ -f "$venv/.trl" ] && tests+=("${oracles[@]}")
  versions=$("$venv/bin/python" -c 'import torch, transformers, peft, accelerate, bitsandbytes, datasets, deepspeed as d
print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, accelerate {accelerate.__version__}, bitsandbytes {bitsandbytes.__version__}, datasets {datasets.__version__}, deepspeed {d.__version__}")' 2>/dev/null | tail -1)
  say "$set: $versions ($(du -sh "$venv" | cut -f1) on disk)"
  # The checkout on the path, not an install: `import finetune` must be this tree (checked, it is what is tested).
  where=$(cd "$repo" && PYTHONPATH="$repo" "$venv/bin/python" -c 'import finetune, os; print(os.path.dirname(finetune.__file__))')
  [ "$where" = "$repo/finetune" ] || { echo "[test-compat] $set: finetune imports from $where, not $repo" >&2; exit 2; }
  set +e
  # (the dtype line of a launched run is the day-to-day suite's: its launch is left out here)
  (cd "$repo" && PYTHONPATH="$repo" "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "${tests[@]}" \
    --deselect tests/test_precision.py::test_a_launched_run_says_the_dtype_once)
  code=$?
  set -e
  say "$set: pytest exit $code"
  [ "$code" -eq 0 ] || status=1
done
say "done (exit $status); venvs under $root: $(du -sh "$root" | cut -f1)"
exit $status
