"""One dataset tokenized once per machine into a memory-mapped store (store.py), shared by every rank and run.

The cache key covers everything the tokens depend on: the rows (a local file's bytes, a hub dataset's `datasets`
fingerprint), the tokenizer (vocabulary, special tokens, chat template), the recipe's data settings and the rendering
code (the source of the modules that read and render rows, _RENDERING_CODE, plus STORE_FORMAT). So any change is a miss, never a
stale hit; an entry written by older code (another format, or the .npz files of v1-v3) is never read.

The first process to want an entry builds it while the others (the ranks of this node, other runs) wait on a file
lock, saying after a few seconds whom they wait for, then all map it. A whole entry is mapped without the lock (a
read-only cache filled in advance is used). The builder streams the rows in chunks through data.num_proc processes, so
neither it nor anyone else holds the dataset's tokens in Python lists; a process that dies (the OOM killer) stops the
build with an error, never a hang. With data.cache off (or an unwritable cache folder, then with a note) each process
builds into a private temporary folder, removed once mapped.
"""

from __future__ import annotations

import collections
import contextlib
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
from finetune.data.store import STORE_FORMAT, DamagedEntry, StoreWriter, TokenStore, chunk_arrays
from finetune.data.tokenize import check_dataset, check_end_tokens, merge_counts, parse_lines, tokenize_chunk
from finetune.distributed import print0
from finetune.errors import DataError
from finetune.files import _fsync_dir, _fsync_tree, exclusive_lock
from finetune.recipe import DatasetSpec, Recipe

# The code that reads and renders rows (the layout is STORE_FORMAT): editing any invalidates every entry.
_RENDERING_CODE = ("sources.py", "readers.py", "csv_files.py", "folders.py", "templates.py", "tokens.py", "conversations.py",
                   "chat.py", "pairs.py", "tokenize.py", "ported_rows.py", "template_facts.py")


def _rendering_code_version() -> str:
    """A hash of the code that turns rows into tokens and masks: editing it invalidates every entry (no manual bump)."""
    digest = hashlib.blake2b(str(STORE_FORMAT).encode(), digest_size=8)
    for name in _RENDERING_CODE:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()


CACHE_VERSION = _rendering_code_version()


# ---------------------------------------------------------------------------------------------------- the key
def cache_dir() -> Path:
    """Where tokenized datasets are kept: a `data` folder beside the GGUF conversions and the quantized cache, by the one
    rule of every finetune cache (gguf.cache_root: $FINETUNE_CACHE with `~` expanded, else $XDG_CACHE_HOME/finetune,
    else ~/.cache/finetune). Before, this cache alone took a literal `~/x` as a folder `~` in the working folder and
    ignored XDG_CACHE_HOME (bb20)."""
    from finetune.model.sources.gguf import cache_root

    return cache_root().parent / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything about a tokenizer that changes token ids or rendered text: its backend's serialized form,
    its template, its special tokens, and the settings tokenizer_config.json gives that the backend's form leaves out
    (`split_special_tokens` turned `<|im_end|>` in text into pieces with the entry of the other setting reused, bb63);
    the libraries that tokenize and render (transformers, tokenizers, jinja2) by version."""
    import importlib.metadata

    import transformers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    settings = {name: str(getattr(tokenizer, name, None)) for name in (
        "add_bos_token", "add_eos_token", "split_special_tokens", "add_prefix_space", "legacy", "do_lower_case")}
    versions = [transformers.__version__, *(_version(importlib.metadata, name) for name in ("tokenizers", "jinja2"))]
    parts = [type(tokenizer).__name__, *versions, backend.to_str() if backend is not None else
             json.dumps(sorted(tokenizer.get_vocab().items())), str(getattr(tokenizer, "chat_template", None)),
             str(tokenizer.bos_token), str(tokenizer.eos_token), json.dumps(settings, sort_keys=True)]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def _version(metadata, name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


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
    check_end_tokens(spec, tokenizer, spec.path)  # a cached entry too: its run is told its rows have no end token
    key = cache_key(spec, source, recipe, tokenizer) if recipe.data.cache else None
    if key is not None:
        target = cache_dir() / key
        store = _mapped_entry(target, remove_bad=False)  # whole entries are published by a rename: no lock needed
        if store is not None:
            return store, dict(store.counts, cached=True)
        try:
            with _entry_lock(cache_dir() / f"{key}.lock"):  # one process of the node builds; the rest wait here
                store = _mapped_entry(target)
                if store is not None:
                    return store, dict(store.counts, cached=True)
                _remove_stale_temporaries(target)
                _build_into(target, source, recipe, tokenizer)
            store = _mapped_entry(target)
            if store is not None:
                return store, dict(store.counts, cached=False)
        except OSError as exc:  # a read-only or full cache disk must not stop a run: build privately below
            if not exc.filename or str(exc.filename).startswith(str(cache_dir())):  # (else the rows' build names it)
                print0(f"[finetune] note: the tokenization cache {cache_dir()} cannot be written ({exc.strerror or exc})"
                       f": tokenizing {spec.path} for this run only, again at every start (set FINETUNE_CACHE to a "
                       "writable folder with room, or data.cache: false).", file=sys.stderr)
    folder = Path(tempfile.mkdtemp(prefix="finetune-data-"))
    try:
        _build_into(folder / "entry", source, recipe, tokenizer)
        store = TokenStore(folder / "entry")  # mapped: the pages stay readable after the folder is removed
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return store, dict(store.counts, cached=False)


def _entry_lock(lock_path: Path):
    """The entry's lock (files.exclusive_lock), saying once whom a run that waits long waits for."""
    return exclusive_lock(lock_path, _say_waiting)


