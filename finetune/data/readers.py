"""The readers of local data files but CSV (data/csv_files.py): JSON Lines, JSON arrays, Parquet, text and Arrow
files, each yielding (item, place, raw) rows from row `skip` on; the suffixes they read; the read-error helpers."""

from __future__ import annotations

import bz2
import codecs
import gzip
import itertools
import json
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

from finetune.errors import DataError

CHUNK_ROWS = 1000  # rows per chunk handed to a tokenizing process: a few MB of tokens, never the whole dataset
# ... and at most about this many characters of text: tokenizing keeps each token's offsets (~70 bytes of memory per
# character), so 1,000 rows of 38 KB took 3.2 GB per chunk in flight (bug bash: continued pretraining on long rows
# ran out of memory with max_length 128); 4M characters are ~0.3 GB, and short rows still come 1,000 at a time.
CHUNK_CHARS = 4_000_000

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
# A folder's data files may also be these, as `datasets` read them before finetune did: `.txt` (a row per line,
# paragraph or file, data.datasets[].sample_by, in a `text` column) and `.arrow` (Arrow IPC streams, as `datasets`
# writes them). A file given alone stays one of LOCAL_SUFFIXES: a stray notes.txt or cache-*.arrow named by mistake
# is refused rather than read as rows.
FOLDER_SUFFIXES = (*LOCAL_SUFFIXES, ".txt", ".arrow")
# Data files may be compressed, as hub downloads often are (`datasets` read them so before finetune did).
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# what reading a damaged compressed file raises: cut short (EOFError), a bad CRC or header (gzip.BadGzipFile, an
# OSError; zlib.error), a corrupt xz/bz2 stream (lzma.LZMAError; bz2's OSError)
DAMAGED = (EOFError, OSError, zlib.error, lzma.LZMAError)
FILE_TYPES = ".jsonl, .json, .csv, .tsv or .parquet (JSON Lines, JSON, CSV and TSV also compressed: .gz, .bz2, .xz)"

RECODE = ("Fix: convert the file to UTF-8 (e.g. `iconv -f cp1252 -t utf-8 IN > OUT`, naming its real encoding: "
          "`-f UTF-16` for a file starting with the bytes ff fe or fe ff, what Windows saves as \"Unicode\"), or remove "
          "the line. (data.bad_rows: skip does not skip it: bytes that are not UTF-8 say the file is in another "
          "encoding, whose other non-ASCII text would be read wrong, so the file is converted, not a row skipped.)")
# Byte-order marks of the encodings Windows saves as "Unicode": a file starting with one is no UTF-8 with a bad line
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
              (codecs.BOM_UTF16_BE, "UTF-16"))


