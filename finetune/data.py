"""Data: load rows, render them to text segments, tokenize with exact loss masks, pack, batch per rank.

Every format is reduced to a list of `(text, trained)` segments. The segments are joined and tokenized once with
character offsets; a token is trained when its characters overlap a trained segment. So the labels are exactly
the tokens of the rendered text the model sees (no drift between a separately tokenized prompt and response), and
masking works for any chat template that renders each conversation prefix as a prefix of the whole.

Flow: `prepare()` reads each dataset (or its tokenized cache), weights and mixes them, splits off the eval set and,
with `data.packing`, packs the train examples into rows of at most `data.max_length` tokens whose position ids
restart per example. `BatchStream` then shuffles those rows per epoch and hands each rank its disjoint share.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import math
import os
import random
import statistics
import tempfile
from bisect import bisect_left, insort
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

IGNORE_INDEX = -100
CACHE_VERSION = 1  # bump when rendering or labelling changes: old cache entries are then never read

# Field names each format needs, and optional ones (the recipe's `columns` maps them to other column names).
FORMAT_FIELDS = {
    "alpaca": (("instruction", "output"), ("input", "system")),
    "chat": (("messages",), ()),
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# ShareGPT-style `conversations` use from/value and these speaker names; everything maps to system/user/assistant.
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "model": "assistant", "bot": "assistant"}
# Attention implementations that turn restarting position_ids (with no attention_mask) into a block-diagonal mask
# in transformers 5: sdpa/eager/flex through masking_utils.find_packed_sequence_indices, flash through cu_seqlens.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass
class Example:
    """One training row: token ids, labels (IGNORE_INDEX where untrained), position ids when packed."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None

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
    train_sequences: int = 0  # rows the BatchStream walks over: packed rows, or train_examples unpacked
    tokens_min: int = 0
    tokens_median: float = 0.0
    tokens_max: int = 0
    total_tokens: int = 0
    trained_tokens: int = 0
    batch_efficiency: float = 0.0  # non-pad / all tokens of the train micro-batches of one epoch, as the run collates
    unpacked_efficiency: float = 0.0  # the same without packing, for comparison
    cached_datasets: int = 0  # datasets read from the tokenization cache instead of tokenized
    per_dataset: list[dict] = field(default_factory=list)


@dataclass
class PreparedData:
    """Everything `prepare` builds: the examples before packing (for previews) and what training consumes."""

    examples: list[Example]
    train: list[Example]
    eval: list[Example]
    stats: DataStats
    eval_files: list[Example] = field(default_factory=list)  # the examples of data.eval_datasets (first in `eval`)


