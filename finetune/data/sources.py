"""Where rows come from: local files and folders (read by data/readers.py, csv_files.py; a folder's files chosen by
folders.py), save_to_disk folders, hub datasets; the pre-flight check of local files."""

from __future__ import annotations

import difflib
import functools
import hashlib
import itertools
import json
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data.csv_files import csv_rows
from finetune.data.folders import folder_files, saved_folder
from finetune.data.ported_rows import checked_spec
from finetune.data.readers import (
    CHUNK_CHARS,
    CHUNK_ROWS,
    COMPRESSED,
    DAMAGED,
    FILE_TYPES,
    BlankLine,
    arrow_rows,
    damaged,
    data_suffix,
    file_suffix,
    json_array_rows,
    json_is_array,
    json_lines_rows,
    looks_local,
    parquet_rows,
    reason,
    text_lines,
    text_rows,
)
from finetune.data.templates import FORMAT_FIELDS, _column
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe
from finetune.recipe.text import locale_path_problem


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
    if problem := split_problem(spec, path):
        raise DataError(f"data.datasets path `{spec.path}`: {problem}")
    if path.is_file() or (path.is_dir() and not saved_folder(path)):
        files, folder = local_files(spec)
        return Source(spec, files=files, folder=folder)
    if path.is_dir():
        return Source(spec, table=_load_saved(path, spec))
    if local_looking(spec.path):
        raise DataError(not_found(f"data.datasets path `{spec.path}`", spec.path))
    return Source(spec, table=_load_hub(spec))


def local_looking(text: str) -> bool:
    """A path that names no hub dataset: a local-looking one (readers.looks_local), one with a Windows `\\` (no hub
    name has one: `data\\chats` was looked up on the hub), or one this locale cannot name."""
    return looks_local(text) or "\\" in text or locale_path_problem(text) is not None


def not_found(where: str, text: str) -> str:
    """The paragraph of a local path that does not exist; a glob pattern is said to be one (paths are not expanded:
    a folder is the way to name several files, and its bytes are what the token cache is keyed by)."""
    if any(char in text for char in "*?["):
        return (f"{where}: not found, and `{text}` looks like a glob pattern, which is not expanded: a path names one "
                "file or one folder. Fix: point the path at the folder (every data file in it and its sub-folders is "
                "read), or move the files you want into a folder of their own, or give each file its own entry.")
    if problem := locale_path_problem(text):  # the file may well exist: this process cannot name it
        return f"{where}: {problem}"
    said = f"{where}: file not found (relative paths are read from {Path.cwd()})."
    if "\\" in text:
        posix = text.replace("\\", "/")
        there = f" `{posix}` exists here." if Path(posix).expanduser().exists() else ""
        return (f"{said} The path holds `\\`, which separates folders on Windows; here `/` does, and `\\` is a "
                f"character of the name.{there} Fix: write the path with `/`: `{posix}`.")
    return said + near_name(Path(text).expanduser())


def near_name(path: Path) -> str:
    """What to say of a file or folder in `path`'s folder whose name is near `path`'s: one that differs only in Unicode
    normalization first (macOS writes `é` as e + U+0301, NFD; a recipe typed elsewhere holds é, NFC: the two print
    alike, and the file was "not found"), else a near spelling. "" where there is none."""
    folder = path.parent
    try:
        names = [entry.name for entry in itertools.islice(folder.iterdir(), 10_000) if not entry.name.startswith(".")]
    except OSError:
        return ""
    same = [name for name in names if unicodedata.normalize("NFC", name) == unicodedata.normalize("NFC", path.name)]
    if same:
        return (f" {folder / same[0]} exists: the names differ only in Unicode normalization (the same letters as "
                "other code points: macOS writes names decomposed, NFD; most editors compose them, NFC), and a file "
                "name is its code points. Fix: rename the file to the name the path writes (`mv`, typing the name), or "
                "copy its name from `ls` into the path.")
    if near := nearest_name(path.name, names):
        return f" Did you mean {folder / near}?"
    files = sorted(name for name in names if data_suffix(Path(name)) and (folder / name).is_file())
    if 0 < len(files) <= LISTED_FILES:  # no near spelling: what is there, for the user to choose (never a guess)
        return f" {folder} holds: {', '.join(files)}."
    return ""