def data_suffix(path: Path) -> str | None:
    """The FOLDER_SUFFIXES type of a data file (also compressed: a.jsonl.gz), else None."""
    suffixes = [suffix.lower() for suffix in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in COMPRESSED and suffixes[:-1] not in ([".parquet"], [".arrow"]):  # compressed inside
        suffixes.pop()
    return suffixes[-1] if suffixes and suffixes[-1] in FOLDER_SUFFIXES else None


def file_suffix(path: Path) -> str | None:
    """The LOCAL_SUFFIXES type of a data file given alone (also compressed: a.jsonl.gz), else None."""
    kind = data_suffix(path)
    return kind if kind in LOCAL_SUFFIXES else None


def looks_local(text: str) -> bool:
    """Whether a data.datasets[].path names a local file (a path, or a data file's name) rather than a hub dataset."""
    return text.startswith((".", "/", "~")) or file_suffix(Path(text)) is not None


# ------------------------------------------------------------------------------------------------ JSON
def json_lines_rows(path: Path, prefix: str, skip: int):
    passed = 0
    for number, line in enumerate(text_lines(path), start=1):
        if line.strip() and passed < skip:
            passed += 1
        elif line.strip():
            yield line.removesuffix("\n"), f"{prefix}line {number}", True
    return passed


def json_array_rows(path: Path, prefix: str, skip: int):
    rows = _json_array(path)
    yield from ((row, f"{prefix}row {number}", False) for number, row in enumerate(rows[skip:], start=skip + 1))
    return min(skip, len(rows))


def json_is_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (parsed whole) rather than JSON Lines. One object holding the rows
    (`{"data": [...]}`), pretty-printed or on one line as `json.dump` writes it, is neither, and is refused naming what
    it holds."""
    lines = text_lines(path)  # bytes that are not UTF-8: named with their line, as when the rows are read
    try:
        filled = (line for line in lines if line.strip())
        first, alone = next(filled, ""), next(filled, None) is None
    finally:
        lines.close()
    if first.lstrip().startswith("["):
        return True
    try:
        value = json.loads(first)
    except json.JSONDecodeError:
        pass
    else:
        # A whole value on the first line: JSON Lines, unless it is the file's only line and holds a list of objects.
        # Read as one row, `{"data": [...]}` was refused for lacking the format's columns, with a `columns:` fix that
        # cannot work. A single row of that shape (one chat) reads from a .jsonl file, where no object is refused.
        if alone and _holds_rows(value):
            raise DataError(_not_rows(path, value) + " (One row of JSON Lines? Name the file .jsonl.)")
        return False
    try:
        value = json.loads("".join(text_lines(path)))
    except json.JSONDecodeError:
        return False  # JSON Lines with a broken line: named with its line and column when read
    if not isinstance(value, list):
        raise DataError(_not_rows(path, value))
    return True


def _json_array(path: Path) -> list:
    try:
        rows = json.loads("".join(text_lines(path)))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}). Fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(_not_rows(path, rows))
    return rows


def _holds_rows(value) -> bool:
    """Whether a JSON value is an object one of whose values is a list of objects: rows wrapped in an object."""
    return isinstance(value, dict) and any(isinstance(item, list) and item and all(isinstance(row, dict) for row in item)
                                           for item in value.values())


def _not_rows(path: Path, value) -> str:
    lists = [key for key, item in value.items() if isinstance(item, list)] if isinstance(value, dict) else []
    hint = (f" Its `{lists[0]}` holds a list: save that list as the file, e.g. as JSON Lines with "
            f"`jq -c '.{lists[0]}[]' {path.name} > rows.jsonl`." if lists else "")
    kind = f"an object (keys: {', '.join(map(str, value))})" if isinstance(value, dict) else type(value).__name__
    return f"{path}: a JSON data file must hold a list of rows (or be JSON Lines: one object per line), got {kind}.{hint}"


# --------------------------------------------------------------------------------------- text and Arrow
class BlankLine(dict):
    """A blank line of a .txt file read a row per line: no row (it separates paragraphs), left out and counted by the
    tokenizing code whatever data.bad_rows says. A dict of empty text, so the dataset checks read it as any row."""

    def __init__(self):
        super().__init__(text="")


def text_rows(path: Path, prefix: str, skip: int, *, sample_by: str | None = None):
    """A .txt file as `datasets`' text builder reads it, in a `text` column, by data.datasets[].sample_by. line (None):
    a row per line (universal newlines, the line break dropped: keep_linebreaks false), a blank line (empty or only
    whitespace) a BlankLine; paragraph: a row per run of lines between blank lines, its line breaks kept but the last;
    document: the file's whole text, unless it is blank. Places are `line N` or `lines N-M`."""
    if sample_by in ("paragraph", "document"):
        return (yield from _text_blocks(path, prefix, skip, whole=sample_by == "document"))
    number = 0
    for number, line in enumerate(text_lines(path), start=1):
        if number > skip:
            text = line.removesuffix("\n")
            yield ({"text": text} if text.strip() else BlankLine()), f"{prefix}line {number}", False
    return min(skip, number)


def _text_blocks(path: Path, prefix: str, skip: int, *, whole: bool):
    """The paragraphs of a .txt file (`whole`: the file as one block), as (row, place, raw) from block `skip` on;
    returns how many of `skip` it passed. A paragraph ends at a blank line (empty or only whitespace) or at the end."""
    blocks, lines, first = 0, [], 0
    for number, line in enumerate(itertools.chain(text_lines(path), [None]), start=1):
        if line is not None and (whole or line.strip()):
            first = first or number
            lines.append(line)
            continue
        if lines and "".join(lines).strip():
            blocks += 1
            if blocks > skip:
                text = "".join(lines) if whole else "".join(lines).removesuffix("\n")
                last = number - 1
                yield {"text": text}, f"{prefix}line {first}" if last == first else f"{prefix}lines {first}-{last}", False
        lines, first = [], 0
    return min(skip, blocks)


def arrow_rows(path: Path, prefix: str, skip: int):
    """An .arrow file as `datasets`' arrow builder read it: an Arrow IPC stream (what `datasets` writes), else an
    Arrow IPC file, a record batch at a time."""
    import pyarrow
    import pyarrow.ipc

    try:
        with opened(path, "rb") as handle:
            try:
                reader = batches = pyarrow.ipc.open_stream(handle)
            except (OSError, pyarrow.ArrowInvalid):
                handle.seek(0)
                reader = pyarrow.ipc.open_file(handle)
                batches = (reader.get_batch(index) for index in range(reader.num_record_batches))
            decoders = json_decoders(reader.schema, path)
            return (yield from batch_rows(batches, prefix, skip, decoders=decoders, path=path))
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataError(f"{path}: cannot read it as an Arrow stream or file ({reason(exc)}). Fix the file or move it "
                        "out of the folder.") from None


# ------------------------------------------------------------------------------------------------ Parquet
def parquet_rows(path: Path, prefix: str, skip: int):
    import pyarrow
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        if parquet.metadata.num_rows <= skip:  # a resume past this file: its row groups are never decoded
            return parquet.metadata.num_rows
        decoders = json_decoders(parquet.schema_arrow, path)
        return (yield from batch_rows(parquet.iter_batches(batch_size=CHUNK_ROWS), prefix, skip, decoders=decoders,
                                      path=path))
    except pyarrow.ArrowException as exc:
        raise DataError(f"{path}: cannot read it as Parquet ({reason(exc)}). Fix the file or point "
                        "data.datasets[].path at another.") from None


def batch_rows(batches, prefix: str, skip: int, *, decoders: dict | None = None, path: Path | None = None):
    """Row dicts of Arrow record batches, numbered from 1, the first `skip` rows read past (sliced off, not converted).
    `decoders`: json_decoders of the file at `path`, applied to their columns of every row."""
    seen = 0
    for batch in batches:
        cut = min(max(skip - seen, 0), batch.num_rows)
        for number, row in enumerate(batch.slice(cut).to_pylist(), start=seen + cut + 1):
            place = f"{prefix}row {number}"
            yield (_decoded(row, decoders, f"{path} row {number}") if decoders else row), place, False
        seen += batch.num_rows
    return min(skip, seen)


# ------------------------------------------------------------------------- `datasets`' Json feature (>= 4.7)
# `datasets` >= 4.7 stores a nested field whose keys differ between rows (a tool's `parameters.properties`, messages of
# which only some have `tool_calls`) as its `Json` feature: JSON text in an `arrow.json` extension column, the feature
# named in the schema's `huggingface` metadata. `push_to_hub` and `to_parquet` write such files. Arrow gives the text;
# `datasets.load_dataset` gives the objects, and so must finetune, or a tool schema trains as an escaped string.
def json_decoders(schema, path: Path) -> dict:
    """{column: function turning its stored values into the rows' objects} for the columns of a Parquet or Arrow file
    that hold `datasets`' Json feature anywhere inside (as `Features.from_arrow_schema` reads the schema, as
    `load_dataset` does); {} for a file without one, which is read as Arrow stores it, at no cost per row."""
    metadata = schema.metadata or {}
    if b'"Json"' not in metadata.get(b"huggingface", b"") and not any(_holds_json_type(field.type) for field in schema):
        return {}
    import datasets

    try:
        features = datasets.Features.from_arrow_schema(schema)
    except (ValueError, TypeError, KeyError) as exc:  # a feature type this `datasets` does not know (Json before 4.7)
        raise DataError(f"{path}: its columns are typed with `datasets`' Json feature (written by datasets >= 4.7), "
                        f"which the installed datasets {datasets.__version__} cannot read ({reason(exc)}). Fix: "
                        "`pip install -U 'datasets>=4.7'`.") from None
    json_type = getattr(datasets, "Json", None)  # None: "Json" named no feature type (a column's name)
    decoders = {name: _json_decoder(feature, json_type) for name, feature in features.items()} if json_type else {}
    return {name: decode for name, decode in decoders.items() if decode is not None}


def _holds_json_type(arrow_type) -> bool:
    """Whether an Arrow type is or holds the `arrow.json` extension type (pyarrow >= 19 knows it)."""
    import pyarrow

    if isinstance(arrow_type, getattr(pyarrow, "JsonType", ())):
        return True
    if isinstance(arrow_type, pyarrow.StructType):
        return any(_holds_json_type(field.type) for field in arrow_type)
    inner = getattr(arrow_type, "value_type", None)  # lists of any kind
    return inner is not None and _holds_json_type(inner)


def _json_decoder(feature, json_type):
    """The function decoding a value of `feature` as `datasets`' decode_nested_example decodes it, but only its Json
    parts (an Image or Audio feature stays the dict Arrow stores, as before), or None where it holds no Json."""
    if isinstance(feature, json_type):
        return (lambda value: None if value is None else feature.decode_example(value)) if feature.decode else None
    if isinstance(feature, dict):
        fields = {key: decode for key, sub in feature.items() if (decode := _json_decoder(sub, json_type)) is not None}
        if not fields:
            return None
        return lambda value: None if value is None else {
            key: fields[key](item) if key in fields else item for key, item in value.items()}
    element = feature[0] if isinstance(feature, (list, tuple)) else getattr(feature, "feature", None)  # List, LargeList
    decode = None if element is None else _json_decoder(element, json_type)
    if decode is None:
        return None
    return lambda value: None if value is None else [decode(item) for item in value]


def _decoded(row: dict, decoders: dict, place: str) -> dict:
    """The row with its Json columns decoded (json_decoders); `place` names it where a value is not JSON."""
    for column, decode in decoders.items():
        try:
            row[column] = decode(row[column])
        except ValueError as exc:  # text that is not JSON in a column its metadata types Json: not as datasets wrote it
            raise DataError(f"{place}: column `{column}` is typed Json by the file's `huggingface` metadata but holds "
                            f"text that is not JSON ({reason(exc)}). Fix the file (write it again with `datasets`), "
                            "or remove the row.") from None
    return row


# ------------------------------------------------------------------------------------------- text helpers
def opened(path: Path, mode: str, **options):
    """The file, decompressed when its name ends in .gz, .bz2 or .xz."""
    return COMPRESSED.get(path.suffix.lower(), open)(path, mode, **options)


def text_lines(path: Path) -> Iterator[str]:
    """The lines of a text file (Python's universal newlines: \\n, \\r\\n or \\r; a leading UTF-8 byte-order mark
    dropped, as editors on Windows write it). Bytes that are not UTF-8 name the file, the line and the fix: the text
    reader cannot say which line, so the bytes are read again to find it (only then)."""
    try:
        with opened(path, "rt", encoding="utf-8-sig") as handle:
            for line in handle:  # a mark starting a later line: two files saved on Windows joined with `cat`
                yield line.removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise DataError(not_utf8(path)) from None
    except DAMAGED as exc:
        if path.suffix.lower() not in COMPRESSED:
            raise
        raise damaged(path, exc) from None


def damaged(path: Path, exc: BaseException) -> DataError:
    """A compressed data file that cannot be read to its end (cut short by a copy or a download, or corrupt): what
    the decompressor said (EOFError, a CRC or format error), the file, and the fix."""
    test = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}[path.suffix.lower()]
    return DataError(f"{path}: the compressed file is damaged or cut short ({reason(exc)}), so its rows cannot all be "
                     f"read. Fix: copy or download it again (`{test} -t {path}` tests it). (data.bad_rows: skip does not "
                     "skip it: a damaged stream has no rows after the damage to skip to.)")