# ----------------------------------------------------------------------------------------------------- loading
def _read_json_rows(path: Path, *, bad_rows: str = "error") -> tuple[list, list[str], list[str]]:
    """Rows of a JSON / JSON Lines file, where each came from ("line N" / "row N"), and broken lines skipped."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not text.lstrip().startswith("[")):
        rows, places, broken = [], [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
                places.append(f"line {number}")
            except json.JSONDecodeError as exc:
                message = (f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}). Fix or delete "
                           "that line, or set data.bad_rows: skip to skip broken rows with a count.")
                if bad_rows == "error":
                    raise DataError(message) from None
                broken.append(message)
        return rows, places, broken
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}). Fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a JSON data file must hold a list of rows (or be JSON Lines), got {type(rows).__name__}.")
    return rows, [f"row {i}" for i in range(1, len(rows) + 1)], []


def _read_rows(spec: DatasetSpec, *, bad_rows: str = "error") -> tuple[list, list[str], list[str]]:
    """Rows of one dataset, their places for messages, and the reasons of unreadable rows skipped."""
    path = Path(spec.path).expanduser()
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            rows, places, broken = _read_json_rows(path, bad_rows=bad_rows)
        elif path.suffix in (".csv", ".parquet"):
            import datasets

            rows, broken = list(datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train")), []
            places = [f"row {i}" for i in range(1, len(rows) + 1)]
        else:
            raise DataError(f"data.datasets path {path}: unsupported file type `{path.suffix}`; use .jsonl, .json, .csv "
                            "or .parquet.")
    elif path.is_dir():
        rows, broken = _load_folder_rows(path, spec), []
        places = [f"row {i}" for i in range(1, len(rows) + 1)]
    elif spec.path.startswith((".", "/", "~")) or Path(spec.path).suffix in (".jsonl", ".json", ".csv", ".parquet"):
        raise DataError(f"data.datasets path `{spec.path}`: file not found (relative paths are read from {Path.cwd()}).")
    else:
        rows, broken = _load_hub_rows(spec), []
        places = [f"row {i}" for i in range(1, len(rows) + 1)]
    if spec.max_rows is not None:
        rows, places = rows[: spec.max_rows], places[: spec.max_rows]
    return rows, places, broken


def load_rows(spec: DatasetSpec) -> list[dict]:
    """Rows of one dataset as plain dicts: local JSON/JSONL/CSV/Parquet, a folder, or a `datasets` hub name."""
    return _read_rows(spec)[0]


def _load_folder_rows(path: Path, spec: DatasetSpec) -> list[dict]:
    """A `save_to_disk` folder, else a folder of data files (a downloaded hub dataset) read by `load_dataset`."""
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise DataError(f"{path}: split `{spec.split}` not found (has {list(loaded)}); set data.datasets[].split.")
            loaded = loaded[spec.split]
        return list(loaded)
    try:
        return list(datasets.load_dataset(str(path), spec.subset, split=spec.split))
    except Exception as exc:  # noqa: BLE001  datasets raises many types for folders it cannot read
        raise DataError(f"{path}: a folder that is neither a `datasets.save_to_disk` folder nor a folder of data files "
                        f"`datasets.load_dataset` can read ({_first_line(exc)}). Point data.datasets[].path at a file, "
                        "or check split/subset.") from None


def _load_hub_rows(spec: DatasetSpec) -> list[dict]:
    import datasets

    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()  # offline: the `datasets` cache only, failing at once instead of retrying

    try:
        return list(datasets.load_dataset(spec.path, spec.subset, split=spec.split))
    except Exception as exc:  # noqa: BLE001  datasets raises many types for offline / missing names
        raise DataError(
            f"data.datasets path `{spec.path}`: not a local file and could not be loaded as a `datasets` name "
            f"({_first_line(exc)}). If you are offline, download it elsewhere "
            "(`datasets.load_dataset(...).save_to_disk(DIR)`) and set the path to DIR."
        ) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------------- rendering
def _column(spec: DatasetSpec, name: str, row: dict | None = None) -> str:
    """The data column holding field `name` (chat data may use ShareGPT's `conversations` unmapped)."""
    if name in spec.columns:
        return spec.columns[name]
    if name == "messages" and row is not None and "messages" not in row and "conversations" in row:
        return "conversations"
    return name


def _field(row: dict, spec: DatasetSpec, name: str):
    return row.get(_column(spec, name, row))


def check_row(row: dict, spec: DatasetSpec, where: str) -> None:
    """The row is an object with every field its format needs, and chat turns are well formed (no tokenizer needed)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object with fields, got {type(row).__name__}.")
    required, _ = FORMAT_FIELDS[spec.format]
    missing = [_column(spec, name, row) for name in required if _field(row, spec, name) in (None, "", [])]
    if missing:
        raise DataError(
            f"{where}: missing or empty {', '.join(f'`{m}`' for m in missing)} needed by format `{spec.format}` (row has: "
            f"{', '.join(sorted(row))}). Fix the row, map the columns with data.datasets[].columns, or set data.bad_rows: skip."
        )
    if spec.format == "chat":
        normalize_messages(_field(row, spec, "messages"), spec, where)


def normalize_messages(turns, spec: DatasetSpec, where: str) -> list[dict]:
    """role/content or from/value turns -> [{role, content}] with system/user/assistant roles that alternate."""
    if not isinstance(turns, list):
        raise DataError(f"{where}: chat messages must be a list of turns, got {type(turns).__name__}.")
    role_key, content_key = spec.columns.get("role", "role"), spec.columns.get("content", "content")
    messages = []
    for number, turn in enumerate(turns, start=1):
        if isinstance(turn, dict) and role_key not in turn and "from" in turn and "value" in turn:
            role, content = turn["from"], turn["value"]
        elif isinstance(turn, dict) and role_key in turn and content_key in turn:
            role, content = turn[role_key], turn[content_key]
        else:
            raise DataError(f"{where}: message {number} needs `{role_key}` and `{content_key}` (or `from` and `value`), "
                            f"got {turn!r}. Fix the row or map the keys with data.datasets[].columns (role, content).")
        if ROLE_ALIASES.get(str(role).lower()) is None:
            raise DataError(f"{where}: message {number} has role `{role}`; known roles are {', '.join(ROLE_ALIASES)}.")
        messages.append({"role": ROLE_ALIASES[str(role).lower()], "content": "" if content is None else str(content)})
    _check_alternation(messages, where)
    return messages


def _check_alternation(messages: list[dict], where: str) -> None:
    """System turns only first; then user, assistant, user, ...; at least one assistant turn to train on."""
    expected = "user"
    for number, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "system" and all(m["role"] == "system" for m in messages[:number]):
            continue
        if role != expected:
            raise DataError(
                f"{where}: message {number} has role `{role}` where `{expected}` was expected: after an optional system "
                "message, roles must alternate user, assistant, user, ... Fix the row (merge consecutive turns of one "
                "speaker) or set data.bad_rows: skip."
            )
        expected = "assistant" if role == "user" else "user"
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing would be trained. Add the answer or "
                        "set data.bad_rows: skip.")


def _chat_segments(messages: list[dict], tokenizer, where: str) -> list[tuple[str, bool]]:
    """Segments of a rendered conversation: each assistant turn (content + end-of-turn) trained, the rest not."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = render(messages, False)
    segments, cursor = [], 0
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        start = len(render(messages[:index], True))
        upto = render(messages[: index + 1], False)
        if not full.startswith(upto) or not cursor <= start <= len(upto):
            raise DataError(
                f"{where}: the tokenizer's chat template does not render conversation prefixes as prefixes of the whole, so "
                "assistant turns cannot be located exactly. Use a template without history rewriting."
            )
        end = len(upto.rstrip())  # the end-of-turn token is trained (the model must learn to stop), the newline not
        segments += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def render_segments(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str) -> list[tuple[str, bool]]:
    """Row -> [(text, trained)] for the dataset's format."""
    check_row(row, spec, where)
    eos = tokenizer.eos_token or ""
    system_prompt = spec.system_prompt if spec.system_prompt is not None else system_prompt
    if spec.format == "text":
        return [(str(_field(row, spec, "text")) + eos, True)]
    if spec.format == "completion":
        return [(str(_field(row, spec, "prompt")), False), (str(_field(row, spec, "completion")) + eos, True)]
    if spec.format == "chat":
        messages = normalize_messages(_field(row, spec, "messages"), spec, where)
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        return _chat_segments(messages, tokenizer, where)
    instruction, extra = str(_field(row, spec, "instruction")), _field(row, spec, "input")
    template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    system = _field(row, spec, "system") or system_prompt
    if system:
        prompt = f"{system}\n\n{prompt}"
    return [(prompt, False), (str(_field(row, spec, "output")) + eos, True)]


# -------------------------------------------------------------------------------------------------- tokenizing
def _labels(ids: list[int], offsets, segments: list[tuple[str, bool]]) -> list[int]:
    """Label a token with its id when its characters overlap a trained segment, else IGNORE_INDEX.

    Overlap (not "starts inside") so that a token merging the prompt's last space with the answer's first
    characters is trained: the answer must be learned even when the tokenizer glues it to the prompt.
    """
    lows, highs, position = [], [], 0
    for text, trained in segments:
        if trained:
            lows.append(position)
            highs.append(position + len(text))
        position += len(text)
    if not ids:
        return []
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = spans[:, 0], np.maximum(spans[:, 1], spans[:, 0] + 1)
    index = np.searchsorted(np.asarray(highs, dtype=np.int64), starts, side="right")  # first span ending after start
    valid = index < len(lows)
    trained = valid & (np.asarray(lows + [0], dtype=np.int64)[np.minimum(index, len(lows))] < ends)
    return np.where(trained, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()


def _with_bos(example: Example, tokenizer) -> Example:
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not example.input_ids or example.input_ids[0] != bos):
        return Example([bos] + example.input_ids, [IGNORE_INDEX] + example.labels)
    return example


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> Example:
    """Tokenize the joined text once; label the tokens that overlap a trained segment."""
    return tokenize_many([segments], tokenizer)[0]


def tokenize_many(all_segments: list[list[tuple[str, bool]]], tokenizer, *, chunk: int = 1024) -> list[Example]:
    """Batch-tokenize many rendered rows: a fast tokenizer encodes a batch on all cores (Rust threads)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    examples = []
    for first in range(0, len(all_segments), chunk):
        part = all_segments[first : first + chunk]
        texts = ["".join(text for text, _ in segments) for segments in part]
        if backend is not None:  # straight to the Rust tokenizer: skips transformers' per-row Python conversion
            for segments, encoding in zip(part, backend.encode_batch(texts, add_special_tokens=False)):
                examples.append(_with_bos(Example(encoding.ids, _labels_from_encoding(encoding, segments)), tokenizer))
            continue
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for segments, ids, offsets in zip(part, encoded["input_ids"], encoded["offset_mapping"]):
            examples.append(_with_bos(Example(list(ids), _labels(list(ids), offsets, segments)), tokenizer))
    return examples


def _labels_from_encoding(encoding, segments: list[tuple[str, bool]]) -> list[int]:
    """`_labels` in O(trained spans): the tokens holding a span's first and last characters bound its tokens."""
    ids, labels, position = encoding.ids, [IGNORE_INDEX] * len(encoding.ids), 0
    for text, trained in segments:
        if trained and text:
            first, last = encoding.char_to_token(position), encoding.char_to_token(position + len(text) - 1)
            if first is None or last is None:  # a character no token covers (a normalizer dropped it): the slow way
                return _labels(ids, encoding.offsets, segments)
            labels[first : last + 1] = ids[first : last + 1]
        position += len(text)
    return labels


def _render_rows(rows: list, places: list[str], spec: DatasetSpec, tokenizer, system_prompt: str | None,
                 workers: int) -> list:
    """Render every row to segments, or to the DataError message that rejects it (in worker processes if asked)."""
    source = spec.path
    jobs = [(row, f"{source} {place}") for row, place in zip(rows, places)]
    if workers > 1 and len(jobs) >= 2000:
        import multiprocessing

        global _WORKER_CONTEXT
        _WORKER_CONTEXT = (spec, tokenizer, system_prompt)  # inherited by the forked workers, not pickled per row
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_render_in_worker, jobs, chunksize=256)
    return [_render_or_reason(row, spec, tokenizer, system_prompt, where) for row, where in jobs]


