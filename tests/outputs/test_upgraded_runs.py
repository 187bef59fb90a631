"""Run folders and checkpoints written by an older finetune, read by this one: a recipe.yaml with a key removed since
loads (the key dropped, with a note), any other invalid recipe is said whole, and a checkpoint records which finetune
wrote it so that a resume onto changed tokens can name an upgrade. Found by a bug bash of upgrading finetune between
runs (bb5). The fast tests write the folders by hand; the slow one exports and generates from a real run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import recipe_dict, write_recipe

from finetune.errors import CheckpointError, RecipeError
from finetune.outputs import checkpoint, resume_changes
from finetune.outputs.checkpoint_adapter import checkpoint_recipe
from finetune.outputs.export_source import resolve_source
from finetune.outputs.run_folder import finetune_version
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import load_recipe, recipe_to_yaml

SINGLE = ParallelPlan(strategy="single", world_size=1)


def _old_recipe(tmp_path: Path, folder: Path, **data) -> Path:
    """A resolved recipe.yaml as a finetune before e1c0ecd wrote it (data.num_workers set), in `folder`."""
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                         data={"num_workers": 0, "system_prompt": "Be brief.", **data})
    return write_recipe(folder / "recipe.yaml", values)


def _fake_adapter(folder: Path) -> None:
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "some/base"}))
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"x")


def test_a_checkpoints_recipe_with_a_key_removed_since_loads_with_a_note(tmp_path, capsys):
    """Found by a bug bash (bb5 F3): `export --step` / `generate --step` refused every checkpoint written before
    e1c0ecd, whose recipe.yaml has data.num_workers (removed without a rename): "its recipe.yaml is not a valid recipe
    any more"; the LoRA layout could not be known. The run's recipe was valid for the finetune that wrote it: the
    removed key is dropped, and a one-line note names it and what removed it."""
    _old_recipe(tmp_path, tmp_path / "step-00000004")
    recipe = checkpoint_recipe(tmp_path / "step-00000004")
    assert recipe.data.system_prompt == "Be brief." and recipe.lora.r == 8
    note = capsys.readouterr().out
    assert "read without data.num_workers (removed in e1c0ecd" in note and note.count("\n") == 1, note
    # A recipe the user writes now is still refused: only what a run wrote is read leniently.
    with pytest.raises(RecipeError, match="data.num_workers"):
        load_recipe(tmp_path / "step-00000004" / "recipe.yaml")


def test_an_invalid_checkpoint_recipe_is_said_whole(tmp_path):
    """Found by a bug bash (bb5 F3): the refusal kept the first line of the recipe error only, "(...: 1 problem in the
    recipe:)", so the problem itself and its fix were never shown. Now every problem is in the message, with a fix."""
    path = _old_recipe(tmp_path, tmp_path / "step-00000004")
    raw = yaml.safe_load(path.read_text())
    raw["train"]["learning_rat"] = 1.0
    raw["lora"]["r"] = -1
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_recipe(tmp_path / "step-00000004")
    said = str(caught.value)
    assert "2 problems in the recipe:" in said and "train.learning_rat: unknown key" in said and "lora.r:" in said
    assert "Fix: run the same command with the finetune that wrote the checkpoint" in said  # never an edit of it
    assert "Do not edit that recipe.yaml" in said  # (bug bash bb70: the edit made the checkpoint damaged)


def test_a_finished_old_run_keeps_its_recipe_for_generate_and_export(tmp_path, capsys):
    """Found by a bug bash (bb5 F3/F4): on a finished run written before e1c0ecd, resolve_source dropped the whole
    recipe for data.num_workers, so `finetune generate` loaded the base in bf16 (not 4-bit as trained) and rendered
    prompts with the tokenizer's chat template, not the run's data format and system prompt; the note said why only
    as "1 problem in the recipe:". Now the recipe is kept (the removed key dropped with a note), and a recipe that is
    really invalid is named whole in the note."""
    run = tmp_path / "run"
    _old_recipe(tmp_path, run)
    _fake_adapter(run)
    source = resolve_source(run)
    assert source.recipe is not None and source.recipe.data.system_prompt == "Be brief."
    assert source.recipe.data.datasets[0].format == "alpaca" and source.recipe.quantization.method == "nf4"
    assert "read without data.num_workers" in capsys.readouterr().out
    raw = yaml.safe_load((run / "recipe.yaml").read_text())
    raw["train"]["learning_rat"] = 1.0
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert resolve_source(run).recipe is None
    assert "train.learning_rat: unknown key" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ the version (F5)
