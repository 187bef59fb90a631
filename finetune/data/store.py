"""Tokenized examples on disk, memory-mapped: one flat token array, a trained mask and offsets; rows built on access.

A dataset's tokens live in one folder (the tokenization cache's entry, or a private temporary one): `ids.bin` (int32
token ids, every example back to back), `trained.bin` (one byte per token: is it a target), `bounds.npy` (where each
example starts), `trained_counts.npy` (targets per example), `rows.npy` (each example's row: the examples of one
row, a conversation's turns or a KTO pair's two rows, share a number, rows numbered from 0 in order), `meta.json` (the counts, the format version, the
other files' sampled checksums, compared at every mapping: DamagedEntry); unpaired preference rows
(KTO) add `desirable.npy` (each row's label) and `tail_ids.npy`, `tail_trained.npy`, `tail_bounds.npy` (each row's
Example.completion_tail, empty for a row that was not cut: what its KL partner's row takes). Every
rank maps the same files, so the pages are shared through the page cache: a rank's own memory holds only per-example
arrays (offsets, lengths), never Python lists of every token. An `Example` (lists of ints) is built only for the rows
of the micro-batch being collated.

Views select and combine examples without copying them: `ExampleView` (a list of examples by index, over the datasets
of a run, with the reference log-probs of preference pairs when they are precomputed) and `PackedView` (several
examples per row, as `packing.pack_lengths` grouped them).
"""

from __future__ import annotations

import itertools
import json
import re
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from finetune.data.examples import IGNORE_INDEX, Example
from finetune.data.packing import concat_examples

STORE_FORMAT = 6  # the on-disk layout above; a folder that says another version is never read (it is rebuilt)


