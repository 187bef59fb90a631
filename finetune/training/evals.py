"""Generation-based evaluation: greedy answers to held-out prompts, scored by a simple metric.

A loss on held-out data says the model got less surprised; this says whether it now gives the right answer. Rows
are either tokenized examples from finetune/data (the prompt is everything before the first trained token, completed
into the prompt serving sends where the two differ; the reference is the first trained turn's final answer, read as a
client reads a reply: finetune/data/replies.py) or `{"prompt": text, "answer": text}` dicts whose prompt
is already rendered (chat template applied). Only rows with a question and an answer to give are asked: a KTO row's
undesirable completion is no reference, and a text row (every token trained) has no prompt. Generation is greedy and
stops at every end token (the tokenizer's EOS and the model's generation config's, as GRPO's), so the score is
deterministic. Where the chat template's end of turn is text to the tokenizer (ChatML's `<|im_end|>` on a Llama 2 or
Mistral base: trained as ordinary pieces, never followed by the EOS), generation also stops once that text is
written (transformers' stop_strings) and the text is cut from the answer and from the reference, as a special end
token is dropped in decoding: the score compares the answers.

Under FSDP/DDP every rank must call this with the same rows (each forward is a collective); with greedy decoding
all ranks then take the same number of steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from finetune.data import IGNORE_INDEX
from finetune.data.prompts import cut_at_stops, turn_end_stops
from finetune.data.replies import decode_reply, prompt_tail, reply_message, serving_prompt, shown
from finetune.distributed import print0

Metric = Literal["exact_match", "contains", "prefix_match"]


def _normalize(text: str) -> str:
    return " ".join(text.strip().split())


METRICS: dict[str, Callable[[str, str], bool]] = {
    "exact_match": lambda generated, reference: _normalize(generated) == _normalize(reference),
    "contains": lambda generated, reference: _normalize(reference) in _normalize(generated),
    "prefix_match": lambda generated, reference: _normalize(generated).startswith(_normalize(reference)),
}


def answerable(row: Any, tokenizer) -> bool:
    """Whether a held-out row can be asked and scored: a {prompt, answer} dict, or an Example with a prompt before its
    first trained token (a lone BOS is none: a text row trains every token, so it has no question) whose reference is
    an answer to give (not a KTO row's undesirable completion, which the run learns to avoid)."""
    if isinstance(row, dict):
        return True
    if getattr(row, "desirable", None) is False:
        return False
    first = next((i for i, label in enumerate(row.labels) if label != IGNORE_INDEX), None)
    if first is None:
        return False
    return first > (1 if tokenizer.bos_token_id is not None and row.input_ids[:1] == [tokenizer.bos_token_id] else 0)


def prompt_and_reference(row: Any, tokenizer) -> tuple[list[int], str]:
    """(prompt token ids, reference text) of one row: an Example (input_ids + labels) or a {prompt, answer} dict.

    An Example's prompt is what serving sends for its first trained turn: the tokens before it, completed where they
    stop inside the template's generation prompt (replies.serving_prompt: DeepSeek-R1's `<think>\\n` before an answer
    without reasoning) and cut back to its end where they run past it (data.reasoning: context under Qwen3.5's and
    DeepSeek-R1's templates, which prefill `<think>\\n`: the turn's own reasoning, untrained, is not asked with). Its
    reference is that turn's final answer, read as a client reads the model's reply
    (replies.reply_message: no reasoning, no harmony channel words); under data.reasoning: context, whose turn is
    trained in two runs (the opener, then after the untrained reasoning the answer), the runs up to the answer."""
    if isinstance(row, dict):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        return list(ids), str(row["answer"])
    labels = row.labels
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    if first is None:
        raise ValueError("an eval example has no trained token, so it has no reference answer")
    context = list(row.input_ids[:first])
    prompt, added = serving_prompt(context, tokenizer)
    tail, stops = prompt_tail(context, tokenizer), turn_end_stops(tokenizer)

    def read(end: int) -> dict:
        text = cut_at_stops(decode_reply(row.input_ids[first:end], tokenizer), stops)
        text = text[len(added):] if added and text.startswith(added) else text  # the prompt serving sends holds it
        return reply_message(text, tokenizer, prompt=tail)

    end = _run_end(labels, first)
    message = read(end)
    while not (message["content"] or message.get("tool_calls")):  # an opener alone (data.reasoning: context)
        following = next((i for i in range(end, len(labels)) if labels[i] != IGNORE_INDEX), None)
        if following is None:
            break
        end = _run_end(labels, following)
        message = read(end)
    return prompt, shown(message)


def _run_end(labels: list[int], start: int) -> int:
    """The end of the run of trained labels that starts at `start`."""
    return next((i for i in range(start, len(labels)) if labels[i] == IGNORE_INDEX), len(labels))


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int,
                     device: torch.device | None = None) -> list[dict]:
    """Greedy continuations of token-id prompts (left-padded into one batch), each cut at the chat template's end of
    turn where that is text (prompts.turn_end_stops) and read as a client reads it (replies.reply_message): the
    assistant message {"role", "content": the final answer, "reasoning"?, "tool_calls"?}.

    `device`: where the inputs go, the rank's compute device in a run. Only a plain model (`finetune generate`) may
    leave it to the first parameter's device: under CPU offload that is the CPU while the forward runs on the GPU.
    """
    from finetune.training.objectives.grpo.rollouts import eos_token_ids

    device = device or next(model.parameters()).device
    # Every token that ends a turn stops an answer, as GRPO's completions: the tokenizer's EOS and the generation
    # config's (a chat model's end-of-turn token, `<end_of_turn>`, or `<|im_end|>` of a chat template given to a base).
    eos, stops = eos_token_ids(model, tokenizer), turn_end_stops(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = pad_id if pad_id is not None else eos[0]
    batch = _left_padded(prompts, pad_id, device)
    output = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad_id,
        eos_token_id=eos,
        temperature=None,
        top_p=None,
        top_k=None,
        # an end of turn written as text stops the row as transformers' StopStringCriteria finds it (a wrapper's
        # greedy loop without stop strings runs on: the cut below makes the answer the same)
        **({"stop_strings": stops, "tokenizer": tokenizer} if stops else {}),
    )
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return [reply_message(cut_at_stops(decode_reply(row, tokenizer), stops), tokenizer,
                          prompt=prompt_tail(prompt, tokenizer)) for row, prompt in zip(new_tokens, prompts)]


