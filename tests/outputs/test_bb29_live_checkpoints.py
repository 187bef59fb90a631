"""Found by a bug bash (bb29 #3): `finetune checkpoints RUN` polled while RUN trained showed healthy checkpoints as
"damaged: no manifest.json (... killed or crashed while writing)" and "damaged: trainer_state.json is missing": a
checkpoint was renamed into place before its manifest was written, and pruning deleted folders in place. Now the
manifest is written before the publishing rename, a pruned folder is renamed out of the listing before it is deleted,
and the listing of a run in progress never calls a checkpoint damaged."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import torch

from finetune.outputs import checkpoint, step_folders
from finetune.outputs.run_folder import LOCK_FILE


def _save(run: Path, step: int) -> Path:
    model = torch.nn.Linear(4, 3)
    return checkpoint.save_checkpoint(run, step, model, torch.optim.AdamW(model.parameters()),
                                      {name for name, _ in model.named_parameters()},
                                      {"step": step, "world_size": 1, "strategy": "single"}, "a: 1\n", keep_last=2)


def test_a_reader_listing_during_saves_and_prunes_never_sees_a_damaged_checkpoint(tmp_path, monkeypatch):
    """Every rename and every folder deletion of three saves (keep_last 2) is a moment a `finetune checkpoints` poll may
    look: at each, the listing shows only whole checkpoints, and no listed folder is being deleted."""
    run, seen = tmp_path / "run", []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def look(moment: str) -> None:
        if (run / step_folders.CHECKPOINTS).is_dir():
            for step, path in step_folders.list_checkpoints(run):
                if problem := step_folders.checkpoint_problem(path):
                    seen.append(f"{moment}: step {step} {problem}")

    def replace(source, target, *args, **kwargs):
        look(f"before replace {Path(target).name}")
        real_replace(source, target, *args, **kwargs)
        look(f"after replace {Path(target).name}")

    def rmtree(path, *args, **kwargs):
        if Path(path) in {folder for _, folder in step_folders.list_checkpoints(run)}:
            seen.append(f"{path} deleted while listed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    for step in range(1, 4):
        _save(run, step)
    assert seen == []
    assert [step for step, _ in step_folders.list_checkpoints(run)] == [2, 3]
    assert not [p.name for p in (run / step_folders.CHECKPOINTS).iterdir() if p.name.startswith(".")]


def test_the_listing_of_a_run_in_progress_calls_no_checkpoint_damaged(tmp_path, capsys):
    """`finetune checkpoints RUN` while a run holds the folder's lock (a run of an older finetune, which still renames
    before the manifest): a checkpoint without its manifest yet is said to be in the run's hands, not damaged."""
    from finetune.cli import main

    run = tmp_path / "run"
    whole, partial = _save(run, 1), run / step_folders.CHECKPOINTS / "step-00000002"
    shutil.copytree(whole, partial)
    (partial / step_folders.MANIFEST).unlink()
    capsys.readouterr()
    fd = os.open(run / LOCK_FILE, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": 4242, "host": "node7"}).encode())
        assert main(["checkpoints", str(run)]) == 0
    finally:
        os.close(fd)
    table = capsys.readouterr().out
    assert "damaged" not in table, table
    assert "not whole now (no manifest.json" in table and "the run in progress (PID 4242 on node7)" in table, table
    assert main(["checkpoints", str(run)]) == 0  # the run is gone: what is left is damaged
    assert "damaged: no manifest.json" in capsys.readouterr().out