LISTED_FILES = 6  # a folder with at most this many data files and no near name: they are listed instead
NEAR_STEMS = 0.8  # difflib's ratio of two names without their suffixes, from which one is offered for the other
# The words of a split's name -> which split (one spelled either way may be offered for the other: train_data for
# training_data, val for eval; never another split)
SPLIT_WORDS = {"train": "train", "training": "train", "test": "test", "testing": "test",
               **dict.fromkeys(("eval", "evaluation", "valid", "validation", "val", "dev", "holdout"), "eval")}


def nearest_name(name: str, names: list[str]) -> str | None:
    """The one of `names` that is a near spelling of `name` (a typo), or None. Compared without their suffixes: with
    them, difflib's default (0.6) was met by `.jsonl` alone, and a missing train.jsonl was offered test.jsonl, the
    test split, to train on (bb38). Never offered: a name of another split (train / test / eval ...) or a numbered
    sibling (part-1 for part-2), which are other files on purpose, however alike they are spelled."""
    stem = _stem(name)
    scored = [(_near(stem, _stem(other)), other) for other in names if _may_be_meant(stem, _stem(other))]
    best = max(scored, default=(0.0, None), key=lambda pair: (pair[0], Path(pair[1]).suffix == Path(name).suffix))
    return best[1] if best[0] >= NEAR_STEMS else None


def _may_be_meant(stem: str, other: str) -> bool:
    """Whether `other` may be offered for `stem` (both without suffixes): the same stem; else not a numbered sibling,
    and each split word of either is in the other or spelled near a word there that is no split word (a typo)."""
    if other == stem:
        return True
    if re.sub(r"\d+", "", other) == re.sub(r"\d+", "", stem):
        return False
    words = [re.split(r"[^a-z]+", text) for text in (stem, other)]
    return all(SPLIT_WORDS[word] in {SPLIT_WORDS.get(typed) for typed in there}
               or any(_near(word, typed) >= NEAR_STEMS for typed in there if typed not in SPLIT_WORDS)
               for here, there in (words, words[::-1]) for word in here if word in SPLIT_WORDS)


def _near(one: str, other: str) -> float:
    return difflib.SequenceMatcher(None, one, other).ratio()


def _stem(name: str) -> str:
    """A name without its data suffixes (`train.jsonl.gz` -> `train`), lower case."""
    path = Path(name.lower())
    while path.suffix and (path.suffix in COMPRESSED or data_suffix(path) == path.suffix):
        path = path.with_suffix("")
    return path.name


def hub_name_note(text: str) -> str:
    """For a name that loaded neither as a local path nor from the hub: that no local file or folder has it, and a
    near name in its parent folder when that folder exists here (a mistyped `data/splitz` is taken for a hub name)."""
    path = Path(text).expanduser()
    note = (f" No local file or folder `{text}` exists (relative paths are read from {Path.cwd()}), so it was taken "
            "for a hub dataset name.")
    if str(path.parent) not in ("", ".") and path.parent.is_dir():
        names = [entry.name for entry in path.parent.iterdir() if not entry.name.startswith(".")]
        near = nearest_name(path.name, names)
        note += (f" The folder {path.parent} exists here" + (f": did you mean {path.parent / near}?" if near else
                 f" and holds no `{path.name}`: fix the path if you meant a local folder."))
    return note