_WORKER_CONTEXT: tuple | None = None


def _render_in_worker(job: tuple) -> list | str:
    spec, tokenizer, system_prompt = _WORKER_CONTEXT
    return _render_or_reason(job[0], spec, tokenizer, system_prompt, job[1])


def _render_or_reason(row, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str) -> list | str:
    try:
        return render_segments(row, spec, tokenizer, system_prompt, where)
    except DataError as exc:
        return str(exc)


# ------------------------------------------------------------------------------------------- one dataset, cached
def _check_dataset(rows: list, spec: DatasetSpec, tokenizer, source: str) -> None:
    """Problems of a whole dataset that skipping rows cannot fix: a column absent everywhere, no chat template."""
    dict_rows = [row for row in rows[:1000] if isinstance(row, dict)]
    required, _ = FORMAT_FIELDS[spec.format]
    for name in required:
        if dict_rows and all(_column(spec, name, row) not in row for row in dict_rows):
            columns = sorted({key for row in dict_rows for key in row})
            mapped = f" (mapped from `{name}`)" if name in spec.columns else ""
            raise DataError(
                f"{source}: column `{_column(spec, name, dict_rows[0])}`{mapped}, needed by format `{spec.format}`, does "
                f"not exist (columns: {', '.join(columns)}). Map it with data.datasets[].columns, e.g. "
                f"columns: {{{name}: {columns[0] if columns else 'COLUMN'}}}, or pick the right format."
            )
    if spec.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{source}: chat data needs a tokenizer with a chat template, and this tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has none. Use a chat/instruct model's "
            "tokenizer (model.tokenizer), or the alpaca/completion formats."
        )