def _checkpoint(tmp_path: Path, *, written_by: str | None, fingerprint: str = "before", rows: int = 61) -> tuple:
    """(checkpoint folder, this run's recipe): a checkpoint as a save writes it, its manifest's `finetune` replaced by
    `written_by` (None: a manifest from before versions were recorded)."""
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", recipe_dict(
        tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run", train={"max_steps": 12, "resume": "auto"})))
    folder = checkpoint.checkpoint_dir(Path(recipe.output.dir), 3)
    (folder / "trainable").mkdir(parents=True)
    (folder / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    data = {"epoch": 0, "cursor": 3, "world_size": 1, "micro_batch_size": 4, "rows": rows, "seed": recipe.train.seed,
            "fingerprint": fingerprint}
    state = {"step": 3, "data": data, "losses": [], "eval_losses": [], "tokens": 0, "world_size": 1,
             "strategy": "single process"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    checkpoint._write_manifest(folder, 3, state)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["finetune"] == finetune_version()  # what a save records
    manifest.pop("finetune")
    if written_by is not None:
        manifest["finetune"] = written_by
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder, recipe


def test_a_resume_onto_other_tokens_names_an_upgrade_when_another_finetune_wrote_the_checkpoint(tmp_path):
    """Found by a bug bash (bb5 F5): an upgrade that changed how rows are tokenized (496f43e's EOS rule) was said on
    resume as "a data file, the tokenizer or a data setting changed", blaming the user; the checkpoint did not record
    which finetune wrote it. Now its manifest does, and a resume whose tokens (or row count) changed names the upgrade
    when the versions differ (or the checkpoint recorded none), and only then."""
    source, recipe = _checkpoint(tmp_path / "old", written_by=None)
    [note] = resume_changes(source, recipe, SINGLE, train_rows=61, train_fingerprint="after")
    assert "or this finetune's upgrade: the checkpoint was written by an older finetune (it recorded no version) and " \
           f"this is {finetune_version()}" in note, note
    source, recipe = _checkpoint(tmp_path / "other", written_by="0.0.9 (git 0123456789ab)")
    [note] = resume_changes(source, recipe, SINGLE, train_rows=61, train_fingerprint="after")
    assert "written by finetune 0.0.9 (git 0123456789ab)" in note
    with pytest.raises(CheckpointError, match=r"the training rows are 60 here, 61 in the checkpoint \(.*or this "
                                              r"finetune's upgrade.*held out for eval.*resume with the finetune that "
                                              r"wrote it, or start anew"):
        # (a review, rv5 #5: the eval hold-out by rows (2026-12) counts other rows of the same conversations; the
        # refusal said only "rendering" and that the recipe's data settings would fix it)
        resume_changes(source, recipe, SINGLE, train_rows=60, train_fingerprint="after")
    source, recipe = _checkpoint(tmp_path / "same", written_by=finetune_version())
    [note] = resume_changes(source, recipe, SINGLE, train_rows=61, train_fingerprint="after")
    assert "upgrade" not in note and "a data file, the tokenizer or a data setting changed)" in note


# ---------------------------------------------------------------------------------- a real run, end to end
@pytest.mark.slow  # checkpointed_run launches `finetune train`
def test_export_and_generate_step_of_a_checkpoint_with_a_removed_key(checkpointed_run, tmp_path, capsys):
    """Found by a bug bash (bb5 F3): `finetune export RUN OUT --step N` and `finetune generate RUN --step N` exited 1 on
    a checkpoint whose recipe.yaml holds data.num_workers (every checkpoint written before e1c0ecd). Here a run's
    recipe.yaml and checkpoints are given the key as such a finetune wrote them (manifests kept valid); both verbs
    work, say the key was dropped, and the exported adapter is the one exported without the key."""
    from safetensors.torch import load_file

    from finetune.cli import main
    from finetune.files import _sha256

    original = checkpointed_run("single")
    run = Path(shutil.copytree(original, tmp_path / "run"))
    step, _ = max((int(p.name.removeprefix("step-")), p) for p in (run / "checkpoints").iterdir())
    for path in [run / "recipe.yaml", *sorted((run / "checkpoints").glob("step-*/recipe.yaml"))]:
        raw = yaml.safe_load(path.read_text())
        raw["data"]["num_workers"] = 0
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        manifest_path = path.parent / "manifest.json"
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            manifest["files"]["recipe.yaml"] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            manifest_path.write_text(json.dumps(manifest))
    assert main(["export", str(original), str(tmp_path / "expected"), "--step", str(step)]) == 0
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out"), "--step", str(step)]) == 0
    assert "read without data.num_workers (removed in e1c0ecd" in capsys.readouterr().out
    got, expected = (load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("out", "expected"))
    assert got.keys() == expected.keys() and all((got[k] == expected[k]).all() for k in got)
    assert main(["generate", str(run), "--step", str(step), "--prompt", "Add 2 and 3.", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "read without data.num_workers" in out and "no recipe" not in out, out


# ------------------------------------------------------------------------------------- a stream's relative path (F2)
def test_a_streams_position_saved_with_a_relative_path_resumes_from_its_absolute_path(tmp_path, monkeypatch):
    """Found by a bug bash (bb5 F2): a streaming run checkpointed by a finetune before a4f6ddb saved its dataset as
    written, `data/train.jsonl`; this finetune's recipe names it absolute, and the stream compared the strings, so the
    resume was refused as "the data or data settings changed" although nothing had. The same file named relatively
    (from where the run is launched) is now no change, as the recipe check says; another file is still refused."""
    from conftest import addition_rows, write_jsonl

    from finetune import data
    from finetune.cli.tiny import build_tokenizer
    from finetune.errors import DataError
    from finetune.recipe import validate_recipe

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows(16))
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 2},
                              "data": {"datasets": [{"path": str(path), "format": "alpaca"}], "streaming": True,
                                       "eval_fraction": 0.0, "max_length": 64}})
    tokenizer = build_tokenizer()

    def stream():
        rows, _, _ = data.stream_examples(recipe, tokenizer)
        return data.batch_stream(rows, micro_batch_size=2, rank=0, world_size=1, seed=0, pad_id=tokenizer.pad_token_id)

    first = stream()
    next(iter(first))
    state = dict(first.state_dict(), datasets=["data/train.jsonl"])  # as the old finetune saved it
    monkeypatch.chdir(tmp_path)
    resumed = stream()
    resumed.load_state_dict(state)
    assert resumed.position == first.position
    monkeypatch.chdir(tmp_path / "data")  # from here `data/train.jsonl` is another (absent) file
    with pytest.raises(DataError, match=r"had datasets=\['data/train.jsonl'\], this run has"):
        stream().load_state_dict(state)