def split_problem(spec: DatasetSpec, path: Path) -> str | None:
    """A split or subset set on a source that has none to pick (a folder checks its own: folders.py). A single file is
    one split of one configuration (`load_dataset` names all its rows `train`), and so is a save_to_disk Dataset; a
    saved DatasetDict has splits (`split` picks one) and no configurations. Ignored there, the whole source was read:
    an eval file's `split: test` evaluated on every training row."""
    saved = path.is_dir() and saved_folder(path)
    if not (path.is_file() or saved):
        return None
    listing = path / "dataset_dict.json"
    splits = json.loads(listing.read_text(encoding="utf-8")).get("splits", []) if saved and listing.is_file() else None
    if spec.split != "train" and splits is None:
        if path.is_file():
            what = "a single file"
            own = ("the split's own file, or at a folder whose file names give the splits (train.jsonl, test.jsonl; "
                   "`split` then picks one)")
        else:
            what, own = f"{path} is a save_to_disk folder of one Dataset, which", "a DatasetDict saved with its splits"
        return (f"split `{spec.split}` is set, but {what} has no splits: the whole of it would be read as the `train` "
                f"split. Fix: remove `split` (or set it to train), or point the path at {own}.")
    if spec.subset is not None:
        held = f" (its splits, which `split` picks: {', '.join(map(str, splits))})" if splits else ""
        place = "a single file" if path.is_file() else "a save_to_disk folder"
        return (f"subset `{spec.subset}` is set, but {place} has no subsets (configurations){held}: it would be "
                "ignored and the whole of it read. Fix: remove `subset` (or set it to null), or point the path at the "
                "subset's own file or folder.")
    return None


def local_files(spec: DatasetSpec) -> tuple[list[Path], Path | None]:
    """(files, folder) of a local dataset: a data file alone (folder None), or a folder's data files."""
    path = Path(spec.path).expanduser()
    if path.is_dir():
        return folder_files(path, spec), path
    if file_suffix(path) is None:
        raise DataError(f"data.datasets path {path}: {_unsupported(path)}")
    return [path], None


def _unsupported(path: Path) -> str:
    folder = (f" A {data_suffix(path)} file is read as rows inside a folder of them: point the path at its folder "
              f"({path.parent}).") if data_suffix(path) in (".txt", ".arrow") else ""
    return f"unsupported file type `{path.suffix}`; use {FILE_TYPES}.{folder}"


def row_chunks(source: Source, *, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[list, list[str], bool]]:
    """(items, places, raw) per chunk, in order, at most spec.max_rows rows. `raw`: the items are JSON Lines text,
    parsed by whoever tokenizes the chunk (so parsing is spread over the processes too). A chunk holds rows of one
    kind (lines or row dicts): in a folder of JSON Lines and CSV files, a new chunk starts where the kind changes."""
    entries = (_table_rows(source.table) if source.table is not None else
               local_rows(source.files, source.folder, sample_by=source.spec.sample_by))
    if source.spec.max_rows is not None:
        entries = itertools.islice(entries, source.spec.max_rows)
    for raw, group in itertools.groupby(entries, key=lambda entry: entry[2]):
        while chunk := _sized_chunk(group, chunk_rows):
            yield [item for item, _, _ in chunk], [place for _, place, _ in chunk], raw


def _sized_chunk(entries, rows: int, chars: int = CHUNK_CHARS) -> list:
    """The next entries, up to `rows` of them or `chars` characters of text (at least one entry)."""
    chunk, size = [], 0
    for entry in entries:
        chunk.append(entry)
        size += _text_size(entry[0])
        if len(chunk) >= rows or size >= chars:
            break
    return chunk


def _text_size(item) -> int:
    """The characters of text an item holds: a JSON line's, or the strings of a row's values at any depth."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(map(_text_size, item.values()))
    if isinstance(item, (list, tuple)):
        return sum(map(_text_size, item))
    return 0


def _table_rows(table) -> Iterator[tuple[dict, str, bool]]:
    """A `datasets.Dataset`'s rows as dicts, read a chunk of columns at a time."""
    for start in range(0, len(table), CHUNK_ROWS):
        columns = table[start:start + CHUNK_ROWS]
        for number, values in enumerate(zip(*columns.values()), start=start + 1):
            yield dict(zip(columns, values)), f"row {number}", False


