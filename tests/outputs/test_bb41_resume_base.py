"""Resuming with a changed recipe, found by bug bash 41 (finetune/outputs/resume_checks.py, base_record.py):
a base replaced in place resumed without a word; a base of another size was noted, loaded whole, then failed with a
bare size mismatch; lora.target_modules naming the same modules was refused; changes that leave the training rows
as they were were said to make the run differ.

The fast tests write checkpoints in this process (save_checkpoint of a small module: the checks read its recipe,
trainer state, base record and DCP metadata, not what the tensors are); the slow one runs the tiny llama.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import RUN_PY, addition_rows, recipe_dict, run_cmd, write_jsonl, write_recipe
from safetensors.torch import load_file, save_file

from finetune.errors import CheckpointError
from finetune.outputs import base_record, checkpoint, checkpoint_load, resume_changes
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import load_recipe, recipe_to_yaml

SINGLE = ParallelPlan(strategy="single", world_size=1)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------------- helpers
def recipe_file(tmp_path: Path, base: Path, **sections) -> Path:
    values = recipe_dict(base, tmp_path / "train.jsonl", tmp_path / "run",
                         train={"max_steps": 12, "micro_batch_size": 2, "seed": 7}, **sections)
    return write_recipe(tmp_path / "recipe.yaml", values)


def saved_checkpoint(recipe_path: Path, *overrides: str, step: int = 3, fingerprint: str = "rows-hash") -> Path:
    """step-N of the recipe's run as save_checkpoint writes it (its trainable tensors: a small module's)."""
    recipe = load_recipe(recipe_path, list(overrides))
    model = torch.nn.Linear(4, 8)
    data = {"epoch": 0, "cursor": step, "world_size": 1, "micro_batch_size": 2, "rows": 61, "seed": 7,
            "fingerprint": fingerprint}
    state = {"step": step, "data": data, "losses": [], "eval_losses": [], "tokens": 0, "world_size": 1,
             "strategy": "single process"}
    return checkpoint.save_checkpoint(Path(recipe.output.dir), step, model, torch.optim.AdamW(model.parameters()),
                                      {"weight", "bias"}, state, recipe_to_yaml(recipe), keep_last=5)


def changes(source: Path, recipe_path: Path, *overrides: str, fingerprint: str | None = None) -> list[str]:
    recipe = load_recipe(recipe_path, ["train.resume=auto", *overrides])
    return resume_changes(source, recipe, SINGLE, train_rows=61, train_fingerprint=fingerprint)


def refusal(source: Path, recipe_path: Path, *overrides: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        changes(source, recipe_path, *overrides)
    return str(caught.value)


def other_weights(folder: Path) -> None:
    """The same tensors with other values written over the base's weights, the old mtime kept (cp -p, rsync -a): a
    re-download of another revision, or a `git pull`, into the same folder."""
    path = folder / "model.safetensors"
    stat = path.stat()
    tensors = load_file(str(path))
    save_file({name: value + 0.05 if value.is_floating_point() else value for name, value in tensors.items()},
              str(path), metadata={"format": "pt"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def resized(folder: Path, **sizes: int) -> None:
    """config.json of another size (what a base of other shapes says before any weight loads)."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | sizes))


# -------------------------------------------------------------------------------------------- 1. base in place
def test_a_base_replaced_in_place_is_noted_naming_its_files(tiny_llama, tmp_path):
    """Found by a bug bash (bb41 #1): other weights of the same shapes copied over model.name_or_path's folder between
    stop and resume were trained on without a word (the step-5 loss was another base's). Each checkpoint now records
    the base (base.json: a content sample of config.json and every weight file, no mtime) and a resume compares it."""
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    path = recipe_file(tmp_path, base)
    source = saved_checkpoint(path)
    assert json.loads((source / base_record.RECORD).read_text())["files"].keys() == {"config.json",
                                                                                      "model.safetensors"}
    assert "base.json" in json.loads((source / "manifest.json").read_text())["files"]  # its checksum is kept
    assert changes(source, path) == []  # the same base: nothing said
    other_weights(base)
    [note] = changes(source, path)
    assert f"model.name_or_path {base} holds another base than the checkpoint was trained on (model.safetensors " \
           "differ" in note and note.endswith("the run will differ from an uninterrupted one"), note