def _tokenize_dataset(spec: DatasetSpec, recipe: Recipe, tokenizer) -> tuple[list[Example], dict]:
    """Read, render, tokenize and length-limit one dataset; return its examples and its counts."""
    data = recipe.data
    rows, places, broken = _read_rows(spec, bad_rows=data.bad_rows)
    _check_dataset(rows, spec, tokenizer, spec.path)
    rendered = _render_rows(rows, places, spec, tokenizer, data.system_prompt, data.num_workers)
    reasons = broken + [item for item in rendered if isinstance(item, str)]
    if reasons and data.bad_rows == "error":
        raise DataError(reasons[0])
    counts = {"rows": len(rows) + len(broken), "skipped": len(reasons), "truncated": 0, "dropped": 0,
              "skipped_reasons": reasons[:20]}
    examples = []
    for example in tokenize_many([item for item in rendered if not isinstance(item, str)], tokenizer):
        if len(example.input_ids) > data.max_length:
            if data.overlong == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            example = Example(example.input_ids[: data.max_length], example.labels[: data.max_length])
        if any(label != IGNORE_INDEX for label in example.labels):
            examples.append(example)
        else:  # e.g. the answer was cut off by truncation: nothing to learn from the row
            counts["skipped"] += 1
    return examples, counts


def cache_dir() -> Path:
    """Where tokenized datasets are kept: $FINETUNE_CACHE, else ~/.cache/finetune (a `data` folder inside)."""
    root = os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune"
    return Path(root) / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything about a tokenizer that changes token ids or rendered text."""
    import transformers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [type(tokenizer).__name__, transformers.__version__, backend.to_str() if backend is not None else
             json.dumps(sorted(tokenizer.get_vocab().items())), str(getattr(tokenizer, "chat_template", None)),
             str(tokenizer.bos_token), str(tokenizer.eos_token), str(getattr(tokenizer, "add_bos_token", None))]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def _content_hash(spec: DatasetSpec) -> str | None:
    """Hash of a local file's or folder's bytes; None for a hub name (datasets keeps its own cache of those)."""
    path = Path(spec.path).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _cache_key(spec: DatasetSpec, recipe: Recipe, tokenizer) -> str | None:
    content = _content_hash(spec)
    if content is None or not recipe.data.cache:
        return None
    data = recipe.data
    settings = {"spec": spec.model_dump(exclude={"weight"}), "system_prompt": data.system_prompt,
                "max_length": data.max_length, "overlong": data.overlong, "bad_rows": data.bad_rows}
    text = json.dumps([CACHE_VERSION, tokenizer_fingerprint(tokenizer), content, settings], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _cache_load(key: str) -> tuple[list[Example], dict] | None:
    path = cache_dir() / f"{key}.npz"
    try:
        with np.load(path) as stored:
            ids, trained, bounds = stored["ids"], stored["trained"], stored["bounds"]
            counts = json.loads(bytes(stored["counts"]).decode())
    except (OSError, KeyError, ValueError):
        return None  # absent or damaged: tokenize again
    labels = np.where(trained, ids, IGNORE_INDEX)
    examples = [Example(ids[a:b].tolist(), labels[a:b].tolist()) for a, b in itertools.pairwise(bounds)]
    return examples, counts


def _cache_save(key: str, examples: list[Example], counts: dict) -> None:
    """Write atomically (temporary file + rename): ranks building the same data at once never see half a file."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.fromiter((t for e in examples for t in e.input_ids), dtype=np.int64)
    trained = np.fromiter((label != IGNORE_INDEX for e in examples for label in e.labels), dtype=bool, count=len(ids))
    bounds = np.cumsum([0] + [len(e.input_ids) for e in examples], dtype=np.int64)
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            np.savez(out, ids=ids, trained=trained, bounds=bounds, counts=np.frombuffer(json.dumps(counts).encode(), np.uint8))
        os.replace(temporary, folder / f"{key}.npz")
    except OSError:
        Path(temporary).unlink(missing_ok=True)  # a read-only or full cache disk must not stop a run


