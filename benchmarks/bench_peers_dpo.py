"""DPO: this project (reference adapter_off, and precomputed) against TRL's DPOTrainer, same model, pairs and settings.

    python benchmarks/bench_peers.py --dpo [--steps 8] [--repeats 3] [--tiny]     (or run this file directly)

Work: QLoRA DPO (NF4 base, bf16 where native else fp32 as bench_peers.DTYPE, LoRA r16 / alpha 32 on all linear
layers, dropout off as both tools do for DPO,
sigmoid loss, beta 0.1) of SmolLM2-135M-Instruct (the quickstart's model) on pairs of realistic length built from the
ledger_report task (finetune/cli/tasks.py): the prompt is a statement of 2-7 payments (~150 tokens), `chosen` its
ledger lines and total (~150 tokens), `rejected` the same lines with day and month swapped in every stamp and the
total off by one payment; 200 pairs, 180 train / 20 held out; batch 4 pairs, max length 512, lr 5e-5 (cosine),
no gradient checkpointing, the same steps for every runner. Each run is a fresh process; repeats are interleaved.
  * ours              finetune/run.py, train.objective dpo, dpo.reference adapter_off (a no-grad forward per step)
  * ours-precomputed  the same, dpo.reference precomputed (reference log-probs before step 1, policy-only steps)
  * trl               DPOTrainer with peft_config (its reference: the same model with the adapter disabled),
                      bf16, on the same pairs given as conversations (TRL renders them with the same chat template)
Figures, the same way for every runner: training tokens/s = non-pad tokens of steps 2..N over their wall time (both
sequences of every pair), peak RSS of the process, the step-1 loss (ln 2 = 0.6931 for both: policy = reference),
and the reward accuracy on the held-out pairs after the last step, computed by one function for all runners
(beta x (policy - reference) log-prob of chosen above rejected, the reference = the adapter switched off).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from peers_common import (
    BF16,
    SYSTEM_PROMPT,
    device,
    names,
    peak_rss_mb,
    run_measured,
    throughput,
    worker_env,
    write_report,
)

RUNNERS = ("ours", "ours-precomputed", "trl")
PAIRS = 200


def pair_rows(n: int, seed: int = 0) -> list[dict]:
    """ledger_report chats turned into pairs: the right ledger lines preferred to lines with swapped stamps."""
    from finetune.cli.tasks import ledger_report_rows

    rng = random.Random(seed)
    rows = []
    for chat in ledger_report_rows(n, seed=seed):
        prompt, answer = chat["messages"][0]["content"], chat["messages"][1]["content"]
        lines = answer.splitlines()
        wrong = []
        for line in lines[:-1]:
            stamp, rest = line.split(" | ", 1)
            day, month, year = stamp.removeprefix("LS ").split(".")
            wrong.append(f"LS {month}.{day}.{year} | {rest}")
        total = int(lines[-1].split()[1]) + rng.randint(100, 99_999)
        rows.append({"prompt": prompt, "chosen": answer, "rejected": "\n".join(wrong + [f"TOTAL {total} c"])})
    return rows


def write_inputs(root: Path, *, tiny: bool) -> Path:
    """bench_peers' recipe (model, QLoRA, batch, schedule, no checkpointing) turned into DPO on the pairs."""
    from peers_common import write_inputs as sft_inputs

    path = sft_inputs(root, tiny=tiny, task="ledger_stamp")  # the model (tiny: built here) and the SFT recipe
    recipe = yaml.safe_load(path.read_text())
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in pair_rows(PAIRS)))
    recipe["data"]["datasets"] = [{"path": str(data), "format": "preference"}]
    recipe["train"].update(objective="dpo", learning_rate=5e-5, warmup_steps=0)
    recipe["dpo"] = {"loss": "sigmoid", "beta": 0.1}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def held_out_reward_accuracy(peft_model, recipe, examples, pad_id: int) -> float:
    """Share of held-out pairs whose implicit reward prefers chosen (reference: the adapter off), one function for all."""
    import torch

    from finetune.data import eval_batches
    from finetune.training.objectives import preference

    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"adapter": None}),
                                       "dpo": recipe.dpo.model_copy(update={"reference": "adapter_off"})})
    reference = preference.Reference(peft_model, recipe)
    peft_model.eval()
    correct, pairs = 0.0, 0.0
    with torch.no_grad():
        for batch in eval_batches(examples, micro_batch_size=4, rank=0, world_size=1, pad_id=pad_id):
            batch.pop("reference_logps", None)
            _, _, metrics, counts = preference.micro_batch_terms(peft_model, batch, recipe.dpo, reference, device())
            correct, pairs = correct + float(metrics[3]), pairs + float(counts[0])
    return correct / max(pairs, 1)


