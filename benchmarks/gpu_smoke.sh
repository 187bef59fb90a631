#!/usr/bin/env bash
# GPU smoke check: a small Llama-shaped model built from a config (no hub), 4-bit NF4 + LoRA in bf16, trained
# through finetune/run.py on one GPU; prints tokens/s and peak GPU memory. Then sharded loading (FSDP2, one rank, as
# run.py loads under FSDP) with the GPU allocator's peak checked against the planner's load figure (within 15%).
# Last, the peer comparison on this GPU: this project against the plain PEFT loop (benchmarks/bench_peers.py, same
# model, data and steps; SmolLM2-135M from the quickstart package). Needs a CUDA machine; ~3-4 minutes.
#   bash benchmarks/gpu_smoke.sh [HIDDEN] [LAYERS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
HIDDEN=${1:-1024}; LAYERS=${2:-8}; STEPS=${3:-30}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible: this script is for GPU machines')"
$PY -m finetune tiny-model "$WORK/model" --hidden-size "$HIDDEN" --layers "$LAYERS"
$PY - "$WORK" <<'PY'
import json, random, sys
root = sys.argv[1]
rng = random.Random(0)
with open(f"{root}/data.jsonl", "w") as f:
    for _ in range(512):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        f.write(json.dumps({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)}) + "\n")
PY
cat > "$WORK/recipe.yaml" <<YAML
model: {name_or_path: $WORK/model, dtype: bfloat16}
lora: {r: 16, alpha: 32, dropout: 0.0}
data: {datasets: [{path: $WORK/data.jsonl}], max_length: 256}
train: {max_steps: $STEPS, micro_batch_size: 16, learning_rate: 1.0e-3, eval_every: 0, save_every: 0}
output: {dir: $WORK/run}
YAML
$PY finetune/run.py "$WORK/recipe.yaml"
$PY - "$WORK/run" <<'PY'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
stats = json.loads((run / "ranks" / "rank0.json").read_text())
tps = statistics.median(m["tokens_per_s"] for m in metrics[3:])
print(f"GPU smoke: {len(metrics)} steps, loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}, "
      f"median {tps:.0f} tokens/s, peak GPU memory {stats.get('peak_gpu_bytes', 0) / 2**20:.0f} MiB, "
      f"held parameters {(stats['frozen_bytes'] + stats['trainable_bytes']) / 2**20:.1f} MiB")
assert metrics[-1]["loss"] < metrics[0]["loss"], "loss did not fall"
PY
$PY -m torch.distributed.run --nproc_per_node 1 --master_port 29651 benchmarks/bench_loading.py --worker sharded "$WORK/model" "$WORK"
$PY - "$WORK" <<'PY'
import json, sys
r = json.load(open(f"{sys.argv[1]}/sharded-w1-rank0.json"))
ratio = r["peak_gpu_allocated"] / r["planner_sharded_load"]
print(f"GPU load (sharded, FSDP2): peak allocated {r['peak_gpu_allocated'] / 2**20:.0f} MiB, planner "
      f"{r['planner_sharded_load'] / 2**20:.0f} MiB (ratio {ratio:.2f}), {r['load_s']:.1f} s")
assert 0.85 <= ratio <= 1.15, "the planner's load term is off by more than 15% on this GPU"
PY
$PY benchmarks/bench_peers.py --only ours,peft --repeats 1 --steps 10 --no-breakdown --json "$WORK/peers.json"
$PY - "$WORK/peers.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
for mode in ("unpacked", "packed"):
    ours, peft = (next(r for r in runs if r["runner"] == name and r["mode"] == mode) for name in ("ours", "peft"))
    print(f"GPU peers ({mode}): ours {ours['median_tokens_per_s']:.0f} tokens/s, {ours['peak_gpu_mb']:.0f} MiB; plain PEFT "
          f"loop {peft['median_tokens_per_s']:.0f} tokens/s, {peft['peak_gpu_mb']:.0f} MiB "
          f"(speed {ours['median_tokens_per_s'] / peft['median_tokens_per_s']:.2f}x, memory "
          f"{ours['peak_gpu_mb'] / peft['peak_gpu_mb']:.2f}x)")
PY
