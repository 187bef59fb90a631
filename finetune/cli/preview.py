"""`finetune data RECIPE [key=value ...] --rows N`: what the model will be trained on, before any weight loads.

Shows a few rendered examples with the trained tokens marked (green on a terminal, `[[...]]` otherwise: piped output,
NO_COLOR, TERM=dumb), and the statistics that decide whether the data path is right: rows read / skipped / truncated /
dropped, tokens per example, packing efficiency and the steps one epoch takes at the recipe's launch
(`--num-processes`, else the accelerate config the recipe names, else one process). Needs only the tokenizer.
"""

from __future__ import annotations

import argparse
import os
import sys

from finetune.data import IGNORE_INDEX, Example, PreparedData, rows_left_note, step_over_rows_note, steps_per_epoch
from finetune.data.build import cut_lines, eval_overlap, examples_said, prompt_notes, stats_counts
from finetune.data.streaming import preview_lines
from finetune.data.vocab import check_token_ids
from finetune.recipe import Recipe, steps_for_epochs
from finetune.recipe.checks import eval_every_note, steps_per_rows

GREEN, RESET = "\033[32m", "\033[0m"


def cli_data(args: argparse.Namespace) -> int:
    """The `finetune data` verb: load the recipe and tokenizer, prepare the data, print the preview."""
    from finetune import data, model
    from finetune.cli.library import resolve_recipe_path
    from finetune.recipe import load_recipe

    recipe_path = resolve_recipe_path(args.recipe)
    recipe = load_recipe(recipe_path, list(args.overrides))
    data.check_local_files(recipe)
    processes, launch = launch_processes(recipe_path, getattr(args, "num_processes", None))
    tokenizer = model.load_tokenizer(recipe)
    if recipe.data.streaming:  # the first rows only: a stream is never read whole
        prepared = data.stream_preview(recipe, tokenizer, rows=args.rows)
    else:
        prepared = data.prepare(recipe, tokenizer)
    check_token_ids(recipe, tokenizer, prepared.train, prepared.eval)  # as the run: every id has an embedding row
    print(render_preview(prepared, tokenizer, recipe, rows=args.rows, color=wants_color(sys.stdout),
                         processes=processes, launch=launch))
    return 0


def wants_color(stream) -> bool:
    """Colour on a terminal, unless NO_COLOR is set (no-color.org: any value but empty) or the terminal is dumb
    (TERM=dumb): then the `[[ ]]` marks of piped output, since a colour that is not shown left no mark at all (bb29)."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return stream.isatty()


def launch_processes(recipe_path: str, asked: int | None) -> tuple[int, str]:
    """The process count of the recipe's launch, and where it comes from: --num-processes, else the accelerate config
    the recipe names in its leading comments (as `finetune validate`), else one process."""
    from finetune.cli.library import named_launch, resolve_accelerate_config
    from finetune.parallel import accelerate_config_env

    if asked:
        return asked, "--num-processes"
    named = named_launch(recipe_path)  # validate's launch: the first config, with the count written for it
    if named:
        processes = named.num_processes or int(accelerate_config_env(resolve_accelerate_config(named.config))
                                                ["ACCELERATE_NUM_PROCESSES"])
        return processes, f"the launch the recipe names: {named.describe()}"
    return 1, "the recipe names no accelerate config; --num-processes N for another launch"


def render_preview(prepared: PreparedData, tokenizer, recipe: Recipe, *, rows: int, color: bool = False,
                   processes: int = 1, launch: str = "one process") -> str:
    """The whole preview as text: examples first, statistics last (where a terminal leaves them in view).
    `processes`: the launch's process count, for the steps per epoch (`launch` says where it comes from)."""
    parts = []
    for number, example in enumerate(prepared.examples[: max(rows, 0)], start=1):
        if example.rejected is not None:  # a preference pair: both sequences, the scored responses marked
            parts.append(f"--- pair {number}: chosen ({len(example.input_ids)} tokens, {example.num_trained} scored) ---")
            parts.append(mark_trained(example, tokenizer, color=color))
            rejected = example.rejected
            parts.append(f"--- pair {number}: rejected ({len(rejected.input_ids)} tokens, {rejected.num_trained} scored) ---")
            parts.append(mark_trained(rejected, tokenizer, color=color))
            continue
        label = "" if example.desirable is None else f", {'desirable' if example.desirable else 'undesirable'}"
        parts.append(f"--- example {number} ({len(example.input_ids)} tokens, {example.num_trained} trained{label}) ---")
        parts.append(mark_trained(example, tokenizer, color=color))
    for number, example in enumerate(prepared.eval_files[: max(min(rows, 2), 0)], start=1):
        parts.append(f"--- eval example {number} (data.eval_datasets; {len(example.input_ids)} tokens, "
                     f"{example.num_trained} scored) ---")
        parts.append(mark_trained(example, tokenizer, color=color))
    parts.append(streaming_stats(prepared, recipe) if recipe.data.streaming else
                 format_stats(prepared, recipe, processes=processes, launch=launch))
    return "\n".join(parts)


