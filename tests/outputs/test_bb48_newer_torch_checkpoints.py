"""A checkpoint written by a newer torch, read by an older one inside the declared range (bug bash bb48).

torch 2.15 writes DCP metadata that torch 2.11-2.13 cannot unpickle (`TensorProperties.__setstate__`: "too many values
to unpack (expected 5)"). A resume said "does not fit this model" (blaming the base and the LoRA settings), `export
--step` and `generate --step` ended in a traceback, and `finetune checkpoints` said "intact"; no file said which torch
wrote the checkpoint. Here the newer torch's metadata is simulated in this process by one op: while saving,
TensorProperties' state gets one more field, as torch 2.15 writes it; reading it back then fails in this torch exactly
as it does in 2.13.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bb26_untrusted_checkpoints import _model  # a trained Linear and its AdamW: a checkpoint's contents
from torch.distributed.checkpoint.metadata import TensorProperties

from finetune.errors import CheckpointError
from finetune.outputs import checkpoint, checkpoint_adapter, checkpoint_load, step_folders

NEWER = f"{torch.__version__.split('.')[0]}.{int(torch.__version__.split('.')[1]) + 2}.0+cu132"


def _saved(tmp_path: Path, monkeypatch, *, newer: bool) -> tuple[Path, tuple]:
    model, optimizer, names = _model()
    with monkeypatch.context() as patch:
        if newer:  # the metadata as a newer torch writes it: one more field per tensor's properties
            state = TensorProperties.__getstate__
            patch.setattr(TensorProperties, "__getstate__", lambda self: (*state(self), None))
            patch.setattr(torch, "__version__", NEWER)
        path = checkpoint.save_checkpoint(tmp_path / "run", 1, model, optimizer, names,
                                          {"step": 1, "world_size": 1, "strategy": "single"}, "a: 1\n", keep_last=2)
    return path, (model, optimizer, names)


def test_a_newer_torchs_checkpoint_is_said_so_by_resume_export_and_the_listing(tmp_path, monkeypatch):
    path, (model, optimizer, names) = _saved(tmp_path, monkeypatch, newer=True)
    assert json.loads((path / "manifest.json").read_text())["torch"] == NEWER
    release = NEWER.split("+")[0]
    for read in (lambda: checkpoint_adapter.read_trainable_tensors(path),  # export --step, generate --step
                 lambda: checkpoint_load.load_checkpoint(path, model, optimizer, names)):  # resume
        with pytest.raises(CheckpointError) as refused:
            read()
        message = str(refused.value)
        assert f"trainable/.metadata was written by torch {NEWER}, and this is torch {torch.__version__}" in message
        assert f"Fix: use torch {release} or newer here (pip install 'torch>={release}')" in message
        assert "does not fit" not in message and "\n" not in message
    table = step_folders.checkpoints_table(tmp_path / "run")
    assert f"intact; written by torch {NEWER}: readable with that torch or newer only" in table


def test_this_torchs_checkpoint_is_recorded_and_read_and_an_unreadable_one_is_not_blamed_on_the_model(
        tmp_path, monkeypatch):
    path, (model, optimizer, names) = _saved(tmp_path, monkeypatch, newer=False)
    assert json.loads((path / "manifest.json").read_text())["torch"] == torch.__version__
    assert set(checkpoint_adapter.read_trainable_tensors(path)) == names
    checkpoint_load.load_checkpoint(path, model, optimizer, names)
    assert "intact  " in step_folders.checkpoints_table(tmp_path / "run")
    # The same failure where the manifest names no torch (written before finetune recorded it): not "does not fit".
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["torch"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(step_folders._MetadataUnpickler, "load",
                        lambda self: (_ for _ in ()).throw(ValueError("too many values to unpack (expected 5)")))
    with pytest.raises(CheckpointError, match=r"cannot be read by torch .*its manifest names no torch version.*"
                                              r"Fix: read it with the torch that wrote it"):
        checkpoint_load.load_checkpoint(path, model, optimizer, names)
