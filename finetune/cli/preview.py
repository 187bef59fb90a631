"""`finetune data RECIPE [key=value ...] --rows N`: what the model will be trained on, before any weight loads.

Shows a few rendered examples with the trained tokens marked (green on a terminal, `[[...]]` otherwise), and
the statistics that decide whether the data path is right: rows read / skipped / truncated / dropped, tokens per
example, packing efficiency and the steps one epoch takes. Needs only the tokenizer.
"""

from __future__ import annotations

import argparse
import sys

from finetune.data import IGNORE_INDEX, Example, PreparedData
from finetune.recipe import Recipe

GREEN, RESET = "\033[32m", "\033[0m"


def cli_data(args: argparse.Namespace) -> int:
    """The `finetune data` verb: load the recipe and tokenizer, prepare the data, print the preview."""
    from finetune import data, model
    from finetune.cli.library import resolve_recipe_path
    from finetune.recipe import load_recipe

    recipe = load_recipe(resolve_recipe_path(args.recipe), list(args.overrides))
    data.check_local_files(recipe)
    tokenizer = model.load_tokenizer(recipe)
    if recipe.data.streaming:  # the first rows only: a stream is never read whole
        prepared = data.stream_preview(recipe, tokenizer, rows=args.rows)
    else:
        prepared = data.prepare(recipe, tokenizer)
    print(render_preview(prepared, tokenizer, recipe, rows=args.rows, color=sys.stdout.isatty()))
    return 0


def render_preview(prepared: PreparedData, tokenizer, recipe: Recipe, *, rows: int, color: bool = False) -> str:
    """The whole preview as text: examples first, statistics last (where a terminal leaves them in view)."""
    parts = []
    for number, example in enumerate(prepared.examples[: max(rows, 0)], start=1):
        if example.rejected is not None:  # a preference pair: both sequences, the scored responses marked
            parts.append(f"--- pair {number}: chosen ({len(example.input_ids)} tokens, {example.num_trained} scored) ---")
            parts.append(mark_trained(example, tokenizer, color=color))
            rejected = example.rejected
            parts.append(f"--- pair {number}: rejected ({len(rejected.input_ids)} tokens, {rejected.num_trained} scored) ---")
            parts.append(mark_trained(rejected, tokenizer, color=color))
            continue
        parts.append(f"--- example {number} ({len(example.input_ids)} tokens, {example.num_trained} trained) ---")
        parts.append(mark_trained(example, tokenizer, color=color))
    for number, example in enumerate(prepared.eval_files[: max(min(rows, 2), 0)], start=1):
        parts.append(f"--- eval example {number} (data.eval_datasets; {len(example.input_ids)} tokens, "
                     f"{example.num_trained} scored) ---")
        parts.append(mark_trained(example, tokenizer, color=color))
    parts.append(streaming_stats(prepared, recipe) if recipe.data.streaming else format_stats(prepared, recipe))
    return "\n".join(parts)


def mark_trained(example: Example, tokenizer, *, color: bool = False) -> str:
    """The example's text with every run of trained tokens marked, so a wrong loss mask is visible at a glance."""
    opening, closing = (GREEN, RESET) if color else ("[[", "]]")
    pieces, run, run_trained = [], [], None
    for token, label in zip(example.input_ids, example.labels):
        trained = label != IGNORE_INDEX
        if run and trained != run_trained:
            pieces.append(_decode(run, tokenizer, run_trained, opening, closing))
            run = []
        run.append(token)
        run_trained = trained
    if run:
        pieces.append(_decode(run, tokenizer, run_trained, opening, closing))
    return "".join(pieces)


def _decode(ids: list[int], tokenizer, trained: bool, opening: str, closing: str) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return f"{opening}{text}{closing}" if trained else text


