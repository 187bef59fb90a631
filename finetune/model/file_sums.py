"""Sampled checksums of the cache files finetune writes once and maps at every start (the tokenized data, the 4-bit
cache), recorded when an entry is published and compared when it is read.

Why: the size of a file says nothing of its bytes. After a power cut or a node crash shortly after a build, a renamed
entry can hold files of their final size full of NULs (unwritten extents read as zeros), and a cache copied or
restored in part can too: a zeroed `trained.bin` trained every step at loss 0.0, silently (bb30). Hashing a
multi-GB file at every start would cost seconds to minutes, so a large file is sampled: SAMPLES blocks of
SAMPLE_BYTES, evenly spaced from its first byte to its last, which any zeroed or garbled region longer than
1/SAMPLES of the file meets (a lost tail, a hole, a whole file). A small file is hashed whole. The size is hashed too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WHOLE_BELOW = 4 << 20  # files up to 4 MiB are hashed whole
SAMPLES = 128  # larger ones: this many blocks, spaced evenly over the file
SAMPLE_BYTES = 32 << 10


def sampled_sum(path: Path) -> str:
    """blake2b of the file's size and of its bytes (whole) or its SAMPLES evenly spaced blocks (a large file)."""
    digest = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= WHOLE_BELOW:
            digest.update(os.pread(fd, size, 0))
        else:
            stride = (size - SAMPLE_BYTES) / (SAMPLES - 1)
            for number in range(SAMPLES):
                digest.update(os.pread(fd, SAMPLE_BYTES, round(number * stride)))
    finally:
        os.close(fd)
    return digest.hexdigest()


def folder_sums(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: sampled_sum} of the files `names` in `folder` (what an entry records when it is published)."""
    return {name: sampled_sum(Path(folder) / name) for name in names}


def changed_files(folder: Path, sums: dict) -> list[str]:
    """The files of `folder` whose bytes differ from the recorded `sums` (missing or unreadable ones included)."""
    changed = []
    for name, recorded in sums.items():
        try:
            same = sampled_sum(Path(folder) / str(name)) == recorded
        except OSError:
            same = False
        if not same:
            changed.append(str(name))
    return changed