def test_a_checkpoint_without_the_record_resumes_as_before(tiny_llama, tmp_path):
    """A checkpoint written before the record (no base.json) is not compared: no note, as before."""
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    path = recipe_file(tmp_path, base)
    source = saved_checkpoint(path)
    (source / base_record.RECORD).unlink()
    checkpoint._write_manifest(source, 3, json.loads((source / "trainer_state.json").read_text()))
    other_weights(base)
    assert changes(source, path) == []


def test_a_base_moved_elsewhere_with_the_same_files_is_the_same_base(tiny_llama, tmp_path):
    """model.name_or_path changed to a copy of the same files: said as the same base, not "the run will differ";
    another base under the new name keeps the model.name_or_path note."""
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    path = recipe_file(tmp_path, base)
    source = saved_checkpoint(path)
    moved = Path(shutil.copytree(base, tmp_path / "moved"))
    [said] = changes(source, path, f"model.name_or_path={moved}")
    assert said.endswith(f"with model.name_or_path {base} -> {moved}: the same base model (config.json and every "
                         "weight file as the checkpoint recorded them), so the training does not change"), said
    other_weights(moved)
    [note] = changes(source, path, f"model.name_or_path={moved}")
    assert f"model.name_or_path {base} -> {moved}: the run will differ" in note and "holds another" not in note


def test_the_base_is_sampled_once_per_run_not_per_save(tiny_llama, tmp_path, monkeypatch):
    """The record is computed once while the base's files are unchanged (every save and the resume check ask), and
    again once a file is written over (its ctime changes, whatever mtime it keeps)."""
    from finetune.model.quantization import cache

    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    sampled = []
    monkeypatch.setattr(cache, "content_sample", lambda file: sampled.append(file.name) or file.name)
    model = {"name_or_path": str(base)}
    first = base_record.base_record(model)
    assert base_record.base_record(model) == first and sorted(sampled) == ["config.json", "model.safetensors"]
    other_weights(base)
    base_record.base_record(model)
    assert sorted(sampled) == ["config.json", "model.safetensors", "model.safetensors"]


# ---------------------------------------------------------------------------------------------- 2. base size
def test_a_base_of_another_size_is_refused_before_loading_with_the_fix(tiny_llama, tmp_path):
    """Found by a bug bash (bb41 #2): a base of another hidden size was noted ("the run will differ"), loaded whole,
    then refused with a bare "does not fit this model (ValueError: Size mismatch ...)" and no fix. Now the sizes that
    decide the LoRA tensors (config.json, recorded in the checkpoint) are compared before any weight loads."""
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    path = recipe_file(tmp_path, base)
    source = saved_checkpoint(path)
    wider = Path(shutil.copytree(tiny_llama, tmp_path / "wider"))
    resized(wider, hidden_size=96)
    said = refusal(source, path, f"model.name_or_path={wider}")
    assert f"the base model here ({wider}) is of another size than the checkpoint's ({base}): hidden_size 64 -> 96" \
           in said and f"Fix: resume with the checkpoint's values (model.name_or_path={base})" in said, said
    resized(base, num_hidden_layers=3)  # replaced in place by a deeper model: no name to go back to
    said = refusal(source, path)
    assert "num_hidden_layers 2 -> 3" in said and "was replaced by a model of another " \
           "size since: put the checkpoint's base back there" in said and "Fix: as said, or start a new run" in said


