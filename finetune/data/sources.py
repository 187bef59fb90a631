"""Where rows come from: local JSON/JSONL/CSV/Parquet files, folders, hub datasets; the pre-flight file check."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import itertools
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data.templates import FORMAT_FIELDS, _column
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

# ----------------------------------------------------------------------------------------------------- loading
CHUNK_ROWS = 1000  # rows per chunk handed to a tokenizing process: a few MB of tokens, never the whole dataset

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# A folder's files may be compressed, as hub downloads often are (`datasets` read them so before finetune did).
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass
class Source:
    """One dataset opened for reading: local files are read in order, as they are iterated (JSON Lines line by line,
    CSV and Parquet an Arrow batch at a time, a JSON array parsed whole), never copied into a `datasets` cache;
    a save_to_disk folder or a hub dataset is a `datasets.Dataset` (memory-mapped Arrow)."""

    spec: DatasetSpec
    files: list[Path] = field(default_factory=list)
    folder: Path | None = None  # the files are this folder's: each row's place names its file
    table: object | None = None  # datasets.Dataset

    def fingerprint(self) -> str | None:
        """What identifies a hub dataset's rows for the cache (local files have their bytes hashed instead), from
        `datasets`' public API: the Arrow files behind the table (their names carry the builder's hash of the config,
        revision and data files; their sizes and modification times, a rebuild), its length and features. None for a
        table with no files behind it (in memory): not cached. `Dataset._fingerprint` is private, and a rename
        would have turned caching off without a word."""
        files = getattr(self.table, "cache_files", None) if self.table is not None else None
        if not files:
            return None
        digest = hashlib.blake2b(f"{len(self.table)}|{self.table.features}".encode(), digest_size=16)
        for entry in files:
            path = Path(entry["filename"])
            stat = path.stat()
            digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        return digest.hexdigest()


def open_source(spec: DatasetSpec) -> Source:
    """Open a local JSON/JSONL/CSV/Parquet file, a folder (save_to_disk, or data files) or a `datasets` hub name.

    Local files are read by finetune itself, never through `datasets.load_dataset`: that caches a local file's table by
    path and modification time, so a file edited in place (same mtime: a copy with `cp -p`, a restored backup, two
    writes in a second) gave the old rows, which the token cache then stored under the new bytes' hash."""
    path = Path(spec.path).expanduser()
    if path.is_file() or (path.is_dir() and not _saved_folder(path)):
        files, folder = local_files(spec)
        return Source(spec, files=files, folder=folder)
    if path.is_dir():
        return Source(spec, table=_load_saved(path, spec))
    if spec.path.startswith((".", "/", "~")) or Path(spec.path).suffix in LOCAL_SUFFIXES:
        raise DataError(f"data.datasets path `{spec.path}`: file not found (relative paths are read from {Path.cwd()}).")
    return Source(spec, table=_load_hub(spec))


def local_files(spec: DatasetSpec) -> tuple[list[Path], Path | None]:
    """(files, folder) of a local dataset: a data file alone (folder None), or a folder's data files."""
    path = Path(spec.path).expanduser()
    if path.is_dir():
        return folder_files(path, spec), path
    if path.suffix not in LOCAL_SUFFIXES:
        raise DataError(f"data.datasets path {path}: unsupported file type `{path.suffix}`; use .jsonl, .json, .csv "
                        "or .parquet.")
    return [path], None


def row_chunks(source: Source, *, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[list, list[str], bool]]:
    """(items, places, raw) per chunk, in order, at most spec.max_rows rows. `raw`: the items are JSON Lines text,
    parsed by whoever tokenizes the chunk (so parsing is spread over the processes too). A chunk holds rows of one
    kind (lines or row dicts): in a folder of JSON Lines and CSV files, a new chunk starts where the kind changes."""
    entries = _table_rows(source.table) if source.table is not None else local_rows(source.files, source.folder)
    if source.spec.max_rows is not None:
        entries = itertools.islice(entries, source.spec.max_rows)
    for raw, group in itertools.groupby(entries, key=lambda entry: entry[2]):
        while chunk := list(itertools.islice(group, chunk_rows)):
            yield [item for item, _, _ in chunk], [place for _, place, _ in chunk], raw


