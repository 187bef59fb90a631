"""CSV and TSV data files: every non-empty cell the text written in it, an empty or absent cell missing (None), read by Arrow a
block at a time, or by Python's csv module for a file whose rows are shorter than its header."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from finetune.data.readers import batch_rows, data_suffix, not_utf8, opened, reason
from finetune.errors import DataError

# Arrow's refusal of a row whose cell count is not the header's; such a file is read again by the csv module
RAGGED = re.compile(r"Expected (\d+) columns, got (\d+)")
FIELD_LIMIT = 2**31 - 1  # the csv module's default (128 KiB a cell) refuses long answers that Arrow reads


def csv_rows(path: Path, prefix: str, skip: int):
    """A CSV file's rows from row `skip` on, every non-empty value the text written in it: no type inference (`007`,
    `02134`, `+49...` stay as they are; an empty cell does not turn a column of integers into floats), no missing-value
    words (`NA`, `None`, `null` are answers like any other). An empty cell is missing (None), as `datasets` (pandas)
    read it: a GRPO reward function is given the row's columns, and `"" in text` is always true. Read by Arrow a block
    at a time (quoted values may hold newlines), so a large file is never whole in memory. Arrow refuses a row with
    fewer cells than the header, which pandas read with the missing cells missing: such a file is read on by the csv
    module from where Arrow stopped, and a row with more cells than the header is refused naming its line. A .tsv file
    is read the same way with tabs between cells, as `datasets` read it."""
    import pyarrow
    import pyarrow.csv

    names = _csv_header(path)
    separator = _separator(path)
    convert = pyarrow.csv.ConvertOptions(column_types={name: pyarrow.string() for name in names}, null_values=[""],
                                         strings_can_be_null=True, quoted_strings_can_be_null=True)
    done = 0  # rows Arrow gave before it stopped at a short row
    try:
        with opened(path, "rb") as handle:
            batches = pyarrow.csv.open_csv(handle, convert_options=convert,
                                           parse_options=pyarrow.csv.ParseOptions(delimiter=separator,
                                                                                  newlines_in_values=True))
            rows = batch_rows(batches, prefix, skip)
            while True:
                try:
                    entry = next(rows)
                except StopIteration as stop:
                    return stop.value
                done += 1
                yield entry
    except pyarrow.ArrowException as exc:
        if RAGGED.search(str(exc)):
            return (yield from _short_rows(path, names, prefix, skip, done))
        if "UTF8" in str(exc):  # the line and byte, or a UTF-16 file (Excel's "Unicode text") named as such
            raise DataError(f"cannot read it as {_kind(path)}: {not_utf8(path)}") from None
        raise DataError(f"{path}: cannot read it as {_kind(path)} ({reason(exc)}). Fix the file.") from None


def _separator(path: Path) -> str:
    return "\t" if data_suffix(path) == ".tsv" else ","


def _kind(path: Path) -> str:
    return "TSV" if data_suffix(path) == ".tsv" else "CSV"


def _short_rows(path: Path, names: list[str], prefix: str, skip: int, done: int):
    """The rows after the first `skip + done`, read by the csv module (as Arrow parses: double quotes, newlines in
    quoted values, empty lines no rows): a row shorter than the header has its last cells missing, a longer one is
    refused naming its line."""
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, FIELD_LIMIT))
    number = 0
    try:
        with opened(path, "rt", encoding="utf-8-sig", newline="") as handle:
            records = csv.reader(handle, delimiter=_separator(path))
            next(records)  # the header, read by _csv_header
            for cells in records:
                if not cells:
                    continue
                number += 1
                if len(cells) > len(names):
                    raise DataError(_long_row(path, names, cells, records.line_num))
                if number > skip + done:
                    row = dict(zip(names, [cell or None for cell in cells] + [None] * (len(names) - len(cells))))
                    yield row, f"{prefix}row {number}", False
    except UnicodeDecodeError:
        raise DataError(not_utf8(path)) from None  # a UTF-16 file (Excel's "Unicode text") named as such
    finally:
        csv.field_size_limit(limit)
    return min(skip, number)


def _long_row(path: Path, names: list[str], cells: list[str], line: int) -> str:
    separator = _separator(path)
    text = separator.join(cells).replace("\t", "\\t")
    which, quoted = ("a tab", "in double quotes") if separator == "\t" else ("a comma", '"a, b"')
    return (f"{path}: cannot read it as {_kind(path)} (line {line}: Expected {len(names)} columns, got {len(cells)}: "
            f"{text[:80]}{'...' if len(text) > 80 else ''}). Line {line} has more cells than the header names "
            f"({', '.join(names)}): {which} in a value that is not quoted? Fix: quote that value ({quoted}), or name "
            "the extra column in the header.")


def _csv_header(path: Path) -> list[str]:
    """The column names (the first record, as Arrow reads it: a byte-order mark dropped). A file without rows is refused
    (Arrow reads a header alone as no rows, and the message would not say why), and so is a header naming a column
    twice (pandas renamed the second `output.1`; Arrow would keep one of the two silently)."""
    with opened(path, "rt", encoding="utf-8-sig", newline="", errors="replace") as handle:
        records = csv.reader(handle, delimiter=_separator(path))
        header = next(records, None)
        try:
            first = next(records, None)
        except csv.Error:  # a value past the csv module's field limit (128 KiB): a row all the same, for Arrow
            first = []
    if not header or first is None:
        what = "empty" if not header else "a header without rows"
        raise DataError(f"{path}: cannot read it as {_kind(path)} ({what}); is "
                        "it empty, or a header without rows? Fix the file or point data.datasets[].path at another.")
    twice = next((name for index, name in enumerate(header) if name in header[:index]), None)
    if twice is not None:
        columns = [str(index + 1) for index, name in enumerate(header) if name == twice]
        raise DataError(f"{path} line 1: the header names column `{twice}` twice (columns {' and '.join(columns)}), so "
                        "one of them would be lost. Fix: give each column its own name (e.g. rename the second "
                        f"`{twice}_2`), or remove the one you do not need.")
    return header