# ------------------------------------------------------------------------------------------------ writing
class StoreWriter:
    """Append tokenized examples chunk by chunk (the builder never holds a whole dataset), then `finish`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._ids = open(self.folder / "ids.bin", "wb")  # noqa: SIM115  closed in finish()
        self._trained = open(self.folder / "trained.bin", "wb")  # noqa: SIM115
        self._lengths: list[np.ndarray] = []
        self._trained_counts: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []
        self._row_count = 0  # rows numbered so far: a chunk's row numbers start after them
        self._desirable: list[np.ndarray] = []
        self._tails: list[dict[str, np.ndarray]] = []  # KTO rows' completion tails (small: a cut row's few tokens)

    def add(self, arrays: dict[str, np.ndarray]) -> None:
        """Write one chunk's `chunk_arrays`."""
        self._ids.write(arrays["ids"].tobytes())
        self._trained.write(arrays["trained"].tobytes())
        self._lengths.append(arrays["lengths"])
        self._trained_counts.append(arrays["trained_counts"])
        self._rows.append(arrays["rows"] + self._row_count)
        self._row_count += int(arrays["rows"].max()) + 1 if len(arrays["rows"]) else 0
        if "desirable" in arrays:
            self._desirable.append(arrays["desirable"])
            self._tails.append({key: arrays[key] for key in ("tail_ids", "tail_trained", "tail_lengths")})

    def close(self) -> None:
        """Close the token files (finish does; a build that failed part-way calls it itself)."""
        self._ids.close()
        self._trained.close()

    def finish(self, counts: dict, *, pairs: bool) -> None:
        self.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        np.save(self.folder / "bounds.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        counts_per_sequence = np.concatenate(self._trained_counts) if self._trained_counts else np.zeros(0, np.int64)
        np.save(self.folder / "trained_counts.npy", counts_per_sequence)
        np.save(self.folder / "rows.npy", np.concatenate(self._rows or [np.zeros(0, np.int64)]).astype(np.int64))
        if counts.get("unpaired"):  # unpaired preference rows (KTO): each one's label
            desirable = np.concatenate(self._desirable) if self._desirable else np.zeros(0, dtype=np.bool_)
            np.save(self.folder / "desirable.npy", desirable.astype(np.bool_))
            self._finish_tails()
        from finetune.model.file_sums import folder_sums

        written = sorted(path.name for path in self.folder.iterdir() if path.is_file())
        meta = {"format": STORE_FORMAT, "pairs": pairs, "sequences": len(lengths), "counts": counts,
                "sums": folder_sums(self.folder, written)}  # checked at every mapping (TokenStore)
        (self.folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")

    def _finish_tails(self) -> None:
        """The KTO rows' completion tails, one after another, and where each starts (an empty one: a row not cut)."""
        joined = {key: np.concatenate([tails[key] for tails in self._tails] or [np.zeros(0, dtype)]).astype(dtype)
                  for key, dtype in (("tail_ids", np.int32), ("tail_trained", np.bool_), ("tail_lengths", np.int64))}
        np.save(self.folder / "tail_ids.npy", joined["tail_ids"])
        np.save(self.folder / "tail_trained.npy", joined["tail_trained"])
        np.save(self.folder / "tail_bounds.npy", np.concatenate([[0], np.cumsum(joined["tail_lengths"])]).astype(np.int64))


def chunk_arrays(examples: list[Example], origins: list[str] | None = None) -> dict[str, np.ndarray]:
    """A chunk's examples as the store's arrays (a preference pair as its chosen then its rejected sequence). Made by
    the process that tokenized them: arrays cross the process boundary far cheaper than lists of ints. `origins`:
    each example's row by its place (tokenize.ChunkResult.origins), for the row numbers (`row_numbers`)."""
    sequences = [s for e in examples for s in ((e, e.rejected) if e.rejected is not None else (e,))]
    ids = np.fromiter(itertools.chain.from_iterable(s.input_ids for s in sequences), dtype=np.int32)
    labels = np.fromiter(itertools.chain.from_iterable(s.labels for s in sequences), dtype=np.int64, count=len(ids))
    trained = labels != IGNORE_INDEX
    lengths = np.fromiter((len(s.input_ids) for s in sequences), dtype=np.int64, count=len(sequences))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    targets = trained.astype(np.int64)
    targets[bounds[:-1][lengths > 0]] = 0  # an example's first token is never a target (nothing predicts it)
    trained_counts = np.add.reduceat(targets, bounds[:-1]) if len(ids) else np.zeros(len(lengths), np.int64)
    arrays = {"ids": ids, "trained": trained, "lengths": lengths,
              "trained_counts": np.where(lengths > 0, trained_counts, 0).astype(np.int64),
              "rows": row_numbers(origins or [], len(examples))}
    if examples and examples[0].desirable is not None:
        arrays["desirable"] = np.fromiter((bool(e.desirable) for e in examples), dtype=np.bool_, count=len(examples))
        tails = [e.completion_tail or Example([], []) for e in examples]
        arrays["tail_ids"] = np.fromiter(itertools.chain.from_iterable(t.input_ids for t in tails), dtype=np.int32)
        arrays["tail_trained"] = np.fromiter((label != IGNORE_INDEX for t in tails for label in t.labels), dtype=np.bool_,
                                             count=len(arrays["tail_ids"]))
        arrays["tail_lengths"] = np.fromiter((len(t.input_ids) for t in tails), dtype=np.int64, count=len(tails))
    return arrays


def row_numbers(origins: list[str], count: int) -> np.ndarray:
    """Each of a chunk's `count` examples' row, numbered from 0 in the order the rows first give an example: the
    examples of one row (a conversation gives one per assistant turn: data/chat.py; a text row split into pieces)
    share a number, so the eval hold-out (build.split_eval_indices) keeps a row whole on one side. A KTO pair unpaired
    into two rows (ported_rows.unpaired: places `line 3 (chosen)` and `line 3 (rejected)`) is one row. Without a
    place per example (preference pairs: one example per row) each example is its own row."""
    if len(origins) != count:
        return np.arange(count, dtype=np.int64)
    first: dict[str, int] = {}
    return np.fromiter((first.setdefault(_UNPAIRED.sub("", place), len(first)) for place in origins), dtype=np.int64,
                       count=count)


_UNPAIRED = re.compile(r" \((chosen|rejected)\)$")


# ------------------------------------------------------------------------------------------------ reading
class DamagedEntry(ValueError):
    """A store folder whose files are not the bytes its build wrote (their sampled checksums in meta.json differ)."""


def _changed_files(folder: Path, sums) -> list[str]:
    """The token files whose sampled checksums (model/file_sums.py) differ from meta.json's; none for a folder written
    before they were recorded. A cheap read (a few MB of a GB-sized entry), not a hash of every byte."""
    if sums is None:
        return []
    if not isinstance(sums, dict):
        return ["meta.json"]
    from finetune.model.file_sums import changed_files

    return changed_files(folder, sums)


class TokenStore:
    """One dataset's tokenized examples, mapped from its folder (read-only; pages shared by every process)."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        if self.meta.get("format") != STORE_FORMAT:
            raise ValueError(f"{folder}: store format {self.meta.get('format')}, expected {STORE_FORMAT}")
        self.bounds = np.load(folder / "bounds.npy")
        self._trained_counts = np.load(folder / "trained_counts.npy")
        self.rows = np.load(folder / "rows.npy")  # each example's row (row_numbers), numbered within this dataset
        total = int(self.bounds[-1])
        if (folder / "ids.bin").stat().st_size != 4 * total or (folder / "trained.bin").stat().st_size != total:
            raise ValueError(f"{folder}: token files do not match their offsets (a damaged entry)")
        if changed := _changed_files(folder, self.meta.get("sums")):
            raise DamagedEntry(f"{', '.join(changed)} {'differs' if len(changed) == 1 else 'differ'} from what was "
                               "written (zeroed or changed since: a power cut after the build, a partial copy)")
        self.ids = _mapped(folder / "ids.bin", np.int32, total)
        self.trained = _mapped(folder / "trained.bin", np.bool_, total)
        self.pairs = bool(self.meta["pairs"])
        self.counts = self.meta["counts"]
        if len(self.rows) != len(self):
            raise ValueError(f"{folder}: {len(self.rows)} row numbers for {len(self)} examples (a damaged entry)")
        labels = folder / "desirable.npy"
        self.desirable = np.load(labels) if self.counts.get("unpaired") else None
        if self.desirable is not None and len(self.desirable) != len(self.bounds) - 1:
            raise ValueError(f"{labels}: {len(self.desirable)} labels for {len(self.bounds) - 1} rows (a damaged entry)")
        self.tails = None
        if self.desirable is not None:  # (ids, trained, bounds) of the KTO rows' completion tails
            self.tails = tuple(np.load(folder / f"tail_{name}.npy") for name in ("ids", "trained", "bounds"))
            if len(self.tails[2]) != len(self.desirable) + 1 or len(self.tails[0]) != self.tails[2][-1]:
                raise ValueError(f"{folder}: completion tails do not match the rows (a damaged entry)")

    def __len__(self) -> int:
        return (len(self.bounds) - 1) // (2 if self.pairs else 1)

    def sequence(self, index: int) -> Example:
        start, end = int(self.bounds[index]), int(self.bounds[index + 1])
        ids = np.asarray(self.ids[start:end], dtype=np.int64)
        return Example(ids.tolist(), np.where(self.trained[start:end], ids, IGNORE_INDEX).tolist())

    def example(self, index: int) -> Example:
        if self.desirable is not None:
            example = self.sequence(index)
            example.desirable = bool(self.desirable[index])
            ids, trained, bounds = self.tails
            start, end = int(bounds[index]), int(bounds[index + 1])
            if end > start:
                tail = np.asarray(ids[start:end], dtype=np.int64)
                example.completion_tail = Example(tail.tolist(), np.where(trained[start:end], tail, IGNORE_INDEX).tolist())
            return example
        if not self.pairs:
            return self.sequence(index)
        chosen = self.sequence(2 * index)
        chosen.rejected = self.sequence(2 * index + 1)
        return chosen

    def lengths(self) -> np.ndarray:
        """Tokens per example (a pair: its chosen sequence, the row a batch is sized by, as before)."""
        return np.diff(self.bounds)[:: 2 if self.pairs else 1]

    def rejected_lengths(self) -> np.ndarray | None:
        """Tokens of each pair's rejected sequence (None when the store holds no pairs)."""
        return np.diff(self.bounds)[1::2] if self.pairs else None

    def trained_counts(self) -> np.ndarray:
        """Trained tokens per example (a pair: of its chosen sequence), stored at build: the statistics of a warm
        start never read the token files."""
        return self._trained_counts[:: 2 if self.pairs else 1]

    def rejected_trained_counts(self) -> np.ndarray | None:
        """Trained tokens of each pair's rejected sequence (None when the store holds no pairs)."""
        return self._trained_counts[1::2] if self.pairs else None


def _mapped(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:  # a zero-length file cannot be mapped
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# -------------------------------------------------------------------------------------------------- views
class ExampleView(Sequence):
    """Examples picked by index from the run's datasets (their stores, numbered one after another), built on access.

    `reference_logps` (one (chosen, rejected) pair per example) is set when dpo.reference is precomputed; the
    examples built then carry it, as list examples carry theirs.
    """

    def __init__(self, stores: list[TokenStore], picks: np.ndarray | Sequence[int]):
        self.stores = stores
        self.starts = np.cumsum([0] + [len(s) for s in stores]).tolist()
        self.picks = np.asarray(picks, dtype=np.int64)
        self.reference_logps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        store, local = self.locate(index)
        example = store.example(local)
        if self.reference_logps is not None:
            example.reference_logps = (float(self.reference_logps[index, 0]), float(self.reference_logps[index, 1]))
        return example

    def locate(self, index: int) -> tuple[TokenStore, int]:
        """(the store, the example's number in it) of example `index`."""
        glob = int(self.picks[index])
        number = bisect_right(self.starts, glob) - 1
        return self.stores[number], glob - self.starts[number]

    def lengths(self) -> np.ndarray:
        return np.concatenate([s.lengths() for s in self.stores] or [np.zeros(0, np.int64)])[self.picks]

    def rejected_lengths(self) -> np.ndarray | None:
        """Tokens of each picked pair's rejected sequence; None unless every store holds pairs."""
        parts = [s.rejected_lengths() for s in self.stores]
        return np.concatenate(parts)[self.picks] if parts and all(p is not None for p in parts) else None

    def trained_counts(self) -> np.ndarray:
        return np.concatenate([s.trained_counts() for s in self.stores] or [np.zeros(0, np.int64)])[self.picks]


class PackedView(Sequence):
    """Packed rows: row r joins the examples `members[r]` of `base` (positions restarting per example)."""

    def __init__(self, base: ExampleView, rows: list[list[int]]):
        self.base = base
        self.members = np.fromiter((m for row in rows for m in row), dtype=np.int64)
        self.row_bounds = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.row_bounds) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        start, end = self.row_bounds[index], self.row_bounds[index + 1]
        return concat_examples([self.base[int(m)] for m in self.members[start:end]])

    def lengths(self) -> np.ndarray:
        return np.add.reduceat(self.base.lengths()[self.members], self.row_bounds[:-1]) if len(self) else np.zeros(0)


def sequence_lengths(examples: Sequence[Example]) -> np.ndarray:
    """Tokens per row of any sequence of examples: a view's from its offsets, a list's by counting."""
    if hasattr(examples, "lengths"):
        return np.asarray(examples.lengths(), dtype=np.int64)
    return np.fromiter((len(e.input_ids) for e in examples), dtype=np.int64, count=len(examples))


def set_reference_logps(examples: Sequence[Example], values: Sequence[tuple[float, float]]) -> None:
    """Attach each pair's reference (chosen, rejected) log-probs: to a view as one array, to list examples one by one."""
    if isinstance(examples, ExampleView):
        examples.reference_logps = np.asarray(values, dtype=np.float64).reshape(len(examples), 2)
        return
    for example, (chosen, rejected) in zip(examples, values):
        example.reference_logps = (float(chosen), float(rejected))