def _say_waiting(holder: str, sibling: bool) -> None:
    if sibling:  # the ranks of one launch: one tokenizes, the others map what it wrote (bb27: "another run")
        print0(f"[finetune] data: {holder} is tokenizing the data into the cache; this rank maps it once written.",
               file=sys.stderr)
        return
    print0(f"[finetune] data: waiting for another run building the same data cache entry: {holder}. This run goes on "
           "once that one has tokenized the data; if that process is stopped (Ctrl-Z) or hung, resume or end it.",
           file=sys.stderr)


STALE_AFTER_S = 24 * 3600


def _remove_stale_temporaries(target: Path) -> None:
    """Remove the half-written `.<key>.tmp-<pid>` folders a killed build left (SIGKILL, a power cut: nothing could
    clean up), each as big as the entry: those whose pid is gone, or untouched for a day (a pid reused since). Called
    while holding the entry's lock, so no live build of this key on this machine writes one."""
    for folder in target.parent.glob(f".{target.name}.tmp-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        try:
            touched = max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.iterdir()])
        except OSError:
            continue
        if not pid.isdigit() or not _alive(int(pid)) or time.time() - touched > STALE_AFTER_S:
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's own leftover: it is rebuilding now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's process)
    return True


def _mapped_entry(target: Path, *, remove_bad: bool = True) -> TokenStore | None:
    """The entry at `target` if it is whole and of this format; anything else (absent, older, damaged) is None, and
    removed when `remove_bad` (only under the lock: another process may be replacing it). A damaged entry whose files
    have their sizes but not their bytes (store.DamagedEntry: the sampled checksums) is named in a note."""
    if not (target / "meta.json").is_file():
        return None
    try:
        return TokenStore(target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        if remove_bad:
            if isinstance(exc, DamagedEntry):  # (the process that rebuilds it says so; any rank may be that one)
                print(f"[finetune] note: the tokenization cache entry {target} ({_entry_source(target)}) is damaged: "
                      f"{exc}. It is removed and the data tokenized again.", file=sys.stderr, flush=True)
            shutil.rmtree(target, ignore_errors=True)  # older format or damaged: rebuilt, never misread
        return None


def _entry_source(target: Path) -> str:
    """The data file an entry was built from (its source.json), for a note; the key when unknown."""
    try:
        return f"built from {json.loads((target / 'source.json').read_text(encoding='utf-8'))['path']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"key {target.name}"


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
        # Which entry is which, for a person cleaning the cache (the key is a hash): read by nothing else.
        (temporary / "source.json").write_text(json.dumps({"path": str(spec.path), "rows": counts["rows"],
                                                           "built": time.strftime("%Y-%m-%d %H:%M:%S")}), encoding="utf-8")
        # On disk before the rename publishes it (files, then the folder that holds the new name): without this, a
        # power cut soon after could leave the entry renamed into place with files of their size but NUL bytes (bb30).
        _fsync_tree(temporary)
        if target.exists():
            shutil.rmtree(target)
        os.replace(temporary, target)
        _fsync_dir(target.parent)
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
    """The chunks' results through `processes` forked workers. A ProcessPoolExecutor, not multiprocessing.Pool: a Pool
    replaces a worker that dies (the OOM killer's SIGKILL) and waits forever for the chunk it held, holding the
    entry's lock, so every run on that data hung (bb20); the executor raises BrokenProcessPool instead."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    global _WORKER_CONTEXT
    _WORKER_CONTEXT = context  # inherited by the forked workers, not pickled per chunk
    # The workers tokenize one row batch each, single-threaded; without this every fork would warn that the Rust
    # tokenizer's thread pool was used before forking.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pending: collections.deque = collections.deque()
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start,
                               initargs=(os.getpid(),))
    try:
        for chunk in chunks:
            pending.append(pool.submit(_worker, chunk))
            if len(pending) >= 2 * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except (BrokenProcessPool, MemoryError):
        spec = context[0]
        raise _this_rank_alone(DataError(
            f"data.num_proc: a tokenizing process (one of the {processes} that data.num_proc starts) died while "
            f"tokenizing {spec.path}: it was killed, most likely by the out-of-memory killer (or a signal sent to it). "
            "Nothing was cached. Fix: lower data.num_proc (each process holds a tokenizer and 1,000 rows at a time; 1 "
            "tokenizes in the run's own process), or free memory on this machine, then run again.")) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a problem row (or Ctrl-C) ended the build early


def _this_rank_alone(error: DataError) -> DataError:
    """An error this machine's builder meets alone (a killed process): printed by its rank at once, not held for a
    paragraph from rank 0 that never comes (data.build_examples marks the rows' errors alike on every rank)."""
    error.alike_on_every_rank = False
    return error


def _worker_start(parent: int) -> None:
    """Run in each forked worker before its first chunk. A run's SIGTERM/SIGINT handlers only set a flag, so the worker
    puts the default action back (the pool could not be shut down otherwise), except where the parent ignores the
    signal: a run started in the background of a script ignores SIGINT (POSIX), and the Ctrl-C meant for the script
    killed the workers and hung the build (bb20). The worker also dies with its parent (prctl PR_SET_PDEATHSIG, Linux):
    a killed run leaves no worker waiting for chunks, or writing tracebacks into a closed pipe."""
    for number in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


_WORKER_CONTEXT: tuple | None = None


def _worker(chunk):
    return _tokenize_in_worker(chunk, _WORKER_CONTEXT)


def _tokenize_in_worker(chunk, context: tuple):
    spec, recipe, tokenizer = context
    rows, places, broken = _parsed(chunk, spec, recipe)
    return _with_arrays(tokenize_chunk(rows, places, broken, spec, recipe, tokenizer))


def _with_arrays(result):
    """The chunk's examples as the store's arrays (built where they were tokenized, with each one's row number), the
    lists let go."""
    result.arrays, result.examples = chunk_arrays(result.examples, result.origins), []
    return result


def _parsed(chunk, spec: DatasetSpec, recipe: Recipe) -> tuple[list, list[str], list[str]]:
    items, places, raw = chunk
    if not raw:
        return items, places, []
    return parse_lines(items, places, spec.path, bad_rows=recipe.data.bad_rows)


PROGRESS_EVERY_S = 60.0  # a build's progress line where no terminal shows a bar


class _Progress:
    """Rows tokenized, shown by the builder (the waiting ranks show nothing): a bar on a terminal; elsewhere (a CI log,
    a file) a line every PROGRESS_EVERY_S seconds, so that a long build does not read as a hung run (bug bash: 1.5M rows
    tokenized for 14 minutes under one line)."""

    def __init__(self, source: Source):
        self.bar, self.rows, self.name, self.every_s = None, 0, Path(source.spec.path).name, PROGRESS_EVERY_S
        self.started = self.said = time.perf_counter()
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=f"tokenizing {self.name}", unit=" rows", dynamic_ncols=True)

    def __enter__(self):
        return self

    def update(self, rows: int) -> None:
        self.rows += rows
        if self.bar is not None:
            self.bar.update(rows)
        elif time.perf_counter() - self.said >= self.every_s:
            self.said = time.perf_counter()
            print(f"[finetune] data: tokenizing {self.name}: {self.rows:,} rows so far "
                  f"({self.rows / (self.said - self.started):,.0f} rows/s)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
