"""`finetune plan`: the memory plan of a recipe on given GPUs; and the recipe library's fit table for the docs.

    finetune plan RECIPE [overrides] [--gpus 2] --gpu-memory 24GiB [--nodes 1] [--cpu-memory 128GiB]
                  [--read-bandwidth 2GB] [--json]
    python -m finetune.cli.plan --library-table

The strategy judged is the one the run takes: the launch `finetune train` makes (the accelerate config the recipe
names in its leading comment, at its process count unless --gpus asks for another: cli/library.train_launch),
resolved as `finetune validate` resolves it (parallel.resolve_plan), on the GPUs planned. Every other strategy's row
is listed beside it, and the planner's own choice is said when it is another.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from dataclasses import asdict, dataclass, field

from finetune.cli.library import TrainLaunch, library_dir, named_launch, resolve_recipe_path, train_launch
from finetune.errors import FinetuneError
from finetune.planner.facts import GB, GiB, PlanError, model_config_for
from finetune.planner.fit import decide, parse_count, parse_size


def cli_plan(args: argparse.Namespace) -> int:
    """`finetune plan RECIPE [overrides] --gpus N --gpu-memory 24GiB --nodes M --cpu-memory 128GiB [--json]`."""
    from finetune.recipe import load_recipe

    gpus = None if args.gpus is None else _gpus_per_node(args.gpus)  # None: as many as the recipe's launch starts
    gpu_memory = _size(args.gpu_memory, "--gpu-memory")
    nodes = None if args.nodes is None else parse_count(args.nodes, "--nodes")
    cpu_memory = _size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None
    bandwidth = getattr(args, "read_bandwidth", None)  # bytes per second
    bandwidth = _size(bandwidth, "--read-bandwidth") if bandwidth else None
    recipe_path = resolve_recipe_path(args.recipe)
    recipe = load_recipe(recipe_path, list(args.overrides), dtype_device="gpu")  # auto: bf16 GPUs
    config = model_config_for(recipe)
    launch = planned_launch(recipe_path, recipe, config, gpus=gpus, nodes=nodes, gpu_memory_bytes=gpu_memory,
                            accelerate_config=getattr(args, "accelerate_config", None))
    decision = decide(launch.recipe_as_run(recipe), config, gpus_per_node=launch.gpus_per_node,
                      gpu_memory_bytes=gpu_memory, nodes=launch.nodes, cpu_memory_bytes=cpu_memory,
                      read_bytes_per_s=bandwidth)
    run = launch_verdict(recipe, launch, decision.estimates)
    asked = run if recipe.parallel.strategy != "auto" else None
    if args.json:
        print(json.dumps(plan_payload(decision, asked, launch=launch, run=run), indent=2))
    else:
        print(decision.table)
        print()
        print("\n".join(launch.lines() + _verdict_lines(recipe, decision, run)))
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


# ----------------------------------------------------------------------------------------- the launch planned
@dataclass
class PlannedLaunch:
    """The launch planned: how `finetune train` starts the recipe (`train`), its processes over the GPUs planned, and
    the parallel plan it resolves to (`plan`, a parallel.ParallelPlan; None where the launch is refused: `refused`
    says why, as `finetune validate` does). `note`: --gpus against the count the recipe's own launch names."""

    train: TrainLaunch
    processes: int
    gpus_per_node: int
    nodes: int
    plan: object | None = None
    refused: str | None = None
    note: str | None = None
    launcher: dict = field(default_factory=dict)  # the accelerate config's settings (parallel.launcher_settings)

    def recipe_as_run(self, recipe):
        """The recipe with the FSDP version the launch runs (an fsdp1.yaml launch: FSDP1's flat units), for the rows."""
        version = getattr(self.plan, "fsdp_version", None)
        if getattr(self.plan, "strategy", None) != "fsdp" or version not in (1, 2) or recipe.parallel.fsdp_version == version:
            return recipe
        return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"fsdp_version": version})})

    def describe(self) -> str | None:
        """The plan as validate's `parallel:` line says it (a layer split by its GPUs: none are seen from here)."""
        if self.plan is None:
            return None
        if self.plan.strategy == "layer_split":
            return f"layer split over {self.gpus_per_node} GPUs in one process"
        return self.plan.describe()

    def lines(self) -> list[str]:
        """`launch:` and `parallel:` as `finetune validate` prints them, the note, and a refusal."""
        how = self.train.how.replace("--num-processes", "--gpus")  # (plan's flag for the process count)
        lines = [f"launch: {self.processes} process{'es' if self.processes > 1 else ''}, {how}"]
        if self.plan is not None:
            lines.append(f"parallel: {self.describe()}")
        if self.note:
            lines.append(f"note: {self.note}")
        if self.refused:
            lines.append(f"this launch is refused, as `finetune validate` and `finetune train` refuse it: {self.refused}")
        return lines

    def payload(self, run: dict | None) -> dict:
        return {"config": self.train.config, "processes": self.processes, "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "how": self.train.how, "parallel": self.describe(), "note": self.note,
                "refused": self.refused, "verdict": run}