def generate_batch(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int,
                   device: torch.device | None = None) -> list[str]:
    """The final answers of `generate_replies` (a turn that only calls tools: its calls as JSON text)."""
    return [shown(reply) for reply in generate_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                                       device=device)]


def generation_eval(
    model,
    tokenizer,
    rows: Sequence[Any],
    *,
    max_new_tokens: int = 32,
    metric: Metric = "exact_match",
    batch_size: int = 16,
    samples: int = 3,
    device: torch.device | None = None,
) -> dict:
    """Score greedy generations on `rows`; returns {metric, score, correct, total, samples: [...]}.

    The model is put in eval mode for the call and restored afterwards. On CPU, load 4-bit models through
    finetune.model (keep_4bit_weights_trainable_on_cpu), else generation repacks the weights and training after it
    silently loses their gradients.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    was_training = model.training
    model.eval()
    pairs = [prompt_and_reference(row, tokenizer) for row in rows]
    generated: list[str] = []
    try:
        for start in range(0, len(pairs), batch_size):
            chunk = [prompt for prompt, _ in pairs[start : start + batch_size]]
            generated += generate_batch(model, tokenizer, chunk, max_new_tokens=max_new_tokens, device=device)
    finally:
        model.train(was_training)
    judge = METRICS[metric]
    correct = [judge(text, reference) for text, (_, reference) in zip(generated, pairs)]
    shown = [
        {
            "prompt": tokenizer.decode(prompt[-40:], skip_special_tokens=True)[-120:],
            "reference": reference,
            "generated": text.strip(),
            "correct": ok,
        }
        for (prompt, reference), text, ok in list(zip(pairs, generated, correct))[:samples]
    ]
    total = len(pairs)
    return {
        "metric": metric,
        "score": sum(correct) / total if total else 0.0,
        "correct": sum(correct),
        "total": total,
        "samples": shown,
    }


# ------------------------------------------------------------------------------- metrics.jsonl contract (run.py)
def recipe_generation_eval(model, tokenizer, eval_examples: Sequence[Any], recipe, *, phase: str,
                           device: torch.device | None = None) -> dict | None:
    """The recipe's generation eval (`eval.generation_rows` held-out examples) as a metrics.jsonl record, or None if off.

    The rows are the first held-out examples that can be asked and scored (`answerable`: KTO's desirable rows, never
    a text row). With none, it says why in one line and returns None: the eval asked for is not silently absent.
    run.py calls it with phase "before" (after the model is built, before the first step) and "after" (after the last
    step) and writes the record with MetricsLog.write(**record).
    """
    if not recipe.eval.generation_rows:
        return None
    # the first rows that can be asked: read one at a time, not the whole eval set (each row an Example built)
    rows = list(itertools.islice((row for row in eval_examples if answerable(row, tokenizer)),
                                 recipe.eval.generation_rows))
    if not rows:
        print0(f"[finetune] note: no generation eval {phase} training: {no_rows_reason(len(eval_examples), recipe)}")
        return None
    # it may take minutes (greedy answers, one token at a time): said first, not a silence (bug bash: 174 s of none)
    print0(f"[finetune] asking {len(rows)} held-out prompt{'s' if len(rows) > 1 else ''} for the generation eval "
           f"{phase} training (up to {recipe.eval.max_new_tokens} new tokens each)")
    result = generation_eval(
        model, tokenizer, rows, max_new_tokens=recipe.eval.max_new_tokens, metric=recipe.eval.metric, device=device
    )
    return metrics_record(phase, result)


def no_rows_reason(held_out: int, recipe) -> str:
    """Why eval.generation_rows has no row to ask: no eval rows at all, or none with a prompt and an answer to give."""
    data = recipe.data
    if not held_out:
        files = "its data.eval_datasets hold no rows" if data.eval_datasets else "there are no data.eval_datasets"
        return (f"eval.generation_rows is {recipe.eval.generation_rows}, but the run has no eval rows (data.eval_fraction "
                f"{data.eval_fraction:g} of the rows rounds to none, and {files}). Fix: raise data.eval_fraction, give "
                "data.eval_datasets, or set eval.generation_rows: 0.")
    return (f"eval.generation_rows is {recipe.eval.generation_rows}, but none of the {held_out} eval rows has a prompt "
            "and an answer to give (text rows train every token, so they ask nothing; KTO's undesirable completions "
            "are not answers). Fix: eval rows with prompts (data.eval_datasets of completion, alpaca or chat rows; "
            "KTO rows with label: true), or eval.generation_rows: 0.")


def metrics_record(phase: str, result: dict) -> dict:
    """One flat metrics.jsonl record of a generation eval: phase, metric, score, correct, total, first sample."""
    record = {
        "phase": phase,
        "generation_metric": result["metric"],
        "generation_score": round(result["score"], 4),
        "generation_correct": result["correct"],
        "generation_total": result["total"],
    }
    if result["samples"]:
        record["generation_sample"] = result["samples"][0]
    return record


def read_generation_evals(metrics_path) -> dict[str, dict]:
    """{"before": record, "after": record} from a run's metrics.jsonl (the last record of each phase)."""
    import json
    from pathlib import Path

    found: dict[str, dict] = {}
    path = Path(metrics_path)
    if not path.is_file():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "generation_score" in record:
            found[str(record.get("phase"))] = record
    return found
