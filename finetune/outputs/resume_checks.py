"""Whether a checkpoint can continue this run, decided before any weight loads: the checkpoint's resolved recipe
against this run's, key by key; the base it recorded against this run's (base_record.py: its sizes, its files); the
strategy that wrote it against this run's plan; its step against train.max_steps; its data position against this
run's rows.

A difference is refused (one paragraph naming every refused key, both values and the fix), harmless (where the run
writes, what it logs and tracks, how often it checkpoints), or noted: every other key, so a key added to the recipe
later is noted by default rather than forgotten. `finetune validate` runs the same checks.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.files import on_main, same_place
from finetune.outputs.base_record import compare_base
from finetune.outputs.step_folders import (
    MANIFEST,
    TRAINER_STATE,
    checkpoint_problem,
    list_checkpoints,
    read_dcp_metadata,
)
from finetune.rendezvous import DIGEST, code_facts, digests

# Changes that leave the checkpoint unusable by this run, and why; the fix is the checkpoint's value.
REFUSED = {
    "lora.r": "it fixes the shapes of the saved LoRA tensors",
    "lora.target_modules": "it decides which modules have saved LoRA tensors",
    "lora.dora": "it adds or removes the saved magnitude vectors",
    "lora.bias": "it adds or removes saved bias tensors",
    "lora.train_router": "it adds or removes the saved router weights",
    "train.objective": "the saved state (data position, optimizer, reward head) belongs to another objective",
    "train.optimizer": "the saved optimizer state is of the checkpoint's optimizer, whose state this one cannot read",
    "train.seed": "the saved data position is a place in the order train.seed shuffles the rows in",
    "data.streaming": "the saved data position counts rows of a stream, or of the shuffled rows, not both",
}
# Changes that change nothing the run trains or computes: where it writes, its name, what it logs and where it tracks,
# how often it checkpoints and which checkpoints it keeps, worker counts and caches of identical bytes. `parallel`
# is compared as the strategy itself (this run's plan against the one that wrote the checkpoint: `_strategy_problem`;
# a reshard is said when the checkpoint loads), since an accelerate config chooses it as well as the recipe.
HARMLESS = ("description", "output", "parallel", "train.resume", "train.log_every", "train.save_every",
            "train.keep_last", "train.keep_best", "train.trackers", "train.run_name", "train.tensorboard_dir",
            "train.mlflow_tracking_uri", "train.mlflow_experiment", "train.wandb_project", "data.num_proc", "data.cache",
            "model.quantized_cache")
# Changes of what is evaluated and when, not of what is trained: said apart, as such (train.keep_best compares the eval
# losses of other cadences or rows).
EVAL_ONLY = ("train.eval_every", "eval")
# Compared together as the rows of one optimizer step (micro_batch_size x processes x grad_accum), not key by key:
# 2 processes x 2 rows and 1 process x 2 rows x grad_accum 2 train the same steps.
BATCH = ("train.micro_batch_size", "train.grad_accum")
WHY_NOTED = {"train.max_steps": "it reshapes the learning-rate schedule",
             "train.warmup_steps": "it reshapes the learning-rate schedule"}
# Changes that act on the training only through the training rows' tokens: where the rows' fingerprint shows the rows
# unchanged, they are said as such (bb41: data.max_length cutting no row, a chat template alpaca rows never use, were
# "the run will differ"). For the objectives whose training reads nothing else of them (KTO reads data.max_length
# while training, GRPO decodes with the tokenizer).
ROWS_DECIDE = ("data", "model.chat_template", "model.tokenizer")
ROWS_ONLY_OBJECTIVES = ("sft", "dpo")
# How each kind of change is said, in this order: one line per kind that has changes.
SAID = {"noted": "the run will differ from an uninterrupted one",
        "another_path": "the same training by another code path (PEFT's LoRA forward or finetune's fused one): it may "
                        "differ from an uninterrupted run in rounding, and in its dropout masks where lora.dropout > 0",
        "rows_kept": "the training rows are unchanged (the same tokens in the same order as the checkpoint's), so the "
                     "training does not change",
        "same_base": "the same base model (config.json and every weight file as the checkpoint recorded them), so the "
                     "training does not change",
        "evaluation": "the evaluation differs, the training does not"}


@functools.cache
def finetune_version() -> str:
    """This finetune as a checkpoint's manifest records it: `0.1.0 (code 1a2b3c4d5e6f)`, the code a digest of every
    file of the package (rendezvous.code_facts), with the commit when it runs from a git checkout (an editable install:
    `0.1.0 (git 89f920a0c1d2, code 1a2b3c4d5e6f)`). A resume compares it with the checkpoint's, so that tokens changed
    by an upgrade are not blamed on the user's data (resume_checks.py). Installed from a wheel, it said `0.1.0` for
    every finetune, whose upgrades then went unnamed (bug bash bb70)."""
    # finetune.__version__: the package is loaded before any of its modules (an import of it here would be a stage
    # importing the top-level package, the CLI's room: tests/test_architecture.py)
    __version__ = sys.modules["finetune"].__version__
    code = "code " + digests({"finetune": code_facts()})["finetune"].removeprefix(DIGEST)[:12]
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # an installed wheel: its files say it (and no enclosing repository is asked)
        return f"{__version__} ({code})"
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                               text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    return f"{__version__} (git {found}, {code})" if found else f"{__version__} ({code})"


def check_resume(source: Path | None, recipe, plan, *, train_rows: int | None,
                 train_fingerprint: str | None = None) -> None:
    """Refuse, before any weight loads, a checkpoint this run cannot continue; say every change that makes the run
    differ from an uninterrupted one (rank 0 decides and prints; every rank gets the same answer). `plan`: this
    run's ParallelPlan; `train_rows`: its training rows (None for a stream). After train.num_epochs is resolved."""
    if source is None:
        return

    def decide() -> None:
        for note in resume_changes(source, recipe, plan, train_rows=train_rows, train_fingerprint=train_fingerprint):
            distributed.print0(f"[finetune] note: {note}")

    on_main(decide)


