"""Data files damaged or pieced together by other tools (finetune/data/readers.py, sources.py): a compressed file cut
short, two Windows files joined with `cat`, a UTF-8 file with one line from another encoding. Found by bug bashes;
each test failed before its fix."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pytest

from finetune.data.sources import local_rows
from finetune.errors import DataError

ROWS = [{"prompt": f"What is {i} plus {i}?", "completion": f"{2 * i}"} for i in range(400)]


def _jsonl() -> bytes:
    return "".join(json.dumps(row) + "\n" for row in ROWS).encode()


def _csv() -> bytes:
    return ("prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in ROWS)).encode()


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
@pytest.mark.parametrize("kind, body", [(".jsonl", _jsonl), (".csv", _csv)])
def test_a_compressed_file_cut_short_is_named_with_the_fix(tmp_path, suffix, compress, kind, body):
    """Found by a bug bash: a .gz/.bz2/.xz data file cut short by a copy or a download was a raw EOFError (or a CRC
    error) traceback in train, validate, data and streaming; bad_rows: skip did not help."""
    whole = compress(body())
    path = tmp_path / f"rows{kind}{suffix}"
    path.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(DataError) as caught:
        list(local_rows([path], None))
    message = str(caught.value)
    assert str(path) in message and "damaged or cut short" in message and " -t " in message, message


def test_a_byte_order_mark_where_two_windows_files_were_joined_is_no_part_of_the_row(tmp_path):
    """Found by a bug bash: `cat a.jsonl b.jsonl` of two files saved on Windows left b's byte-order mark at the start
    of a line in the middle: that row was "not valid JSON", and the fix offered (delete the line, bad_rows: skip)
    dropped a valid row. The mark is dropped there as at the file's start."""
    path = tmp_path / "joined.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl()[:200].rsplit(b"\n", 1)[0] + b"\n" + b"\xef\xbb\xbf" +
                     json.dumps(ROWS[7]).encode() + b"\r\n")
    items = [item for item, _, _ in local_rows([path], None)]
    assert [json.loads(item) for item in items][-1] == ROWS[7]
    assert all(json.loads(item) for item in items)


def test_one_latin1_line_in_a_utf8_file_is_not_fixed_by_converting_the_file(tmp_path):
    """Found by a bug bash: a UTF-8 file with one Latin-1 line was told to `iconv -f cp1252` the whole file, which
    garbles every line that was UTF-8 (and the result trained without a word). Now the line is named as the one to
    correct; a file that is Latin-1 throughout keeps the iconv fix."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(json.dumps({"prompt": "Grüße", "completion": "ok"}, ensure_ascii=False).encode() + b"\n" +
                      '{"prompt": "caf\xe9", "completion": "ok"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as caught:
        list(local_rows([mixed], None))
    message = str(caught.value)
    assert "line 2: not UTF-8 text" in message and "(line 1 is one)" in message and "do not convert" in message
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9", "completion": "ok"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="iconv -f cp1252"):
        list(local_rows([latin], None))