def load_rows(spec: DatasetSpec) -> list[dict]:
    """Rows of one dataset as plain dicts (small datasets and checks; training reads chunks through row_chunks). A
    .txt file's blank lines are no rows (readers.BlankLine): left out."""
    rows = []
    for items, _, raw in row_chunks(open_source(spec)):
        rows += [json.loads(item) for item in items] if raw else [item for item in items if not isinstance(item, BlankLine)]
    return rows


# --------------------------------------------------------------------------------------------- local files
def local_rows(files: list[Path], folder: Path | None, start: int = 0, *,
               sample_by: str | None = None) -> Iterator[tuple[object, str, bool]]:
    """(item, place, raw) of the files' rows in order, from row `start` on (the rows before it are read past, never
    parsed or converted). Items are JSON Lines text (raw, without its newline, so a parse error's column is the line's
    own) or row dicts. A place is `line N` or `row N`, after the file's name within `folder` when there is one.
    `sample_by`: data.datasets[].sample_by, what a row of a .txt file is (readers.text_rows)."""
    skip = start
    for file in files:
        prefix = f"{file.relative_to(folder).as_posix()} " if folder is not None else ""
        kind = data_suffix(file)
        if kind == ".json" and json_is_array(file):
            reader = json_array_rows
        else:
            reader = {".jsonl": json_lines_rows, ".json": json_lines_rows, ".csv": csv_rows, ".tsv": csv_rows,
                      ".parquet": parquet_rows, ".txt": functools.partial(text_rows, sample_by=sample_by),
                      ".arrow": arrow_rows}[kind]
        try:
            skip -= yield from reader(file, prefix, skip)
        except DAMAGED as exc:  # a compressed CSV cut short (text files: readers.text_lines says it itself)
            if file.suffix.lower() not in COMPRESSED:
                raise
            raise damaged(file, exc) from None


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
        error = DataError(
            f"data.datasets path `{spec.path}`: not a local file and could not be loaded as a `datasets` name "
            f"({hub_reason(exc)}).{hub_name_note(spec.path)} If you are offline, download it elsewhere "
            "(`datasets.load_dataset(...).save_to_disk(DIR)`) and set the path to DIR.")
        error.alike_on_every_rank = False  # a hub that did not answer this rank: said at once (data.build_examples)
        raise error from None


def hub_reason(exc: BaseException) -> str:
    """`reason`, without `datasets`' offline "is not cached in None" (its cache folder when none is set)."""
    return reason(exc).replace(" is not cached in None", " is not in the `datasets` cache")


def check_local_files(recipe: Recipe) -> None:
    """Before anything loads: every local data file (train and eval) exists, has a supported type, and its first rows
    have the fields its format needs. Hub names are checked when they load."""
    for key, specs in (("data.datasets", recipe.data.datasets), ("data.eval_datasets", recipe.data.eval_datasets)):
        for index, spec in enumerate(specs):
            _check_column_names(spec, f"{key}[{index}]")
            path = Path(spec.path).expanduser()
            where = f"{key}[{index}] path `{spec.path}`"
            if not path.exists():
                if local_looking(spec.path):
                    raise DataError(not_found(where, spec.path))
                continue
            if problem := split_problem(spec, path):
                raise DataError(f"{where}: {problem}")
            if path.is_file() and file_suffix(path) is None:
                raise DataError(f"{where}: {_unsupported(path)}")
            if path.is_file() and file_suffix(path) == ".jsonl":
                _check_first_lines(path, spec, where, bad_rows=recipe.data.bad_rows)
            if path.is_dir() and not saved_folder(path):  # which files it reads, and their first lines
                for file in folder_files(path, spec):
                    if data_suffix(file) == ".jsonl":
                        _check_first_lines(file, spec, f"{where} file {file.relative_to(path).as_posix()}",
                                           bad_rows=recipe.data.bad_rows)