def test_the_vocabulary_is_compared_only_where_lora_is_on_the_embeddings(tiny_llama, tmp_path):
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    path = recipe_file(tmp_path, base, lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]})
    source = saved_checkpoint(path)
    embeddings = saved_checkpoint(path, "lora.target_modules=[q_proj,embed_tokens]", step=4)
    resized(base, vocab_size=json.loads((base / "config.json").read_text())["vocab_size"] + 8)
    [note] = changes(source, path)  # the LoRA tensors of q_proj fit: another base, noted
    assert "holds another base" in note and "config.json" in note
    said = refusal(embeddings, path, "lora.target_modules=[q_proj,embed_tokens]")
    assert "is of another size than the checkpoint's" in said and "vocab_size" in said, said


def test_tensors_that_do_not_fit_at_load_name_the_cause_and_the_fix(tmp_path):
    """The late error (a checkpoint without the record, or a change the checks before loading cannot see) was a
    bare "does not fit this model (...)." (bb41 #2): now the cause and the fix, naming the checkpoint's base."""
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tmp_path / "base", tmp_path / "train.jsonl",
                                                              tmp_path / "run"))
    source = saved_checkpoint(path)
    model = torch.nn.Linear(4, 6)
    with pytest.raises(CheckpointError) as caught:
        checkpoint_load.load_checkpoint(source, model, torch.optim.AdamW(model.parameters()), {"weight", "bias"})
    said = str(caught.value)
    assert "does not fit this model (ValueError: Size mismatch" in said and "a base of another size" in said, said
    assert f"Fix: resume on the checkpoint's base (model.name_or_path={tmp_path / 'base'}" in said, said


# -------------------------------------------------------------------------------------------- 3. target modules
def lora_checkpoint(tmp_path: Path, *overrides: str, leaves: list[str]) -> tuple[Path, Path]:
    """A checkpoint whose trainable/ holds LoRA tensors of `leaves` in 2 layers (their names as a run saves them)."""
    import torch.distributed.checkpoint as dcp

    path = recipe_file(tmp_path, tmp_path / "base")
    source = saved_checkpoint(path, *overrides)
    shutil.rmtree(source / "trainable")
    names = [f"base_model.model.model.layers.{layer}.{leaf}.lora_{ab}.default.weight"
             for layer in (0, 1) for leaf in leaves for ab in "AB"]
    checkpoint._dcp(dcp.save, {"model": {name: torch.ones(2, 2) for name in names}}, source / "trainable")
    checkpoint._write_manifest(source, 3, json.loads((source / "trainer_state.json").read_text()))
    return source, path


def test_target_modules_in_another_order_are_the_same_modules(tmp_path):
    """Found by a bug bash (bb41 #3a): [v_proj, q_proj] against the checkpoint's [q_proj, v_proj] was refused ("it
    decides which modules have saved LoRA tensors"): the lists were compared whole."""
    source, path = lora_checkpoint(tmp_path, "lora.target_modules=[q_proj,v_proj]", leaves=["q_proj", "v_proj"])
    assert changes(source, path, "lora.target_modules=[v_proj,q_proj]") == []
    assert "lora.target_modules is [\"q_proj\"] here" in refusal(source, path, "lora.target_modules=[q_proj]")


def test_all_linear_written_out_is_the_modules_its_saved_tensors_are_on(tmp_path):
    """Found by a bug bash (bb41 #3b): all-linear in the checkpoint and here the list of the modules it put LoRA on
    was refused; the checkpoint's DCP metadata names those modules (read without running code)."""
    source, path = lora_checkpoint(tmp_path, leaves=ALL_LINEAR)
    assert changes(source, path, f"lora.target_modules=[{','.join(reversed(ALL_LINEAR))}]") == []
    said = refusal(source, path, f"lora.target_modules=[{','.join(ALL_LINEAR[:4])}]")
    assert "lora.target_modules is [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"] here, all-linear in the " \
           "checkpoint" in said, said