def planned_launch(recipe_path: str, recipe, model_config, *, gpus: int | None, nodes: int | None,
                   gpu_memory_bytes: int, accelerate_config: str | None = None) -> PlannedLaunch:
    """The launch `finetune train` makes of the recipe (cli/library.train_launch: `accelerate_config` as given, else
    the one the recipe's leading comment names) with --gpus x --nodes processes, or, without --gpus, the processes and
    machines that launch has; resolved as `finetune validate` resolves it. A layer split is one process over the GPUs."""
    from finetune.cli.library import resolve_accelerate_config
    from finetune.parallel import accelerate_config_env

    config = resolve_accelerate_config(accelerate_config) if accelerate_config else None
    one_process = recipe.parallel.strategy == "layer_split"  # one process spreads its layers over the GPUs it sees
    asked = None if gpus is None else 1 if one_process else gpus * (nodes or 1)
    named = None if config else _named_count(recipe_path)  # (count, the launch as written) the recipe names
    own = named[0] if named else 1  # (no launch named: one process)
    train = train_launch(recipe_path, config, None if asked == own and not config else asked)
    env = accelerate_config_env(train.config) if train.config else None  # (a broken config: its own paragraph)
    processes = train.num_processes or int((env or {}).get("ACCELERATE_NUM_PROCESSES", 1))
    if gpus is None:  # the launch's own shape: its processes over its machines
        nodes = nodes or max(1, int((env or {}).get("ACCELERATE_NUM_MACHINES", 1)))
        gpus = _gpus_per_node(str(max(1, processes // nodes)))
    note = None
    if named and asked is not None and asked != own:
        flags = f"--gpus {gpus}" + (f" --nodes {nodes}" if nodes and nodes > 1 else "")
        note = (f"{flags} plans {asked} process{'es' if asked > 1 else ''}, as asked; the recipe's launch names {own} "
                f"({named[1]}): without --gpus, `finetune plan` plans that one")
    launch = PlannedLaunch(train, processes, gpus, nodes or 1, note=note)
    launch.launcher, launch.plan, launch.refused = _resolved(recipe, model_config, launch, env, gpu_memory_bytes)
    return launch


def _named_count(recipe_path: str) -> tuple[int, str] | None:
    """(the process count, the launch as written) of the launch the recipe's leading comment names, read as `finetune
    data` and `finetune validate` read it; None where it names none."""
    from finetune.cli.preview import launch_processes

    named = named_launch(recipe_path)
    return (launch_processes(recipe_path, None)[0], named.describe()) if named else None


def _resolved(recipe, model_config, launch: PlannedLaunch, env: dict | None, gpu_memory_bytes: int):
    """(launcher settings, the parallel plan, None) as `finetune validate` resolves the launch, or (settings, None,
    why) where it refuses it. The run is resolved on the GPUs planned: a CUDA device (only named: with `gpus` given
    nothing asks CUDA) and the memory planner on, so `auto` chooses and offloads as the run's own planner does."""
    import torch

    from finetune import parallel
    from finetune.distributed import DistInfo
    from finetune.parallel.launcher import accelerate_launch_forms_group

    launcher = parallel.launcher_settings(env) if env is not None else None
    config = launch.train.config
    grouped = launch.processes > 1 or bool(config and accelerate_launch_forms_group(config))
    dist = DistInfo(rank=0, world_size=launch.processes, local_rank=0,
                    local_world_size=max(1, launch.processes // launch.nodes), device=torch.device("cuda", 0),
                    backend="nccl" if grouped else None)
    lenient = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"strict": False})})
    try:  # (parallel.strict: a plan says what does not fit, it does not refuse it)
        with contextlib.redirect_stdout(io.StringIO()):  # the run's planner report: plan prints its own table
            plan = parallel.resolve_plan(lenient, dist, model_config, launcher=launcher, config_file=config,
                                         gpus=(launch.gpus_per_node, gpu_memory_bytes))
    except FinetuneError as exc:
        return launcher or {}, None, str(exc)
    except Exception as exc:  # noqa: BLE001  (the plan is advice: a model the run's checks cannot read is said)
        return launcher or {}, None, f"its parallel plan could not be resolved ({type(exc).__name__}: {exc})"
    return launcher or {}, plan, None