def _table_rows(table) -> Iterator[tuple[dict, str, bool]]:
    """A `datasets.Dataset`'s rows as dicts, read a chunk of columns at a time."""
    for start in range(0, len(table), CHUNK_ROWS):
        columns = table[start:start + CHUNK_ROWS]
        for number, values in enumerate(zip(*columns.values()), start=start + 1):
            yield dict(zip(columns, values)), f"row {number}", False


def load_rows(spec: DatasetSpec) -> list[dict]:
    """Rows of one dataset as plain dicts (small datasets and checks; training reads chunks through row_chunks)."""
    rows = []
    for items, _, raw in row_chunks(open_source(spec)):
        rows += [json.loads(item) for item in items] if raw else items
    return rows


# --------------------------------------------------------------------------------------------- local files
def local_rows(files: list[Path], folder: Path | None, start: int = 0) -> Iterator[tuple[object, str, bool]]:
    """(item, place, raw) of the files' rows in order, from row `start` on (the rows before it are read past, never
    parsed or converted). Items are JSON Lines text (raw, without its newline, so a parse error's column is the line's
    own) or row dicts. A place is `line N` or `row N`, after the file's name within `folder` when there is one."""
    skip = start
    for file in files:
        prefix = f"{file.relative_to(folder).as_posix()} " if folder is not None else ""
        kind = _data_suffix(file)
        if kind == ".json" and _json_is_array(file):
            reader = _json_array_rows
        else:
            reader = {".jsonl": _json_lines_rows, ".json": _json_lines_rows, ".csv": _csv_rows,
                      ".parquet": _parquet_rows}[kind]
        skip -= yield from reader(file, prefix, skip)


def _json_lines_rows(path: Path, prefix: str, skip: int):
    passed = 0
    for number, line in enumerate(_text_lines(path), start=1):
        if line.strip() and passed < skip:
            passed += 1
        elif line.strip():
            yield line.removesuffix("\n"), f"{prefix}line {number}", True
    return passed


def _json_array_rows(path: Path, prefix: str, skip: int):
    rows = _json_array(path)
    yield from ((row, f"{prefix}row {number}", False) for number, row in enumerate(rows[skip:], start=skip + 1))
    return min(skip, len(rows))


def _csv_rows(path: Path, prefix: str, skip: int):
    """A CSV file's rows with every value the text written in it: no type inference (`007`, `02134`, `+49...` stay as
    they are; one empty cell does not turn a column of integers into floats), no missing-value words (`NA`, `None`,
    `null` are answers like any other), an empty cell the empty string (a missing field to the row checks). Read by
    Arrow a block at a time (quoted values may hold newlines), so a large file is never whole in memory."""
    import pyarrow
    import pyarrow.csv

    names = _csv_header(path)
    convert = pyarrow.csv.ConvertOptions(column_types={name: pyarrow.string() for name in names}, null_values=[],
                                         strings_can_be_null=False, quoted_strings_can_be_null=False)
    try:
        with _opened(path, "rb") as handle:
            batches = pyarrow.csv.open_csv(handle, convert_options=convert,
                                           parse_options=pyarrow.csv.ParseOptions(newlines_in_values=True))
            return (yield from _batch_rows(batches, prefix, skip))
    except pyarrow.ArrowException as exc:
        number, column, byte = _first_undecodable(path) if "UTF8" in str(exc) else (0, 0, 0)
        fix = f"Line {number}: byte {byte:#04x} at column {column} is not UTF-8. {RECODE}" if number else "Fix the file."
        raise DataError(f"{path}: cannot read it as CSV ({_reason(exc)}). {fix}") from None