def _change(key: str, before, now, recipe) -> str:
    """A changed key as the notes say it; warmup steps resolved from the recipe's warmup_ratio are said as the ratio
    (bug bash bb69: "train.warmup_steps 1 -> 2" for a recipe that sets only warmup_ratio, extended)."""
    ratio = recipe.train._warmup_ratio if key == "train.warmup_steps" else None
    shown = (f"train.warmup_ratio {ratio:g} (= {_shown(before)} -> {_shown(now)} warmup steps over the new length)"
             if ratio is not None else f"{key} {_shown(before)} -> {_shown(now)}")
    return shown + (f" ({WHY_NOTED[key]})" if key in WHY_NOTED else "")


def resume_changes(source: Path, recipe, plan, *, train_rows: int | None,
                   train_fingerprint: str | None = None) -> list[str]:
    """What check_resume decides: CheckpointError for a checkpoint this run cannot continue, else the notes.
    `train_fingerprint`: data.rows_fingerprint of this run's training rows (None: not compared)."""
    saved, state = _saved(source)
    current = recipe.model_dump(mode="json")
    _adapter_layout_as_resolved(saved, current)
    base = compare_base(source, saved, current)  # the base's sizes and files against the checkpoint's record
    rows_kept = _rows_kept(state, current, train_rows, train_fingerprint)
    refused, said = [], {kind: [] for kind in SAID}
    # train.num_epochs not yet resolved (`finetune validate` without the rows): the length is compared by the run
    unresolved = ("train.num_epochs", "train.max_steps", "train.warmup_steps", "train.warmup_ratio") if (
        recipe.train.num_epochs is not None) else ()
    from finetune.model.lora.kept import same_start_adapter

    for key, before, now in differences(saved, current):
        if _under(key, unresolved) or same_place(before, now) or _same_targets(source, key, before, now) or (
                key == "model.adapter" and same_start_adapter(recipe)) or (  # the kept start-adapter/ is read (kept.py)
                key in WHY_NOTED and _same_rates(saved, current, state["step"])):
            continue
        if key == "train.seed" and _streams(saved) and _streams(current):
            said["noted"].append(f"train.seed {_shown(before)} -> {_shown(now)} (a stream is read in its order, "
                                 "unshuffled: the LoRA weights and the dropout's random state continue from the checkpoint)")
        elif key in REFUSED:  # leaves, each (lora.target_modules: the modules it names, _same_targets)
            refused.append((key, before, now, REFUSED[key]))
        elif kind := _kind(key, same_base=base.same, rows_kept=rows_kept):
            said[kind].append(_change(key, before, now, recipe))
    rows_then, rows_now = _rows_per_step(saved, state), _rows_per_step(current, None, plan.world_size)
    # train.num_epochs, once resolved, is null and max_steps set: the recipe keeps how (its resolved recipe.yaml's comment)
    by_epochs = getattr(recipe, "_length_origin", None) is not None
    upgrade = _upgrade(source)  # the tokens or the row count changed: an upgrade may be why, not the user's data
    problems = [_described(*item) for item in refused] + ([base.problem] if base.problem else [])
    problems += [p for p in (_strategy_problem(source, state, plan), _rows_problem(state, train_rows, upgrade),
                             _epochs_problem(rows_then, rows_now, current, plan.world_size, by_epochs=by_epochs)) if p]
    if problems:
        raise CheckpointError(_refusal(source, recipe, problems, [(key, before) for key, before, _, _ in refused]
                                       + _base_fix(base, saved, current)))
    if not unresolved and (length := _length_problem(source, state["step"], recipe.train.max_steps)) is not None:
        raise CheckpointError(length)
    if base.note:
        said["noted"].append(base.note)
    if cycle := _inside_cycle(saved, state["step"]):
        said["noted"].append(cycle)
    saved_print = (state.get("data") or {}).get("fingerprint")
    if train_fingerprint and saved_print and saved_print != train_fingerprint and train_rows == state["data"].get("rows"):
        said["noted"].append(f"the training rows (as many, other tokens: a data file, the tokenizer or a data setting "
                             f"changed{upgrade}) or the same rows in another order (the checkpoint's hash of its rows "
                             "does not tell which); the saved data position is applied to these rows")
    if rows_then is not None and rows_then != rows_now:
        skipped = _rows_skipped(state, current, plan.world_size)
        said["noted"].append(f"rows per optimizer step {rows_then} -> {rows_now} (train.micro_batch_size x processes "
                             "x train.grad_accum)" + (f"; the data position moves on to the next whole micro-batch of "
                                                      f"the new size, so {skipped} row(s) of this epoch are not trained"
                                                      if skipped else ""))
    return [f"resuming {source} with {'; '.join(items)}: {SAID[kind]}" for kind, items in said.items() if items]