def mark_trained(example: Example, tokenizer, *, color: bool = False) -> str:
    """The example's text with every run of trained tokens marked, so a wrong loss mask is visible at a glance.

    Each run is the text it adds to the decoded sequence so far, not the run decoded alone: a decoder that strips a
    leading space (Llama 2's, Mistral's: `▁yes` alone decodes to `yes`) would hide the space a run's first token
    holds, and a space the row does not have (a pair scored as `Answer:  yes`) would not be seen."""
    opening, closing = (GREEN, RESET) if color else ("[[", "]]")
    pieces, start, shown, run_trained = [], 0, "", None
    ids = list(example.input_ids)
    for position, label in enumerate(example.labels):
        trained = label != IGNORE_INDEX and position > 0  # nothing predicts an example's first token
        if position and trained != run_trained:
            text, shown = _run_text(ids, start, position, shown, tokenizer)
            pieces.append(f"{opening}{text}{closing}" if run_trained else text)
            start = position
        run_trained = trained
    if ids:
        text, shown = _run_text(ids, start, len(ids), shown, tokenizer)
        pieces.append(f"{opening}{text}{closing}" if run_trained else text)
    return "".join(pieces)


def _run_text(ids: list[int], start: int, end: int, shown: str, tokenizer) -> tuple[str, str]:
    """(the text tokens [start, end) add after the decoded `shown` of the tokens before them, the decoded [0, end)).
    Where the longer decoding does not continue the shorter (a run that ends inside a character's bytes), the run
    decoded alone."""
    decoded = _decode(ids[:end], tokenizer)
    if decoded.startswith(shown):
        return decoded[len(shown):], decoded
    return _decode(ids[start:end], tokenizer), decoded


