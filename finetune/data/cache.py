"""One dataset tokenized once per machine into a memory-mapped store (store.py), shared by every rank and run.

The cache key covers everything the tokens depend on: the rows (a local file's bytes, a hub dataset's `datasets`
fingerprint), the tokenizer (vocabulary, special tokens, chat template), the recipe's data settings and the rendering
code (the source of the modules that read and render rows, _RENDERING_CODE, plus STORE_FORMAT). So any change is a miss, never a
stale hit; an entry written by older code (another format, or the .npz files of v1-v3) is never read.

The first process to want an entry builds it while the others (the ranks of this node, other runs) wait on a file
lock, then all map it. The builder streams the rows in chunks through data.num_proc processes, so neither it nor
anyone else holds the dataset's tokens in Python lists. With data.cache off (or an unwritable cache folder) each
process builds into a private temporary folder, removed once mapped.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from finetune.data.pairs import prompt_limit
from finetune.data.sources import Source, open_source, row_chunks
from finetune.data.store import STORE_FORMAT, StoreWriter, TokenStore, chunk_arrays
from finetune.data.tokenize import check_dataset, merge_counts, parse_lines, tokenize_chunk
from finetune.errors import DataError
from finetune.files import exclusive_lock
from finetune.recipe import DatasetSpec, Recipe

# The code that reads and renders rows (the layout is STORE_FORMAT): editing any invalidates every entry.
_RENDERING_CODE = ("sources.py", "readers.py", "csv_files.py", "folders.py", "templates.py", "conversations.py",
                   "chat.py", "pairs.py", "tokenize.py")


def _rendering_code_version() -> str:
    """A hash of the code that turns rows into tokens and masks: editing it invalidates every entry (no manual bump)."""
    digest = hashlib.blake2b(str(STORE_FORMAT).encode(), digest_size=8)
    for name in _RENDERING_CODE:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()


CACHE_VERSION = _rendering_code_version()


# ---------------------------------------------------------------------------------------------------- the key
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
    """Hash of a local file's or folder's bytes; None for a hub name."""
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


def _file_hash(path: str) -> str | None:
    try:
        return hashlib.blake2b(Path(path).expanduser().read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None  # unreadable: the rows' build names the file


def cache_key(spec: DatasetSpec, source: Source, recipe: Recipe, tokenizer) -> str | None:
    """The entry's name, or None when the rows cannot be identified (a hub dataset with no fingerprint)."""
    rows = _content_hash(spec) or source.fingerprint()
    if rows is None:
        return None
    data = recipe.data
    settings = {"spec": spec.model_dump(exclude={"weight"}), "system_prompt": data.system_prompt,
                "max_length": data.max_length, "overlong": data.overlong, "bad_rows": data.bad_rows, "reasoning": data.reasoning}
    if spec.format == "preference":
        settings["max_prompt_length"] = prompt_limit(recipe)
    if isinstance(spec.tools, str):  # a tools file: its schemas are rendered into every row, so its bytes count
        settings["tools_file"] = _file_hash(spec.tools)
    text = json.dumps([CACHE_VERSION, tokenizer_fingerprint(tokenizer), rows, settings], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# ------------------------------------------------------------------------------------------- built or mapped
def dataset_store(spec: DatasetSpec, recipe: Recipe, tokenizer) -> tuple[TokenStore, dict]:
    """One dataset's tokenized store and counts: mapped from the cache, else built once (the others wait) and mapped."""
    source = open_source(spec)
    key = cache_key(spec, source, recipe, tokenizer) if recipe.data.cache else None
    if key is not None:
        target = cache_dir() / key
        try:
            with exclusive_lock(cache_dir() / f"{key}.lock"):  # one process of the node builds; the rest wait here
                store = _mapped_entry(target)
                if store is not None:
                    return store, dict(store.counts, cached=True)
                _build_into(target, source, recipe, tokenizer)
            store = _mapped_entry(target)
            if store is not None:
                return store, dict(store.counts, cached=False)
        except OSError:
            pass  # a read-only or full cache disk must not stop a run: build privately below
    folder = Path(tempfile.mkdtemp(prefix="finetune-data-"))
    try:
        _build_into(folder / "entry", source, recipe, tokenizer)
        store = TokenStore(folder / "entry")  # mapped: the pages stay readable after the folder is removed
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return store, dict(store.counts, cached=False)


def _mapped_entry(target: Path) -> TokenStore | None:
    """The entry at `target` if it is whole and of this format; anything else (absent, older, damaged) is None."""
    if not (target / "meta.json").is_file():
        return None
    try:
        return TokenStore(target)
    except (OSError, ValueError, KeyError):
        shutil.rmtree(target, ignore_errors=True)  # older format or damaged: rebuilt, never misread
        return None


def _build_into(target: Path, source: Source, recipe: Recipe, tokenizer) -> None:
    """Tokenize every chunk (in data.num_proc processes) into a temporary folder, renamed to `target` when whole."""
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    writer, counts, spec, started = StoreWriter(temporary), {}, source.spec, time.perf_counter()
    try:
        with _Progress(source) as progress:
            for result in _chunk_results(source, recipe, tokenizer):
                if result.fatal is not None:
                    raise DataError(result.fatal)
                writer.add(result.arrays)
                merge_counts(counts, result)
                progress.update(result.counts["rows"])
        if not counts.get("rows"):
            raise DataError(f"data.datasets path {spec.path}: no rows (an empty file, blank lines, or `[]`). Fix: point "
                            "the path at a file with rows, or remove that dataset from the recipe.")
        counts.setdefault("skipped_reasons", [])
        counts.setdefault("dropped_rows", [])
        counts["pairs"] = spec.format == "preference"
        counts["unpaired"] = spec.format == "unpaired_preference"
        writer.finish(counts, pairs=counts["pairs"])
        if target.exists():
            shutil.rmtree(target)
        os.replace(temporary, target)
    finally:
        writer.close()  # (closed already when finished: closing again does nothing)
        shutil.rmtree(temporary, ignore_errors=True)
    if counts["rows"] >= 10 * 1000:
        print(f"[finetune] data: tokenized {counts['rows']:,} rows of {spec.path} in {time.perf_counter() - started:.0f} s "
              f"({_processes(recipe)} processes)", file=sys.stderr, flush=True)


def _processes(recipe: Recipe) -> int:
    if recipe.data.num_proc is not None:
        return recipe.data.num_proc
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _chunk_results(source: Source, recipe: Recipe, tokenizer):
    """Each chunk's ChunkResult, in order. The first chunk is done here (it also checks the whole dataset's columns);
    the rest go to a pool of forked processes, a bounded number of chunks ahead (the file is never all in memory)."""
    chunks = row_chunks(source)
    first = next(chunks, None)
    if first is None:
        return
    rows, places, broken = _parsed(first, source.spec, recipe)
    second = next(chunks, None)
    check_dataset(rows, source.spec, tokenizer, source.spec.path, whole=second is None)
    yield _with_arrays(tokenize_chunk(rows, places, broken, source.spec, recipe, tokenizer))
    if second is None:  # one chunk (most small datasets): no processes started
        return
    chunks, context, processes = itertools.chain([second], chunks), (source.spec, recipe, tokenizer), _processes(recipe)
    if processes <= 1:
        for chunk in chunks:
            yield _tokenize_in_worker(chunk, context)
        return
    yield from _pooled(chunks, processes, context)


def _pooled(chunks, processes: int, context: tuple):
    import multiprocessing

    global _WORKER_CONTEXT
    _WORKER_CONTEXT = context  # inherited by the forked workers, not pickled per chunk
    # The workers tokenize one row batch each, single-threaded; without this every fork would warn that the Rust
    # tokenizer's thread pool was used before forking.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pending: collections.deque = collections.deque()
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_default_signals)
    try:
        for chunk in chunks:
            pending.append(pool.apply_async(_worker, (chunk,)))
            if len(pending) >= 2 * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()  # the workers finish and exit on their own
    finally:
        pool.terminate()  # a problem row (or Ctrl-C) ended the build early: stop the workers
        pool.join()