def _same_rates(saved: dict, current: dict, step: int) -> bool:
    """Whether the steps the checkpoint trained (0 .. step - 1) had the learning rates this run's schedule gives them:
    then a changed max_steps or warmup_steps changes nothing already trained, and the steps after follow this run's
    schedule, as an uninterrupted run's do (a constant schedule extended: bb62, "it reshapes the schedule" was said)."""
    from types import SimpleNamespace

    from finetune.recipe.train import lr_factors

    try:
        then, now = (lr_factors(SimpleNamespace(**recipe["train"])) for recipe in (saved, current))
        return all(then(index) == now(index) for index in range(step))
    except (KeyError, TypeError, AttributeError, ValueError):  # a saved recipe without a key the schedule reads
        return False


def _inside_cycle(saved: dict, step: int) -> str | None:
    """The note for a GRPO checkpoint that ends inside a grpo.num_iterations cycle (only a run's last step saves one:
    save_every is a multiple, a signal finishes the cycle): the cycle's completions are not saved (bb62)."""
    cycle = (saved.get("grpo") or {}).get("num_iterations")
    if (saved.get("train") or {}).get("objective") != "grpo" or not isinstance(cycle, int) or cycle < 2 or (
            step % cycle == 0):
        return None
    return (f"the checkpoint of step {step} ends inside a grpo.num_iterations cycle of {cycle} steps (its run's last "
            f"step), whose completions a checkpoint does not keep: this run samples new completions at step {step + 1},"
            " where an uninterrupted run trains that cycle's again")


def _kind(key: str, *, same_base: bool, rows_kept: bool) -> str | None:
    """How a changed key other than a refused one is said (a kind of SAID), or None: harmless, or compared apart."""
    if _under(key, EVAL_ONLY):
        return "evaluation"
    if _under(key, HARMLESS + BATCH):
        return None
    if key == "model.name_or_path" and same_base:
        return "same_base"
    if key == "lora.fused":
        return "another_path"
    return "rows_kept" if rows_kept and _under(key, ROWS_DECIDE) else "noted"


