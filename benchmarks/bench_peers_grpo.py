"""GRPO: this project against TRL's GRPOTrainer (use_vllm off: both sample with the policy itself), same model,
prompts, reward, G and lengths, in one invocation.

    python benchmarks/bench_peers.py --grpo [--task stamp|sum] [--steps 10] [--repeats 1] [--tiny]   (or this file)

--task stamp (the default): both start from one SFT adapter, the quickstart's (10 steps of recipes/quickstart.yaml on
ledger-stamp chats, trained once here, ~1.5 min), on the GRPO quickstart's prompts (ledger stamps of dates the SFT
never saw) with its reward, finetune.rewards:exact_match against the row's `answer`, completions of up to 12 tokens
(the stamp is 9), lr 3e-4: the SFT model half-solves these prompts (the GRPO quickstart measures 69% greedy), so the
rewards vary within a group and both curves can move. --task sum: the untuned model on arithmetic (below).

--task sum: QLoRA GRPO (NF4 base, bf16 where native else fp32 as bench_peers.DTYPE, LoRA r16 / alpha 32 on all linear
layers, dropout off) of SmolLM2-135M-Instruct
(the quickstart's model; --tiny: a tiny random Llama) on arithmetic prompts given as chat messages with the quickstart's
system prompt (`What is 23 plus 45? Answer with the number only.`), rewarded by finetune.rewards:contains_answer
against the row's `answer` (1 when the sum appears in the completion; the same function for both: it takes TRL's
signature and its message-list completions; exact_match scored 0 on every completion of the untuned model, so
neither curve could move).
G = 8 completions of up to 32 tokens per prompt, temperature 1, one prompt per step (8 completions: TRL's
per_device_train_batch_size 8, ours train.micro_batch_size 8), loss dapo, beta 0, num_iterations 1, epsilon 0.2,
rewards scaled by the group std, lr 1e-4 (cosine). Each run is a fresh process.
Gradient checkpointing: on for both, each tool's default (finetune's train.gradient_checkpointing, TRL's
GRPOConfig.gradient_checkpointing); --no-checkpointing turns it off for both. --seeds N runs each runner N times
with train.seed 42, 43, ... (--first-seed moves the start): the sampling seeds and the prompt order, TRL's seed the
same. The reward is then compared as the mean over the seeds with its spread, not as one curve of 8 draws a step.
Figures, the same way for both: tokens/s = prompt + completion tokens of every sampled sequence of steps 2..N
(what goes through the policy: sampled, then trained on) over their wall time; peak RSS of the process at the end of
training; the reward (mean over the step's completions) of every step: the curve.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
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
    DTYPE,
    QUICKSTART_MODEL,
    SYSTEM_PROMPT,
    device,
    names,
    peak_rss_mb,
    run_measured,
    throughput,
    worker_env,
    write_report,
)

RUNNERS = ("ours", "trl")
PROMPTS = 64
G, COMPLETION, LR = 8, 32, 1e-4  # --task sum
STAMP_COMPLETION, STAMP_LR = 12, 3e-4  # --task stamp: the GRPO quickstart's (finetune/cli/quickstart_grpo.py)


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}? Answer with the number only."}],
                     "answer": str(a + b)})
    return rows


def sft_adapter(root: Path, *, tiny: bool) -> tuple[Path, Path]:
    """The quickstart's SFT run (its own process), as `finetune quickstart --grpo` starts GRPO from it: (the adapter,
    the GRPO prompts of dates it never saw)."""
    from finetune.cli.quickstart import SFT_STEPS, TRAIN_ROWS, prepare, quickstart_recipe
    from finetune.cli.quickstart_grpo import write_prompt_sets

    sft = root / "sft"
    overrides = prepare(sft, tiny=tiny) + ([] if tiny else [f"train.max_steps={SFT_STEPS}", "train.warmup_steps=2"])
    code = "import sys; from finetune.run import main; raise SystemExit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, str(quickstart_recipe()), *overrides], check=False,
                            capture_output=True, text=True, env=worker_env())
    if result.returncode != 0:
        raise SystemExit(f"the SFT run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    prompts, held_out = write_prompt_sets(root / "data", sft_rows=64 if tiny else TRAIN_ROWS, tiny=tiny)
    (root / "held_out.json").write_text(json.dumps(held_out))
    return sft / "adapter", prompts


def write_inputs(root: Path, *, tiny: bool, task: str = "stamp", train_chunk: int | None = None,
                 checkpointing: bool = True) -> Path:
    """The prompts and the recipe both runners read (TRL's settings are taken from it)."""
    model = dict(QUICKSTART_MODEL)
    if task == "stamp":
        adapter, data = sft_adapter(root, tiny=tiny)
        model["adapter"] = str(adapter)
        reward, completion, lr = "finetune.rewards:exact_match", STAMP_COMPLETION, STAMP_LR
    else:
        data = root / "prompts.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(PROMPTS)))
        reward, completion, lr = "finetune.rewards:contains_answer", COMPLETION, LR
    if tiny:
        from finetune.cli.tiny import build_tiny_model

        tiny_dir = root / "sft" / "tiny-model" if task == "stamp" else build_tiny_model(root / "tiny", hidden_size=128,
                                                                                        num_layers=4)
        model = {**{k: v for k, v in model.items() if k != "gguf_file"}, "name_or_path": str(tiny_dir),
                 "dtype": DTYPE}
    recipe = {
        "model": model,
        "quantization": {"method": "nf4", "double_quant": True},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(data), "format": "prompt"}], "system_prompt": SYSTEM_PROMPT,
                 "max_length": 128, "cache": False},
        "train": {"objective": "grpo", "micro_batch_size": G, "learning_rate": lr, "warmup_steps": 0,
                  "lr_schedule": "cosine", "gradient_checkpointing": checkpointing, "log_every": 1, "eval_every": 0,
                  "save_every": 0, "seed": 42},
        "parallel": {"strategy": "single"},
        "grpo": {"num_generations": G, "max_completion_length": completion, "temperature": 1.0, "beta": 0.0,
                 "loss_type": "dapo", "reward_functions": [reward], "train_chunk_size": train_chunk},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------------- runners
