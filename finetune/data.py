"""Data: load rows, render them to text segments, tokenize with exact loss masks, batch per rank.

Every format is reduced to a list of `(text, trained)` segments. The segments are joined and tokenized once with
character offsets; a token is trained when it starts inside a trained segment. So the labels are exactly the
tokens of the rendered text the model sees (no drift between a separately tokenized prompt and response), and
masking works for any chat template that renders each conversation prefix as a prefix of the whole.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

IGNORE_INDEX = -100

# Field names each format needs (the recipe's `columns` maps them to other column names).
FORMAT_FIELDS = {
    "alpaca": (("instruction", "output"), ("input", "system")),
    "chat": (("messages",), ()),
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def num_trained(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class DataStats:
    rows: int = 0
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0
    train_examples: int = 0
    eval_examples: int = 0
    skipped_reasons: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------- loading
def _read_json_rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not text.lstrip().startswith("[")):
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}). Fix or delete that line."
                ) from None
        return rows
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}). Fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a JSON data file must hold a list of rows (or be JSON Lines), got {type(rows).__name__}.")
    return rows


def load_rows(spec: DatasetSpec) -> list[dict]:
    """Rows of one dataset as plain dicts: local JSON/JSONL/CSV/Parquet, a load_from_disk folder, or a hub name."""
    path = Path(spec.path).expanduser()
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            return _read_json_rows(path)
        if path.suffix in (".csv", ".parquet"):
            import datasets

            return list(datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train"))
        raise DataError(f"data.datasets path {path}: unsupported file type `{path.suffix}`; use .jsonl, .json, .csv or .parquet.")
    if path.is_dir():
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise DataError(f"{path}: a folder but not a `datasets.save_to_disk` folder; point data.datasets[].path at a file.") from None
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise DataError(f"{path}: split `{spec.split}` not found (has {list(loaded)}); set data.datasets[].split.")
            loaded = loaded[spec.split]
        return list(loaded)
    if spec.path.startswith((".", "/", "~")) or Path(spec.path).suffix in (".jsonl", ".json", ".csv", ".parquet"):
        raise DataError(f"data.datasets path `{spec.path}`: file not found (relative paths are read from {Path.cwd()}).")
    return _load_hub_rows(spec)


def _load_hub_rows(spec: DatasetSpec) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(spec.path, spec.subset, split=spec.split))
    except Exception as exc:  # datasets raises many types for offline / missing names
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"data.datasets path `{spec.path}`: not a local file and could not be loaded as a `datasets` name ({reason}). "
            "If you are offline, download it elsewhere (`datasets.load_dataset(...).save_to_disk(DIR)`) and set the path to DIR."
        ) from None


# --------------------------------------------------------------------------------------------------- rendering
def _field(row: dict, spec: DatasetSpec, name: str):
    return row.get(spec.columns.get(name, name))


def check_row(row: dict, spec: DatasetSpec, where: str) -> None:
    """The row is an object with every field its format needs (no tokenizer needed)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object with fields, got {type(row).__name__}.")
    required, _ = FORMAT_FIELDS[spec.format]
    missing = [spec.columns.get(name, name) for name in required if _field(row, spec, name) in (None, "")]
    if missing:
        present = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise DataError(
            f"{where}: missing {', '.join(f'`{m}`' for m in missing)} needed by format `{spec.format}` (row has: {present}). "
            "Fix the row, map the columns with data.datasets[].columns, or set data.bad_rows: skip."
        )


def _chat_segments(messages: list[dict], tokenizer, where: str) -> list[tuple[str, bool]]:
    """Segments of a rendered conversation: each assistant turn (content + end-of-turn) trained, the rest not."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: chat data needs a tokenizer with a chat template, and this tokenizer has none. Use a chat/instruct "
            "model's tokenizer (model.tokenizer) or the alpaca/completion formats."
        )
    for turn in messages:
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{where}: every message needs `role` and `content`, got {turn!r}.")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing would be trained.")
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    segments, cursor = [], 0
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        start = len(render(messages[:index], True))
        upto = render(messages[: index + 1], False)
        if not full.startswith(upto) or start > len(upto):
            raise DataError(
                f"{where}: the tokenizer's chat template does not render conversation prefixes as prefixes of the whole, so "
                "assistant turns cannot be located exactly. Use a template without history rewriting."
            )
        end = len(upto.rstrip())
        segments += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def render_segments(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str) -> list[tuple[str, bool]]:
    """Row -> [(text, trained)] for the dataset's format."""
    check_row(row, spec, where)
    eos = tokenizer.eos_token or ""
    if spec.format == "text":
        return [(str(_field(row, spec, "text")) + eos, True)]
    if spec.format == "completion":
        return [(str(_field(row, spec, "prompt")), False), (str(_field(row, spec, "completion")) + eos, True)]
    if spec.format == "chat":
        messages = list(_field(row, spec, "messages"))
        if system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": system_prompt}] + messages
        return _chat_segments(messages, tokenizer, where)
    instruction, extra = str(_field(row, spec, "instruction")), _field(row, spec, "input")
    template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    system = _field(row, spec, "system") or system_prompt
    if system:
        prompt = f"{system}\n\n{prompt}"
    return [(prompt, False), (str(_field(row, spec, "output")) + eos, True)]


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> Example:
    """Tokenize the joined text once; label a token when it starts inside a trained segment."""
    text = "".join(t for t, _ in segments)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained_spans, position = [], 0
    for segment, trained in segments:
        if trained:
            trained_spans.append((position, position + len(segment)))
        position += len(segment)
    ids = list(encoded["input_ids"])
    bos = tokenizer.bos_token_id
    labels = [
        token if any(lo <= start < hi for lo, hi in trained_spans) else IGNORE_INDEX
        for token, (start, _end) in zip(ids, encoded["offset_mapping"])
    ]
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids, labels = [bos] + ids, [IGNORE_INDEX] + labels
    return Example(ids, labels)