# ------------------------------------------------------------------------------------------------ 4. wording
def test_settings_that_leave_the_training_rows_unchanged_are_said_so(tmp_path):
    """Found by a bug bash (bb41 #4): data.max_length cutting no row and a chat template alpaca rows never use were
    "the run will differ from an uninterrupted one", though the training was bit-identical; the rows' fingerprint
    (the same tokens in the same order) now says so. Without a fingerprint to compare, they are noted as before."""
    path = recipe_file(tmp_path, tmp_path / "base")
    source = saved_checkpoint(path)
    [said] = changes(source, path, "data.max_length=40", "model.chat_template=chatml", fingerprint="rows-hash")
    assert said.endswith("with model.chat_template null -> chatml; data.max_length 128 -> 40: the training rows are "
                         "unchanged (the same tokens in the same order as the checkpoint's), so the training does not "
                         "change"), said
    [note] = changes(source, path, "data.max_length=40")
    assert note.endswith("data.max_length 128 -> 40: the run will differ from an uninterrupted one"), note
    note, same = changes(source, path, "data.max_length=40", "train.weight_decay=0.1", fingerprint="rows-hash")
    assert note.endswith("train.weight_decay 0.0 -> 0.1: the run will differ from an uninterrupted one"), note
    assert same.endswith("with data.max_length 128 -> 40: the training rows are unchanged (the same tokens in the same "
                         "order as the checkpoint's), so the training does not change"), same


def test_the_fused_lora_path_and_reordered_rows_are_said_as_what_they_may_be(tmp_path):
    """bb41 #4: lora.fused true -> false trains the same LoRA by another code path (bit-identical in float32 without
    dropout), and the same rows in another order were called "other tokens"."""
    path = recipe_file(tmp_path, tmp_path / "base")
    source = saved_checkpoint(path)
    [said] = changes(source, path, "lora.fused=false")
    assert said.endswith("with lora.fused true -> false: the same training by another code path (PEFT's LoRA forward "
                         "or finetune's fused one): it may differ from an uninterrupted run in rounding, and in its "
                         "dropout masks where lora.dropout > 0"), said
    [note] = changes(source, path, fingerprint="other-hash")
    assert "the training rows (as many, other tokens: a data file, the tokenizer or a data setting changed) or the " \
           "same rows in another order (the checkpoint's hash of its rows does not tell which)" in note, note


# ------------------------------------------------------------------------------------------------ a real run
@pytest.mark.slow
def test_a_run_notes_a_base_replaced_in_place_and_refuses_another_size_before_loading(tiny_llama, tmp_path):
    """The bb41 repro end to end: a run's checkpoints record its base; the resume onto other weights in the same
    folder says so, and onto a wider base is refused before any weight loads, naming the base to resume with."""
    from finetune.cli.tiny import build_tiny_model

    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(48))
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(base, data, tmp_path / "run", train={
        "max_steps": 2, "save_every": 2, "micro_batch_size": 2, "seed": 7, "gradient_checkpointing": False}))
    first = run_cmd([sys.executable, str(RUN_PY), str(path)])
    assert first.returncode == 0, first.stderr[-3000:]
    other_weights(base)
    resumed = run_cmd([sys.executable, str(RUN_PY), str(path), "train.max_steps=4", "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"model.name_or_path {base} holds another base than the checkpoint was trained on (model.safetensors " \
           "differ" in resumed.stdout, resumed.stdout[-3000:]
    wider = build_tiny_model(tmp_path / "wider", hidden_size=96)
    refused = run_cmd([sys.executable, str(RUN_PY), str(path), "train.max_steps=6", "train.resume=auto",
                       f"model.name_or_path={wider}"])
    assert refused.returncode == 2 and "hidden_size 64 -> 96" in refused.stderr, refused.stderr[-3000:]
    assert f"model.name_or_path={base}" in refused.stderr and "[finetune] model:" not in refused.stdout
