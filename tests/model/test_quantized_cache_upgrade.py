"""The quantized cache across a finetune upgrade (finetune/model/quantization/cache.py): an entry an older writer left
under the same key is never read, its replacement is built, and the old entry is named so it can be deleted."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch


def _recipe(base: Path):
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": str(base), "dtype": "bfloat16", "quantized_cache": "auto"},
                                  "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def _old_writers_entry(recipe, base: Path) -> Path:
    """What the writer before 4e46171 (CACHE_VERSION 1) left: the key of its settings (no transformers version) and, for
    a mixture-of-experts model, the checkpoint's own names with every expert in bf16 (here: the base's files as they
    are), with a manifest that matches the base, so nothing but the version says it is of another layout."""
    import bitsandbytes

    from finetune.model.quantization import cache as quantized_cache

    quant = recipe.quantization
    old_settings = {"method": quant.method, "double_quant": quant.double_quant, "dtype": recipe.model.dtype,
                    "quant_storage": quant.quant_storage or recipe.model.dtype, "bitsandbytes": bitsandbytes.__version__,
                    "cache_version": 1}
    text = json.dumps([str(base.resolve()), old_settings], sort_keys=True)
    entry = quantized_cache.cache_root() / hashlib.sha256(text.encode()).hexdigest()[:20]
    shutil.copytree(base, entry)
    manifest = {"base": str(base.resolve()), "name_or_path": str(base), "settings": old_settings,
                "identity": quantized_cache.base_identity(base),
                "files": {p.name: p.stat().st_size for p in sorted(entry.iterdir()) if p.is_file()}}
    (entry / quantized_cache.MANIFEST).write_text(json.dumps(manifest))
    return entry


def test_an_entry_of_the_old_writer_is_rebuilt_not_read(tiny_llama, tmp_path, monkeypatch, capsys):
    """Found by a bug bash (bb5 F1): CACHE_VERSION stayed 1 when 4e46171 changed the writer (model names, experts
    split and 4-bit), so after an upgrade the old entry of a Mixtral was read and refused as "does not match the
    model's config.json ... re-download the model"; the user had to find and delete the entry by hand. Now the old
    entry is a miss: a new one is built, and a note names the old one as no longer read. (A Llama keeps the test fast:
    what is checked is the key; the old entry here holds the base's bf16 weights, as the old writer left a Mixtral's
    experts, and the new one 4-bit weights. The MoE layout itself: test_prequantized.py's MoE cache test.)"""
    from safetensors import safe_open

    from finetune.model.quantization import cache as quantized_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    base = Path(tiny_llama)
    recipe = _recipe(base)
    old = _old_writers_entry(recipe, base)
    folder = quantized_cache.cached_checkpoint(recipe, base, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert folder != old and (folder / quantized_cache.MANIFEST).is_file(), out
    assert "quantizing" in out and f"are no longer read: {old} (" in out, out
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.weight.absmax" in keys, sorted(keys)[:8]
    assert quantized_cache.orphaned_entries(recipe, base) == [old]
    # another recipe's entry of the same base (other double quant) is live, not an orphan
    other = recipe.model_copy(update={"quantization": recipe.quantization.model_copy(update={"double_quant": False})})
    assert quantized_cache.orphaned_entries(other, base) == []


def test_a_cache_entry_that_does_not_match_names_the_fixes_that_work(tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash (bb5 F1): a cache entry refused as not matching the model said "use the config.json that
    came with these weights (or re-download the model)", which does not help; the fixes are to delete the entry or to
    set model.quantized_cache: off. (mismatch_fix words them; a checkpoint outside the cache gets none.)"""
    from finetune.model.quantization import cache as quantized_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    recipe = _recipe(Path(tiny_llama))
    entry = quantized_cache.cached_checkpoint(recipe, Path(tiny_llama), device=torch.device("cpu"))
    fix = quantized_cache.mismatch_fix(entry)
    assert fix is not None and str(entry) in fix and "delete" in fix and "model.quantized_cache: off" in fix
    assert quantized_cache.mismatch_fix(Path(tiny_llama)) is None


@pytest.mark.parametrize("changed", ["transformers", "cache_version"])
def test_the_key_covers_the_writers_version_and_transformers(changed, tiny_llama, monkeypatch):
    """Found by a bug bash (bb5 F1): the entry's tensor names are transformers' renames of the checkpoint's, and the
    key held neither the transformers version nor a writer version that changed with the layout."""
    import transformers

    from finetune.model.quantization import cache as quantized_cache

    recipe = _recipe(Path(tiny_llama))
    before = quantized_cache.entry_folder(recipe, Path(tiny_llama))
    if changed == "transformers":
        monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    else:
        monkeypatch.setattr(quantized_cache, "CACHE_VERSION", quantized_cache.CACHE_VERSION + 1)
    assert quantized_cache.entry_folder(recipe, Path(tiny_llama)) != before