def dataset_examples(spec: DatasetSpec, recipe: Recipe, tokenizer) -> tuple[list[Example], dict]:
    """One dataset's examples and counts, from the cache when the tokenizer, data and settings are unchanged."""
    key = _cache_key(spec, recipe, tokenizer)
    cached = _cache_load(key) if key else None
    if cached is not None:
        examples, counts = cached
        if counts["skipped"] and recipe.data.bad_rows == "error":  # cannot happen (bad_rows is in the key); be safe
            raise DataError(counts["skipped_reasons"][0])
        return examples, dict(counts, cached=True)
    examples, counts = _tokenize_dataset(spec, recipe, tokenizer)
    if key:
        _cache_save(key, examples, counts)
    return examples, dict(counts, cached=False)


# ------------------------------------------------------------------------------------------------ the datasets
def prepare(recipe: Recipe, tokenizer) -> PreparedData:
    """Every dataset tokenized (or from the cache), the eval set split off, weights applied, train rows packed."""
    stats, examples, origin = DataStats(), [], []
    for index, spec in enumerate(recipe.data.datasets):
        dataset, counts = dataset_examples(spec, recipe, tokenizer)
        for name in ("rows", "skipped", "truncated", "dropped"):
            setattr(stats, name, getattr(stats, name) + counts[name])
        stats.skipped_reasons += counts["skipped_reasons"]
        stats.cached_datasets += int(counts["cached"])
        if not dataset:
            first = f" First problem: {counts['skipped_reasons'][0]}" if counts["skipped_reasons"] else ""
            raise DataError(f"data.datasets[{index}] ({spec.path}): no usable rows ({counts['rows']} read, "
                            f"{counts['skipped']} skipped, {counts['dropped']} dropped as too long).{first}")
        stats.per_dataset.append({"path": spec.path, "format": spec.format, "rows": counts["rows"],
                                  "examples": len(dataset), "weight": spec.weight, "cached": counts["cached"]})
        examples += dataset
        origin += [index] * len(dataset)
    eval_files = eval_file_examples(recipe, tokenizer, stats)
    train_ids, eval_ids = split_eval_indices(len(examples), recipe)
    train = _mix([examples[i] for i in train_ids], [origin[i] for i in train_ids], recipe)
    evaluation = eval_files + [examples[i] for i in eval_ids]  # files first: the generation eval takes the first rows
    sequences = train
    if recipe.data.packing:
        problem = packing_problem(recipe.model.attn_implementation)
        if problem:
            raise DataError(problem)
        sequences = pack_examples(train, recipe.data.max_length)
    _fill_stats(stats, examples, train, evaluation, sequences, recipe)
    return PreparedData(examples, sequences, evaluation, stats, eval_files)


def eval_file_examples(recipe: Recipe, tokenizer, stats: DataStats) -> list[Example]:
    """The examples of data.eval_datasets (tokenized like training data, cached, never weighted, packed or capped)."""
    found: list[Example] = []
    for index, spec in enumerate(recipe.data.eval_datasets):
        key = f"data.eval_datasets[{index}]"
        try:
            dataset, counts = dataset_examples(spec, recipe, tokenizer)
        except DataError as exc:  # the loaders name data.datasets; this is an eval file
            raise DataError(str(exc).replace("data.datasets path", f"{key} path", 1)) from None
        for name in ("rows", "skipped", "truncated", "dropped"):
            setattr(stats, name, getattr(stats, name) + counts[name])
        stats.skipped_reasons += counts["skipped_reasons"]
        stats.cached_datasets += int(counts["cached"])
        if not dataset:
            first = f" First problem: {counts['skipped_reasons'][0]}" if counts["skipped_reasons"] else ""
            raise DataError(f"{key} ({spec.path}): no usable rows ({counts['rows']} read, {counts['skipped']} skipped, "
                            f"{counts['dropped']} dropped as too long).{first}")
        stats.per_dataset.append({"path": spec.path, "format": spec.format, "rows": counts["rows"], "role": "eval",
                                  "examples": len(dataset), "weight": spec.weight, "cached": counts["cached"]})
        found += dataset
    return found