def _csv_header(path: Path) -> list[str]:
    """The column names (the first record, as Arrow reads it: a byte-order mark dropped); a file without rows is refused
    (Arrow reads a header alone as no rows, and the message would not say why)."""
    import csv

    with _opened(path, "rt", encoding="utf-8-sig", newline="", errors="replace") as handle:
        records = csv.reader(handle)
        header = next(records, None)
        try:
            first = next(records, None)
        except csv.Error:  # a value past the csv module's field limit (128 KiB): a row all the same, for Arrow
            first = []
    if not header or first is None:
        raise DataError(f"{path}: cannot read it as CSV ({'empty' if not header else 'a header without rows'}); is "
                        "it empty, or a header without rows? Fix the file or point data.datasets[].path at another.")
    return header


def _parquet_rows(path: Path, prefix: str, skip: int):
    import pyarrow
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        if parquet.metadata.num_rows <= skip:  # a resume past this file: its row groups are never decoded
            return parquet.metadata.num_rows
        return (yield from _batch_rows(parquet.iter_batches(batch_size=CHUNK_ROWS), prefix, skip))
    except pyarrow.ArrowException as exc:
        raise DataError(f"{path}: cannot read it as Parquet ({_reason(exc)}). Fix the file or point "
                        "data.datasets[].path at another.") from None


def _batch_rows(batches, prefix: str, skip: int):
    """Row dicts of Arrow record batches, numbered from 1, the first `skip` rows read past (sliced off, not converted)."""
    seen = 0
    for batch in batches:
        cut = min(max(skip - seen, 0), batch.num_rows)
        for number, row in enumerate(batch.slice(cut).to_pylist(), start=seen + cut + 1):
            yield row, f"{prefix}row {number}", False
        seen += batch.num_rows
    return min(skip, seen)


