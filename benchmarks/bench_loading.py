"""Loading at scale: what each rank reads, quantizes and holds, for each loader, at 1 and 2 ranks in one invocation.

    python benchmarks/bench_loading.py [--hidden 1536] [--layers 40] [--vocab 32000] [--modes today,range,cache]

A Llama-shaped random model with many thin layers, as real large models have (70B: 80 layers, one bf16 layer ~5%
of the 4-bit base; the default here: hidden 1536 x 40 layers, ~1.1B parameters, one bf16 layer ~4% of the model),
written once into the cache ($FINETUNE_CACHE/bench, else ~/.cache/finetune/bench) as a sharded bf16 safetensors
checkpoint with an index file. Each (loader, world size) pair runs in fresh processes under torchrun and loads the
model as `finetune/run.py` does under FSDP2 (host_memory's allocator setting, loading.load_model + parallel.wrap). The loaders (`--modes`):

  v1      transformers' from_pretrained on every rank, then FSDP shards (parallel.sharded_loading: false)
  today   sharded loading as before issue 24 (and still FSDP1's): every rank reads and quantizes each whole unit
  range   FSDP2 sharded loading now: each rank reads and quantizes only its chunk (finetune/model/sources/shard_reads.py)
  cache   (c) `model.quantized_cache: auto`, the entry built once before the timed rows (a 4-bit checkpoint as
          `finetune quantize` writes it): FSDP2 ranks read their chunk of the packed bytes, quantize nothing

Per rank: checkpoint bytes read (the TensorReader's count), seconds inside bitsandbytes' quantization
(quantize_4bit, and the double quantization of the absmax; wall and this thread's CPU seconds, the latter
steady on a shared machine), load seconds (load + wrap), and the peak anonymous
resident memory (RssAnon: file-backed pages of the memory-mapped checkpoint excluded) over the baseline taken right
before loading, sampled every 20 ms; on a GPU also the allocator's peak. Goals (issue 24): at 2 ranks, bytes read
and quantize seconds per rank of `range` <= 0.55x `today`'s; the planner's read/rank within 5% of the count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def cache_dir(hidden: int, layers: int, vocab: int) -> Path:
    base = Path(os.environ["FINETUNE_CACHE"]).expanduser() if os.environ.get("FINETUNE_CACHE") else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune"
    return base / "bench" / f"llama-h{hidden}-l{layers}-v{vocab}"


def write_model(target: Path, hidden: int, layers: int, vocab: int) -> Path:
    """Random bf16 Llama-shaped model, sharded safetensors (500 MB shards) + index + tokenizer; written once."""
    if (target / "done").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.cli.tiny import build_tokenizer

    heads = max(1, hidden // 128)
    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                                  max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="500MB")
    build_tokenizer().save_pretrained(tmp)
    (tmp / "done").write_text("ok")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


MODES = {
    "v1": "per-rank from_pretrained (v1)",
    "today": "(a) today: every rank reads + quantizes whole units",
    "range": "(b) range reads: each rank its own chunk",
    "cache": "(c) the 4-bit cache entry: each rank its chunk of the packed bytes",
}


def quantize_timer():
    """Seconds spent inside bitsandbytes' quantization (outermost call only: quantize_4bit calls quantize_blockwise
    for the double quantization)."""
    from bitsandbytes import functional

    spent, depth = [0.0, 0.0], [0]  # wall seconds, CPU seconds of this thread (torch runs 1 thread here)

    def timed(original):
        def call(*args, **kwargs):
            depth[0] += 1
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - start
                    spent[1] += time.thread_time() - cpu
        return call

    functional.quantize_4bit = timed(functional.quantize_4bit)
    functional.quantize_blockwise = timed(functional.quantize_blockwise)
    return spent


def worker(model_dir: str, mode: str, out: Path) -> None:
    """One rank: load like run.py under FSDP2 with the chosen loader while a thread samples RssAnon."""
    import torch

    from finetune import distributed, host_memory, parallel, planner
    from finetune.model import import_backends, load_config, loading, release_freed_memory
    from finetune.planner.reads import rank_read_bytes
    from finetune.recipe import Recipe

    info = distributed.init_distributed()
    host_memory.bound_heap_growth_for("fsdp", info.device)  # as run.py does (FSDP on CPU: freed tensors leave)
    import_backends()
    quantize_seconds = quantize_timer()
    cache = "auto" if mode == "cache" else "off"  # --cache rows: the 4-bit bytes of model.quantized_cache
    recipe = Recipe.model_validate({"model": {"name_or_path": model_dir, "dtype": "bfloat16", "quantized_cache": cache},
                                    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                                    "data": {"datasets": [{"path": "unused.jsonl"}]}})
    config = load_config(recipe)
    plan = parallel.ParallelPlan(strategy="fsdp", world_size=info.world_size, fsdp_version=2,
                                 layer_class=parallel.decoder_layer_class(parallel.meta_model(config)).__name__,
                                 param_dtype=torch.bfloat16, activation_checkpointing=True, sharded_loading=mode != "v1")
    distributed.barrier()
    baseline = rss_anon()
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    start = time.perf_counter()
    loaded = loading.load_model(recipe, sharded=mode != "v1", device=info.device, device_map=None,
                                gradient_checkpointing=True,
                                shard=plan.own_shard(info.rank) if mode in ("range", "cache") else None)
    wrapped = parallel.wrap(loaded.model, plan, info, materialize=loaded.materialize)
    release_freed_memory()
    distributed.barrier()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    facts = planner.facts_from_config(config, recipe)
    held = parallel.local_parameter_bytes(wrapped)
    result = {"rank": info.rank, "world": info.world_size, "mode": mode, "load_s": seconds,
              "quantize_s": quantize_seconds[0], "quantize_cpu_s": quantize_seconds[1], "bytes_read": loaded.bytes_read,
              "planner_bytes_read": rank_read_bytes(facts, rank=info.rank, world_size=info.world_size,
                                                    own_shard=mode in ("range", "cache")),
              "peak_over_baseline": peak[0] - baseline, "after_wrap_over_baseline": rss_anon() - baseline,
              "held_bytes": held["frozen_bytes"] + held["trainable_bytes"] + facts.quant_state_bytes,
              "full_4bit_base": facts.total_bytes(trainable=False)}
    if info.device.type == "cuda":
        result["peak_gpu_allocated"] = torch.cuda.max_memory_allocated(info.device)
    (out / f"{mode}-w{info.world_size}-rank{info.rank}.json").write_text(json.dumps(result))
    distributed.teardown()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(model_dir: Path, mode: str, world: int, out: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={free_port()}",
               __file__, "--worker", mode, str(model_dir), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{mode} at {world} ranks failed:\n{result.stderr[-3000:]}")
    return [json.loads((out / f"{mode}-w{world}-rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", default="today,range,cache", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--cache", action="store_true", help="only the (c) rows: load from the 4-bit cache vs "
                        "quantizing the bf16 base at load, 1 rank")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, model_dir, out = args.worker
        return worker(model_dir, mode, Path(out))
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    started = time.perf_counter()
    model_dir = write_model(cache_dir(args.hidden, args.layers, args.vocab), args.hidden, args.layers, args.vocab)
    print(f"model: {model_dir} (written/checked in {time.perf_counter() - started:.0f} s)")
    if args.cache:
        return cache_rows(model_dir)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "cache" in modes:  # a fresh cache entry, built once and not timed: the (c) rows are later starts
            os.environ["FINETUNE_CACHE"] = str(Path(tmp) / "cache")
            started = time.perf_counter()
            run(model_dir, "cache", 1, Path(tmp))
            print(f"cache entry built in {time.perf_counter() - started:.0f} s (not in the table)", flush=True)
        for world in (1, 2):
            for mode in modes:
                rows[(mode, world)] = ranks = run(model_dir, mode, world, Path(tmp))
                print(f"{mode:6s} x{world}: " + " | ".join(
                    f"rank {r['rank']}: read {_gib(r['bytes_read'])} GiB (planner {_gib(r['planner_bytes_read'])}), "
                    f"quantize {r['quantize_s']:.1f} s (CPU {r['quantize_cpu_s']:.1f} s), load {r['load_s']:.1f} s, "
                    f"peak {_gib(r['peak_over_baseline'])} GiB"
                    for r in ranks), flush=True)
    print(f"\n4-bit base (planner): {_gib(rows[(modes[0], 1)][0]['full_4bit_base'])} GiB")
    print(table(rows, modes))
    if {"cache", "range"} <= set(modes):
        for world in (1, 2):
            new, cache = rows[("range", world)], rows[("cache", world)]
            print(f"at {world} rank(s), cache / range per rank (largest rank): bytes read "
                  f"{_worst(cache, 'bytes_read') / _worst(new, 'bytes_read'):.2f}x, load s "
                  f"{_worst(cache, 'load_s') / _worst(new, 'load_s'):.2f}x ({_worst(new, 'load_s') / _worst(cache, 'load_s'):.1f}x "
                  "faster; goal at 1 rank >= 3x)")
    if {"today", "range"} <= set(modes):
        today, new = rows[("today", 2)], rows[("range", 2)]
        print(f"at 2 ranks, range / today per rank (largest rank): bytes read "
              f"{_worst(new, 'bytes_read') / _worst(today, 'bytes_read'):.2f}x, quantize s "
              f"{_worst(new, 'quantize_s') / _worst(today, 'quantize_s'):.2f}x (CPU s "
              f"{_worst(new, 'quantize_cpu_s') / _worst(today, 'quantize_cpu_s'):.2f}x; goal <= 0.55x), load s "
              f"{_worst(new, 'load_s') / _worst(today, 'load_s'):.2f}x, "
              f"peak {_worst(new, 'peak_over_baseline') / _worst(today, 'peak_over_baseline'):.2f}x")
    counted = [(r["planner_bytes_read"], r["bytes_read"]) for ranks in rows.values() for r in ranks if r["bytes_read"]]
    print("planner read/rank over counted bytes: " + ", ".join(f"{p / c:.4f}" for p, c in counted))


def _worst(ranks: list[dict], key: str):
    """The largest rank's figure (None where the loader does not count it)."""
    values = [r[key] for r in ranks if r[key] is not None]
    return max(values) if values else None


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def table(rows: dict, modes: list[str]) -> str:
    """Markdown, one row per (world, loader); the largest rank's figure for each column."""
    header = "| ranks | loader | bytes read / rank (GiB) | quantize s / rank (CPU s) | load s | peak RssAnon over baseline (GiB) |"
    lines = [header, "|---|---|---|---|---|---|"]
    for world in (1, 2):
        for mode in modes:
            ranks = rows[(mode, world)]
            lines.append(f"| {world} | {MODES[mode]} | {_gib(_worst(ranks, 'bytes_read'))} | "
                         f"{_worst(ranks, 'quantize_s'):.1f} ({_worst(ranks, 'quantize_cpu_s'):.1f}) | "
                         f"{_worst(ranks, 'load_s'):.1f} | "
                         f"{_gib(_worst(ranks, 'peak_over_baseline'))} |")
    return "\n".join(lines)


