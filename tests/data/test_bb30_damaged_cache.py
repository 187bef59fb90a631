"""Found by a bug bash (bb30 #1): a tokenization cache entry whose files kept their sizes but lost their bytes (NULs
after a power cut soon after the build, a partly copied cache) was mapped and trained on silently (loss 0.0000 at every
step for a zeroed trained.bin), and the entry was published without fsync. Now each entry records sampled checksums
of its files (finetune/model/file_sums.py), compared at every mapping: a mismatch is rebuilt with a note naming it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import addition_rows, write_jsonl
from test_data import make_recipe

from finetune import data

pytestmark = pytest.mark.usefixtures("private_cache")


def _entry(recipe, tokenizer) -> Path:
    spec = recipe.data.datasets[0]
    return data.cache_dir() / data.cache_key(spec, data.open_source(spec), recipe, tokenizer)


@pytest.mark.parametrize("name", ["trained.bin", "ids.bin"])
def test_a_zeroed_cache_file_of_the_right_size_is_rebuilt_with_a_note(tmp_path, tokenizer, capsys, name):
    """Found by a bug bash (bb30 #1, cache_corrupt.sh trained_zero / ids_zero): the file overwritten with NULs, same
    size, was mapped as it was (every trained mask off: loss 0.0; every token id 0). Now it is rebuilt, said."""
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(30)))})
    fresh, _, _ = data.build_examples(recipe, tokenizer)
    expected = [(e.input_ids, e.labels) for e in fresh]  # (the views map the entry's files: read before the damage)
    entry = _entry(recipe, tokenizer)
    size = (entry / name).stat().st_size
    (entry / name).write_bytes(bytes(size))
    capsys.readouterr()
    rebuilt, _, stats = data.build_examples(recipe, tokenizer)
    said = capsys.readouterr().err
    assert stats.cached_datasets == 0, "the damaged entry was used"
    assert f"the tokenization cache entry {entry}" in said and name in said and "tokenized again" in said, said
    assert [(e.input_ids, e.labels) for e in rebuilt] == expected
    assert np.asarray(rebuilt.stores[0].trained).any() and np.asarray(rebuilt.stores[0].ids).any()


def test_the_entry_is_fsynced_before_the_rename_that_publishes_it(tmp_path, tokenizer, monkeypatch):
    """Found by a bug bash (bb30 #1): the entry was written with plain open/np.save and renamed into place with no
    fsync of its files or folder, so a power cut soon after could publish files of their size with NUL bytes."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")
        return real_fsync(fd)

    def replace(source, target, *args, **kwargs):
        events.append(f"replace {source} {target}")
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    recipe = make_recipe({"path": str(write_jsonl(tmp_path / "a.jsonl", addition_rows(30)))})
    data.build_examples(recipe, tokenizer)
    entry = _entry(recipe, tokenizer)
    published = next(i for i, event in enumerate(events) if event.startswith("replace") and event.endswith(str(entry)))
    synced = {Path(event.split(" ", 1)[1]).name for event in events[:published] if event.startswith("fsync")}
    assert {"ids.bin", "trained.bin", "bounds.npy", "meta.json"} <= synced, events
    assert any(event == f"fsync {entry.parent}" for event in events[published:]), events  # the rename itself


def test_a_large_file_is_sampled_and_a_zeroed_region_is_still_seen(tmp_path):
    """The check reads a few MB of a large file, not all of it, and still sees a zeroed region (a lost tail, a hole)
    of more than 1/SAMPLES of the file."""
    from finetune.model import file_sums

    path = tmp_path / "ids.bin"
    size = 64 << 20
    path.write_bytes(np.random.default_rng(0).integers(1, 255, size, dtype=np.uint8).tobytes())
    recorded = file_sums.folder_sums(tmp_path, ["ids.bin"])
    assert file_sums.changed_files(tmp_path, recorded) == []
    with open(path, "r+b") as handle:  # the last eighth lost, as after a power cut
        handle.seek(size - size // 8)
        handle.write(bytes(size // 8))
    assert file_sums.changed_files(tmp_path, recorded) == ["ids.bin"]
    assert file_sums.SAMPLES * file_sums.SAMPLE_BYTES <= 4 << 20  # what a check reads of a large file
