"""This project vs TRL's SFTTrainer vs a minimal hand-written PEFT loop: same model, data and hyperparameters.

    python benchmarks/bench_peers.py                      # every runner, unpacked and packed, 3 repeats, + memory parts
    python benchmarks/bench_peers.py --tiny --steps 4 --repeats 1     # a tiny random model: a smoke run of the harness
    python benchmarks/bench_peers.py --only ours,trl --modes packed --distributed
    python benchmarks/bench_peers.py --summarize results.json         # the tables of an earlier --json run
    python benchmarks/bench_peers.py --dpo                # DPO against TRL's DPOTrainer (benchmarks/bench_peers_dpo.py)
    python benchmarks/bench_peers.py --grpo               # GRPO against TRL's GRPOTrainer (benchmarks/bench_peers_grpo.py)

Work: QLoRA (NF4 base, bf16 where native else fp32 (DTYPE below), LoRA r16 / alpha 32 / dropout 0.05 on all linear
layers) of SmolLM2-135M-Instruct (the
quickstart's model) on the ledger_report task (finetune/cli/tasks.py: 200 chats of 156-439 tokens, median 315, 45% of
them trained; 180 train / 20 held out), batch 4, max length 512, lr 1e-3 (5 warmup steps, cosine to 10%), no
gradient checkpointing, the same number of steps for every runner. Each run is a fresh process:
  * ours            finetune/run.py (its main(), the recipe below): the fused LoRA path, the chunked loss;
  * ours-peft       the same with lora.fused=false: PEFT's own LoRA forward (what v1 ran);
  * trl             SFTTrainer (TRL is a benchmark dependency only) on the same tokenized rows and loss mask,
                    bf16, padding-free BFD packing when packed, LoRA via peft_config;
  * peft            model(**batch, labels) + AdamW: the loop of PEFT's QLoRA examples (prepare_model_for_kbit_training,
                    which casts the embeddings, the norms and the lm_head to fp32, as the standard PEFT QLoRA recipe
                    does: its time and memory include those fp32 layers, where ours keeps them in bf16), on our
                    batches (packed: the same rows, position ids restarting per example, no attention mask).
The repeats are interleaved (every runner once, then again) so a slow spell of the machine hits all runners alike.
Figures, the same way for every runner: training tokens/s = non-pad tokens of steps 2..N over their wall time (step 1
is warm-up), and the median of the per-step rates; peak RSS of the process (max over ranks); eval loss = token-weighted
mean next-token loss over the held-out answers after the last step (the same function for all); "other CPU" = the
share of the machine's CPU time that other processes used during the run (from /proc/stat minus this run's own
CPU time): above a few percent the run was contended. Ratios are against `ours` in the same mode. After the tables,
benchmarks/memory_breakdown.py's per-part peak of `ours` in each mode, with the planner's estimate of each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
from peers_common import (  # noqa: F401
    BF16,
    DTYPE,
    QUICKSTART_MODEL,
    ROWS,
    SYSTEM_PROMPT,
    cpu_seconds,
    device,
    names,
    peak_rss_mb,
    run_measured,
    synced,
    synchronize,
    throughput,
    worker_env,
    write_inputs,
    write_report,
)

# --------------------------------------------------------------------------------------------------- inputs


def steps_per_epoch(recipe_path: Path, *, packed: bool) -> int:
    from finetune import data, model
    from finetune.recipe import load_recipe

    recipe = load_recipe(recipe_path, [f"data.packing={str(packed).lower()}"])
    train_examples, _, _ = data.build_examples(recipe, model.load_tokenizer(recipe))
    return len(train_examples) // recipe.train.micro_batch_size


# ---------------------------------------------------------------------------------------- shared measurement




def held_out_loss(model, examples, pad_id: int) -> float:
    """Token-weighted mean next-token loss over the held-out answers (what finetune's evaluate() computes)."""
    import torch

    from finetune.data import eval_batches
    from finetune.training.loop import loss_sum

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(examples, micro_batch_size=4, rank=0, world_size=1, pad_id=pad_id):
            value, tokens = loss_sum(model, batch, device())
            total, count = total + float(value), count + tokens
    return total / max(count, 1)




# ------------------------------------------------------------------------------------------------- runners
# What the loop calls at the end of a run (finetune/training/loop.py: `evaluate_figures(...)` and
# `checkpoint.save_checkpoint(...)`, looked up at each call): the peak RSS is read before and after each, so the
# table shows which phase set it. tests/test_bench_peers.py checks that the loop still calls these names.
PHASE_CALLS = {"eval": ("finetune.training.loop", "evaluate_figures"),
               "checkpoint": ("finetune.outputs.checkpoint", "save_checkpoint")}


@contextlib.contextmanager
def measured_run(tokens: list[int], phases: dict[str, float]):
    """While open: the non-pad tokens of every micro-batch go into `tokens`, each optimizer step's clock stops after
    the GPU's work, and `phases` gets the peak RSS before and after the last call of each of PHASE_CALLS."""
    import importlib

    from finetune import data, training

    def counting_iter(stream, _iter=data.BatchStream.__iter__):
        for batch in _iter(stream):
            tokens.append(data.real_token_count(batch, stream.pad_id))
            yield batch

    def noting(name: str, function):
        def wrapper(*args, **kwargs):
            phases[f"before_{name}"] = peak_rss_mb()  # the last call's: the final eval, after the last step
            value = function(*args, **kwargs)
            phases[f"after_{name}"] = peak_rss_mb()
            return value
        return wrapper

    patches = [(data.BatchStream, "__iter__", counting_iter),
               (training.loop, "optimizer_step", synced(training.loop.optimizer_step))]
    for name, (module, attribute) in PHASE_CALLS.items():
        owner = importlib.import_module(module)
        patches.append((owner, attribute, noting(name, getattr(owner, attribute))))
    originals = [(owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in patches]
    try:
        for owner, attribute, replacement in patches:
            setattr(owner, attribute, replacement)
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def worker_ours(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    """finetune/run.py's main() in this process (one rank), counting the non-pad tokens each micro-batch carries and
    noting the peak RSS before and after the final evaluation and the checkpoint (which phase sets the peak)."""
    from finetune import run

    tokens: list[int] = []
    phases: dict[str, float] = {}
    with measured_run(tokens, phases):
        code = run.main([str(recipe_path), f"output.dir={out / 'run'}", *overrides])
    if code != 0:
        raise SystemExit(code)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    write_report(out, step_tokens=tokens, step_end=[m["elapsed_s"] for m in metrics if "elapsed_s" in m], phases=phases,
                 eval_loss=next((m["eval_loss"] for m in reversed(metrics) if "eval_loss" in m), None))


def worker_trl(recipe_path: Path, out: Path, overrides: list[str], *, packed: bool) -> None:
    """SFTTrainer on the same tokenized rows and loss mask; its own packing (BFD, padding-free) when packed."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from finetune import data, model
    from finetune.recipe import load_recipe

    recipe = load_recipe(recipe_path, [*overrides, "data.packing=false"])
    tokenizer = model.load_tokenizer(recipe)
    train_examples, eval_examples, _ = data.build_examples(recipe, tokenizer)
    rows = [{"input_ids": e.input_ids, "completion_mask": [int(label != -100) for label in e.labels]} for e in train_examples]
    tokens, step_end = [], []

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            step_end.append(time.perf_counter())

    t = recipe.train
    config = SFTConfig(
        output_dir=str(out / "trl"), max_length=recipe.data.max_length, packing=packed, completion_only_loss=True,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=1, max_steps=t.max_steps,
        learning_rate=t.learning_rate, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=t.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", bf16=BF16,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        use_cpu=device().type == "cpu", dataloader_num_workers=0, seed=t.seed, disable_tqdm=True,
    )
    base = model.load_base_model(recipe, device=device())
    trainer = Counting(model=base, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                       peft_config=model.lora_config(recipe), callbacks=[Clock()])
    trainer.train()
    write_report(out, step_tokens=tokens, step_end=step_end,
                 eval_loss=held_out_loss(trainer.model, eval_examples, tokenizer.pad_token_id))


def worker_peft(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    """The loop of PEFT's QLoRA examples: 4-bit model, prepare_model_for_kbit_training (embeddings, norms and lm_head
    cast to fp32, as that recipe does), LoRA, model(**batch).loss."""
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training

    from finetune import data, model, training
    from finetune.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    tokenizer = model.load_tokenizer(recipe)
    train_examples, eval_examples, _ = data.build_examples(recipe, tokenizer)  # packed when data.packing
    base = model.load_base_model(recipe, device=device())
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    peft_model = get_peft_model(base, model.lora_config(recipe))
    parameters = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=recipe.train.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, training.loop.lr_lambda(recipe))
    stream = iter(data.BatchStream(train_examples, micro_batch_size=recipe.train.micro_batch_size, rank=0, world_size=1,
                                   seed=recipe.train.seed, pad_id=tokenizer.pad_token_id))
    tokens, step_end = [], []
    peft_model.train()
    for _ in range(recipe.train.max_steps):
        batch = next(stream)
        tokens.append(data.real_token_count(batch, tokenizer.pad_token_id))
        peft_model(**{k: v.to(device()) for k, v in batch.items()}).loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()  # the GPU's work of this step is done: the clock times it, not the launches
        step_end.append(time.perf_counter())
    write_report(out, step_tokens=tokens, step_end=step_end,
                 eval_loss=held_out_loss(peft_model, eval_examples, tokenizer.pad_token_id))


# ---------------------------------------------------------------------------------------------- orchestration
RUNNERS = ("ours", "ours-peft", "trl", "peft")


def configurations(only: list[str], modes: list[str], distributed: bool) -> list[dict]:
    """(runner, mode, processes) in the order they run; 2-process runs keep the global batch at 4 (2 per rank)."""
    configs = []
    for mode in modes:
        configs += [{"runner": runner, "mode": mode, "procs": 1, "strategy": "single"} for runner in RUNNERS if runner in only]
        if distributed and "ours" in only:
            configs += [{"runner": "ours", "mode": mode, "procs": 2, "strategy": strategy} for strategy in ("ddp", "fsdp2")]
    return configs








def launch(config: dict, recipe: Path, out: Path, steps: int) -> dict:
    """Run one configuration in fresh processes; returns the figures read back from their reports."""
    overrides = [f"train.max_steps={steps}", f"data.packing={str(config['mode'] == 'packed').lower()}"]
    if config["runner"] == "ours-peft":
        overrides.append("lora.fused=false")
    if config["procs"] > 1:
        overrides += ["train.micro_batch_size=2", "parallel.strategy=" + config["strategy"].rstrip("12")]
        overrides += ["parallel.fsdp_version=2"] if config["strategy"] == "fsdp2" else []
    worker = [str(Path(__file__).resolve()), "--worker", config["runner"], "--recipe", str(recipe), "--out", str(out),
              "--mode", config["mode"], *overrides]
    env = worker_env()
    if config["procs"] > 1:
        env["OMP_NUM_THREADS"] = "1"  # two processes share the cores
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={config['procs']}",
                   "--master_port=29533", *worker]
    else:
        command = [sys.executable, *worker]
    wall, other = run_measured(command, env, str(config))
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("bench_rank*.json"))]
    return {**config, "steps": steps, **throughput(reports, steps), "other_cpu": other,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in reports), "eval_loss": reports[0]["eval_loss"],
            "peak_gpu_mb": max((r.get("peak_gpu_mb", 0) for r in reports), default=0),
            "phases": reports[0].get("phases", {}), "wall_s": wall}




def combine(results: list[dict]) -> list[dict]:
    """One row per (runner, mode, processes): medians over the repeats and their spread (min..max)."""
    rows: dict[tuple, list[dict]] = {}
    for r in results:
        rows.setdefault((r["runner"], r["mode"], r["procs"], r["strategy"]), []).append(r)
    combined = []
    for (runner, mode, procs, strategy), runs in rows.items():
        row = {"runner": runner, "mode": mode, "procs": procs, "strategy": strategy, "repeats": len(runs)}
        for key in ("median_tokens_per_s", "tokens_per_s", "peak_rss_mb", "eval_loss", "other_cpu"):
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key], row[key + "_range"] = (statistics.median(values), (min(values), max(values))) if values else (None, None)
        combined.append(row)
    return combined


def ratio(value: float, base: dict | None, key: str) -> str:
    """`value` against the `ours` row's figure, or n/a when no `ours` ran in that mode (never a row against itself)."""
    return f"{value / base[key]:.2f}x" if base and base.get(key) else "n/a"


def table(results: list[dict]) -> str:
    """Markdown table of the combined rows; ratios against `ours` (1 process) in the same mode."""
    rows = combine(results)
    lines = [("| runner | mode | processes | tokens/s, median step (range) | tokens/s, mean | peak RSS MB (range) | "
              "eval loss | other CPU | tokens/s vs ours | RSS vs ours |"), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next((b for b in rows if b["runner"] == "ours" and b["mode"] == r["mode"] and b["procs"] == 1), None)
        procs = "1" if r["procs"] == 1 else f"{r['procs']} ({r['strategy'].upper()})"
        low, high = r["median_tokens_per_s_range"]
        rss_low, rss_high = r["peak_rss_mb_range"]
        lines.append(f"| {r['runner']} | {r['mode']} | {procs} | {r['median_tokens_per_s']:.0f} ({low:.0f}-{high:.0f}) | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} ({rss_low:.0f}-{rss_high:.0f}) | "
                     f"{r['eval_loss']:.4f} | {r['other_cpu']:.0%} | "
                     f"{ratio(r['median_tokens_per_s'], base, 'median_tokens_per_s')} | "
                     f"{ratio(r['peak_rss_mb'], base, 'peak_rss_mb')} |")
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    """Which phase of `ours` sets its peak RSS: training, the final evaluation, or the checkpoint (- : not seen)."""
    lines = ["| runner | mode | peak RSS after training (MB) | after the final eval | after the checkpoint |",
             "|---|---|---:|---:|---:|"]
    for r in combine([r for r in results if r.get("phases")]):
        runs = [x for x in results if x["runner"] == r["runner"] and x["mode"] == r["mode"] and x["procs"] == r["procs"]]
        phases = runs[0]["phases"]
        figures = [phases.get(key) for key in ("before_eval", "after_eval", "after_checkpoint")]
        lines.append(f"| {r['runner']} | {r['mode']} | "
                     + " | ".join("-" if figure is None else f"{figure:.0f}" for figure in figures) + " |")
    return "\n".join(lines)


def breakdown(recipe: Path, mode: str, out: Path) -> dict:
    """benchmarks/memory_breakdown.py on the `ours` recipe in a fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve().parent / "memory_breakdown.py"), str(recipe),
               f"data.packing={str(mode == 'packed').lower()}", "--json", str(out)]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"memory breakdown ({mode}) failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def report(results: list[dict], breakdowns: list[dict]) -> str:
    from memory_breakdown import format_breakdown

    parts = [table(results), "", phase_table(results)]
    parts += ["\n" + format_breakdown(b) for b in breakdowns]
    return "\n".join(parts)


MODES = ("unpacked", "packed")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked before anything runs: --steps, and every --only / --modes name spelled as listed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M (smoke test)")
    parser.add_argument("--random", metavar="HIDDEN,LAYERS", help="a random model of this size instead of SmolLM2-135M "
                        "(built from a config, no download: the GPU smoke's 2048,8)")
    parser.add_argument("--task", default="ledger_report", choices=sorted(ROWS), help="the data (finetune/cli/tasks.py)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run, the same for every runner")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved")
    parser.add_argument("--only", default=",".join(RUNNERS), help=f"comma-separated runners: {', '.join(RUNNERS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--distributed", action="store_true", help="also 2-process DDP and FSDP2 runs of ours")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-part memory breakdown")
    parser.add_argument("--json", help="write every run's figures here as JSON")
    parser.add_argument("--keep", help="keep run folders under this path")
    parser.add_argument("--summarize", help="print the tables of an earlier --json file, run nothing")
    args = parser.parse_args(argv)
    if not args.summarize:
        if args.steps < 3:
            parser.error("--steps must be at least 3 (step 1 is warm-up)")
        args.only = names(parser, "--only", args.only, RUNNERS)
        args.modes = names(parser, "--modes", args.modes, MODES)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--dpo" in argv:  # preference tuning against TRL's DPOTrainer: benchmarks/bench_peers_dpo.py
        from bench_peers_dpo import main as dpo_main

        dpo_main([arg for arg in argv if arg != "--dpo"])
        return
    if "--grpo" in argv:  # online RL against TRL's GRPOTrainer: benchmarks/bench_peers_grpo.py
        from bench_peers_grpo import main as grpo_main

        grpo_main([arg for arg in argv if arg != "--grpo"])
        return
    args = arguments(argv)
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        print(report(saved["runs"], saved["breakdowns"]))
        return
    only, modes = args.only, args.modes
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        size = tuple(int(n) for n in args.random.split(",")) if args.random else None
        recipe = write_inputs(root, tiny=args.tiny, task=args.task, random_size=size)
        results, breakdowns = [], []
        for repeat in range(args.repeats):
            for index, config in enumerate(configurations(only, modes, args.distributed)):
                name = f"r{repeat}-{index:02d}-{config['runner']}-{config['mode']}-{config['strategy']}"
                result = launch(config, recipe, root / name, args.steps)
                print(f"{repeat + 1}/{args.repeats} {result['runner']:>9} {result['mode']:>8} {result['strategy']:>6}: "
                      f"{result['median_tokens_per_s']:7.1f} tokens/s (median step; mean {result['tokens_per_s']:.1f}), "
                      f"peak RSS {result['peak_rss_mb']:6.0f} MB, eval loss {result['eval_loss']:.4f}, other CPU "
                      f"{result['other_cpu']:.0%} ({args.steps} steps, {result['wall_s']:.0f} s)", flush=True)
                results.append(result)
        if not args.no_breakdown and "ours" in only:
            breakdowns = [breakdown(recipe, mode, root / f"breakdown-{mode}.json") for mode in modes]
    print()
    print(report(results, breakdowns))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "breakdowns": breakdowns}, indent=1))


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=RUNNERS)
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", required=True, choices=MODES)
    args, overrides = parser.parse_known_args(argv)
    if args.worker.startswith("ours"):
        worker_ours(args.recipe, args.out, overrides)
    elif args.worker == "trl":
        worker_trl(args.recipe, args.out, overrides, packed=args.mode == "packed")
    else:
        worker_peft(args.recipe, args.out, overrides)


if __name__ == "__main__":
    worker_main(sys.argv[1:]) if "--worker" in sys.argv else main()