def _decode(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


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
    lines += preview_lines(prepared, recipe)
    lines.append(f"totals: unknown (streaming: the rows above are the first {len(prepared.examples)} of the stream; the "
                 "rest are read and tokenized while training, so rows, tokens, efficiency and epochs are not counted)")
    return "\n".join(lines)


def format_stats(prepared: PreparedData, recipe: Recipe, *, processes: int = 1, launch: str = "one process") -> str:
    """Rows, tokens per example, length policy, packing efficiency, steps per epoch and the run's length."""
    stats, data = prepared.stats, recipe.data
    lines = ["--- statistics ---"]
    for item in stats.per_dataset:
        source = "tokenization cache" if item["cached"] else "tokenized now"
        role = "eval dataset" if item.get("role") == "eval" else "dataset"
        weight = "" if item.get("role") == "eval" else f", weight {item['weight']}"
        mixed = f", {item['train_examples']} train examples after the eval hold-out and weighting" if "train_examples" in item else ""
        lines.append(f"{role} {item['path']} ({item['format']}{weight}): {item['rows']} rows -> "
                     f"{item['examples']} examples{mixed} ({source})")
    lines.append(f"rows: {stats.rows} read, {stats.skipped} skipped{examples_said(stats_counts(stats))}"
                 f"{stats.truncated} truncated, {stats.dropped} dropped "
                 f"(max_length {data.max_length}, overlong: {data.overlong}, bad_rows: {data.bad_rows})")
    lines += cut_lines(stats, recipe)
    lines += closing_tag_lines(prepared)
    lines += [f"note: {line}" for line in prompt_notes(stats)]
    if recipe.train.objective == "dpo":
        from finetune.data.pairs import prompt_limit

        lines.append(f"pairs truncated: {stats.prompt_truncated} lost the beginning of their prompt (kept: its last "
                     f">= {prompt_limit(recipe)} tokens, dpo.max_prompt_length), {stats.response_truncated} lost the end of "
                     "their responses; only response tokens are scored (marked above)")
    trained_share = stats.trained_tokens / max(stats.total_tokens, 1)
    per = "pair (chosen + rejected, each within max_length)" if stats.pairs else "example"
    lines.append(f"tokens per {per}: min {stats.tokens_min} / median {stats.tokens_median:g} / max {stats.tokens_max}; "
                 f"{stats.total_tokens} tokens, {stats.trained_tokens} trained ({trained_share:.1%})")
    held_out = stats.eval_examples - len(prepared.eval_files)
    eval_parts = ([f"{len(prepared.eval_files)} from data.eval_datasets"] if prepared.eval_files else []) + (
        [f"{held_out} held out (eval_fraction {data.eval_fraction})"] if held_out or not prepared.eval_files else [])
    lines.append(f"examples: {stats.train_examples} train, {stats.eval_examples} eval ({' + '.join(eval_parts)})")
    if stats.eval_in_train:
        lines.append(f"warning: {eval_overlap(stats)}")
    if data.packing:
        lines.append(f"packing: on, {stats.train_examples} examples in {stats.train_sequences} rows of <= {data.max_length} "
                     f"tokens; efficiency {stats.batch_efficiency:.1%} non-pad tokens (unpacked: {stats.unpacked_efficiency:.1%})")
    elif recipe.train.objective == "sft":
        lines.append(f"packing: off; efficiency {stats.batch_efficiency:.1%} non-pad tokens (data.packing: true would "
                     "put several examples per row)")
    else:  # preference, unpaired, reward and prompt rows are never packed (recipe/checks.py refuses data.packing)
        lines.append(f"packing: off (train.objective {recipe.train.objective} rows are not packed); efficiency "
                     f"{stats.batch_efficiency:.1%} non-pad tokens")
    lines += length_lines(stats.train_sequences, recipe.train, processes=processes, launch=launch,
                          rows_per_micro_batch=recipe.rows_per_micro_batch, iterations=steps_per_rows(recipe))
    lines += [f"note: {note}" for note in length_notes(recipe, stats, processes)]
    for reason in stats.skipped_reasons[:3]:
        lines.append(f"skipped: {reason}")
    if stats.dropped_rows:
        more = (f" ({stats.dropped} examples dropped in all: the first rows are named, and a conversation whose "
                "template rewrites history gives an example per turn)" if stats.dropped > len(stats.dropped_rows) else "")
        fix = ("data.overlong: truncate (the default) keeps them cut to max_length, a larger data.max_length whole"
               if recipe.data.overlong == "drop" else
               "their answers lie past max_length; data.overlong: error stops on such rows, a larger data.max_length "
               "keeps them")
        lines.append(f"dropped for length: {', '.join(stats.dropped_rows)}{more}; {fix}")
    return "\n".join(lines)


def length_notes(recipe: Recipe, stats, processes: int) -> list[str]:
    """The notes the run prints once its length is known (bb64: validate and `finetune data` left them out): a warmup
    clamped to the steps train.num_epochs resolves to (or a GRPO cycle it cuts), and train.eval_every with no eval
    examples. On a copy: `finetune data` resolves nothing of the recipe it was given."""
    notes = []
    per_epoch = steps_per_epoch(stats.train_sequences, micro_batch_size=recipe.rows_per_micro_batch,
                                world_size=processes, grad_accum=recipe.train.grad_accum, iterations=steps_per_rows(recipe))
    if recipe.train.num_epochs is not None and per_epoch:
        resolved = recipe.model_copy(deep=True)
        known = len(resolved.notes)
        resolved.resolve_num_epochs(per_epoch, launch=f"{processes} process{'es' if processes > 1 else ''}")
        notes += resolved.notes[known:]
    if note := eval_every_note(recipe, stats.eval_examples):
        notes.append(note)
    return notes


def closing_tag_lines(prepared: PreparedData) -> list[str]:
    """A line for the rows whose assistant answer was read as reasoning closed by a `</think>` line (DeepSeek-R1's
    shape, conversations._INLINE_THINK): data that merely talks about the tags is rewritten by that rule, so it is said
    (the counts are kept with each dataset's tokenized rows: a cached run says it too)."""
    counts = [store.counts for store in getattr(prepared.examples, "stores", ())]
    rows = sum(int(count.get("closing_tag_rows", 0)) for count in counts)
    if not rows:
        return []
    first = next((count["first_closing_tag_row"] for count in counts if count.get("first_closing_tag_row")), "?")
    many = rows > 1
    line = (f"reasoning: {rows} row{'s' if many else ''} (the first: {first}) {'hold' if many else 'holds'} an "
            "assistant answer with a `</think>` line and no `<think>` before it, read as DeepSeek-R1 writes its output: "
            "the text before that line is the turn's reasoning (data.reasoning applies to it), the rest its answer. "
            "Where it is the answer's own text, rewrite that tag in the rows (e.g. `&lt;/think&gt;`); docs/data.md, "
            "Reasoning")
    return [line]


def length_lines(rows: int, train, *, processes: int, launch: str, rows_per_micro_batch: int | None = None,
                 iterations: int = 1) -> list[str]:
    """Steps per epoch at the launch's process count (and at twice as many, with the formula for any other), and
    what train.max_steps or train.num_epochs makes of it: what the run prints at its start. `rows_per_micro_batch`:
    Recipe.rows_per_micro_batch (GRPO: prompts), default train.micro_batch_size; `iterations`: recipe.checks.
    steps_per_rows (GRPO's grpo.num_iterations, whose cycle trains that many steps on one step's prompts)."""
    batch = rows_per_micro_batch or train.micro_batch_size
    cycles = f" x grpo.num_iterations {iterations}" if iterations > 1 else ""

    def per_epoch(count: int) -> int:
        return steps_per_epoch(rows, micro_batch_size=batch, world_size=count, grad_accum=train.grad_accum,
                               iterations=iterations)

    steps, at = per_epoch(processes), f"at {processes} process{'es' if processes > 1 else ''}"
    size = (f"micro_batch_size {batch}" if batch == train.micro_batch_size else  # GRPO: completions / generations
            f"{batch} prompt{'s' if batch > 1 else ''} per micro-batch = micro_batch_size {train.micro_batch_size} "
            f"completions / grpo.num_generations {train.micro_batch_size // batch}")
    lines = [(f"steps per epoch: {steps} {at} ({launch}): {rows} rows // ({size} x "
              f"{processes} x grad_accum {train.grad_accum}){cycles}; {per_epoch(2 * processes)} at {2 * processes} "
              f"processes; in general rows // ({'micro_batch_size' if batch == train.micro_batch_size else 'prompts per micro-batch'}"
              f" x processes x grad_accum){cycles}"
              f"{rows_left_note(rows, micro_batch_size=batch, world_size=processes, grad_accum=train.grad_accum)}")]
    if steps == 0 and train.num_epochs is not None:
        lines.append(f"train.num_epochs: a run {at} stops at its start, an epoch holds no whole optimizer step (add "
                     "data, lower train.micro_batch_size or train.grad_accum, or set train.max_steps)")
    elif steps == 0:
        lines.append(f"train.max_steps {train.max_steps} {at}: "
                     + step_over_rows_note(rows, micro_batch_size=batch, world_size=processes,
                                           grad_accum=train.grad_accum))
    elif train.num_epochs is not None:
        lines.append(f"train.num_epochs {train.num_epochs:g} = {steps_for_epochs(train.num_epochs, steps)} steps {at} "
                     "(train.max_steps = ceil(num_epochs x steps per epoch), resolved at the run's start)")
    else:
        lines.append(f"train.max_steps {train.max_steps} = {train.max_steps / steps:.2f} epochs {at}")
    return lines