def _default_signals() -> None:
    """A forked worker keeps its parent's signal handlers; a run's SIGTERM handler only sets a flag, so the pool's
    terminate() would wait forever for the worker to exit."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)


_WORKER_CONTEXT: tuple | None = None


def _worker(chunk):
    return _tokenize_in_worker(chunk, _WORKER_CONTEXT)


def _tokenize_in_worker(chunk, context: tuple):
    spec, recipe, tokenizer = context
    rows, places, broken = _parsed(chunk, spec, recipe)
    return _with_arrays(tokenize_chunk(rows, places, broken, spec, recipe, tokenizer))


def _with_arrays(result):
    """The chunk's examples as the store's arrays (built where they were tokenized), the lists let go."""
    result.arrays, result.examples = chunk_arrays(result.examples), []
    return result


def _parsed(chunk, spec: DatasetSpec, recipe: Recipe) -> tuple[list, list[str], list[str]]:
    items, places, raw = chunk
    if not raw:
        return items, places, []
    return parse_lines(items, places, spec.path, bad_rows=recipe.data.bad_rows)


class _Progress:
    """A progress bar of rows tokenized, shown by the builder on a terminal (the waiting ranks show nothing)."""

    def __init__(self, source: Source):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=f"tokenizing {Path(source.spec.path).name}", unit=" rows", dynamic_ncols=True)

    def __enter__(self):
        return self

    def update(self, rows: int) -> None:
        if self.bar is not None:
            self.bar.update(rows)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