def _rows_kept(state: dict, current: dict, train_rows: int | None, train_fingerprint: str | None) -> bool:
    """This run's training rows are the checkpoint's, token for token and in order, and the objective reads nothing
    else of the settings that make them (ROWS_DECIDE)."""
    data = state.get("data") or {}
    return bool(train_fingerprint) and data.get("fingerprint") == train_fingerprint and data.get(
        "rows") == train_rows and (current.get("train") or {}).get("objective") in ROWS_ONLY_OBJECTIVES


def _base_fix(base, saved: dict, current: dict) -> list[tuple[str, Any]]:
    """The checkpoint's model.name_or_path, for a base of another size under another name."""
    then, now = ((recipe.get("model") or {}).get("name_or_path") for recipe in (saved, current))
    return [("model.name_or_path", then)] if base.problem and then != now and not same_place(then, now) else []


def _same_targets(source: Path, key: str, before: Any, now: Any) -> bool:
    """lora.target_modules naming the modules the checkpoint's LoRA tensors are on: the same names in another order,
    or all-linear in the checkpoint and here the list of the modules its saved tensors are on (the names in
    trainable/'s metadata, read without running code). Both were refused as other modules (bb41)."""
    if key != "lora.target_modules" or not isinstance(now, list):
        return False
    if isinstance(before, list):
        return set(before) == set(now)
    return before == "all-linear" and _saved_target_leaves(source) == set(now)


def _saved_target_leaves(source: Path) -> set[str] | None:
    """The last name of every module with saved LoRA tensors (`q_proj`), from the checkpoint's DCP metadata; None
    where it has none (DeepSpeed's own format) or cannot be read."""
    try:
        keys = read_dcp_metadata(source / "trainable").state_dict_metadata
    except (OSError, CheckpointError, AttributeError):
        return None
    found = {re.split(r"\.lora_(?:embedding_)?[AB]\.", key)[0].rsplit(".", 1)[-1] for key in keys
             if key.startswith("model.") and re.search(r"\.lora_(?:embedding_)?[AB]\.", key)}
    return found or None


def differences(saved: Any, current: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, checkpoint's value, this run's value) of every leaf that differs; keys the checkpoint's recipe
    does not have (written before they existed) are skipped. Lists of sections of the same length (data.datasets)
    are compared item by item (`data.datasets[0].path`), other lists whole."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key, value in current.items():
            if key in saved:
                yield from differences(saved[key], value, f"{path}.{key}" if path else key)
    elif (isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current)
          and all(isinstance(item, dict) for item in [*saved, *current])):
        for index, (before, now) in enumerate(zip(saved, current)):
            yield from differences(before, now, f"{path}[{index}]")
    elif saved != current:
        yield path, saved, current


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    """`key` is one of `prefixes` or inside one (a section, a list of sections)."""
    return any(key == p or key.startswith((f"{p}.", f"{p}[")) for p in prefixes)


def _adapter_layout_as_resolved(saved: dict, current: dict) -> None:
    """A run started from model.adapter before its lora keys were filled from the adapter (r, alpha, rslora, dora,
    bias; target_modules, which said all-linear) saved the schema's defaults there, though it trained the adapter's
    layout: read as the adapter's (this run's resolved values), not as a changed layout that refuses the resume."""
    from finetune.model.lora.adapter import LAYOUT
    from finetune.recipe.schema import LoraSection

    adapter, now_adapter = (saved.get("model") or {}).get("adapter"), (current.get("model") or {}).get("adapter")
    if not adapter or not (adapter == now_adapter or same_place(adapter, now_adapter)):
        return
    default, now, lora = LoraSection(), current.get("lora") or {}, saved.setdefault("lora", {})
    for key in (*LAYOUT, "target_modules"):
        if lora.get(key, getattr(default, key)) == getattr(default, key) and key in now:
            lora[key] = now[key]