def _json_is_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (parsed whole) rather than JSON Lines. One object written over several
    lines (`{"data": [...]}`, pretty-printed) is neither, and is refused naming what it holds."""
    with _opened(path, "rt", encoding="utf-8-sig") as handle:
        first = next((line for line in handle if line.strip()), "")
    if first.lstrip().startswith("["):
        return True
    try:
        json.loads(first)
        return False  # a whole value on the first line: JSON Lines
    except json.JSONDecodeError:
        pass
    try:
        value = json.loads("".join(_text_lines(path)))
    except json.JSONDecodeError:
        return False  # JSON Lines with a broken line: named with its line and column when read
    if not isinstance(value, list):
        raise DataError(_not_rows(path, value))
    return True


def _json_array(path: Path) -> list:
    try:
        rows = json.loads("".join(_text_lines(path)))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}). Fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(_not_rows(path, rows))
    return rows


def _not_rows(path: Path, value) -> str:
    lists = [key for key, item in value.items() if isinstance(item, list)] if isinstance(value, dict) else []
    hint = (f" Its `{lists[0]}` holds a list: save that list as the file, e.g. as JSON Lines with "
            f"`jq -c '.{lists[0]}[]' {path.name} > rows.jsonl`." if lists else "")
    kind = f"an object (keys: {', '.join(map(str, value))})" if isinstance(value, dict) else type(value).__name__
    return f"{path}: a JSON data file must hold a list of rows (or be JSON Lines: one object per line), got {kind}.{hint}"


RECODE = ("Fix: convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`, naming its real encoding), "
          "or remove the line.")


def _opened(path: Path, mode: str, **options):
    """The file, decompressed when its name ends in .gz, .bz2 or .xz."""
    return COMPRESSED.get(path.suffix.lower(), open)(path, mode, **options)


def _text_lines(path: Path) -> Iterator[str]:
    """The lines of a JSON Lines file (Python's universal newlines: \\n, \\r\\n or \\r; a leading UTF-8 byte-order mark
    dropped, as editors on Windows write it). Bytes that are not UTF-8 name the file, the line and the fix: the text
    reader cannot say which line, so the bytes are read again to find it (only then)."""
    try:
        with _opened(path, "rt", encoding="utf-8-sig") as handle:
            yield from handle
    except UnicodeDecodeError:
        number, column, byte = _first_undecodable(path)
        raise DataError(f"{path} line {number}: not UTF-8 text (byte {byte:#04x} at column {column}). {RECODE}") from None


def _first_undecodable(path: Path) -> tuple[int, int, int]:
    """(line, column, byte) of the first bytes that are not UTF-8, lines counted as universal newlines count them."""
    number = 0
    with _opened(path, "rb") as handle:
        for raw in handle:
            body = raw.removesuffix(b"\n").removesuffix(b"\r")
            for line in body.split(b"\r"):  # bare carriage returns end lines too
                number += 1
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return number, exc.start + 1, line[exc.start]
    return number, 1, 0


# ------------------------------------------------------------------------------------------------- folders
def _saved_folder(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _data_suffix(path: Path) -> str | None:
    """.jsonl, .json, .csv or .parquet for a data file (also compressed: a.jsonl.gz), else None."""
    suffixes = [suffix.lower() for suffix in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in COMPRESSED and suffixes[:-1] != [".parquet"]:  # Parquet compresses inside
        suffixes.pop()
    return suffixes[-1] if suffixes and suffixes[-1] in LOCAL_SUFFIXES else None


def folder_files(path: Path, spec: DatasetSpec) -> list[Path]:
    """Every data file of a folder that is not a save_to_disk folder, by path. Names choose a split only where they
    give two or more (a hub download's data/train-*.parquet and data/test-*.parquet), and then each file must be of
    one: `datasets`' guessing read train.jsonl alone of train.jsonl, batch2.jsonl and batch3.jsonl."""
    # hidden files and folders (a hub download's .cache) are not data, to `datasets` either
    found = sorted((file for file in path.rglob("*") if file.is_file() and not any(
        part.startswith((".", "__")) for part in file.relative_to(path).parts)), key=lambda file: file.relative_to(path).as_posix())
    files = [file for file in found if _data_suffix(file)]
    named = lambda group: ", ".join(file.relative_to(path).as_posix() for file in group[:8]) + (
        f" and {len(group) - 8} more" if len(group) > 8 else "")
    if not files:
        raise DataError(f"{path}: a folder with no .jsonl, .json, .csv or .parquet data files "
                        f"({'it holds ' + named(found) if found else 'it is empty'}). Point data.datasets[].path at "
                        "a data file or a folder of them, or a `datasets.save_to_disk` folder.")
    if spec.subset is not None:
        raise DataError(f"{path}: data.datasets[].subset `{spec.subset}` is for a hub dataset's configurations; a "
                        "local folder is read whole. Point the path at the subset's own folder or file instead.")
    splits = _named_splits(path, files)
    if len(splits) < 2:
        if spec.split not in ("train", *splits):
            raise DataError(f"{path}: split `{spec.split}` not found: the folder's files ({named(files)}) name no "
                            "other split, and are read whole as one. Remove data.datasets[].split, or point the path "
                            "at the split's own files.")
        return files
    left = [file for file in files if not any(file in group for group in splits.values())]
    if left:
        raise DataError(f"{path}: the file names give splits ({', '.join(sorted(splits))}), and reading split "
                        f"`{spec.split}` would leave out the data files named after none: {named(left)}. Fix: rename "
                        "them after a split (e.g. train-2.jsonl), move them out, or give each its own data.datasets entry.")
    if spec.split not in splits:
        raise DataError(f"{path}: split `{spec.split}` not found (the file names give {', '.join(sorted(splits))}); "
                        "set data.datasets[].split.")
    return [file for file in files if file in splits[spec.split]]


def _named_splits(path: Path, files: list[Path]) -> dict[str, set[Path]]:
    """Split -> the files its name patterns match, by `datasets`' own rules (train/test/validation and their
    synonyms as a word of the name, `SPLIT-00000-of-00003` shards). A folder whose names give no split: {}."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        resolved = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except Exception:  # noqa: BLE001  `datasets` found nothing it reads: no split names either
        return {}
    ours = {file.resolve(): file for file in files}  # `datasets` gives absolute paths
    splits = {str(name): {ours[found] for found in map(Path, group) if found in ours} for name, group in resolved.items()}
    return {name: group for name, group in splits.items() if group}


def _load_saved(path: Path, spec: DatasetSpec):
    """A `save_to_disk` folder: memory-mapped Arrow files, read as they are (no `datasets` cache in between)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise DataError(f"{path}: split `{spec.split}` not found (has {list(loaded)}); set data.datasets[].split.")
        loaded = loaded[spec.split]
    return loaded


def _load_hub(spec: DatasetSpec):
    import datasets

    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()  # offline: the `datasets` cache only, failing at once instead of retrying

    try:
        return datasets.load_dataset(spec.path, spec.subset, split=spec.split)
    except Exception as exc:  # noqa: BLE001  datasets raises many types for offline / missing names
        raise DataError(
            f"data.datasets path `{spec.path}`: not a local file and could not be loaded as a `datasets` name "
            f"({_reason(exc)}). If you are offline, download it elsewhere "
            "(`datasets.load_dataset(...).save_to_disk(DIR)`) and set the path to DIR."
        ) from None


def _reason(exc: BaseException) -> str:
    """The error's first line and, where it wraps another (`datasets`' "An error occurred while generating the
    dataset"), the last line of the innermost cause: what actually went wrong."""
    top, seen = exc, [exc]
    while (inner := exc.__cause__ or exc.__context__) is not None and inner not in seen:
        exc = inner
        seen.append(exc)
    first, last = (str(top).strip() or type(top).__name__).splitlines()[0], (str(exc).strip() or type(exc).__name__).splitlines()[-1]
    return first[:200] if exc is top or last == first else f"{first[:200]}: {last[:200]}"


def check_local_files(recipe: Recipe) -> None:
    """Before anything loads: every local data file (train and eval) exists, has a supported type, and its first rows
    have the fields its format needs. Hub names are checked when they load."""
    for key, specs in (("data.datasets", recipe.data.datasets), ("data.eval_datasets", recipe.data.eval_datasets)):
        for index, spec in enumerate(specs):
            _check_column_names(spec, f"{key}[{index}]")
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
            if path.is_dir() and not _saved_folder(path):  # which files it reads, and their first lines
                for file in folder_files(path, spec):
                    if _data_suffix(file) == ".jsonl":
                        _check_first_lines(file, spec, f"{where} file {file.relative_to(path).as_posix()}",
                                           bad_rows=recipe.data.bad_rows)


def _check_column_names(spec: DatasetSpec, where: str) -> None:
    """Every key of `columns` is a field of the format: another (a typo, or a field of another format) was ignored."""
    if spec.format == "prompt":  # GRPO: any column can be mapped, for the reward functions (data/prompts.py)
        return
    required, optional = FORMAT_FIELDS[spec.format]
    turns = ("role", "content", "reasoning") if spec.format in ("chat", "preference", "unpaired_preference") else ()
    fields = sorted({*required, *optional, *turns})
    unknown = sorted(set(spec.columns) - set(fields))
    if unknown:
        raise DataError(f"{where}.columns: `{unknown[0]}` is not a field of format `{spec.format}` (its fields: "
                        f"{', '.join(fields)}), so the mapping would be ignored. Fix: map one of those fields (field: "
                        "the column in the data), or set the dataset's format.")


def _check_first_lines(path: Path, spec: DatasetSpec, where: str, *, bad_rows: str, lines: int = 20) -> None:
    """The first lines of a JSON Lines file parse (unless bad_rows: skip) and, together, have the fields of the
    dataset's format: a file in another format fails here, in seconds, before a tokenizer or a model loads."""
    rows = []
    for number, line in enumerate(itertools.islice(_text_lines(path), lines), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line.removesuffix("\n")))  # the newline would move the column to the next line
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