def check_local_files(recipe: Recipe) -> None:
    """Before anything loads: every local data file (train and eval) exists, has a supported type, and its first rows
    have the fields its format needs. Hub names are checked when they load."""
    for key, specs in (("data.datasets", recipe.data.datasets), ("data.eval_datasets", recipe.data.eval_datasets)):
        for index, spec in enumerate(specs):
            path = Path(spec.path).expanduser()
            where = f"{key}[{index}] path `{spec.path}`"
            looks_local = spec.path.startswith((".", "/", "~")) or path.suffix in (".jsonl", ".json", ".csv", ".parquet")
            if not path.exists():
                if looks_local:
                    raise DataError(f"{where}: file not found (relative paths are read from {Path.cwd()}).")
                continue
            if path.is_file() and path.suffix not in (".jsonl", ".json", ".csv", ".parquet"):
                raise DataError(f"{where}: unsupported file type `{path.suffix}`; use .jsonl, .json, .csv or .parquet.")
            if path.is_file() and path.suffix == ".jsonl":
                _check_first_lines(path, spec, where, bad_rows=recipe.data.bad_rows)


def _check_first_lines(path: Path, spec: DatasetSpec, where: str, *, bad_rows: str, lines: int = 20) -> None:
    """The first lines of a JSON Lines file parse (unless bad_rows: skip) and, together, have the fields of the
    dataset's format: a file in another format fails here, in seconds, before a tokenizer or a model loads."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(itertools.islice(handle, lines), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if bad_rows == "error":
                    raise DataError(f"{where}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}); a "
                                    "JSON Lines file holds one JSON object per line.") from None
    objects = [row for row in rows if isinstance(row, dict)]
    if rows and not objects:
        raise DataError(f"{where}: the rows are {type(rows[0]).__name__}s, not objects with the fields of format "
                        f"`{spec.format}`.")
    required, _ = FORMAT_FIELDS[spec.format]
    for name in required:
        if objects and all(_column(spec, name, row) not in row for row in objects):
            fields = sorted({key for row in objects for key in row})
            raise DataError(
                f"{where}: no row has the `{_column(spec, name, objects[0])}` field that format `{spec.format}` needs "
                f"(fields: {', '.join(fields) or 'none'}). Set the dataset's format (alpaca | chat | completion | "
                "text) or map the columns with `columns:`."
            )


def build_examples(recipe: Recipe, tokenizer) -> tuple[list[Example], list[Example], DataStats]:
    """Train rows (packed when data.packing) and eval examples; every rank builds the same lists, BatchStream splits."""
    prepared = prepare(recipe, tokenizer)
    return prepared.train, prepared.eval, prepared.stats


def _mix(train: list[Example], origin: list[int], recipe: Recipe) -> list[Example]:
    """Apply each dataset's weight to its train examples: repeat (weight > 1) or subsample (weight < 1)."""
    weights = [spec.weight for spec in recipe.data.datasets]
    if all(weight == 1.0 for weight in weights):
        return train
    mixed = []
    for index, weight in enumerate(weights):
        mixed += _weighted([e for e, o in zip(train, origin) if o == index], weight, recipe.train.seed + index)
    return mixed


def _weighted(examples: list[Example], weight: float, seed: int) -> list[Example]:
    """Repeat (weight > 1) or subsample (weight < 1) a dataset's examples for mixing."""
    if weight == 1.0:
        return examples
    whole, fraction = int(weight), weight - int(weight)
    rng = random.Random(seed)
    extra = rng.sample(examples, k=round(fraction * len(examples)))
    return examples * whole + extra


def split_eval_indices(count: int, recipe: Recipe) -> tuple[list[int], list[int]]:
    """Indices of train and eval examples: a seeded choice of eval_fraction (at most eval_max_rows), order kept."""
    order = list(range(count))
    random.Random(recipe.train.seed).shuffle(order)
    n_eval = min(recipe.data.eval_max_rows, round(recipe.data.eval_fraction * count))
    if count - n_eval < 1:
        n_eval = 0
    eval_ids = set(order[:n_eval])
    return [i for i in range(count) if i not in eval_ids], sorted(eval_ids)


def split_eval(examples: list[Example], recipe: Recipe) -> tuple[list[Example], list[Example]]:
    train_ids, eval_ids = split_eval_indices(len(examples), recipe)
    return [examples[i] for i in train_ids], [examples[i] for i in eval_ids]