def worker_ours(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    """finetune/run.py's main() in this process, counting the prompt + completion tokens of every sampled sequence."""
    from finetune import run
    from finetune.training.objectives.grpo import rollouts as grpo_rollouts

    per_call: list[int] = []
    prompts: list[list[str]] = []  # each generation batch's answers: which prompts it drew (compared with TRL's)
    original = grpo_rollouts.sample_and_score

    def counting(model, batch, objective, dev):
        rollout, problem = original(model, batch, objective, dev)
        per_call.append(int(rollout.batch["attention_mask"].sum()))
        prompts.append([str(row.get("answer")) for row in batch["rows"]])
        return rollout, problem

    grpo_rollouts.sample_and_score = counting
    code = run.main([str(recipe_path), f"output.dir={out / 'run'}", *overrides])
    if code != 0:
        raise SystemExit(code)
    peak = peak_rss_mb()
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward" in m]
    write_report(out, step_tokens=per_call, step_end=[m["elapsed_s"] for m in steps], train_peak_rss_mb=peak,
                 rewards=[m["reward"] for m in steps], prompts=prompts)


def worker_trl(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from finetune import model
    from finetune.data.loader import epoch_permutation
    from finetune.recipe import load_recipe
    from finetune.recipe.grpo import import_reward_function

    recipe = load_recipe(recipe_path, overrides)
    reward = import_reward_function(recipe.grpo.reward_functions[0])  # the same function object as ours
    tokenizer = model.load_tokenizer(recipe)
    system = {"role": "system", "content": recipe.data.system_prompt}
    rows = [json.loads(line) for line in Path(recipe.data.datasets[0].path).read_text().splitlines()]
    # The prompts in the order finetune draws them (its seeded permutation of the rows), TRL's shuffle off: both
    # runners train on the same prompt at every step, so the reward curves compare step by step (the report says
    # whether they did).
    order = [i for epoch in range(-(-recipe.train.max_steps // len(rows)))
             for i in epoch_permutation(len(rows), recipe.train.seed, epoch)]
    train_rows = [{"prompt": [system, *rows[i]["prompt"]], "answer": rows[i]["answer"]} for i in order]
    tokens, step_end, prompts = [], [], []

    class Counting(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            tokens.append(int(output["prompt_mask"].sum() + output["completion_mask"].sum()))
            prompts.append([str(row["answer"]) for row in inputs[::self.num_generations]])
            return output

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

    t, g = recipe.train, recipe.grpo
    # --train-chunk N: TRL's counterpart of grpo.train_chunk_size, slices of N completions of one generation batch of
    # micro_batch_size (per_device_train_batch_size N, accumulated micro_batch_size / N times: steps_per_generation
    # follows gradient_accumulation_steps, so one generation per optimizer step, as ours).
    chunk = g.train_chunk_size or t.micro_batch_size
    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=chunk,
        gradient_accumulation_steps=t.micro_batch_size // chunk,
        num_generations=g.num_generations, max_completion_length=g.max_completion_length, temperature=g.temperature,
        top_p=g.top_p, beta=g.beta, loss_type=g.loss_type, epsilon=g.epsilon, num_iterations=g.num_iterations,
        scale_rewards=g.scale_rewards, max_steps=t.max_steps, learning_rate=t.learning_rate,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", bf16=BF16, gradient_checkpointing=t.gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=device().type == "cpu",
        dataloader_num_workers=0, seed=t.seed, disable_tqdm=True, disable_dropout=True, use_vllm=False,
        shuffle_dataset=False,
    )
    base = model.load_base_model(recipe, device=device())
    peft_config = model.lora_config(recipe)
    if recipe.model.adapter:  # --task stamp: the SFT adapter, trainable, as TRL takes a PEFT model
        from peft import PeftModel

        base, peft_config = PeftModel.from_pretrained(base, recipe.model.adapter, is_trainable=True), None
    trainer = Counting(model=base, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(train_rows),
                       processing_class=tokenizer, peft_config=peft_config, callbacks=[Clock()])
    trainer.train()
    peak = peak_rss_mb()
    trainer.model.save_pretrained(str(out / "adapter"))  # scored on the held-out prompts as ours is (worker_score)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    write_report(out, step_tokens=tokens, step_end=step_end, train_peak_rss_mb=peak, rewards=rewards, prompts=prompts)


def worker_score(recipe_path: Path, out: Path, overrides: list[str]) -> None:
    """Greedy exact match of base + `out`/adapter on the held-out prompts (dates no run trained on), the same code
    for either runner's adapter: finetune's 4-bit base, PEFT's PeftModel.from_pretrained, the recipe's system prompt
    and chat template, 16 new tokens (as `finetune quickstart --grpo` measures)."""
    from peft import PeftModel

    from finetune import model
    from finetune.cli.generate import render
    from finetune.recipe import load_recipe
    from finetune.training.evals import generation_eval

    recipe = load_recipe(recipe_path, overrides)
    tokenizer = model.load_tokenizer(recipe)
    policy = PeftModel.from_pretrained(model.load_base_model(recipe, device=device()), str(out / "adapter")).eval()
    held_out = json.loads((recipe_path.parent / "held_out.json").read_text())
    rows = [{"prompt": tokenizer.decode(render(tokenizer, r["prompt"], recipe.data.system_prompt)), "answer": r["answer"]}
            for r in held_out]
    result = generation_eval(policy, tokenizer, rows, max_new_tokens=16, metric="exact_match")
    (out / "held_out.json").write_text(json.dumps({k: result[k] for k in ("score", "correct", "total")}))


def held_out_score(recipe: Path, out: Path) -> dict:
    """worker_score in its own process."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "score", "--recipe", str(recipe), "--out",
               str(out)]
    result = subprocess.run(command, check=False, capture_output=True, text=True,
                            env=worker_env())
    if result.returncode != 0:
        raise SystemExit(f"scoring {out} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads((out / "held_out.json").read_text())


# ---------------------------------------------------------------------------------------------- orchestration
def launch(runner: str, recipe: Path, out: Path, steps: int, seed: int) -> dict:
    env = worker_env()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", runner, "--recipe", str(recipe), "--out",
               str(out), f"train.max_steps={steps}", f"train.seed={seed}"]
    _, other = run_measured(command, env, runner)
    report = json.loads((out / "bench_rank0.json").read_text())
    return {"runner": runner, **throughput([report], steps), "peak_rss_mb": report["train_peak_rss_mb"],
            "rewards": report["rewards"], "prompts": report.get("prompts"), "other_cpu": other, "seed": seed}


def table(results: list[dict]) -> str:
    rows: dict[str, list[dict]] = {}
    for item in results:
        rows.setdefault(item["runner"], []).append(item)
    trl = statistics.median(r["tokens_per_s"] for r in rows["trl"]) if "trl" in rows else None
    trl_rss = statistics.median(r["peak_rss_mb"] for r in rows["trl"]) if "trl" in rows else None
    lines = ["runner  seed  tokens/s  vs TRL  peak RSS MiB  vs TRL  mean reward  other CPU  reward per step", "-" * 110]
    for runner, items in rows.items():
        for r in items:
            curve = r["rewards"]
            lines.append(f"{runner:<7} {r['seed']:>4}  {r['tokens_per_s']:>8.1f}  {r['tokens_per_s'] / trl if trl else 0:>6.2f}  "
                         f"{r['peak_rss_mb']:>12.0f}  {r['peak_rss_mb'] / trl_rss if trl_rss else 0:>6.2f}  "
                         f"{statistics.mean(curve) if curve else 0:>11.3f}  {r['other_cpu']:>9.0%}  "
                         f"{' '.join(f'{x:.2f}' for x in curve)}")
    lines.append("")
    for runner, items in rows.items():  # medians over the runs; the reward as the mean over runs, with their spread
        speed = statistics.median(r["tokens_per_s"] for r in items)
        rss = statistics.median(r["peak_rss_mb"] for r in items)
        means = [statistics.mean(r["rewards"]) for r in items if r["rewards"]]
        spread = f" (runs {min(means):.3f}..{max(means):.3f})" if len(means) > 1 else ""
        held = [r["held_out"]["score"] for r in items if r.get("held_out")]
        if held:
            spread += f", greedy exact match on the held-out prompts after training {statistics.mean(held):.1%}"
        lines.append(f"{runner:<7} median of {len(items)} run(s): {speed:.1f} tokens/s ({speed / trl if trl else 0:.2f}x "
                     f"TRL), peak RSS {rss:.0f} MiB ({rss / trl_rss if trl_rss else 0:.2f}x TRL), mean reward "
                     f"{statistics.mean(means) if means else 0:.3f}{spread}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M (smoke test)")
    parser.add_argument("--task", choices=("stamp", "sum"), default="stamp",
                        help="stamp: from the quickstart's SFT adapter on ledger stamps (exact match); sum: the "
                             "untuned model on arithmetic (contains the answer)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--train-chunk", type=int, choices=(1, 2, 4), default=None,
                        help="train each step's 8 completions N at a time, both runners (ours: grpo.train_chunk_size; "
                             "TRL: per_device_train_batch_size N accumulated 8/N times); default: all 8 at once")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per runner with train.seed 42, 43, ...: the reward curve's spread over sampling seeds")
    parser.add_argument("--first-seed", type=int, default=42, help="the first of the --seeds (default 42)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="gradient checkpointing off for both (default: on, each tool's default)")
    parser.add_argument("--only", default=",".join(RUNNERS), help=f"comma-separated runners: {', '.join(RUNNERS)}")
    parser.add_argument("--json", help="write every run's figures here as JSON")
    args = parser.parse_args(argv)
    only = names(parser, "--only", args.only, RUNNERS)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recipe = write_inputs(root, tiny=args.tiny, task=args.task, train_chunk=args.train_chunk,
                              checkpointing=args.checkpointing)
        scores = {}
        if args.task == "stamp":
            scores["SFT adapter (the start)"] = held_out_score(recipe, root / "sft")
        seeds = [args.first_seed + k for _ in range(args.repeats) for k in range(args.seeds)]
        for number, seed in enumerate(seeds):
            for runner in only:
                name = f"{runner}-{number}"
                item = launch(runner, recipe, root / name, args.steps, seed)
                if args.task == "stamp":
                    folder = root / name / ("run" if runner == "ours" else "")
                    item["held_out"] = scores[f"{runner} #{number + 1} (seed {seed})"] = held_out_score(recipe, folder)
                results.append(item)
                print(f"[bench grpo] {runner} #{number + 1} (seed {seed}): {item['tokens_per_s']:.1f} tokens/s, "
                      f"{item['peak_rss_mb']:.0f} MiB, rewards {item['rewards']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    task = ("ledger stamps from the quickstart's SFT adapter, exact match" if args.task == "stamp"
            else "arithmetic from the base model, contains the answer")
    print(f"\nGRPO, {args.steps} steps x 1 prompt x G {G} (completions <= "
          f"{STAMP_COMPLETION if args.task == 'stamp' else COMPLETION} tokens, trained "
          f"{f'{args.train_chunk} at a time' if args.train_chunk else 'all at once'}, gradient checkpointing "
          f"{'on' if args.checkpointing else 'off'}), {task}, "
          f"{'tiny random model' if args.tiny else 'SmolLM2-135M-Instruct'}, QLoRA r16, CPU x {os.cpu_count()}\n"
          + table(results))
    drawn = {(r["runner"], r["seed"]): r.get("prompts") for r in results}  # the last repeat of each seed
    for seed in sorted({r["seed"] for r in results}):
        ours, trl = drawn.get(("ours", seed)), drawn.get(("trl", seed))
        if ours and trl:
            same = sum(a == b for a, b in zip(ours, trl))
            print(f"seed {seed}: the same prompts at {same} of {min(len(ours), len(trl))} steps (TRL given finetune's "
                  "order, its shuffle off): the reward curves compare step by step")
    if scores:
        print("greedy exact match on the held-out prompts: " + "; ".join(
            f"{name} {score['score']:.0%} ({score['correct']}/{score['total']})" for name, score in scores.items()))


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args(argv)
    {"trl": worker_trl, "ours": worker_ours, "score": worker_score}[args.worker](args.recipe, args.out, overrides)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main(sys.argv[1:])
    else:
        main()
