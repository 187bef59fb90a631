"""Found by a bug bash (bb30 #1, q_corrupt.sh shard_nul): a 4-bit cache entry (model.quantized_cache: auto) whose
shard kept its size but had a region zeroed (a power cut soon after the build, a partial copy) was loaded as it was
(step-1 loss 6.1921 instead of 6.2162, no note): the entry's check was each file's size. Now its manifest records
sampled checksums of every file (finetune/model/file_sums.py), compared at every start: a mismatch is rebuilt, said."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from test_quantized_cache_base import _recipe

SHARD = "model-00001-of-00001.safetensors"


def _writer(written: list):
    """`finetune quantize`'s writer as the cache calls it, writing a known shard instead of quantizing (seconds)."""
    from finetune.files import atomic_dir

    def write_quantized(base, out, *, replace, finish, **_):
        with atomic_dir(out, replace=replace) as tmp:
            (tmp / SHARD).write_bytes(bytes(range(256)) * 4096)
            (tmp / "config.json").write_text("{}")
            finish(tmp)
        written.append(out)
        return out

    return write_quantized


def test_a_zeroed_region_in_a_cached_4bit_shard_is_rebuilt_with_a_note(tiny_llama, tmp_path, monkeypatch, capsys):
    from finetune.model.quantization import cache as quantized_cache
    from finetune.model.quantization import writer

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    written: list[Path] = []
    monkeypatch.setattr(writer, "write_quantized", _writer(written))
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base", copy_function=shutil.copy2))
    recipe = _recipe(base)
    entry = quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu"))
    manifest = json.loads((entry / quantized_cache.MANIFEST).read_text())
    assert written == [entry] and set(manifest["sums"]) == set(manifest["files"]) == {SHARD, "config.json"}
    assert quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu")) == entry and len(written) == 1
    intact = (entry / SHARD).read_bytes()
    damaged = bytearray(intact)
    damaged[-60000:-20000] = bytes(40000)  # as the bug bash's shard_nul: same size, a region of NULs
    (entry / SHARD).write_bytes(bytes(damaged))
    capsys.readouterr()
    again = quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert again == entry and len(written) == 2, "the damaged entry was loaded"
    assert f"the quantized cache entry is damaged ({SHARD}: the bytes differ" in out, out
    assert (entry / SHARD).read_bytes() == intact