# ------------------------------------------------------------------------------------------------ the datasets
def build_examples(recipe: Recipe, tokenizer) -> tuple[list[Example], list[Example], DataStats]:
    """All train and eval examples (every rank builds the same lists; the sampler splits them)."""
    stats, examples = DataStats(), []
    for index, spec in enumerate(recipe.data.datasets):
        rows = load_rows(spec)
        stats.rows += len(rows)
        dataset_examples = []
        for number, row in enumerate(rows, start=1):
            where = f"{spec.path} row {number}"
            try:
                example = tokenize_segments(render_segments(row, spec, tokenizer, recipe.data.system_prompt, where), tokenizer)
            except DataError as exc:
                if recipe.data.bad_rows == "error":
                    raise
                stats.skipped += 1
                stats.skipped_reasons.append(str(exc))
                continue
            example = _apply_length_policy(example, recipe, stats)
            if example is not None and example.num_trained > 0:
                dataset_examples.append(example)
            elif example is not None:
                stats.skipped += 1
        if not dataset_examples:
            raise DataError(f"data.datasets[{index}] ({spec.path}): no usable rows ({len(rows)} read).")
        examples.extend(_weighted(dataset_examples, spec.weight, recipe.train.seed + index))
    train, evaluation = split_eval(examples, recipe)
    stats.train_examples, stats.eval_examples = len(train), len(evaluation)
    return train, evaluation, stats


def _apply_length_policy(example: Example, recipe: Recipe, stats: DataStats) -> Example | None:
    limit = recipe.data.max_length
    if len(example.input_ids) <= limit:
        return example
    if recipe.data.overlong == "drop":
        stats.dropped += 1
        return None
    stats.truncated += 1
    return Example(example.input_ids[:limit], example.labels[:limit])


def _weighted(examples: list[Example], weight: float, seed: int) -> list[Example]:
    """Repeat (weight > 1) or subsample (weight < 1) a dataset's examples for mixing."""
    if weight == 1.0:
        return examples
    whole, fraction = int(weight), weight - int(weight)
    rng = random.Random(seed)
    extra = rng.sample(examples, k=int(round(fraction * len(examples))))
    return examples * whole + extra


def split_eval(examples: list[Example], recipe: Recipe) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(recipe.train.seed).shuffle(order)
    n_eval = min(recipe.data.eval_max_rows, int(round(recipe.data.eval_fraction * len(examples))))
    if len(examples) - n_eval < 1:
        n_eval = 0
    eval_ids = set(order[:n_eval])
    train = [e for i, e in enumerate(examples) if i not in eval_ids]
    evaluation = [examples[i] for i in sorted(eval_ids)]
    return train, evaluation


# ------------------------------------------------------------------------------------------------- batching
def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked out of attention and loss."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


class BatchStream:
    """Endless micro-batches for one rank: a seeded shuffle per epoch, each rank a disjoint, strided share.

    The global order is the same for every world size: global micro-batch g of size B*W holds rows
    perm[g*B*W : (g+1)*B*W], and rank r takes every W-th of them. So 1 process with batch 4 and 2 processes
    with batch 2 see the same rows per optimizer step. Position (epoch, cursor) is resumable state.
    """

    def __init__(self, examples: list[Example], *, micro_batch_size: int, rank: int, world_size: int, seed: int, pad_id: int):
        global_batch = micro_batch_size * world_size
        if len(examples) < global_batch:
            raise DataError(
                f"only {len(examples)} training examples for a global micro-batch of {global_batch} "
                f"(train.micro_batch_size={micro_batch_size} x {world_size} processes). Add data or lower the batch size."
            )
        self.examples, self.batch, self.rank, self.world = examples, micro_batch_size, rank, world_size
        self.seed, self.pad_id = seed, pad_id
        self.epoch, self.cursor = 0, 0  # cursor counts global micro-batches taken in this epoch
        self.batches_per_epoch = len(examples) // global_batch

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            perm = self._permutation()
            while self.cursor < self.batches_per_epoch:
                start = self.cursor * self.batch * self.world
                rows = perm[start : start + self.batch * self.world][self.rank :: self.world]
                self.cursor += 1
                yield collate([self.examples[i] for i in rows], self.pad_id)
            self.epoch, self.cursor = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "world_size": self.world, "micro_batch_size": self.batch}

    def load_state_dict(self, state: dict) -> None:
        # Position is kept in global micro-batches of the saving run; convert if the global batch changed.
        saved_global = state["world_size"] * state["micro_batch_size"]
        rows_seen = state["cursor"] * saved_global
        self.epoch = state["epoch"]
        self.cursor = math.ceil(rows_seen / (self.batch * self.world))


def eval_batches(examples: list[Example], *, micro_batch_size: int, rank: int, world_size: int, pad_id: int):
    """This rank's share of the eval set, in order.

    Every rank runs the same number of batches (FSDP needs every rank in every forward): a short share is topped
    up with a copy of an example whose labels are all ignored, which changes neither loss sum nor token count.
    """
    per_rank = math.ceil(len(examples) / world_size)
    share = examples[rank::world_size]
    filler = Example(examples[0].input_ids, [IGNORE_INDEX] * len(examples[0].input_ids)) if examples else None
    share = share + [filler] * (per_rank - len(share))
    for start in range(0, per_rank, micro_batch_size):
        yield collate(share[start : start + micro_batch_size], pad_id)