# ------------------------------------------------------------------------------------------------- runners
def worker_ours(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    from peft import PeftModel

    from finetune import data, model, run
    from finetune.recipe import load_recipe

    tokens: list[int] = []
    original_iter = data.BatchStream.__iter__

    def counting_iter(stream):
        for batch in original_iter(stream):
            tokens.append(data.real_token_count(batch, stream.pad_id))
            yield batch

    data.BatchStream.__iter__ = counting_iter
    code = run.main([str(recipe_path), f"output.dir={out / 'run'}", *overrides])
    if code != 0:
        raise SystemExit(code)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    recipe = load_recipe(recipe_path, overrides)
    tokenizer = model.load_tokenizer(recipe)
    _, eval_examples, _ = data.build_examples(recipe, tokenizer)
    peak = peak_rss_mb()  # the training run's peak, before the evaluation model loads
    base = model.load_base_model(recipe, device=device())
    trained = PeftModel.from_pretrained(base, str(out / "run" / "adapter"))
    write_report(out, step_tokens=tokens, step_end=[m["elapsed_s"] for m in metrics if "elapsed_s" in m],
                 first_loss=next(m["loss"] for m in metrics if "loss" in m), train_peak_rss_mb=peak,
                 reward_accuracy=held_out_reward_accuracy(trained, recipe, eval_examples, tokenizer.pad_token_id))


def worker_trl(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from finetune import data, model
    from finetune.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    tokenizer = model.load_tokenizer(recipe)
    _, eval_examples, _ = data.build_examples(recipe, tokenizer)
    rows = [json.loads(line) for line in Path(recipe.data.datasets[0].path).read_text().splitlines()]
    train_ids, _ = data.split_eval_indices(len(rows), recipe)  # ours holds out these rows too (none is skipped)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    train_rows = [{"prompt": [system, {"role": "user", "content": r["prompt"]}],
                   "chosen": [{"role": "assistant", "content": r["chosen"]}],
                   "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in (rows[i] for i in train_ids)]
    tokens, step_end = [], []

    class Counting(DPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            tokens.append(int(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

    t = recipe.train
    config = DPOConfig(
        output_dir=str(out / "trl"), beta=recipe.dpo.beta, loss_type=["sigmoid"], max_length=recipe.data.max_length,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=1, max_steps=t.max_steps,
        learning_rate=t.learning_rate, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", bf16=BF16, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", use_cpu=device().type == "cpu",
        dataloader_num_workers=0, seed=t.seed, disable_tqdm=True, disable_dropout=True,
    )
    base = model.load_base_model(recipe, device=device())
    trainer = Counting(model=base, args=config, train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer,
                       peft_config=model.lora_config(recipe), callbacks=[Clock()])
    trainer.train()
    peak = peak_rss_mb()
    first = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    write_report(out, step_tokens=tokens, step_end=step_end, first_loss=first, train_peak_rss_mb=peak,
                 reward_accuracy=held_out_reward_accuracy(trainer.model, recipe, eval_examples, tokenizer.pad_token_id))


# ---------------------------------------------------------------------------------------------- orchestration
def launch(runner: str, recipe: Path, out: Path, steps: int) -> dict:

    overrides = [f"train.max_steps={steps}"]
    if runner == "ours-precomputed":
        overrides.append("dpo.reference=precomputed")
    env = worker_env()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", runner, "--recipe", str(recipe), "--out",
               str(out), *overrides]
    _, other = run_measured(command, env, runner)
    report = json.loads((out / "bench_rank0.json").read_text())
    return {"runner": runner, **throughput([report], steps), "peak_rss_mb": report["train_peak_rss_mb"],
            "first_loss": report["first_loss"], "reward_accuracy": report["reward_accuracy"], "other_cpu": other}


def table(results: list[dict]) -> str:
    rows = {}
    for item in results:
        rows.setdefault(item["runner"], []).append(item)
    ours = statistics.median(r["tokens_per_s"] for r in rows["ours"]) if "ours" in rows else None
    ours_rss = statistics.median(r["peak_rss_mb"] for r in rows["ours"]) if "ours" in rows else None
    lines = [("runner            tokens/s (median of runs)  vs ours  peak RSS MiB  vs ours  step-1 loss  "
              "held-out reward acc.  other CPU"), "-" * 118]
    for runner, items in rows.items():
        speed = statistics.median(r["tokens_per_s"] for r in items)
        rss = statistics.median(r["peak_rss_mb"] for r in items)
        each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in items)
        lines.append(f"{runner:<17} {speed:>10.1f} ({each:<12})"
                     f"  {f'{speed / ours:.2f}' if ours else 'n/a':>6}  {rss:>12.0f}"
                     f"  {f'{rss / ours_rss:.2f}' if ours_rss else 'n/a':>7}"
                     f"  {statistics.median(r['first_loss'] for r in items):>11.4f}"
                     f"  {statistics.median(r['reward_accuracy'] for r in items):>20.0%}"
                     f"  {max(r['other_cpu'] for r in items):>9.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M (smoke test)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run, the same for every runner")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(RUNNERS), help=f"comma-separated runners: {', '.join(RUNNERS)}")
    parser.add_argument("--json", help="write every run's figures here as JSON")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (step 1 is warm-up)")
    only = names(parser, "--only", args.only, RUNNERS)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recipe = write_inputs(root, tiny=args.tiny)
        for repeat in range(args.repeats):
            for runner in only:
                item = launch(runner, recipe, root / f"{runner}-{repeat}", args.steps)
                results.append(item)
                print(f"[bench dpo] {runner} #{repeat + 1}: {item['tokens_per_s']:.1f} tokens/s, "
                      f"{item['peak_rss_mb']:.0f} MiB, step-1 loss {item['first_loss']:.4f}, "
                      f"reward accuracy {item['reward_accuracy']:.0%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nDPO, {args.steps} steps x 4 pairs, {'tiny random model' if args.tiny else 'SmolLM2-135M-Instruct'}, "
          f"QLoRA r16, CPU x {__import__('os').cpu_count()}\n" + table(results))


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=RUNNERS)
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args(argv)
    (worker_trl if args.worker == "trl" else worker_ours)(args.recipe, args.out, overrides)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main(sys.argv[1:])
    else:
        main()
