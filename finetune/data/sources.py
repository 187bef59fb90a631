"""Where rows come from: local JSON/JSONL/CSV/Parquet files, folders, hub datasets; the pre-flight file check."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from finetune.data.templates import FORMAT_FIELDS, _column
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

# ----------------------------------------------------------------------------------------------------- loading
CHUNK_ROWS = 1000  # rows per chunk handed to a tokenizing process: a few MB of tokens, never the whole dataset

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass
class Source:
    """One dataset opened for reading: JSON Lines are read line by line; everything else is a `datasets.Dataset`
    (memory-mapped Arrow) or, for a JSON array file, its parsed rows."""

    spec: DatasetSpec
    jsonl: Path | None = None
    table: object | None = None  # datasets.Dataset
    rows: list | None = None  # a JSON array file's rows

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

    def byte_size(self) -> int | None:
        return self.jsonl.stat().st_size if self.jsonl is not None else None


def open_source(spec: DatasetSpec) -> Source:
    """Open a local JSON/JSONL/CSV/Parquet file, a folder (save_to_disk, or data files) or a `datasets` hub name."""
    path = Path(spec.path).expanduser()
    if path.is_file():
        if path.suffix == ".jsonl":
            return Source(spec, jsonl=path)
        if path.suffix == ".json":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}). "
                                f"{RECODE}") from None
            if not text.lstrip().startswith("["):
                return Source(spec, jsonl=path)  # a .json file holding JSON Lines
            return Source(spec, rows=_json_array(path, text))
        if path.suffix in (".csv", ".parquet"):
            import datasets

            try:
                table = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train")
            except Exception as exc:  # noqa: BLE001  (an empty file, a header without rows, bytes not CSV)
                raise DataError(f"{path}: `datasets` cannot read it as {path.suffix[1:].upper()} ({_first_line(exc)}); "
                                "is it empty, or a header without rows? Fix the file or point data.datasets[].path at "
                                "another.") from None
            return Source(spec, table=table)
        raise DataError(f"data.datasets path {path}: unsupported file type `{path.suffix}`; use .jsonl, .json, .csv "
                        "or .parquet.")
    if path.is_dir():
        return Source(spec, table=_load_folder(path, spec))
    if spec.path.startswith((".", "/", "~")) or Path(spec.path).suffix in LOCAL_SUFFIXES:
        raise DataError(f"data.datasets path `{spec.path}`: file not found (relative paths are read from {Path.cwd()}).")
    return Source(spec, table=_load_hub(spec))


def _json_array(path: Path, text: str) -> list:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}). Fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a JSON data file must hold a list of rows (or be JSON Lines), got {type(rows).__name__}.")
    return rows


def row_chunks(source: Source, *, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[list, list[str], bool]]:
    """(items, places, raw) per chunk, in order, at most spec.max_rows rows. `raw`: the items are JSON Lines text,
    parsed by whoever tokenizes the chunk (so parsing is spread over the processes too)."""
    limit = source.spec.max_rows if source.spec.max_rows is not None else float("inf")
    if source.jsonl is not None:
        yield from _line_chunks(source.jsonl, limit, chunk_rows)
        return
    count = min(limit, len(source.rows) if source.rows is not None else len(source.table))
    word = "row"
    for start in range(0, int(count), chunk_rows):
        end = int(min(count, start + chunk_rows))
        if source.rows is not None:
            items = source.rows[start:end]
        else:
            columns = source.table[start:end]
            items = [dict(zip(columns, values)) for values in zip(*columns.values())]
        yield items, [f"{word} {i}" for i in range(start + 1, end + 1)], False


def _line_chunks(path: Path, limit: float, chunk_rows: int) -> Iterator[tuple[list, list[str], bool]]:
    lines, places, taken = [], [], 0
    for number, line in enumerate(_text_lines(path), start=1):
        if not line.strip():
            continue
        if taken >= limit:
            break
        lines.append(line)
        places.append(f"line {number}")
        taken += 1
        if len(lines) == chunk_rows:
            yield lines, places, True
            lines, places = [], []
    if lines:
        yield lines, places, True


RECODE = ("Fix: convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`, naming its real encoding), "
          "or remove the line.")


def _text_lines(path: Path) -> Iterator[str]:
    """The lines of a JSON Lines file (Python's universal newlines: \\n, \\r\\n or \\r). Bytes that are not UTF-8
    name the file, the line and the fix: the text reader cannot say which line, so the bytes are read again to find
    it (only then)."""
    try:
        with open(path, encoding="utf-8") as handle:
            yield from handle
    except UnicodeDecodeError:
        number, column, byte = _first_undecodable(path)
        raise DataError(f"{path} line {number}: not UTF-8 text (byte {byte:#04x} at column {column}). {RECODE}") from None


def _first_undecodable(path: Path) -> tuple[int, int, int]:
    """(line, column, byte) of the first bytes that are not UTF-8, lines counted as universal newlines count them."""
    number = 0
    with open(path, "rb") as handle:
        for raw in handle:
            body = raw.removesuffix(b"\n").removesuffix(b"\r")
            for line in body.split(b"\r"):  # bare carriage returns end lines too
                number += 1
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return number, exc.start + 1, line[exc.start]
    return number, 1, 0


def load_rows(spec: DatasetSpec) -> list[dict]:
    """Rows of one dataset as plain dicts (small datasets and checks; training reads chunks through row_chunks)."""
    rows = []
    for items, _, raw in row_chunks(open_source(spec)):
        rows += [json.loads(item) for item in items] if raw else items
    return rows


def _load_folder(path: Path, spec: DatasetSpec):
    """A `save_to_disk` folder, else a folder of data files (a downloaded hub dataset) read by `load_dataset`."""
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise DataError(f"{path}: split `{spec.split}` not found (has {list(loaded)}); set data.datasets[].split.")
            loaded = loaded[spec.split]
        return loaded
    try:
        return datasets.load_dataset(str(path), spec.subset, split=spec.split)
    except Exception as exc:  # noqa: BLE001  datasets raises many types for folders it cannot read
        raise DataError(f"{path}: a folder that is neither a `datasets.save_to_disk` folder nor a folder of data files "
                        f"`datasets.load_dataset` can read ({_first_line(exc)}). Point data.datasets[].path at a file, "
                        "or check split/subset.") from None


def _load_hub(spec: DatasetSpec):
    import datasets

    from finetune.hub import use_cache_only_if_unreachable

    use_cache_only_if_unreachable()  # offline: the `datasets` cache only, failing at once instead of retrying

    try:
        return datasets.load_dataset(spec.path, spec.subset, split=spec.split)
    except Exception as exc:  # noqa: BLE001  datasets raises many types for offline / missing names
        raise DataError(
            f"data.datasets path `{spec.path}`: not a local file and could not be loaded as a `datasets` name "
            f"({_first_line(exc)}). If you are offline, download it elsewhere "
            "(`datasets.load_dataset(...).save_to_disk(DIR)`) and set the path to DIR."
        ) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


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