def _fill_stats(stats: DataStats, examples: list[Example], train: list[Example], evaluation: list[Example],
                sequences: list[Example], recipe: Recipe) -> None:
    lengths = [len(e.input_ids) for e in examples]
    stats.tokens_min, stats.tokens_max = min(lengths), max(lengths)
    stats.tokens_median = float(statistics.median(lengths))
    stats.total_tokens, stats.trained_tokens = sum(lengths), sum(e.num_trained for e in examples)
    stats.train_examples, stats.eval_examples, stats.train_sequences = len(train), len(evaluation), len(sequences)
    batch, seed = recipe.train.micro_batch_size, recipe.train.seed
    stats.batch_efficiency = batch_efficiency(sequences, micro_batch_size=batch, seed=seed)
    stats.unpacked_efficiency = batch_efficiency(train, micro_batch_size=batch, seed=seed)


# ---------------------------------------------------------------------------------------------------- packing
def packing_problem(attn_implementation: str) -> str | None:
    """Why packed rows would let examples attend to each other with this setup, or None when packing is exact."""
    from importlib.metadata import version

    # Checked by version, not by importing masking_utils: that import pulls in torch._dynamo (seconds).
    if int(version("transformers").split(".")[0]) < 5:
        return ("data.packing needs transformers 5 (masking_utils.find_packed_sequence_indices builds the per-example "
                "mask from restarting position_ids); this transformers cannot keep packed examples apart. Upgrade "
                "transformers or set data.packing: false.")
    if attn_implementation not in PACKING_ATTENTION:
        return (f"data.packing: model.attn_implementation `{attn_implementation}` is not known to keep packed examples "
                f"apart (ones that do: {', '.join(PACKING_ATTENTION)}). Set model.attn_implementation: sdpa or "
                "data.packing: false.")
    return None


def pack_examples(examples: list[Example], max_length: int) -> list[Example]:
    """Pack whole examples into as few rows of at most max_length tokens as best-fit-decreasing needs, balanced.

    Best fit decreasing (each example, longest first, into the fullest row it still fits in) finds how many rows
    are needed. The examples are then dealt again, longest first, to the least loaded of that many rows, so the
    rows come out nearly equally long and a micro-batch pads almost nothing (if balancing needs more rows than
    best fit, best fit is kept). Examples are never split, so none loses its beginning; position ids restart at
    0 per example so the attention mask built from them keeps examples apart.
    """
    sizes = [len(e.input_ids) for e in examples]
    if any(size > max_length for size in sizes):
        raise ValueError(f"an example of {max(sizes)} tokens exceeds max_length {max_length}; apply the length policy first")
    order = sorted(range(len(examples)), key=lambda i: (-sizes[i], i))
    rows = _best_fit_rows(order, sizes, max_length)
    balanced = _balanced_rows(order, sizes, max_length, len(rows))
    if len(balanced) == len(rows):
        rows = balanced
    return [concat_examples([examples[i] for i in members]) for members in rows]


def _best_fit_rows(order: list[int], sizes: list[int], max_length: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row index), sorted: best fit is a binary search
    for i in order:
        at = bisect_left(free, (sizes[i], -1))
        if at == len(free):
            rows.append([i])
            left, row = max_length - sizes[i], len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= sizes[i]
        if left > 0:
            insort(free, (left, row))
    return rows


def _balanced_rows(order: list[int], sizes: list[int], max_length: int, count: int) -> list[list[int]]:
    """Longest first to the least loaded row (a new row when even that one is too full)."""
    rows: list[list[int]] = [[] for _ in range(count)]
    loads = [(0, row) for row in range(count)]  # a heap of (tokens, row)
    for i in order:
        load, row = heapq.heappop(loads)
        if load + sizes[i] > max_length:
            heapq.heappush(loads, (load, row))
            load, row = 0, len(rows)
            rows.append([])
        rows[row].append(i)
        heapq.heappush(loads, (load + sizes[i], row))
    return rows


def concat_examples(examples: list[Example]) -> Example:
    """One packed row: ids and labels joined, positions restarting per example.

    The first token of each example is never a target (in an unpacked batch nothing predicts it), so its label
    is ignored here too: otherwise the last token of one example would be trained to predict the next example.
    """
    ids, labels, positions = [], [], []
    for example in examples:
        ids += example.input_ids
        labels += [IGNORE_INDEX] + example.labels[1:]
        positions += range(len(example.input_ids))
    return Example(ids, labels, positions)


def batch_efficiency(sequences: list[Example], *, micro_batch_size: int, seed: int) -> float:
    """Non-pad tokens / all tokens over the micro-batches of epoch 0, in the order BatchStream takes them."""
    if not sequences:
        return 0.0
    order = epoch_permutation(len(sequences), seed, 0)
    real = padded = 0
    for start in range(0, len(order), micro_batch_size):
        lengths = [len(sequences[i].input_ids) for i in order[start : start + micro_batch_size]]
        real, padded = real + sum(lengths), padded + max(lengths) * len(lengths)
    return real / padded