def cache_rows(model_dir: Path) -> None:
    """(c) `model.quantized_cache: auto` at 1 rank (FSDP2, sharded loading): the first start quantizes into a fresh
    cache and reads it back; later starts read the 4-bit bytes only. Against the bf16 base quantized at load. Every
    load reads warm files (the page cache holds both checkpoints after the first read), so the ratio is the work
    saved (reading 4x fewer bytes, no quantization), not a cold disk's."""
    gib = 2**30
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FINETUNE_CACHE"] = str(Path(tmp) / "cache")  # a fresh cache: the first row builds the entry
        for mode, label in [("sharded", "bf16, quantized at load"), ("cache", "first start: quantize into the cache"),
                            ("cache", "4-bit cache"), ("sharded", "bf16, quantized at load (again)"),
                            ("cache", "4-bit cache (again)")]:
            rank = run(model_dir, mode, 1, Path(tmp))[0]
            rows.setdefault(label.removesuffix(" (again)"), []).append(rank["load_s"])
            print(f"{label:40s}: load {rank['load_s']:6.1f} s | peak RssAnon over baseline "
                  f"{rank['peak_over_baseline'] / gib:5.2f} GiB", flush=True)
        entry = next(p for p in (Path(tmp) / "cache" / "quantized").iterdir() if p.is_dir())
        cached = sum(p.stat().st_size for p in entry.glob("*.safetensors"))
    base = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    fast, slow = min(rows["4-bit cache"]), min(rows["bf16, quantized at load"])
    print(f"bytes: bf16 base {base / gib:.2f} GiB, cache entry {cached / gib:.2f} GiB ({cached / base:.2f}x)")
    print(f"load from the 4-bit cache vs bf16 at 1 rank: {fast:.1f} s vs {slow:.1f} s = {slow / fast:.1f}x faster "
          "(goal >= 3x)")


if __name__ == "__main__":
    main()
