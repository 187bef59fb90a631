"""`finetune quickstart --grpo`: a short SFT run, then GRPO from its adapter, rewarded by exact match; greedy exact
match on held-out prompts after SFT and after GRPO.

The SFT run is the `--dpo` quickstart's (quickstart.SFT_STEPS steps of recipes/quickstart.yaml, given by
quickstart.py, which calls this: SmolLM2-135M half-knows the ledger stamp). GRPO then samples G completions per
prompt with the policy itself and trains on their group advantages
(train.objective: grpo, docs/grpo.md), on ledger-stamp prompts whose dates are in neither the SFT rows nor the
held-out set; the reward is finetune.rewards:exact_match against the row's `answer` (the stamp). Before and after are
measured here, greedily, on HELD_OUT prompts of dates no run trained on, with the SFT adapter and with the GRPO one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

HELD_OUT = 64
GRPO_PROMPTS = 256
GRPO_OVERRIDES = [
    "train.objective=grpo",
    "data.datasets.0.format=prompt",
    "eval.generation_rows=0",  # GRPO has no reference answers to score in the loop: measured here, before and after
    "train.max_steps=16",
    "train.warmup_steps=2",
    "train.micro_batch_size=8",  # completions: 1 prompt x G 8
    "train.grad_accum=4",
    "train.learning_rate=3e-4",
    "train.log_every=1",
    "grpo.num_generations=8",
    "grpo.max_completion_length=12",  # `LS 04.07.23` and the end of turn: 9 tokens
    "grpo.reward_functions=[finetune.rewards:exact_match]",
]
TINY_GRPO = ["train.max_steps=2", "train.grad_accum=1", "model.gguf_file=null", "model.dtype=float32"]


def stamp_prompts(n: int, *, seed: int, exclude: set[str]) -> list[dict]:
    """`n` ledger-stamp prompts (the `prompt` format: chat messages, and the stamp as `answer`) of dates not in
    `exclude` (ISO dates)."""
    from finetune.cli.tasks import ledger_stamp_rows

    rows = []
    for row in ledger_stamp_rows(min(36_000, 2 * n + len(exclude)), seed=seed):
        question, stamp = row["messages"][0]["content"], row["messages"][1]["content"]
        if _iso(question) not in exclude:
            rows.append({"prompt": [{"role": "user", "content": question}], "answer": stamp})
    return rows[:n]


def _iso(question: str) -> str:
    return next(word.rstrip(".?") for word in question.split() if word[:4].isdigit() and word.count("-") == 2)


def write_prompt_sets(folder: Path, *, sft_rows: int, tiny: bool) -> tuple[Path, list[dict]]:
    """(the GRPO prompt file, the held-out rows): dates of neither the SFT rows (the first `sft_rows` of tasks seed 0)
    nor each other."""
    from finetune.cli.tasks import ledger_stamp_rows

    sft_dates = {_iso(r["messages"][0]["content"]) for r in ledger_stamp_rows(sft_rows, seed=0)}
    held_out = stamp_prompts(16 if tiny else HELD_OUT, seed=2, exclude=sft_dates)
    used = sft_dates | {_iso(r["prompt"][0]["content"]) for r in held_out}
    prompts = stamp_prompts(32 if tiny else GRPO_PROMPTS, seed=1, exclude=used)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ledger_stamp_prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in prompts), encoding="utf-8")
    return path, held_out


def exact_match(run_dir: Path, held_out: list[dict]) -> dict:
    """Greedy exact match of the run's model (base + its adapter) on the held-out prompts, rendered with the chat
    template and the quickstart's system prompt as in training."""
    from finetune.cli.generate import load_for_generation, render
    from finetune.outputs.export import resolve_source
    from finetune.training.evals import generation_eval

    source = resolve_source(run_dir)
    model, tokenizer = load_for_generation(source, no_adapter=False)
    system = source.recipe.data.system_prompt if source.recipe is not None else None
    rows = [{"prompt": tokenizer.decode(render(tokenizer, r["prompt"], system)), "answer": r["answer"]}
            for r in held_out]
    return generation_eval(model, tokenizer, rows, max_new_tokens=16, metric="exact_match")


def reward_curve(run_dir: Path) -> list[float]:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return [m["reward"] for m in metrics if "reward" in m]


def run_grpo_quickstart(out: Path, *, recipe: Path, sft_overrides: list[str], sft_rows: int, sft_steps: int,
                        tiny: bool, extra: list[str]) -> int:
    """SFT (recipe + sft_overrides, writing out/sft, its data the first `sft_rows` ledger-stamp rows of seed 0), then
    GRPO from its adapter; print exact match after each and the reward per step. `extra`: the user's overrides, for
    both runs, but `grpo.*` ones for the GRPO run alone."""
    from finetune.run import run

    start = time.perf_counter()
    sft_out = out / "sft"
    grpo_only = [o for o in extra if o.startswith("grpo.")]  # e.g. grpo.generation=vllm: the GRPO run's alone
    extra = [o for o in extra if not o.startswith("grpo.")]
    print(f"[finetune] quickstart 1/2: SFT into {sft_out}", flush=True)  # the two runs' lines look alike (bb43)
    run(str(recipe), sft_overrides + extra)
    prompts, held_out = write_prompt_sets(out / "data", sft_rows=sft_rows, tiny=tiny)
    overrides = [f"output.dir={out}", f"data.datasets.0.path={prompts}", f"model.adapter={sft_out / 'adapter'}",
                 *GRPO_OVERRIDES]
    if tiny:
        overrides += [f"model.name_or_path={sft_out / 'tiny-model'}", *TINY_GRPO]
    print(f"[finetune] quickstart 2/2: GRPO from {sft_out / 'adapter'} into {out}", flush=True)
    run(str(recipe), overrides + extra + grpo_only)
    before, after = exact_match(sft_out, held_out), exact_match(out, held_out)
    print(report(out, before, after, reward_curve(out), time.perf_counter() - start, sft_steps=sft_steps), flush=True)
    return 0


def report(out: Path, before: dict, after: dict, rewards: list[float], seconds: float, *, sft_steps: int) -> str:
    curve = " ".join(f"{r:.2f}" for r in rewards)
    lines = ["", (f"[finetune] quickstart --grpo done in {seconds:.0f} s (SFT {sft_steps} steps, then GRPO from its "
                  "adapter)"),
             (f"  exact match on {after['total']} held-out prompts: after SFT {before['score']:.0%} "
              f"({before['correct']}/{before['total']}) -> after GRPO {after['score']:.0%} "
              f"({after['correct']}/{after['total']})"),
             f"  reward (mean exact match of the sampled completions) per step: {curve}"]
    sample = (after.get("samples") or [None])[0]
    if sample:
        lines.append(f"  sample: {sample.get('generated')!r} (expected {sample.get('reference')!r})")
    lines += ["  next:", f"    finetune generate {out} --prompt 'Write 1999-12-31 as a ledger stamp.'"]
    return "\n".join(lines)