def not_utf8(path: Path) -> str:
    """Why a data file is not UTF-8 text, and the fix: UTF-16 or UTF-32 where its byte-order mark says so (Windows'
    "Unicode"; `iconv -f latin1` would turn it into garbage), else the first line and byte that are not UTF-8."""
    with opened(path, "rb") as handle:
        head = handle.read(4)
    encoding = next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)
    if encoding is not None:
        return (f"{path}: {encoding} text (it starts with the {encoding} byte-order mark {head[:2].hex(' ')}, as Windows "
                f'saves "Unicode" text), not UTF-8. Fix: convert the file to UTF-8, e.g. `iconv -f {encoding} -t UTF-8 '
                f"IN > OUT` (the mark is dropped), and point data.datasets[].path at the result.")
    number, column, byte = first_undecodable(path)
    utf8_line = first_utf8_line(path)
    if utf8_line is not None:  # UTF-8 with a few lines from elsewhere: iconv on the whole file garbles the rest
        return (f"{path} line {number}: not UTF-8 text (byte {byte:#04x} at column {column}), while other lines are "
                f"UTF-8 text with non-ASCII characters (line {utf8_line} is one): the file is UTF-8 with a few lines "
                "from elsewhere. Fix: correct that line's text in an editor that saves UTF-8, or remove the line; do "
                "not convert the whole file with iconv, which would garble every line that is already UTF-8.")
    return f"{path} line {number}: not UTF-8 text (byte {byte:#04x} at column {column}). {RECODE}"


