"""`finetune plan`: the memory plan of a recipe on given GPUs; and the recipe library's fit table for the docs.

    finetune plan RECIPE [overrides] --gpus 2 --gpu-memory 24GiB [--nodes 1] [--cpu-memory 128GiB]
                  [--read-bandwidth 2GB] [--json]
    python -m finetune.cli.plan --library-table
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from finetune.cli.library import library_dir, resolve_recipe_path
from finetune.errors import FinetuneError
from finetune.planner.facts import GB, GiB, PlanError, model_config_for
from finetune.planner.fit import decide, parse_count, parse_size


def cli_plan(args: argparse.Namespace) -> int:
    """`finetune plan RECIPE [overrides] --gpus N --gpu-memory 24GiB --nodes M --cpu-memory 128GiB [--json]`."""
    from finetune.recipe import load_recipe

    gpus = _gpus_per_node(args.gpus)
    gpu_memory = _size(args.gpu_memory, "--gpu-memory")
    nodes = parse_count(args.nodes, "--nodes")
    cpu_memory = _size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None
    bandwidth = getattr(args, "read_bandwidth", None)  # bytes per second
    bandwidth = _size(bandwidth, "--read-bandwidth") if bandwidth else None
    recipe = load_recipe(resolve_recipe_path(args.recipe), list(args.overrides), dtype_device="gpu")  # auto: bf16 GPUs
    decision = decide(recipe, model_config_for(recipe), gpus_per_node=gpus, gpu_memory_bytes=gpu_memory, nodes=nodes,
                      cpu_memory_bytes=cpu_memory, read_bytes_per_s=bandwidth)
    asked = recipe_strategy_verdict(recipe, decision.estimates, gpus_per_node=gpus, nodes=nodes)
    if args.json:
        print(json.dumps(plan_payload(decision, asked), indent=2))
    else:
        print(decision.table)
        print()
        if asked:
            print(asked["summary"])
            print("parallel.strategy: auto would choose: " + decision.summary)
        else:
            print(decision.summary)
    return 0  # a plan was made, fits or not (docs/planner.md): `fits` says which


# The most GPUs one machine holds (8 in most servers, 16 in the largest): the planner counts the checkpoint reads of
# every rank of a node (planner/reads.py), so `--gpus 100000` ran for minutes without a word until bounded (bb56).
MAX_GPUS_PER_NODE = 64


def _gpus_per_node(text: str) -> int:
    gpus = parse_count(text, "--gpus")
    if gpus > MAX_GPUS_PER_NODE:
        raise PlanError(f"--gpus {gpus}: more GPUs than one machine holds (at most {MAX_GPUS_PER_NODE} are planned; "
                        "servers have 8, the largest 16). --gpus is per node. Fix: --gpus N --nodes M for N GPUs in "
                        f"each of M machines (e.g. --gpus 8 --nodes {max(2, -(-gpus // 8))}).")
    return gpus


def _size(text: str, flag: str) -> int:
    """parse_size, with a negative size said as one (`-5GB` was "not a memory size")."""
    if str(text).strip().startswith("-"):
        raise PlanError(f"{flag} {text!r}: a memory size must be more than 0. Fix: e.g. {flag} 24GiB.")
    return parse_size(text, flag)


def plan_payload(decision, asked: dict | None) -> dict:
    """`plan --json`: `fits` is the verdict on the recipe as written: its own parallel.strategy's row when it names one
    (`recipe_strategy`), else auto's choice; `strategy`, `chosen` and `auto_fits` are auto's choice. `fits` was auto's
    alone: true for a recipe whose own strategy is short (bb29), so `jq -e .fits` passed a run that would not fit."""
    payload = asdict(decision)
    payload.pop("table")
    for item in payload["estimates"]:
        item["peak_bytes"] = sum(item["parts"].values())
    payload["auto_fits"] = decision.fits
    payload["recipe_strategy"] = asked
    payload["fits"] = asked["fits"] if asked else decision.fits
    return payload


def _asked_key(parallel) -> str | None:
    """The planner's row of the recipe's parallel.strategy (None: auto, the planner's own choice)."""
    if parallel.strategy == "fsdp":
        return ("fsdp_offload" if parallel.cpu_offload else "fsdp_grad_op" if parallel.reshard_after_forward is False
                else "hsdp" if parallel.hybrid_shard else "fsdp")
    if parallel.strategy == "deepspeed":
        return "zero2" if parallel.zero_stage == 2 else "zero3"
    return None if parallel.strategy == "auto" else parallel.strategy


def recipe_strategy_verdict(recipe, estimates, *, gpus_per_node: int, nodes: int) -> dict | None:
    """The recipe's own parallel.strategy here, None for auto (whose summary speaks of the planner's choice: a recipe
    asking for FSDP read "DDP on 2 GPU(s) fits"): `strategy` as written, `estimate` the planner's row it runs as (None:
    no row on these GPUs, which never fits), `fits`, `short_bytes` (what a GPU lacks: 0 when the GPUs hold it),
    `needs_bytes` (the larger of the training and the load peak per GPU), and `summary`, the line `plan` prints."""
    from finetune.planner.facts import gib

    key = _asked_key(recipe.parallel)
    if key is None:
        return None
    asked = f"the recipe's parallel.strategy {recipe.parallel.strategy}"
    as_run = ""
    if key == "hsdp" and nodes == 1:  # what a run does with it (parallel/plan.py _hybrid_replicas): one shard group
        key, as_run = "fsdp", " (hybrid shard on one node runs as FSDP full shard: replicas need several nodes)"
    verdict = {"strategy": recipe.parallel.strategy, "estimate": None, "fits": False, "short_bytes": None,
               "needs_bytes": None}
    found = next((e for e in estimates if e.strategy == key), None)
    if found is None:
        where = f"{gpus_per_node} GPU(s)" if nodes == 1 else f"{nodes} nodes of {gpus_per_node} GPU(s)"
        return verdict | {"summary": f"{asked}: not planned on {where}: {_not_planned_reason(key, gpus_per_node, nodes)}."}
    short = max(0, -found.margin_bytes)
    said = ("fits" if found.fits else f"does not fit ({gib(short)} short)" if short else
            f"does not fit (it needs {gib(found.cpu_bytes_per_node)} of CPU RAM per node)")
    return verdict | {"estimate": key, "fits": found.fits, "short_bytes": short,
                      "needs_bytes": max(found.peak_bytes, found.load_peak_bytes),
                      "summary": f"{asked}: {found.label} on {found.world_size} GPU(s){as_run} {said}, {found.needs()}."}


def _not_planned_reason(key: str, gpus_per_node: int, nodes: int) -> str:
    """Why the planner has no row for strategy `key` on these GPUs (estimates_for's rules)."""
    if key == "layer_split":
        if gpus_per_node < 2:
            return (f"layer split spreads one process's layers over the GPUs of one machine, so it needs 2 or more GPUs "
                    f"per node, and --gpus says {gpus_per_node} (--nodes does not add to them)")
        return ("an MXFP4 checkpoint is never layer split: a layer split loads through transformers' from_pretrained, "
                "which cannot turn MXFP4 into NF4")
    if key == "hsdp":
        return (f"hybrid shard replicates across nodes, so it needs 2 or more GPUs on each of 2 or more nodes "
                f"(--gpus {gpus_per_node} --nodes {nodes})")
    return "it needs 2 or more GPUs (--gpus and --nodes say how many there are)"


# -------------------------------------------------------------------------------------------- library table
LIBRARY_HARDWARE = [("1x24 GB", 1, 24 * GB), ("2x24 GB", 2, 24 * GB), ("4x24 GB", 4, 24 * GB), ("8x24 GB", 8, 24 * GB),
                    ("1x80 GB", 1, 80 * GB), ("4x48 GB", 4, 48 * GB), ("8x80 GB", 8, 80 * GB)]
TYPICAL_RECIPE = {"lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                  "data": {"max_length": 2048}, "train": {"micro_batch_size": 1, "gradient_checkpointing": True}}


def _library_entries() -> list[tuple[str, object]]:
    """(label, recipe) for every recipes/*.yaml, or a typical QLoRA recipe per stored architecture if there are none."""
    from finetune.model.architectures import stored_names
    from finetune.recipe import load_recipe, validate_recipe

    recipes_dir = library_dir()
    entries = []
    for path in sorted(recipes_dir.glob("*.yaml")):
        try:
            entries.append((path.stem, load_recipe(path, dtype_device="gpu")))
        except FinetuneError as exc:
            print(f"skipped {path.name}: {str(exc).splitlines()[0]}", file=sys.stderr)
    if entries:
        return entries
    for name in stored_names():
        raw = {"model": {"name_or_path": name}, "data": {"datasets": [{"path": "train.jsonl"}]}}
        for section, values in TYPICAL_RECIPE.items():
            raw.setdefault(section, {}).update(values)
        entries.append((name, validate_recipe(raw, source=f"typical QLoRA recipe for {name}", dtype_device="gpu")))
    return entries


def library_table() -> str:
    """Markdown: for each library recipe, the strategy the planner picks on 1, 2, 4 and 8 x 24 GB, 1x80, 4x48 and 8x80 GB
    (with CPU offload, the CPU RAM per machine too)."""
    header = "| recipe | model | " + " | ".join(label for label, _, _ in LIBRARY_HARDWARE) + " |"
    lines = [header, "|" + "---|" * (2 + len(LIBRARY_HARDWARE))]
    for label, recipe in _library_entries():
        try:
            config = model_config_for(recipe)
        except FinetuneError as exc:
            lines.append(f"| {label} | {recipe.model.name_or_path} | " + f"config not readable: {str(exc)[:60]} |")
            continue
        cells = []
        for _, gpus, memory in LIBRARY_HARDWARE:
            d = decide(recipe, config, gpus_per_node=gpus, gpu_memory_bytes=memory)
            chosen = next(e for e in d.estimates if e.strategy == d.chosen) if d.fits else None
            cells.append(_library_cell(chosen, d.max_micro_batch) if chosen else "does not fit")
        lines.append(f"| {label} | {recipe.model.name_or_path} | " + " | ".join(cells) + " |")
    shape = "micro-batch 1 x 2048 tokens, LoRA r=16 all-linear, gradient checkpointing"
    lines.append(f"\nPeak per GPU at the recipe's shape ({shape} for the typical recipe): the larger of the training "
                 "peak and the load peak (marked `to load` where loading needs more); with CPU offload, the CPU RAM the "
                 "machine needs; mb<=N: largest micro-batch that fits.")
    return "\n".join(lines)


def _library_cell(chosen, max_micro_batch: int) -> str:
    """One cell of the library table: the strategy, what a GPU must hold (loading included), offload's RAM, mb<=N."""
    loading = chosen.load_peak_bytes > chosen.peak_bytes
    peak = f"{max(chosen.peak_bytes, chosen.load_peak_bytes) / GiB:.1f} GiB{' to load' if loading else ''}"
    ram = f", {chosen.cpu_bytes_per_node / GiB:.0f} GiB RAM" if chosen.strategy == "fsdp_offload" else ""
    return f"{chosen.label}, {peak}{ram}, mb<={max_micro_batch}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.cli.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--library-table", action="store_true", help="print the docs table for the recipe library")
    args = parser.parse_args(argv)
    if args.library_table:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # stored numbers or local folders only: never wait on the hub
        print(library_table())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
