"""GRPO's prompts (format: prompt): each row's prompt rendered and tokenized, the row kept for the reward functions.

A row holds a `prompt` (text, used as it is, or chat messages, rendered by the chat template with the generation
prompt added, as TRL does) and any other columns, which reach the reward functions as keyword lists. Nothing is
trained in a prompt (the completions are sampled during training), so there is no token store or cache: prompt sets
are small and are read whole. A prompt longer than the budget (data.max_length - grpo.max_completion_length) is an
error naming its row, or dropped and counted with data.overlong: drop; no eval rows are held out (the rewards of each
step are GRPO's measure).
"""

from __future__ import annotations

import numpy as np

from finetune.data.examples import IGNORE_INDEX, DataStats, Example, weighted
from finetune.data.sources import load_rows
from finetune.data.templates import row_tools
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids"}  # what a reward function is called with, by name


def prompt_text(prompt, tokenizer, system_prompt: str | None, *, tools: list[dict] | None = None) -> str:
    """The text the policy continues: chat messages through the chat template (generation prompt added, the row's
    tools rendered as the template renders them), a string as it is."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    if system_prompt and messages and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def prompt_ids(text: str, tokenizer, *, chat: bool) -> list[int]:
    # A chat template writes its own special tokens (BOS included); a text prompt gets the tokenizer's.
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def _rows_of(spec: DatasetSpec, key: str) -> list[dict]:
    rows = load_rows(spec)
    column = spec.columns.get("prompt", "prompt")
    if rows and column not in rows[0]:
        raise DataError(
            f"{key} ({spec.path}): the rows have no `{column}` column (columns: {', '.join(map(str, rows[0]))}), and "
            "format: prompt samples completions for each row's prompt. Fix: give each row a `prompt` (text, or chat "
            f"messages [{{\"role\": \"user\", \"content\": ...}}]), or map yours with {key}.columns: {{prompt: NAME}}.")
    # The reward functions see the prompt as `prompt` and every other column under its own name, beside the arguments
    # of the call itself (TRL's signature), which a column cannot take.
    taken = sorted({key for row in rows for key in row} & REWARD_ARGUMENTS)
    if taken:
        raise DataError(
            f"{key} ({spec.path}): the rows have a column named `{taken[0]}`, which the reward functions receive as "
            f"their own argument (they are called f(prompts=..., completions=..., completion_ids=..., **columns)), so "
            "the column could not reach them. Fix: rename the column in the data.")
    return [{"prompt": row.get(column), **{k: v for k, v in row.items() if k != column}} for row in rows]


def prompt_examples(recipe: Recipe, tokenizer) -> tuple[list[Example], list[Example], DataStats]:
    """(train prompts, no eval rows, stats) of every dataset, weighted and mixed as build.prepare mixes rows."""
    budget = recipe.data.max_length - recipe.grpo.max_completion_length
    stats, examples, index = DataStats(), [], 0
    for number, spec in enumerate(recipe.data.datasets):
        key = f"data.datasets[{number}]"
        rows = _rows_of(spec, key)
        found = []
        for line, row in enumerate(rows, start=1):
            stats.rows += 1
            prompt = row["prompt"]
            if not prompt or not isinstance(prompt, (str, list)):
                if recipe.data.bad_rows == "skip":
                    stats.skipped += 1
                    stats.skipped_reasons.append(f"{spec.path} row {line}: empty or not text/messages")
                    continue
                raise DataError(f"{key} ({spec.path}) row {line}: `prompt` is {prompt!r}; a prompt is text or a list of "
                                "chat messages. Fix the row, or set data.bad_rows: skip.")
            system = spec.system_prompt if spec.system_prompt is not None else recipe.data.system_prompt
            tools = row_tools(row, spec, f"{key} ({spec.path}) row {line}") if isinstance(prompt, list) else None
            ids = prompt_ids(prompt_text(prompt, tokenizer, system, tools=tools), tokenizer, chat=isinstance(prompt, list))
            if len(ids) > budget:
                if recipe.data.overlong == "drop":
                    stats.dropped += 1
                    stats.dropped_rows.append(f"{spec.path} row {line}")
                    continue
                raise DataError(
                    f"{key} ({spec.path}) row {line}: the prompt is {len(ids)} tokens, over the prompt budget of {budget} "
                    f"(data.max_length {recipe.data.max_length} - grpo.max_completion_length "
                    f"{recipe.grpo.max_completion_length}). Fix: raise data.max_length, lower max_completion_length, "
                    "shorten the prompt, or set data.overlong: drop to leave such rows out.")
            found.append(Example(ids, [IGNORE_INDEX] * len(ids), row=row, prompt_index=index))
            index += 1
        if not found:
            raise DataError(f"{key} ({spec.path}): no usable prompt ({len(rows)} rows read).")
        stats.per_dataset.append({"path": spec.path, "format": spec.format, "rows": len(rows), "examples": len(found),
                                  "weight": spec.weight, "cached": False})
        examples += weighted(found, spec.weight, recipe.train.seed + number)  # as build.prepare mixes
    lengths = np.array([len(e.input_ids) for e in examples])
    stats.tokens_min, stats.tokens_max, stats.tokens_median = int(lengths.min()), int(lengths.max()), float(np.median(lengths))
    stats.total_tokens, stats.train_examples, stats.train_sequences = int(lengths.sum()), len(examples), len(examples)
    stats.batch_efficiency = stats.unpacked_efficiency = 1.0
    return examples, [], stats
