"""One dataset read, rendered, tokenized and length-limited, kept in the tokenization cache."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from finetune.data.examples import IGNORE_INDEX, Example
from finetune.data.pairs import pair_examples, prompt_limit
from finetune.data.sources import _read_rows
from finetune.data.templates import FORMAT_FIELDS, _column, _render_rows, tokenize_many
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

CACHE_VERSION = 2  # 2: a reason for every skipped row. Bump when rendering or labelling changes: old cache entries are then never read


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
    counts = {"rows": len(rows) + len(broken), "skipped": len(reasons), "truncated": 0, "dropped": 0}
    kept = [(item, place) for item, place in zip(rendered, places) if not isinstance(item, str)]
    if spec.format == "preference":
        return _pairs(kept, spec, recipe, tokenizer, counts, reasons)
    examples = []
    for example, place in zip(tokenize_many([item for item, _ in kept], tokenizer), (place for _, place in kept)):
        full = example
        if len(example.input_ids) > data.max_length:
            if data.overlong == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            example = Example(example.input_ids[: data.max_length], example.labels[: data.max_length])
        if any(label != IGNORE_INDEX for label in example.labels):
            examples.append(example)
            continue
        # Nothing to learn from the row: its answer lies past max_length (or it has no trained token at all).
        reason = _untrained_reason(full, f"{spec.path} {place}", data.max_length)
        if data.bad_rows == "error":
            raise DataError(f"{reason} Fix: raise data.max_length, set data.overlong: drop to leave such rows out, or "
                            "data.bad_rows: skip to skip them with a count.")
        counts["skipped"] += 1
        reasons.append(reason)
    counts["skipped_reasons"] = reasons[:20]  # every skip has its reason; the cache stores and returns the same
    return examples, counts


def _pairs(kept: list, spec: DatasetSpec, recipe: Recipe, tokenizer, counts: dict, reasons: list[str]):
    counts.update(prompt_truncated=0, response_truncated=0, pairs=True)
    before = len(reasons)
    examples = pair_examples([item for item, _ in kept], [f"{spec.path} {place}" for _, place in kept], tokenizer,
                             recipe, counts, reasons)
    if len(reasons) > before and recipe.data.bad_rows == "error":
        raise DataError(f"{reasons[before]} Fix the row or set data.bad_rows: skip to skip such pairs with a count.")
    counts["skipped"] += len(reasons) - before
    counts["skipped_reasons"] = reasons[:20]
    return examples, counts


def _untrained_reason(example: Example, where: str, max_length: int) -> str:
    trained = next((i for i, label in enumerate(example.labels) if label != IGNORE_INDEX), None)
    if trained is None:
        return f"{where}: no trained token (the answer is empty after rendering)."
    return (f"{where}: the answer starts at token {trained} of max_length {max_length}, so truncation leaves nothing "
            "to learn from this row.")


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
    if spec.format == "preference":
        settings["max_prompt_length"] = prompt_limit(recipe)
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
    if counts.get("pairs"):  # stored chosen, rejected, chosen, rejected, ...
        for chosen, rejected in zip(examples[::2], examples[1::2]):
            chosen.rejected = rejected
        examples = examples[::2]
    return examples, counts


def _cache_save(key: str, examples: list[Example], counts: dict) -> None:
    """Write atomically (temporary file + rename): ranks building the same data at once never see half a file."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if counts.get("pairs"):
        examples = [sequence for pair in examples for sequence in (pair, pair.rejected)]
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
