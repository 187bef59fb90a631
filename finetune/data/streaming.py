"""Streaming (data.streaming): rows read lazily, tokenized and packed on the fly, each rank's share, exact resume.

For datasets larger than memory or disk: nothing is read whole and nothing is cached. Local files and folders of data
files are read as the cached path reads them (sources.local_rows: JSON Lines line by line, CSV and Parquet an Arrow
batch at a time); save_to_disk folders and hub names are `datasets` IterableDatasets (`load_dataset(..., streaming=True)`).
Rows go through `tokenize_chunk` a small chunk at a time, so tokens and labels are those of the cached path. With
data.packing, examples are packed greedily as they come: an open row takes the next example if it fits in
data.max_length, else the row is emitted and a new one opened. The datasets are read one after another in their own
order (no shuffle, as TRL's streaming without a shuffle buffer); at the end a new pass (epoch) starts from the top.

Sharding: every rank reads and tokenizes the whole stream and keeps its share. Global micro-batch g is the next
micro_batch_size x world_size sequences of the one stream and rank r takes every world_size-th of them, BatchStream's
rule: 1 process x batch 4 and 2 processes x batch 2 see the same rows per optimizer step, and the packing never
depends on the world size. The cost is that each rank reads and tokenizes all rows (world_size times the tokenizing
work of reading only a share, which would need per-rank packing and so a world-size-dependent order); tokenizing a
row is a small fraction of its forward and backward, and every rank builds only its own share into tensors.

Position: (epoch, dataset, row, part), the first row not yet consumed into a yielded sequence, and how many of its
examples were (a conversation whose chat template rewrites history gives several: data/chat.py). After a whole global
micro-batch every rank holds the same position, and greedy packing keeps no state across an emitted row, so a resume
skips that many rows without tokenizing them and continues at exactly the next example, with any world size or
micro-batch size.

Counts: what tokenize_chunk counts of the rows (read, skipped, truncated and the tokens cut, dropped, split, blank) is
summed per pass, as the rows are read, and said when a pass ends and at the run's last step (build.row_counts, the
cached path's data line). A checkpoint keeps the pass's counts with the row they reach (rows are read a chunk ahead of
the position), and a resume counts only the rows past that one, so the counts of a resumed pass are those of an
uninterrupted one.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.data.build import count_notes, cut_warning, eval_file_examples, row_counts
from finetune.data.examples import DataStats, Example, PreparedData
from finetune.data.folders import saved_folder
from finetune.data.loader import BatchStream, collate
from finetune.data.packing import concat_examples, packing_problem
from finetune.data.readers import looks_local
from finetune.data.sources import hub_name_note, hub_reason, local_files, local_rows, not_found, split_problem
from finetune.data.tokenize import ChunkResult, check_dataset, merge_counts, parse_lines, tokenize_chunk
from finetune.distributed import print0
from finetune.errors import DataError, FinetuneError
from finetune.files import same_place
from finetune.recipe import DatasetSpec, Recipe

STREAM_CHUNK_ROWS = 64  # rows tokenized together: the Rust tokenizer's batch, and all a rank reads ahead


@dataclass(frozen=True)
class Position:
    """The first row not yet consumed into a yielded sequence, in pass `epoch` of the stream."""

    epoch: int
    dataset: int
    row: int
    part: int = 0  # examples of `row` already consumed (a conversation can give several)


# --------------------------------------------------------------------------------------------------- rows
def _iterable(spec: DatasetSpec, path: Path):
    """A save_to_disk folder or a hub name as a `datasets` IterableDataset (local files are read by sources.py)."""
    import datasets

    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow: read as it is iterated
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[spec.split]
            return loaded.to_iterable_dataset()
        from finetune.hub import use_cache_only_if_unreachable

        use_cache_only_if_unreachable()
        return datasets.load_dataset(spec.path, spec.subset, split=spec.split, streaming=True)
    except Exception as exc:  # noqa: BLE001  datasets raises many types for names and folders it cannot stream
        note = "" if path.is_dir() else hub_name_note(spec.path)
        raise DataError(f"data.datasets path `{spec.path}`: could not be opened as a stream ({hub_reason(exc)}).{note} "
                        "Streaming reads hub datasets from the hub itself: offline, save it to a local folder or files "
                        "first.") from None


def dataset_rows(spec: DatasetSpec, start: int = 0) -> Iterator[tuple[int, object, str]]:
    """(row, item, place) of one dataset from row `start` on, at most spec.max_rows rows. An item is a JSON Lines
    line (text, parsed when tokenized) or a row dict. Skipped rows are read past, never tokenized. Local files and
    folders of data files are read as the cached path reads them (sources.local_rows: every file of a folder, CSV
    values as written), so a stream and a cached run train on the same rows."""
    path = Path(spec.path).expanduser()
    limit = spec.max_rows
    if limit is not None and start >= limit:
        return
    if not path.exists() and looks_local(spec.path):
        raise DataError(not_found(f"data.datasets path `{spec.path}`", spec.path))
    if problem := split_problem(spec, path):
        raise DataError(f"data.datasets path `{spec.path}`: {problem}")
    if path.is_file() or (path.is_dir() and not saved_folder(path)):
        files, folder = local_files(spec)
        rows = ((start + i, item, place) for i, (item, place, _) in
                enumerate(local_rows(files, folder, start, sample_by=spec.sample_by)))
    else:
        table = _iterable(spec, path)
        rows = ((start + i, item, f"row {start + i + 1}") for i, item in enumerate(table.skip(start)))
    yield from rows if limit is None else itertools.takewhile(lambda entry: entry[0] < limit, rows)


def _tokenized(chunk: list[tuple[int, object, str]], spec: DatasetSpec, recipe: Recipe, tokenizer,
               counts: dict | None = None) -> list[tuple[int, Example]]:
    """(row, example) for a chunk of rows: tokenize_chunk, the cached path's treatment of every row. A row skipped or
    dropped leaves no example, so such a chunk is tokenized again row by row to learn which rows the examples came
    from (the same tokens: tokenize_chunk treats a row alike in any chunk). A fatal problem (data.bad_rows: error) is
    raised here, when the stream reaches the row."""
    rows = [row for row, _, _ in chunk]
    result = _tokenize_items([item for _, item, _ in chunk], [place for _, _, place in chunk], spec, recipe, tokenizer)
    if counts is not None:
        merge_counts(counts, result)
    if len(result.origins) == len(result.examples):  # each example's row is known (SFT and KTO rows)
        row_at = {place: row for row, _, place in chunk}
        return [(row_at[origin], example) for origin, example in zip(result.origins, result.examples)]
    if len(result.examples) == len(chunk):
        return list(zip(rows, result.examples))
    found = []
    for row, item, place in chunk:
        found += [(row, example) for example in _tokenize_items([item], [place], spec, recipe, tokenizer).examples]
    return found


def _tokenize_items(items: list, places: list[str], spec: DatasetSpec, recipe: Recipe, tokenizer) -> ChunkResult:
    broken: list[str] = []
    if items and isinstance(items[0], str):
        items, places, broken = parse_lines(items, places, spec.path, bad_rows=recipe.data.bad_rows)
    result = tokenize_chunk(items, places, broken, spec, recipe, tokenizer)
    if result.fatal is not None:
        raise DataError(result.fatal)
    return result


def _chunks(entries: Iterator, size: int) -> Iterator[list]:
    """Chunks of at most `size` (row, item, place) entries of one kind, JSON Lines text or row dicts: a folder can
    hold both (f1.jsonl and sub/f2.csv), and a chunk is parsed as lines or not as a whole, so a new chunk starts where
    the kind changes (as sources.row_chunks cuts the cached path's). Rows are tokenized alike in any chunk."""
    for _, group in itertools.groupby(entries, key=lambda entry: isinstance(entry[1], str)):
        while chunk := list(itertools.islice(group, size)):
            yield chunk


# ------------------------------------------------------------------------------------------------ the stream
class StreamedRows:
    """The training rows of a streaming run: the datasets read from `start` (past the held-out eval rows) in every
    pass. Nothing is read until a stream iterates; `sequences` is deterministic from any position."""

    def __init__(self, recipe: Recipe, tokenizer, start: tuple[int, int] = (0, 0)):
        self.recipe, self.tokenizer, self.start = recipe, tokenizer, start
        self.specs = recipe.data.datasets
        self.restart_counts(0)

    def restart_counts(self, epoch: int, counts: dict | None = None, read: tuple[int, int] | None = None, *,
                       whole: bool = True) -> None:
        """Count pass `epoch` from `counts` (its rows before `read`, (dataset, row): counted already), else from its
        start. `whole`: the counts cover the pass from its start (not a resume from a checkpoint without them)."""
        self.counts: dict = dict(counts or {})  # tokenize_chunk's counts of pass `epoch`'s rows read so far
        self.counted = (epoch, *(read or self.start))  # (epoch, dataset, row): the rows before it are in `counts`
        self.whole_pass = whole

    def _counted_rows(self, epoch: int, dataset: int) -> int:
        """How many of the dataset's first rows are in the counts of pass `epoch` already (all: sys.maxsize)."""
        counted_epoch, counted_dataset, row = self.counted
        if epoch != counted_epoch or dataset > counted_dataset:
            return 0
        return row if dataset == counted_dataset else sys.maxsize

    def examples(self, dataset: int, row: int, epoch: int = 0) -> Iterator[tuple[int, Example]]:
        """(row, example) of one dataset from `row` on, in pass `epoch`, each row counted once in the pass's counts
        (the rows a checkpoint's counts hold already, read again by its resume, are a chunk of their own, uncounted)."""
        spec = self.specs[dataset]
        entries = dataset_rows(spec, row)
        for chunk in _chunks(itertools.islice(entries, max(self._counted_rows(epoch, dataset) - row, 0)),
                             STREAM_CHUNK_ROWS):
            yield from _tokenized(chunk, spec, self.recipe, self.tokenizer)
        for chunk in _chunks(entries, STREAM_CHUNK_ROWS):
            found = _tokenized(chunk, spec, self.recipe, self.tokenizer, self.counts)
            self.counted = (epoch, dataset, chunk[-1][0] + 1)
            yield from found

    def counts_line(self, epoch: int, *, ended: bool, trained: Position | None = None) -> str:
        """The run's line about pass `epoch`'s rows: when it `ended`, or read so far, a warning when truncation cut
        much of them, and (the first pass only: later passes read the same rows) the notes of the cached path's data
        line about the rows' prompts (build.count_notes). `trained`: where training is, said below (trained_line)."""
        counted = "" if self.whole_pass else " (the rows read since the resume)"
        state = "done" if ended else "so far"
        line = f"[finetune] data: pass {epoch + 1} over the stream {state}{counted}: {row_counts(self.counts)}"
        line += f"\n{self.trained_line(trained)}" if trained is not None else ""
        warning = cut_warning(self.counts, self.recipe)
        notes = count_notes([self.counts]) if epoch == 0 else []
        return (line + (f"\n[finetune] warning: {warning}" if warning else "")
                + "".join(f"\n[finetune] note: {note}" for note in notes))

    def trained_line(self, position: Position) -> str:
        """Where training is: the rows before `position` (bb58 #4: the counts alone, of rows read ahead, read as if a
        40-row file had been trained whole after 6 rows)."""
        (first_dataset, first_row), dataset, row = self.start, position.dataset, position.row
        held = first_row if dataset == first_dataset else 0  # the held-out eval rows the pass starts after
        rows = f"the first {row:,} rows of data.datasets[{dataset}]" + (
            f" ({row - held:,} past its {held:,} held-out eval rows)" if held else "")
        before = "".join(f"every row of data.datasets[{index}], " for index in range(first_dataset, dataset))
        part = f" and {position.part} example(s) of the next (a row of several)" if position.part else ""
        return (f"[finetune] data: trained in pass {position.epoch + 1}: {before}{rows}{part}; the counts above are of "
                f"the rows read so far, which are tokenized {STREAM_CHUNK_ROWS} at a time ahead of training")

    def pass_examples(self, epoch: int, dataset: int, row: int, part: int = 0) -> Iterator[tuple[Example, Position]]:
        """Examples of one pass from (dataset, row), past the row's first `part` examples, each with the position
        that follows it (the same row's next example while the row has more)."""
        for index in range(dataset, len(self.specs)):
            first = row if index == dataset else 0
            for found, group in itertools.groupby(self.examples(index, first, epoch), key=lambda entry: entry[0]):
                examples = [example for _, example in group]
                for number, example in enumerate(examples):
                    if index == dataset and found == first and number < part:
                        continue
                    last = number == len(examples) - 1
                    yield example, Position(epoch, index, found + 1) if last else Position(epoch, index, found, number + 1)

    def sequences(self, position: Position, *, report: bool = False) -> Iterator[tuple[Example, Position]]:
        """Training sequences from `position` on, endlessly (pass after pass), each with the position after it:
        examples, or with data.packing rows packed greedily (a pass's last row is emitted at its end). `report`: say
        each pass's counts when it ends (training's stream; not a look-ahead)."""
        epoch, dataset, row, part = position.epoch, position.dataset, position.row, position.part
        packing, limit = self.recipe.data.packing, self.recipe.data.max_length
        while True:
            yielded, members, size, after = False, [], 0, None
            for example, following in self.pass_examples(epoch, dataset, row, part):
                if not packing:
                    yielded = True
                    yield example, following
                    continue
                if members and size + len(example.input_ids) > limit:
                    yielded = True
                    yield concat_examples(members), after
                    members, size = [], 0
                members.append(example)
                size, after = size + len(example.input_ids), following
            if report and self.counts:
                print0(self.counts_line(epoch, ended=True))
            self.restart_counts(epoch + 1)
            if members:
                yielded = True
                yield concat_examples(members), Position(epoch + 1, *self.start)
            if not yielded and (dataset, row) == self.start:  # a whole pass (not the end of one a resume began in)
                raise DataError(self.empty_pass())
            epoch, (dataset, row), part = epoch + 1, self.start, 0

    def empty_pass(self) -> str:
        held = " after the held-out eval rows (data.eval_max_rows)" if self.start != (0, 0) else ""
        return (f"data.streaming: a whole pass over data.datasets gave no training example{held} (every row skipped, "
                "dropped or held out). Check the data with `finetune data`, or lower data.eval_max_rows.")

    def fingerprint(self) -> dict:
        """What the position depends on: a checkpoint of other data or settings cannot be resumed."""
        data = self.recipe.data
        return {"datasets": [spec.path for spec in self.specs], "max_rows": [spec.max_rows for spec in self.specs],
                "start": list(self.start), "packing": data.packing, "max_length": data.max_length}


class StreamingBatches:
    """BatchStream's interface over a stream: endless micro-batches for one rank, and a resumable position.

    Global micro-batch g is the next micro_batch_size x world_size sequences and rank r takes every world_size-th;
    the position advances by whole global micro-batches, so it is the same on every rank.
    """

    def __init__(self, rows: StreamedRows, *, micro_batch_size: int, rank: int, world_size: int, pad_id: int,
                 grad_accum: int = 1):
        # grad_accum is BatchStream's (its epochs end on whole steps); a stream's passes need no alignment
        self.rows, self.batch, self.rank, self.world, self.pad_id = rows, micro_batch_size, rank, world_size, pad_id
        self.position = Position(0, *rows.start)
        self.grad_accum, self.micro_batches = grad_accum, 0  # taken so far: step x grad_accum after a resume

    def epoch_at(self, step: int) -> float:
        """The pass over the stream the last micro-batch came from (a stream's length, so a fraction, is unknown)."""
        return float(self.position.epoch)

    def epochs_done(self, step: int) -> float:
        """What a checkpoint keeps of the epoch (BatchStream's unrounded epoch_at): the pass, as epoch_at."""
        return self.epoch_at(step)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches; as the last step's are taken, the run's line about the rows of the pass read so far (a
        stream has no totals to say before training: this is where a run says what it skipped and cut)."""
        sequences = self.rows.sequences(self.position, report=True)
        last = self.rows.recipe.train.max_steps * self.grad_accum
        while True:
            taken = list(itertools.islice(sequences, self.batch * self.world))
            self.position = taken[-1][1]
            self.micro_batches += 1
            if self.micro_batches == last and self.rows.counts:
                print0(self.rows.counts_line(self.rows.counted[0], ended=False, trained=self.position))
            yield collate([sequence for sequence, _ in taken[self.rank :: self.world]], self.pad_id)

    def state_dict(self) -> dict:
        """The position, and the counts of its pass's rows read so far (`read`: up to which row they go)."""
        position, (epoch, dataset, row) = self.position, self.rows.counted
        return {"streaming": True, "epoch": position.epoch, "dataset": position.dataset, "row": position.row,
                "part": position.part, "world_size": self.world, "micro_batch_size": self.batch,
                "counts": {"epoch": epoch, "read": [dataset, row], "whole_pass": self.rows.whole_pass,
                           "counts": self.rows.counts},
                **self.rows.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position, whatever world size or micro-batch size saved it."""
        if not state.get("streaming"):
            raise DataError("resume: the checkpoint was written by a run without data.streaming, whose position counts "
                            "shuffled rows, not rows of the stream. Resume with data.streaming: false, or start a new run.")
        for key, mine in self.rows.fingerprint().items():
            saved = state.get(key)
            if key == "datasets" and isinstance(saved, list) and len(saved) == len(mine):
                # a path a run before a4f6ddb saved relative, naming the same file as this run's absolute one
                saved = [now if same_place(then, now) else then for then, now in zip(saved, mine)]
            if saved != mine:
                raise DataError(f"resume: the checkpoint's data stream had {key}={state.get(key)}, this run has {mine}: "
                                "the data or data settings changed since the checkpoint, so the position in the stream "
                                "cannot be restored. Resume with the same data and recipe, or start a new run.")
        self.position = Position(state["epoch"], state["dataset"], state["row"], state.get("part", 0))
        self.micro_batches = int(state.get("step", 0)) * self.grad_accum
        saved = state.get("counts") or {}
        if saved.get("epoch") == self.position.epoch:  # the pass's rows read before the checkpoint: counted once
            self.rows.restart_counts(saved["epoch"], saved["counts"], tuple(saved["read"]),
                                     whole=saved.get("whole_pass", True))
        else:  # a checkpoint that kept no counts (written before they were kept): the pass counted from the position
            read = (self.position.dataset, self.position.row)
            self.rows.restart_counts(self.position.epoch, read=read, whole=read == tuple(self.rows.start))


def batch_stream(train, **options) -> BatchStream | StreamingBatches:
    """The loop's micro-batches: a stream's (data.streaming) or BatchStream's over the prepared rows. `options`:
    micro_batch_size, rank, world_size, seed (the shuffle; a stream keeps the data's order), pad_id."""
    if isinstance(train, StreamedRows):
        options.pop("seed", None)
        options.pop("kl_max_length", None)  # KTO does not stream (recipe/checks.py: check_streaming)
        options.pop("iterations", None)  # nor GRPO, whose num_iterations cycles reuse a step's rows
        return StreamingBatches(train, **options)
    return BatchStream(train, **options)


# ---------------------------------------------------------------------------------------- before training
def stream_examples(recipe: Recipe, tokenizer) -> tuple[StreamedRows, list[Example], DataStats]:
    """The stream's training rows, the eval examples (data.eval_datasets first) and what is known without reading the
    data whole. See `_opened`."""
    try:
        rows, files, held, stats = _opened(recipe, tokenizer)
    except FinetuneError as exc:  # every rank opens the same files and finds it alike (as data.build_examples)
        vars(exc).setdefault("alike_on_every_rank", True)  # rank 0 prints it, once (run.py main); one of this rank
        # alone (data.build_examples) says so where it is raised
        raise
    return rows, (list(files) + held if held else files), stats


def _opened(recipe: Recipe, tokenizer) -> tuple[StreamedRows, list[Example], list[Example], DataStats]:
    """(training rows, eval file examples, held-out eval examples, stats).

    Eval: data.eval_datasets are tokenized the cached way; with data.eval_fraction > 0 the first data.eval_max_rows
    rows of the stream are held out too (a stream's total is unknown, so no fraction of it can be taken) and every
    pass of training starts after them. Checked here, before any weight loads: packing's attention, each dataset's
    first rows (columns, chat template, bad rows), and that training rows remain.
    """
    if recipe.data.packing and (problem := packing_problem(recipe.model.attn_implementation)):
        raise DataError(problem)
    stats = DataStats()
    files = eval_file_examples(recipe, tokenizer, stats)
    held, start = _held_out(recipe, tokenizer)
    stats.eval_examples = len(files) + len(held)
    for spec in recipe.data.datasets:
        first = list(itertools.islice(dataset_rows(spec), STREAM_CHUNK_ROWS))
        items = []
        for chunk in _chunks(iter(first), STREAM_CHUNK_ROWS):  # a folder's JSON Lines text and CSV rows apart
            items += _parsed([item for _, item, _ in chunk], [place for _, _, place in chunk], spec)
        check_dataset(items, spec, tokenizer, spec.path,  # as the cached path: before any row's own problem
                      whole=len(first) < STREAM_CHUNK_ROWS)
        for chunk in _chunks(iter(first), STREAM_CHUNK_ROWS):
            _tokenized(chunk, spec, recipe, tokenizer)
    rows = StreamedRows(recipe, tokenizer, start)
    if next(rows.sequences(Position(0, *start)), None) is None:
        raise DataError(rows.empty_pass())
    rows.restart_counts(0)  # that look ahead is read again (and counted) by training
    return rows, files, held, stats


def _parsed(items: list, places: list[str], spec: DatasetSpec) -> list:
    """A chunk's rows for the checks: JSON Lines text parsed (a broken line left out: it is the row's own problem)."""
    if items and isinstance(items[0], str):
        return parse_lines(items, places, spec.path, bad_rows="skip")[0]
    return items


def _held_out(recipe: Recipe, tokenizer) -> tuple[list[Example], tuple[int, int]]:
    """The examples of the first data.eval_max_rows rows of the stream (eval_fraction > 0), and where training starts."""
    data = recipe.data
    wanted = data.eval_max_rows if data.eval_fraction > 0 else 0
    held: list[Example] = []
    for index, spec in enumerate(data.datasets):
        if wanted == 0:
            return held, (index, 0)
        taken = list(itertools.islice(dataset_rows(spec), wanted))
        for chunk in _chunks(iter(taken), STREAM_CHUNK_ROWS):
            held += [example for _, example in _tokenized(chunk, spec, recipe, tokenizer)]
        if len(taken) == wanted:
            return held, (index, taken[-1][0] + 1)
        wanted -= len(taken)
    return held, (len(data.datasets), 0)


def _file_examples(stats: DataStats) -> int:
    return sum(item["examples"] for item in stats.per_dataset if item.get("role") == "eval")


def streaming_line(stats: DataStats, recipe: Recipe) -> str:
    """The run's data line: what a stream can say before training (no totals)."""
    data, count = recipe.data, len(recipe.data.datasets)
    held = stats.eval_examples - _file_examples(stats)
    files = f"{_file_examples(stats)} from data.eval_datasets, " if data.eval_datasets else ""
    packed = f", packed greedily into rows of <= {data.max_length} tokens" if data.packing else ""
    return (f"[finetune] data: streaming {count} dataset{'s' if count > 1 else ''} in order{packed} (totals unknown: "
            f"rows are read and tokenized while training, their counts said as each pass ends and at the last step); "
            f"{stats.eval_examples} eval examples ({files}{held} held out: the stream's first "
            f"{data.eval_max_rows if data.eval_fraction > 0 else 0} rows)")


def stream_preview(recipe: Recipe, tokenizer, *, rows: int) -> PreparedData:
    """For `finetune data`: the first `rows` training examples of the stream and the eval set, nothing read whole."""
    train, files, held, stats = _opened(recipe, tokenizer)
    first = [example for example, _ in itertools.islice(train.pass_examples(0, *train.start), max(rows, 0))]
    return PreparedData(first, train, list(files) + held, stats, files)  # train.counts: the rows read for `first`


def preview_lines(prepared: PreparedData, recipe: Recipe) -> list[str]:
    """`finetune data`'s lines about the rows a stream's preview read (whole chunks: at least the first few dozen
    rows): their counts, a warning when truncation cut much of them, the first reasons rows were skipped."""
    counts = prepared.train.counts if isinstance(prepared.train, StreamedRows) else {}
    if not counts:
        return []
    lines = [f"rows read for this preview (the stream's first, not its totals): {row_counts(counts)}"]
    if warning := cut_warning(counts, recipe):
        lines.append(f"warning: {warning}")
    lines += [f"skipped: {reason}" for reason in counts.get("skipped_reasons", [])[:3]]
    return lines + [f"note: {note}" for note in count_notes([counts])]