def streaming_stats(prepared: PreparedData, recipe: Recipe) -> str:
    """What a stream's preview knows: its datasets and settings, the eval set; no totals (nothing is read whole)."""
    stats, data = prepared.stats, recipe.data
    lines = ["--- statistics (data.streaming) ---"]
    for item in stats.per_dataset:
        lines.append(f"eval dataset {item['path']} ({item['format']}): {item['rows']} rows -> {item['examples']} examples")
    lines.append(f"datasets: {', '.join(f'{spec.path} ({spec.format})' for spec in data.datasets)}, read in this order, "
                 "pass after pass (no shuffle)")
    held = stats.eval_examples - len(prepared.eval_files)
    lines.append(f"eval: {stats.eval_examples} examples ({len(prepared.eval_files)} from data.eval_datasets, {held} from "
                 f"the stream's first {data.eval_max_rows if data.eval_fraction > 0 else 0} rows, which training skips)")
    packing = f"greedily into rows of <= {data.max_length} tokens" if data.packing else "off"
    lines.append(f"packing: {packing}; max_length {data.max_length}, overlong: {data.overlong}, bad_rows: {data.bad_rows}")
    lines.append(f"totals: unknown (streaming: the rows above are the first {len(prepared.examples)} of the stream; the "
                 "rest are read and tokenized while training, so rows, tokens, efficiency and epochs are not counted)")
    return "\n".join(lines)


def format_stats(prepared: PreparedData, recipe: Recipe) -> str:
    """Rows, tokens per example, length policy, packing efficiency, estimated steps per epoch."""
    stats, data, train = prepared.stats, recipe.data, recipe.train
    lines = ["--- statistics ---"]
    for item in stats.per_dataset:
        source = "tokenization cache" if item["cached"] else "tokenized now"
        role = "eval dataset" if item.get("role") == "eval" else "dataset"
        weight = "" if item.get("role") == "eval" else f", weight {item['weight']}"
        lines.append(f"{role} {item['path']} ({item['format']}{weight}): {item['rows']} rows -> "
                     f"{item['examples']} examples ({source})")
    lines.append(f"rows: {stats.rows} read, {stats.skipped} skipped, {stats.truncated} truncated, {stats.dropped} dropped "
                 f"(max_length {data.max_length}, overlong: {data.overlong}, bad_rows: {data.bad_rows})")
    if recipe.train.objective == "dpo":
        from finetune.data.pairs import prompt_limit

        lines.append(f"pairs truncated: {stats.prompt_truncated} lost the beginning of their prompt (kept: its last "
                     f">= {prompt_limit(recipe)} tokens, dpo.max_prompt_length), {stats.response_truncated} lost the end of "
                     "their responses; only response tokens are scored (marked above)")
    trained_share = stats.trained_tokens / max(stats.total_tokens, 1)
    lines.append(f"tokens per example: min {stats.tokens_min} / median {stats.tokens_median:g} / max {stats.tokens_max}; "
                 f"{stats.total_tokens} tokens, {stats.trained_tokens} trained ({trained_share:.1%})")
    held_out = stats.eval_examples - len(prepared.eval_files)
    eval_parts = ([f"{len(prepared.eval_files)} from data.eval_datasets"] if prepared.eval_files else []) + (
        [f"{held_out} held out (eval_fraction {data.eval_fraction})"] if held_out or not prepared.eval_files else [])
    lines.append(f"examples: {stats.train_examples} train, {stats.eval_examples} eval ({' + '.join(eval_parts)})")
    if data.packing:
        lines.append(f"packing: on, {stats.train_examples} examples in {stats.train_sequences} rows of <= {data.max_length} "
                     f"tokens; efficiency {stats.batch_efficiency:.1%} non-pad tokens (unpacked: {stats.unpacked_efficiency:.1%})")
    else:
        lines.append(f"packing: off; efficiency {stats.batch_efficiency:.1%} non-pad tokens (data.packing: true would "
                     "put several examples per row)")
    per_step = train.micro_batch_size * train.grad_accum
    lines.append(f"steps per epoch: {stats.train_sequences // per_step} with 1 process (micro_batch_size "
                 f"{train.micro_batch_size} x grad_accum {train.grad_accum}; divide by the number of processes); "
                 f"train.max_steps {train.max_steps} = {train.max_steps * per_step / max(stats.train_sequences, 1):.2f} epochs")
    for reason in stats.skipped_reasons[:3]:
        lines.append(f"skipped: {reason}")
    if stats.dropped_rows:
        more = f" (and {stats.dropped - len(stats.dropped_rows)} more)" if stats.dropped > len(stats.dropped_rows) else ""
        lines.append(f"dropped for length: {', '.join(stats.dropped_rows)}{more}; data.overlong: error stops on such rows, "
                     "a larger data.max_length keeps them")
    return "\n".join(lines)