def _saved(source: Path) -> tuple[dict, dict]:
    """The checkpoint's recipe and trainer state."""
    import yaml

    try:
        saved = yaml.safe_load((source / "recipe.yaml").read_text(encoding="utf-8")) or {}
        state = json.loads((source / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise CheckpointError(f"train.resume: checkpoint {source} is unreadable ({exc}). Fix: point train.resume at "
                              "another checkpoint, or use `auto` to take the newest good one.") from None
    return saved, state


def _shown(value: Any) -> str:
    """A value in a description: as an override takes it, cut at 80 characters."""
    text = _override(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _override(value: Any) -> str:
    """A value as a `key=value` override takes it (YAML flow: lists and mappings as JSON), never shortened."""
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def _described(key: str, before: Any, now: Any, why: str) -> str:
    return f"{key} is {_shown(now)} here, {_shown(before)} in the checkpoint ({why})"


def _refusal(source: Path, recipe, problems: list[str], fixes: list[tuple[str, Any]]) -> str:
    """One paragraph: every problem, then the fix (the checkpoint's values, or a new run)."""
    overrides = " ".join(shlex.quote(f"{key}={_override(value)}") for key, value in fixes)  # whole, ready to paste
    new_run = ("start a new run (another output.dir, or output.overwrite=true)" if recipe.train.resume == "auto"
               else "start a new run without train.resume")
    fix = f"resume with the checkpoint's values ({overrides}), or {new_run}" if overrides else f"as said, or {new_run}"
    return (f"train.resume: checkpoint {source} cannot continue this run: {'; '.join(problems)}. Nothing was loaded "
            f"or written. Fix: {fix}.")


def _zero_stage(strategy: str | None) -> int | None:
    found = re.search(r"ZeRO-(\d)", strategy or "")
    return int(found.group(1)) if found else None


def _strategy_problem(source: Path, state: dict, plan) -> str | None:
    """A checkpoint's format loads only where it can: DCP (trainable/) into any strategy but DeepSpeed, at any number
    of processes; DeepSpeed's own into DeepSpeed at the ZeRO stage that wrote it, at any number of ranks."""
    from finetune.parallel.zero_checkpoint import CHECKPOINT_FOLDER

    saved = state.get("strategy") or "an unknown strategy"
    written_by_deepspeed = (source / CHECKPOINT_FOLDER).is_dir()
    stage = plan.zero.stage if plan.strategy == "deepspeed" and plan.zero is not None else None
    if written_by_deepspeed and plan.strategy != "deepspeed":
        want = _zero_stage(saved)
        return (f"it was written by {saved} in DeepSpeed's own format, which only DeepSpeed at ZeRO-{want} loads, and "
                f"this run is {plan.describe()}; resume it with parallel.strategy=deepspeed parallel.zero_stage={want} "
                f"(both keys, also under accelerate_configs/deepspeed_zero{want}.yaml: one process of it trains without "
                "DeepSpeed unless the recipe asks for it), any number of processes")
    if not written_by_deepspeed and plan.strategy == "deepspeed":
        return (f"it was written by {saved} (torch DCP, trainable/), which DeepSpeed does not load, and this run is "
                f"{plan.describe()}; resume it with a strategy other than DeepSpeed (single, DDP, FSDP or layer "
                "split: DCP reshards to any of them and any number of processes)")
    if written_by_deepspeed and stage != _zero_stage(saved):
        return (f"it was written by {saved} and this run is ZeRO-{stage}: DeepSpeed partitions the optimizer state per "
                f"stage and loads only the stage that wrote it; resume it at ZeRO-{_zero_stage(saved)}: with "
                f"accelerate_configs/deepspeed_zero{_zero_stage(saved)}.yaml, or parallel.zero_stage="
                f"{_zero_stage(saved)} where the accelerate config names no stage")
    return None


def _rows_problem(state: dict, train_rows: int | None, upgrade: str = "") -> str | None:
    """The saved data position counts this many training rows; another count cannot place it."""
    data = state.get("data") or {}
    if train_rows is None or data.get("streaming") or "rows" not in data or data["rows"] == train_rows:
        return None
    return (f"the training rows are {train_rows} here, {data['rows']} in the checkpoint (the data or a data setting "
            f"changed: data.datasets, max_length, packing, the eval split...{upgrade}), so its data position cannot be "
            "placed; resume it with the data and data settings of its recipe.yaml")


def _upgrade(source: Path) -> str:
    """`; or ...` naming the finetune versions when another one wrote the checkpoint (its manifest's `finetune`;
    none before versions were recorded), else "": how rows are rendered into tokens is finetune's code too."""
    try:
        written = json.loads((source / MANIFEST).read_text(encoding="utf-8")).get("finetune")
    except (OSError, ValueError, AttributeError):
        return ""
    now = finetune_version()
    if written == now:
        return ""
    then = f"finetune {written}" if written else "an older finetune (it recorded no version)"
    return (f"; or this finetune's upgrade: the checkpoint was written by {then} and this is {now}, whose rendering of "
            "the rows, or choice of the rows held out for eval (a conversation's turns held out together from "
            "2026-12 on), may differ: then resume with the finetune that wrote it, or start anew")


def _streams(recipe: dict) -> bool:
    return bool((recipe.get("data") or {}).get("streaming"))


def _rows_skipped(state: dict, current: dict, world_size: int) -> int:
    """Rows of the current epoch a resume with another global micro-batch never trains: the saved position (global
    micro-batches of the saving run) is rounded up to whole micro-batches of this run's (data/loader.py)."""
    data = state.get("data") or {}
    if data.get("streaming") or not {"cursor", "micro_batch_size", "world_size"} <= data.keys():
        return 0
    seen = data["cursor"] * data["micro_batch_size"] * data["world_size"]
    return -seen % (_rows_per_step(current, None, world_size) // current["train"]["grad_accum"])


def _rows_per_step(recipe: dict, state: dict | None, world_size: int | None = None) -> int | None:
    """Rows of one optimizer step: the stream's rows per micro-batch (GRPO: prompts) x processes x grad_accum."""
    train = recipe.get("train") or {}
    if state is not None:  # the checkpoint's: its data position says the rows per micro-batch and the processes
        data = state.get("data") or {}
        if "micro_batch_size" not in data or "world_size" not in data:
            return None
        return data["micro_batch_size"] * data["world_size"] * int(train.get("grad_accum") or 1)
    per_micro_batch = train["micro_batch_size"]
    if train.get("objective") == "grpo":
        per_micro_batch //= (recipe.get("grpo") or {}).get("num_generations") or 1
    return per_micro_batch * world_size * train["grad_accum"]


def _epochs_problem(rows_then: int | None, rows_now: int, recipe: dict, world_size: int, *,
                    by_epochs: bool) -> str | None:
    """train.num_epochs counts steps of the checkpoint's size: with other steps the epochs would not add up (the
    resolved max_steps is of this run's steps, the steps done of the checkpoint's)."""
    if not by_epochs or rows_then is None or rows_then == rows_now:
        return None
    per_micro_batch = rows_now // (world_size * recipe["train"]["grad_accum"])
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    if rows_then % (per_micro_batch * world_size) == 0:
        same = f"train.grad_accum={rows_then // (per_micro_batch * world_size)} with {processes}, or "
    else:
        same = ""
    return (f"train.num_epochs counts optimizer steps of {rows_then} rows (the checkpoint's), and this run's take "
            f"{rows_now} (train.micro_batch_size x {processes} x train.grad_accum), so its epochs would not add up to "
            f"train.num_epochs; resume with steps of {rows_then} rows ({same}the checkpoint's processes and batch "
            "settings), or set train.max_steps instead of train.num_epochs")


def _length_problem(source: Path, step: int, max_steps: int) -> str | None:
    """A checkpoint past train.max_steps would train nothing and leave its own later adapter under a shorter recipe."""
    if step <= max_steps:
        return None
    run_dir = source.parent.parent
    earlier = [path for kept, path in list_checkpoints(run_dir) if kept <= max_steps and checkpoint_problem(path) is None]
    back = (f"train.resume={earlier[-1]} (the newest kept checkpoint at or below step {max_steps}) with another "
            f"output.dir to end at step {max_steps} there (this run is kept), or " if earlier else "")
    return (f"train.resume: checkpoint {source} is of step {step}, past train.max_steps {max_steps} of this run: it "
            f"would train nothing and leave step {step}'s adapter under a recipe that says {max_steps} steps. Nothing "
            f"was loaded or written. Fix: {back}train.max_steps={step} or more to continue the run"
            f"{'' if earlier else ' (no kept checkpoint is at or below step ' + str(max_steps) + ')'}.")