def _check_column_names(spec: DatasetSpec, where: str) -> None:
    """Every key of `columns` is a field of the format: another (a typo, or a field of another format) was ignored."""
    if spec.format == "prompt":  # GRPO: any column can be mapped, for the reward functions (data/prompts.py)
        return
    required, optional = FORMAT_FIELDS[spec.format]
    turns = ("role", "content", "reasoning") if spec.format in ("chat", "preference", "unpaired_preference") else ()
    pairs = ("chosen", "rejected") if spec.format == "unpaired_preference" else ()  # a pair file, unpaired (ported_rows)
    fields = sorted({*required, *optional, *turns, *pairs})
    unknown = sorted(set(spec.columns) - set(fields))
    if unknown:
        raise DataError(f"{where}.columns: `{unknown[0]}` is not a field of format `{spec.format}` (its fields: "
                        f"{', '.join(fields)}), so the mapping would be ignored. Fix: map one of those fields (field: "
                        "the column in the data), or set the dataset's format.")


def _check_first_lines(path: Path, spec: DatasetSpec, where: str, *, bad_rows: str, lines: int = 20) -> None:
    """The first lines of a JSON Lines file parse (unless bad_rows: skip) and, together, have the fields of the
    dataset's format: a file in another format fails here, in seconds, before a tokenizer or a model loads."""
    rows = []
    for number, line in enumerate(itertools.islice(text_lines(path), lines), start=1):
        if not line.strip():
            continue
        try:
            # (the newline would move the column to the next line; text_lines drops a byte-order mark of any line)
            rows.append(json.loads(line.removesuffix("\n")))
        except json.JSONDecodeError as exc:
            if bad_rows == "error":
                raise DataError(f"{where}: line {number} is not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}); a "
                                "JSON Lines file holds one JSON object per line.") from None
    objects = [row for row in rows if isinstance(row, dict)]
    if rows and not objects:
        raise DataError(f"{where}: the rows are {type(rows[0]).__name__}s, not objects with the fields of format "
                        f"`{spec.format}`.")
    spec = checked_spec(spec, objects)  # a pair file given as unpaired_preference: a pair's fields (ported_rows)
    required, _ = FORMAT_FIELDS[spec.format]
    for name in required:
        if objects and all(_column(spec, name, row) not in row for row in objects):
            fields = sorted({key for row in objects for key in row})
            raise DataError(
                f"{where}: no row has the `{_column(spec, name, objects[0])}` field that format `{spec.format}` needs "
                f"(fields: {', '.join(fields) or 'none'}). {_FORMAT_FIX[_FAMILY.get(spec.format, 'sft')]}"
            )


# The formats of each family (what an objective trains on: recipe/objectives.py), for a file whose rows lack a field
# of its format: its fix names the formats its objectives take (a kto run cannot use an SFT format).
_FAMILY = {"preference": "preference", "unpaired_preference": "preference", "prompt": "prompt"}
_FORMAT_FIX = {
    "sft": "Set the dataset's format (alpaca | chat | completion | text: the formats of train.objective sft) or map "
           "the columns with `columns:`.",
    "preference": "Set the dataset's format (preference: prompt/chosen/rejected pairs, for train.objective dpo and "
                  "reward, and kto, which unpairs them as TRL's KTOTrainer does | unpaired_preference: "
                  "prompt/completion/label rows, for kto) or map the columns with `columns:` (docs/preference.md).",
    "prompt": "Format prompt (train.objective grpo) needs each row's `prompt` (text or chat messages): map yours with "
              "`columns: {prompt: NAME}` (docs/grpo.md).",
}
