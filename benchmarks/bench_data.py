"""Data pipeline throughput: rows/s and tokens/s to tokenize and to pack, the tokenization cache, padding waste.

    python benchmarks/bench_data.py [--rows 20000] [--max-length 512] [--micro-batch-size 4] [--tokenizer DIR]
    python benchmarks/bench_data.py --scale 50000[,200000] | --quick     (the scale mode: benchmarks/data_scale.py)

Synthetic alpaca rows and multi-turn chats of varied lengths, plus the addition task of the tests (a stand-in for
the quickstart data), tokenized by the tiny built-in tokenizer unless --tokenizer names a real one. Every figure
is measured here, on this machine, with no cache unless the line says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = "the quick brown fox jumps over a lazy dog while seven models learn to add numbers and reverse words".split()  # noqa: SIM905


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def synthetic_rows(kind: str, count: int, seed: int = 0) -> list[dict]:
    """Rows whose lengths vary as in instruction data: short prompts, answers from a few words to a paragraph."""
    rng = random.Random(seed)
    if kind == "alpaca":
        return [{"instruction": sentence(rng, 4, 20), "input": sentence(rng, 0, 30), "output": sentence(rng, 2, 120)}
                for _ in range(count)]
    if kind == "chat":
        rows = []
        for _ in range(count):
            turns = [{"role": "system", "content": "You are helpful."}]
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "user", "content": sentence(rng, 3, 25)},
                          {"role": "assistant", "content": sentence(rng, 2, 60)}]
            rows.append({"messages": turns})
        return rows
    rows = []  # the addition task of tests/conftest.py
    for _ in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)})
    return rows


def write_rows(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_recipe(path: Path, fmt: str, args: argparse.Namespace, **data_keys):
    from finetune.recipe import validate_recipe

    return validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": args.micro_batch_size},
                            "data": {"datasets": [{"path": str(path), "format": fmt}], "max_length": args.max_length,
                                     "eval_fraction": 0, **data_keys}})


def timed(function, *arguments):
    started = time.perf_counter()
    result = function(*arguments)
    return result, time.perf_counter() - started


def bench_format(name: str, fmt: str, path: Path, rows: int, tokenizer, args: argparse.Namespace) -> None:
    """Tokenize (serial and with worker processes), read back from the cache, pack; print one block per dataset."""
    from finetune import data

    prepared, seconds = timed(data.prepare, make_recipe(path, fmt, args, cache=False, num_proc=1), tokenizer)
    tokens = prepared.stats.total_tokens
    print(f"{name}: {rows} rows, {tokens} tokens (median {prepared.stats.tokens_median:g} per example)")
    print(f"  tokenize, 1 process:  {rows / seconds:9.0f} rows/s {tokens / seconds:10.0f} tokens/s")
    if args.workers is None:
        args.workers = 2
    if args.workers > 1:
        _, parallel = timed(data.prepare, make_recipe(path, fmt, args, cache=False, num_proc=args.workers), tokenizer)
        print(f"  tokenize, {args.workers} workers:  {rows / parallel:9.0f} rows/s {tokens / parallel:10.0f} tokens/s")
    timed(data.prepare, make_recipe(path, fmt, args), tokenizer)  # fills the cache
    cached, cache_seconds = timed(data.prepare, make_recipe(path, fmt, args), tokenizer)
    assert cached.stats.cached_datasets == 1
    print(f"  from the cache:       {rows / cache_seconds:9.0f} rows/s ({seconds / cache_seconds:.1f}x faster than tokenizing)")
    packed, pack_seconds = timed(data.pack_examples, prepared.train, args.max_length)
    print(f"  pack:                 {rows / pack_seconds:9.0f} rows/s {tokens / pack_seconds:10.0f} tokens/s "
          f"({len(prepared.train)} examples -> {len(packed)} rows of <= {args.max_length})")
    unpacked = data.batch_efficiency(prepared.train, micro_batch_size=args.micro_batch_size, seed=0)
    with_packing = data.batch_efficiency(packed, micro_batch_size=args.micro_batch_size, seed=0)
    print(f"  padding waste (micro-batch {args.micro_batch_size}): unpacked {1 - unpacked:.1%}, packed {1 - with_packing:.1%} "
          f"(packing efficiency {with_packing:.2%}); rows to train: {len(prepared.train)} unpacked, {len(packed)} packed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, help="processes tokenizing, data.num_proc (default: 2; "
                        "--scale: the recipe's default, the cores)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the tiny built-in BPE with a ChatML template; "
                        "--scale: SmolLM2's, `tiny` for the built-in one)")
    parser.add_argument("--scale", nargs="?", const="50000", help="the scale mode: row counts, e.g. 50000,200000 "
                        "(default 50000): our data phase against datasets.map, cold and warm, 1 and 2 ranks")
    parser.add_argument("--quick", action="store_true", help="the scale mode on 1,000 rows (about a minute)")
    parser.add_argument("--num-proc", type=int, help="--scale: datasets.map's num_proc (default: the number of cores)")
    parser.add_argument("--scale-worker", help=argparse.SUPPRESS)  # one rank of a scale run (JSON settings)
    args = parser.parse_args()
    if args.scale_worker or args.scale or args.quick:
        import data_scale

        if args.scale_worker:
            return data_scale.worker(json.loads(args.scale_worker))
        args.num_workers = args.workers
        return data_scale.main(args)

    from finetune.cli.tiny import build_tokenizer

    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        os.environ["FINETUNE_CACHE"] = str(Path(folder) / "cache")
        for name, fmt, kind in (("alpaca", "alpaca", "alpaca"), ("chat (multi-turn)", "chat", "chat"),
                                ("addition (quickstart stand-in)", "alpaca", "addition")):
            path = write_rows(Path(folder), kind, synthetic_rows(kind, args.rows))
            bench_format(name, fmt, path, args.rows, tokenizer, args)


if __name__ == "__main__":
    main()