def first_utf8_line(path: Path) -> int | None:
    """The first line (universal newlines) that is UTF-8 text holding non-ASCII characters, if any."""
    number = 0
    with opened(path, "rb") as handle:
        for raw in handle:
            for line in raw.removesuffix(b"\n").removesuffix(b"\r").split(b"\r"):
                number += 1
                if not line.isascii():
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    return number
    return None


def first_undecodable(path: Path) -> tuple[int, int, int]:
    """(line, column, byte) of the first bytes that are not UTF-8, lines counted as universal newlines count them."""
    number = 0
    with opened(path, "rb") as handle:
        for raw in handle:
            body = raw.removesuffix(b"\n").removesuffix(b"\r")
            for line in body.split(b"\r"):  # bare carriage returns end lines too
                number += 1
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return number, exc.start + 1, line[exc.start]
    return number, 1, 0


def reason(exc: BaseException) -> str:
    """The error's first line and, where it wraps another (`datasets`' "An error occurred while generating the
    dataset"), the last line of the innermost cause: what actually went wrong."""
    top, seen = exc, [exc]
    while (inner := exc.__cause__ or exc.__context__) is not None and inner not in seen:
        exc = inner
        seen.append(exc)
    first, last = (str(top).strip() or type(top).__name__).splitlines()[0], (str(exc).strip() or type(exc).__name__).splitlines()[-1]
    return first[:200] if exc is top or last == first else f"{first[:200]}: {last[:200]}"
