"""GRPO's prompts (format: prompt): each row's prompt rendered and tokenized, the row kept for the reward functions.

A row holds a `prompt` (text, used as it is, or chat messages, rendered by the chat template with the generation
prompt added, as TRL does) and any other columns, which reach the reward functions as keyword lists. Nothing is
trained in a prompt (the completions are sampled during training), so there is no token store or cache: prompt sets
are small and are read whole. A prompt longer than the budget (data.max_length - grpo.max_completion_length) is an
error naming its row, or dropped and counted with data.overlong: drop; no eval rows are held out (the rewards of each
step are GRPO's measure).

`dataset_prompt_ids` renders a prompt as the rows of a dataset render theirs in training, whatever the format: the one
code path of GRPO's prompts and of `finetune generate` (finetune/cli/generate.py), so a run is asked as it trained.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from finetune.data.chat import prompt_part
from finetune.data.examples import IGNORE_INDEX, DataStats, Example, weighted_share
from finetune.data.sources import load_rows
from finetune.data.template_facts import note_turn_end, turn_end
from finetune.data.templates import (
    adds_bos,
    arrow_cleaned,
    render_segments,
    row_system,
    row_template_kwargs,
    row_tools,
    template_rendered,
    with_system,
)
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"}  # a reward
# function's call, by name (TRL 1.16's)
TURN_KEYS = ("role", "content", "reasoning")  # data.datasets[].columns keys that name the keys of chat turns


def prompt_text(prompt, tokenizer, system_prompt: str | None, *, tools: list[dict] | None = None,
                spec: DatasetSpec | None = None, where: str = "prompt", template_kwargs: dict | None = None) -> str:
    """The text the policy continues: a string as it is; chat messages (any shape a chat row takes: ShareGPT's, text
    parts, reasoning fields) in the normal form of data/conversations.py, through the chat template with the
    generation prompt added, the row's tools and its chat template arguments (`template_kwargs`), as TRL renders a
    prompt. A prompt must end with a user turn or a tool result (the policy answers it); a template that does not
    render the tools the row offers is the row's error."""
    if isinstance(prompt, str):
        return prompt
    from finetune.data.conversations import convert_turns, renders_tools, template_messages
    from finetune.data.template_facts import chat_template_text

    spec = spec or DatasetSpec(path=where, format="prompt")
    if spec.format != "prompt":
        messages = convert_turns(prompt, spec, where)
    else:  # GRPO's prompt: its history's assistant turns as written (_HIDDEN_TAG)
        try:
            messages = _shown(convert_turns(_hidden(prompt), spec, where))
        except DataError as exc:
            raise DataError(_shown(str(exc))) from None
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: a chat prompt must end with a user turn or a tool result, which the policy answers "
                        f"(it ends with {messages[-1]['role'] if messages else 'nothing'}). Fix the row or set "
                        "data.bad_rows: skip.")
    messages, _ = with_system(messages, system_prompt)
    template = chat_template_text(tokenizer, tools=bool(tools))
    if tools and not renders_tools(template):
        raise DataError(f"{where}: the row offers tools, but the tokenizer's chat template does not render `tools`, so "
                        "the policy would never see them. Fix: set model.chat_template to a template that renders "
                        "them, or leave the tools out of the rows.")
    try:
        return tokenizer.apply_chat_template(template_messages(messages, template), tools=tools, tokenize=False,
                                             add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001  (jinja's and transformers' errors: the row's paragraph)
        raise DataError(f"{where}: the chat template cannot render this prompt: {exc}. Fix the row or set "
                        "data.bad_rows: skip.") from None


# GRPO's prompts keep an assistant turn's `</think>` line as written (`Let me think.\n</think>\nTeal.`): the
# `</think>`-line rule (conversations._INLINE_THINK: DeepSeek-R1's output, reasoning without its opening tag) reads
# a trained answer's reasoning for data.reasoning, but nothing of a prompt is trained, and TRL's GRPOTrainer, vLLM's
# chat endpoint and apply_chat_template send the content as it is; read as reasoning, a template without a reasoning
# field (Llama 3.1, Gemma, Mistral, ChatML) showed the policy a `<think>` opener the row does not hold (bb60). The tag
# is hidden from the rule behind a private-use stand-in and put back. A content that opens with `<think>` keeps its
# reading: a whole block, rendered as the template renders reasoning, as before.
_TAG, _HIDDEN_TAG = "</think>", "\ue000/think\ue000"


def _hidden(value):
    """`value` (a row's prompt) with `</think>` replaced by the stand-in in each content that holds one and does not
    open with `<think>`: a text, or a list of content parts read as their texts joined (a block split over two parts,
    `<think>Calm.` then `</think>Teal.`, is one block, as convert_turns joins them; bb65)."""
    if isinstance(value, str):
        return value if value.lstrip().startswith("<think>") else value.replace(_TAG, _HIDDEN_TAG)
    if isinstance(value, list) and value and all(isinstance(part, dict) and "type" in part for part in value):
        joined = "".join(part["text"] for part in value if isinstance(part.get("text"), str))
        if joined.lstrip().startswith("<think>"):
            return value
    if isinstance(value, list):
        return [_hidden(item) for item in value]
    return {key: _hidden(item) for key, item in value.items()} if isinstance(value, dict) else value


def _shown(value):
    """`value` (messages, or an error's text) with the stand-in put back."""
    return _texts(value, lambda text: text.replace(_HIDDEN_TAG, _TAG))


def _texts(value, change):
    """`value` with `change` applied to every text in it, at any depth of lists and dicts."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_texts(item, change) for item in value]
    return {key: _texts(item, change) for key, item in value.items()} if isinstance(value, dict) else value


def prompt_ids(text: str, tokenizer, *, chat: bool) -> list[int]:
    """A chat template writes its own special tokens (BOS included); a text prompt gets the tokenizer's BOS where it
    puts one first, as text rows trained (tokenize_many), and nothing else: a post-processor that also appends EOS
    (`add_eos_token: true`) would end the prompt with the token that ends an answer."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if chat or not adds_bos(tokenizer) or ids[:1] == [tokenizer.bos_token_id]:
        return ids
    return [tokenizer.bos_token_id] + ids


# A row of each format whose prompt is rendered by the training renderer (templates.render_segments) and whose answer
# is a stand-in: the prompt's text is the rendering's untrained start, as the rows of that format trained.
_ROW_OF_PROMPT = {"alpaca": ("instruction", {"output": "."}), "completion": ("prompt", {"completion": "."}),
                  "preference": ("prompt", {"chosen": "a", "rejected": "b"}),
                  "unpaired_preference": ("prompt", {"completion": ".", "label": True})}


def dataset_prompt_ids(prompt, spec: DatasetSpec, tokenizer, system_prompt: str | None, *, row: dict | None = None,
                       where: str = "prompt") -> list[int]:
    """Token ids of `prompt` (text, or chat messages) rendered as the rows of `spec` render their prompts in training,
    for the model to answer: GRPO's prompts and `finetune generate`'s. Chat messages, chat rows, and pair / KTO rows
    on a tokenizer with a chat template go through the chat template (prompt_text: the system prompt and the tools
    of `row`, else of the dataset); alpaca rows take ALPACA_PROMPT after the system prompt, and pair / KTO rows without
    a template their prompt after it (the training renderer's own text); text, completion and GRPO text prompts are
    the raw text. Text gets the tokenizer's BOS, as those rows trained with it."""
    row = row if row is not None else {}
    if isinstance(prompt, list) or template_rendered(spec, tokenizer):
        # Arrow's null-filled keys dropped from the tools and the prompt's tool calls, as the training rows' are
        row = arrow_cleaned({**row, "prompt": prompt}, spec, where)
        messages = row["prompt"] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        system, tools = row_system(row, spec, system_prompt), row_tools(row, spec, where)
        text = prompt_text(messages, tokenizer, system, tools=tools, spec=spec, where=where,
                           template_kwargs=row_template_kwargs(row, where))
        return prompt_ids(text, tokenizer, chat=True)
    if spec.format in _ROW_OF_PROMPT:
        field, answer = _ROW_OF_PROMPT[spec.format]
        rendered = render_segments({**row, field: prompt, **answer}, spec.model_copy(update={"columns": {}}),
                                   tokenizer, system_prompt, where)
        segments = rendered[0] if isinstance(rendered, tuple) else rendered  # a pair's chosen, a KTO row's segments
        prompt = prompt_part(segments)
    return prompt_ids(prompt, tokenizer, chat=False)


def _rows_of(spec: DatasetSpec, key: str) -> list[dict]:
    rows = load_rows(spec)
    column = spec.columns.get("prompt", "prompt")
    if rows and column not in rows[0]:
        raise DataError(
            f"{key} ({spec.path}): the rows have no `{column}` column (columns: {', '.join(map(str, rows[0]))}), and "
            "format: prompt samples completions for each row's prompt. Fix: give each row a `prompt` (text, or chat "
            f"messages [{{\"role\": \"user\", \"content\": ...}}]), or map yours with {key}.columns: {{prompt: NAME}}.")
    # The reward functions see the prompt as `prompt` and every other column under its own name, and also under the
    # field name data.datasets[].columns gives it (`answer: solution`: `answer` too), beside the arguments of the call
    # itself (TRL's signature), which a column cannot take. role, content and reasoning map the keys of chat turns.
    mapped = {field: column for field, column in spec.columns.items() if field not in TURN_KEYS and field != "prompt"}
    if reserved := sorted(set(mapped) & REWARD_ARGUMENTS):
        raise DataError(f"{key}.columns: `{reserved[0]}` is an argument of the reward functions' call (f(prompts=..., "
                        f"completions=..., completion_ids=..., **columns)), so the column could not reach them under "
                        f"that name. Fix: map `{mapped[reserved[0]]}` to another name.")
    missing = sorted(column for column in mapped.values() if rows and all(column not in row for row in rows))
    if missing:
        raise DataError(f"{key}.columns maps a field to `{missing[0]}`, but no row has that column (columns: "
                        f"{', '.join(map(str, rows[0]))}). Fix the mapping (field: column in the data).")
    rows = [{**row, **{field: row.get(column) for field, column in mapped.items()}} for row in rows]
    taken = sorted({key for row in rows for key in row} & REWARD_ARGUMENTS)
    if taken:
        raise DataError(
            f"{key} ({spec.path}): the rows have a column named `{taken[0]}`, which the reward functions receive as "
            f"their own argument (they are called f(prompts=..., completions=..., completion_ids=..., **columns)), so "
            "the column could not reach them. Fix: rename the column in the data.")
    return [{"prompt": row.get(column), **{k: v for k, v in row.items() if k != column}} for row in rows]


_NO_EVAL_FILES = ("data.eval_datasets ({count} given): GRPO (train.objective: grpo) evaluates nothing, neither eval files "
                  "nor held-out rows: the rewards of each step are its measure (docs/grpo.md), so the files would be "
                  "read for nothing. Fix: remove data.eval_datasets (ask the trained adapter such prompts afterwards with "
                  "`finetune generate RUN --prompt ...`).")


def prompt_examples(recipe: Recipe, tokenizer) -> tuple[list[Example], list[Example], DataStats]:
    """(train prompts, no eval rows, stats) of every dataset, weighted and mixed as build.prepare mixes rows."""
    if recipe.data.eval_datasets:
        raise DataError(_NO_EVAL_FILES.format(count=len(recipe.data.eval_datasets)))
    budget = recipe.data.max_length - recipe.grpo.max_completion_length
    note_turn_end(tokenizer)  # a template whose end of turn is text: the policy stops on it as text (template_facts.py)
    stats, examples, index = DataStats(), [], 0
    for number, spec in enumerate(recipe.data.datasets):
        key = f"data.datasets[{number}]"
        rows = _rows_of(spec, key)
        found = []
        for line, row in enumerate(rows, start=1):
            stats.rows += 1
            index += 1  # every row read counts, kept or not: `prompt_index` is the row's place in the data
            prompt = row["prompt"]
            if not prompt or not isinstance(prompt, (str, list)):
                if recipe.data.bad_rows == "skip":
                    stats.skipped += 1
                    stats.skipped_reasons.append(f"{spec.path} row {line}: empty or not text/messages")
                    continue
                raise DataError(f"{key} ({spec.path}) row {line}: `prompt` is {prompt!r}; a prompt is text or a list of "
                                "chat messages. Fix the row, or set data.bad_rows: skip.")
            where = f"{key} ({spec.path}) row {line}"
            try:
                ids = dataset_prompt_ids(prompt, spec, tokenizer, recipe.data.system_prompt, row=row, where=where)
            except DataError as exc:
                if recipe.data.bad_rows != "skip":
                    raise
                stats.skipped += 1
                stats.skipped_reasons.append(str(exc))
                continue
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
            found.append(Example(ids, [IGNORE_INDEX] * len(ids), row=row, prompt_index=index - 1,
                                 place=f"prompt row {line} of {spec.path} ({key})"))
        if not found:
            raise DataError(f"{key} ({spec.path}): no usable prompt ({len(rows)} rows read).")
        kept = _numbered_copies(weighted_share(found, spec.weight, recipe.train.seed + number,
                                               where=f"{key} ({spec.path})"))  # as build
        stats.per_dataset.append({"path": spec.path, "format": spec.format, "rows": len(rows), "examples": len(found),
                                  "weight": spec.weight, "cached": False, "train_examples": len(kept)})
        examples += kept
    lengths = np.array([len(e.input_ids) for e in examples])
    stats.tokens_min, stats.tokens_max, stats.tokens_median = int(lengths.min()), int(lengths.max()), float(np.median(lengths))
    stats.total_tokens, stats.train_examples, stats.train_sequences = int(lengths.sum()), len(examples), len(examples)
    stats.batch_efficiency = stats.unpacked_efficiency = 1.0
    return examples, [], stats


def _numbered_copies(examples: list[Example]) -> list[Example]:
    """The repeats a dataset's weight made of one prompt, numbered (Example.copy): two copies in one step would draw
    the same completions from the same seeds, a doubled gradient of the same samples (TRL samples each afresh)."""
    seen: dict[int, int] = {}
    numbered = []
    for example in examples:
        copy = seen.get(id(example), 0)
        seen[id(example)] = copy + 1
        numbered.append(dataclasses.replace(example, copy=copy) if copy else example)
    return numbered


def turn_end_ids(tokenizer) -> list[int]:
    """The special token the chat template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>,
    Gemma's <end_of_turn>): what a model trained on the template learns to stop with, which a base model's generation
    config does not list when the recipe gives it a template (model.chat_template). None for a template that closes
    no turn (the next turn's opener ends it), one that closes it with text (turn_end_stops), or no template."""
    end = turn_end(tokenizer)
    return [end.special_id] if end is not None and end.special_id is not None else []


def turn_end_stops(tokenizer) -> list[str]:
    """The stop strings of generation: the chat template's end of turn where it is text to this tokenizer, not a
    special token (ChatML's `<|im_end|>` on a Llama 2 or Mistral base: trained as 10 pieces, template_facts.turn_end). A model
    trained on that template writes the pieces and never the EOS, so generation stops once the text is written
    (transformers' stop_strings, vLLM's stop), and the text is cut from the answer (cut_at_stops), as decoding
    drops a special end token."""
    end = turn_end(tokenizer)
    return [end.text] if end is not None and end.text else []


def cut_at_stops(text: str, stops: list[str]) -> str:
    """`text` up to the first stop string in it (the answer without the end-of-turn marker nor what follows it)."""
    for stop in stops:
        text = text.split(stop, 1)[0]
    return text
