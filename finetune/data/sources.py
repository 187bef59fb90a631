"""Where rows come from: local JSON/JSONL/CSV/Parquet files, folders, hub datasets; the pre-flight file check."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from finetune.data.templates import FORMAT_FIELDS, _column
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe


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
