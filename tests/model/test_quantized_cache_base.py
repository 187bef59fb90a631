"""The quantized cache (finetune/model/quantization/cache.py) against its base and its folder (bug bash bb20): other
weights put in place with the old size and mtime are a miss, and an unwritable cache folder is a note, not a crash."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def _recipe(base: Path):
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": str(base), "dtype": "bfloat16", "quantized_cache": "auto"},
                                  "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def _replace_keeping_size_and_mtime(path: Path, seed: int, only: str | None = None) -> None:
    """Other weights of the same shapes (so the same size and header) with the old mtime put back, as `cp -p`, `rsync
    -a`, a restored backup or a reproducible image build leave them. `only`: change that one tensor."""
    from safetensors.torch import load_file, save_file

    before = path.stat()
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if only in (None, name):
            tensors[name] = value + torch.randn(value.shape, generator=generator).to(value.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_base_replaced_with_the_same_size_and_mtime_is_rebuilt(tiny_llama, tmp_path, monkeypatch, capsys):
    """Found by a bug bash (bb20 #2): the entry's identity of its base was each file's size and mtime, so other
    weights of the same shapes written with the old mtime kept the old entry: the run trained on the old base's
    weights (step-1 loss 6.09 instead of 12.83) without a word. Now a sample of the contents is part of it."""
    from finetune.model.quantization import cache as quantized_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base", copy_function=shutil.copy2))
    recipe = _recipe(base)
    entry = quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu"))
    assert entry != base
    capsys.readouterr()
    _replace_keeping_size_and_mtime(base / "model.safetensors", seed=7)
    again = quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert again == entry and "the base changed since" in out and "contents" in out, out
    manifest = json.loads((entry / quantized_cache.MANIFEST).read_text())
    assert manifest["identity"] == quantized_cache.base_identity(base)
    # an entry written before the contents were recorded ([size, mtime]) is rebuilt, and says why
    old = {name: value[:2] for name, value in manifest["identity"].items()}
    (entry / quantized_cache.MANIFEST).write_text(json.dumps({**manifest, "identity": old}))
    reason = quantized_cache._stale_reason(entry, quantized_cache.base_identity(base))
    assert reason is not None and "did not record the base's contents" in reason


def test_the_content_sample_of_a_large_file_sees_one_changed_tensor(tmp_path):
    """A weight file over 1 MiB is sampled, not read whole (the header and each tensor's first and last 4 KiB): one
    tensor of other values, same size and mtime, changes the identity; nothing changed keeps it."""
    from safetensors.torch import save_file

    from finetune.model.quantization.cache import content_sample

    path = tmp_path / "model.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({f"layers.{i}.weight": torch.randn(512, 512, generator=generator) for i in range(3)}, str(path),
              metadata={"format": "pt"})
    assert path.stat().st_size > 3 * 2**20
    before = content_sample(path)
    assert content_sample(path) == before
    _replace_keeping_size_and_mtime(path, seed=1, only="layers.1.weight")
    assert content_sample(path) != before


def test_the_content_sample_of_a_large_gguf_file_reads_its_ends_not_a_header(tmp_path, monkeypatch):
    """Found by a bug bash (bb63): a GGUF v3 file's first 8 bytes (`GGUF`, version 3) read as a safetensors header of
    14,064,895,815 bytes, which was read whole for any GGUF file past 14.06 GB (an 8B f16 one), at every start: a
    MemoryError under a 3 GB limit. A sparse 15 GB file; every read is recorded and must stay within a MiB."""
    import builtins

    from finetune.model.quantization.cache import content_sample

    path = tmp_path / "model.gguf"
    with open(path, "wb") as handle:
        handle.write(b"GGUF" + (3).to_bytes(4, "little") + (291).to_bytes(8, "little"))
        handle.truncate(15 * 10**9)
    reads, real_open = [], builtins.open

    class Recorded:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size=-1):
            reads.append(size)
            return self.handle.read(size)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: Recorded(real_open(file, *a, **k))
                        if str(file) == str(path) else real_open(file, *a, **k))
    sample = content_sample(path)
    assert reads and max(reads) <= 2**20, reads
    assert sample == content_sample(path)

def test_an_unwritable_quantized_cache_is_a_note_and_the_run_quantizes_at_load(tiny_llama, tmp_path, monkeypatch,
                                                                                capsys):
    """Found by a bug bash (bb20 #3): with FINETUNE_CACHE naming a file (or a read-only folder) the quantized cache
    crashed with a NotADirectoryError (OSError: read-only file system) traceback before the first step, while the data
    cache went on without its cache. Now one note, and the base is quantized at load."""
    from finetune.model.quantization import cache as quantized_cache

    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "afile"))
    base = Path(tiny_llama)
    assert quantized_cache.cached_checkpoint(_recipe(base), base, device=torch.device("cpu")) == base
    out = capsys.readouterr().out
    assert f"the quantized cache folder {tmp_path / 'afile' / 'quantized'} cannot be written" in out, out
    assert "quantizing at load instead" in out and out.count("\n") == 1