def verify_packing(model, *, device: torch.device | str = "cpu") -> float:
    """Run two short examples packed and apart through `model`; raise DataError if the logits differ.

    The check that the model's attention really honours restarting position ids (a model with its own mask code,
    or remote code, may not). Every rank must call it (it runs a forward). Returns the largest logit difference.
    """
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab, (n,), generator=generator) for n in (5, 7))
    packed = {"input_ids": torch.cat([first, second])[None].to(device),
              "position_ids": torch.tensor(list(range(5)) + list(range(7)))[None].to(device)}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        together = model(**packed, use_cache=False).logits[0].float()
        apart = torch.cat([model(input_ids=x[None].to(device), use_cache=False).logits[0].float() for x in (first, second)])
    model.train(was_training)
    difference = float((together - apart).abs().max())
    if difference > 1e-2 * max(1.0, float(apart.abs().max())):
        raise DataError(f"data.packing: this model's attention ({getattr(model.config, '_attn_implementation', '?')}) "
                        f"lets packed examples see each other (logits differ by {difference:.3g}). Set "
                        "model.attn_implementation: sdpa or data.packing: false.")
    return difference


# ------------------------------------------------------------------------------------------------- batching
def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; padding is never trained.

    Unpacked rows carry an attention_mask. Packed rows carry position_ids instead (no attention_mask: transformers
    derives the per-example block mask from restarting positions only when the mask is absent); the padding tail
    gets its own restarting positions, so it is a separate pseudo-example that no real token attends to.
    """
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    packed = any(e.position_ids is not None for e in examples)
    extra = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        if packed:
            positions = example.position_ids if example.position_ids is not None else range(n)
            extra[row, :n] = torch.tensor(list(positions))
            extra[row, n:] = torch.arange(width - n)
        else:
            extra[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, ("position_ids" if packed else "attention_mask"): extra}


def real_token_count(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    """Non-pad tokens of a batch (for tokens/s): the attention mask's sum, or for packed rows everything before
    each row's padding tail (trailing pad ids with ignored labels)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    filler = (batch["input_ids"] == pad_id) & (batch["labels"] == IGNORE_INDEX)
    positions = torch.arange(1, filler.size(1) + 1) * (~filler).long()
    return int(positions.max(dim=1).values.sum())


def epoch_permutation(count: int, seed: int, epoch: int) -> list[int]:
    """The global order of one epoch: the same on every rank and for every world size."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(count, generator=generator).tolist()


class BatchStream:
    """Endless micro-batches for one rank: a seeded shuffle per epoch, each rank a disjoint, strided share.

    The global order is the same for every world size: global micro-batch g of size B*W holds rows
    perm[g*B*W : (g+1)*B*W], and rank r takes every W-th of them. So 1 process with batch 4 and 2 processes
    with batch 2 see the same rows per optimizer step. Position (epoch, cursor) is resumable state. The rows
    past the last whole global batch of an epoch are left out of that epoch (a different set each epoch).
    """

    def __init__(self, examples: list[Example], *, micro_batch_size: int, rank: int, world_size: int, seed: int, pad_id: int):
        global_batch = micro_batch_size * world_size
        if len(examples) < global_batch:
            raise DataError(
                f"only {len(examples)} training rows for a global micro-batch of {global_batch} "
                f"(train.micro_batch_size={micro_batch_size} x {world_size} processes; with data.packing a row holds "
                "several examples). Add data or lower the batch size."
            )
        self.examples, self.batch, self.rank, self.world = examples, micro_batch_size, rank, world_size
        self.seed, self.pad_id = seed, pad_id
        self.epoch, self.cursor = 0, 0  # cursor counts global micro-batches taken in this epoch
        self.batches_per_epoch = len(examples) // global_batch

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (its shuffle is seed + epoch)."""
        self.epoch, self.cursor = epoch, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            perm = epoch_permutation(len(self.examples), self.seed, self.epoch)
            while self.cursor < self.batches_per_epoch:
                start = self.cursor * self.batch * self.world
                rows = perm[start : start + self.batch * self.world][self.rank :: self.world]
                self.cursor += 1
                yield collate([self.examples[i] for i in rows], self.pad_id)
            self.epoch, self.cursor = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "world_size": self.world, "micro_batch_size": self.batch,
                "rows": len(self.examples), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saving run stopped, even if it had another world size or micro-batch size."""
        for key, mine in (("rows", len(self.examples)), ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise DataError(f"resume: the checkpoint's data stream had {key}={state[key]}, this run has {mine}: the "
                                "data, data settings or seed changed since the checkpoint, so the position in the data "
                                "cannot be restored. Resume with the same data and recipe, or start a new run.")
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