def planner_row(plan) -> str:
    """The planner's row (a STRATEGIES key) a resolved parallel plan runs as: the row a run's own fit check judges it
    by (parallel/plan.py _apply_decision)."""
    if plan.strategy == "deepspeed":
        return "zero3" if plan.zero is None or plan.zero.stage == 3 else "zero2"
    if plan.strategy != "fsdp":
        return plan.strategy
    if plan.cpu_offload:
        return "fsdp_offload"
    if not plan.reshard_after_forward:
        return "fsdp_grad_op"  # (an accelerate config's SHARD_GRAD_OP: it was planned as full shard)
    return "hsdp" if plan.replicas > 1 else "fsdp"


# ------------------------------------------------------------------------------------------------ the verdict
def launch_verdict(recipe, launch: PlannedLaunch, estimates) -> dict | None:
    """The verdict on the run as launched (recipe_strategy_verdict's keys; `strategy` the one it runs), or, where the
    launch is refused, on the recipe's own parallel.strategy (None for auto)."""
    if launch.plan is None:
        return recipe_strategy_verdict(recipe, estimates, gpus_per_node=launch.gpus_per_node, nodes=launch.nodes)
    key = planner_row(launch.plan)
    hybrid = recipe.parallel.hybrid_shard if recipe.parallel.hybrid_shard is not None else launch.launcher.get("hybrid_shard")
    as_run = (" (hybrid shard on one node runs as FSDP full shard: replicas need several nodes)"
              if hybrid and key == "fsdp" else "")
    asked = ("the run as launched" if recipe.parallel.strategy == "auto" else
             f"the recipe's parallel.strategy {recipe.parallel.strategy}")
    return _row_verdict(asked, launch.plan.strategy, key, estimates, gpus_per_node=launch.gpus_per_node,
                        nodes=launch.nodes, as_run=as_run)


def _verdict_lines(recipe, decision, run: dict | None) -> list[str]:
    """The verdict on the run, last; the planner's own choice beside it where it is another row."""
    if run is None:  # auto, whose launch is refused: the planner's choice
        return [decision.summary]
    if recipe.parallel.strategy != "auto":
        return [run["summary"], "parallel.strategy: auto would choose: " + decision.summary]
    if run["estimate"] == decision.chosen:
        return [decision.summary]  # the launch leaves the choice to the planner, or takes the one it makes
    return ["the planner's choice, for a launch that leaves the strategy to it (`finetune train "
            "--accelerate-config ddp`): " + decision.summary, run["summary"]]


def plan_payload(decision, asked: dict | None, *, launch: PlannedLaunch | None = None, run: dict | None = None) -> dict:
    """`plan --json`: `fits` and `strategy` are the verdict on the recipe as it runs: the row of its launch's strategy
    (`launch.verdict`; `recipe_strategy` the same where the recipe names its parallel.strategy), else auto's choice;
    `auto_strategy`, `chosen` and `auto_fits` are auto's choice. `fits` was auto's alone: true for a recipe whose own
    strategy is short (bb29); `strategy` was auto's while the recipe's launch ran FSDP2 (bb64)."""
    payload = asdict(decision)
    payload.pop("table")
    for item in payload["estimates"]:
        item["peak_bytes"] = sum(item["parts"].values())
    verdict = run or asked
    payload["auto_fits"] = decision.fits
    payload["auto_strategy"] = decision.strategy
    payload["recipe_strategy"] = asked
    payload["launch"] = launch.payload(run) if launch else None
    payload["strategy"] = verdict["strategy"] if verdict else decision.strategy
    payload["fits"] = verdict["fits"] if verdict else decision.fits
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
    """The recipe's own parallel.strategy here (judged by its keys alone: the verdict where its launch is refused),
    None for auto (whose summary speaks of the planner's choice: a recipe asking for FSDP read "DDP on 2 GPU(s)
    fits")."""
    key = _asked_key(recipe.parallel)
    if key is None:
        return None
    as_run = ""
    if key == "hsdp" and nodes == 1:  # what a run does with it (parallel/plan.py _hybrid_replicas): one shard group
        key, as_run = "fsdp", " (hybrid shard on one node runs as FSDP full shard: replicas need several nodes)"
    return _row_verdict(f"the recipe's parallel.strategy {recipe.parallel.strategy}", recipe.parallel.strategy, key,
                        estimates, gpus_per_node=gpus_per_node, nodes=nodes, as_run=as_run)


def _row_verdict(asked: str, strategy: str, key: str, estimates, *, gpus_per_node: int, nodes: int,
                 as_run: str = "") -> dict:
    """`strategy` as it runs, `estimate` the planner's row (None: no row on these GPUs, which never fits), `fits`,
    `short_bytes` (what a GPU lacks: 0 when the GPUs hold it), `needs_bytes` (the larger of the training and the load
    peak per GPU), and `summary`, the line `plan` prints, starting with `asked`."""
    from finetune.planner.facts import gib

    verdict = {"strategy": strategy, "estimate": None, "fits": False, "short_bytes": None, "needs_bytes": None}
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
