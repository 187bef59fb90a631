"""The destinations of the verbs that write (quantize, tiny-model, quickstart, export, recipes copy, plot): nothing the
user had is lost or overwritten, and a path that cannot be written is a one-paragraph error naming it and the fix,
never a traceback. Found by a bug bash (bb6: "nothing the user had is lost or overwritten")."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from finetune.cli import main


def refused(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(word in err for word in words), err
    return err


def tree(folder: Path) -> dict[str, bytes | str | None]:
    """Every entry under `folder` (a link as its target, a file as its bytes): what must not change."""
    return {str(path.relative_to(folder)): (f"-> {os.readlink(path)}" if path.is_symlink()
                                            else path.read_bytes() if path.is_file() else None)
            for path in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------------------------------------------ quantize
def test_quantize_never_replaces_or_writes_into_its_base(tiny_llama, tmp_path, capsys):
    """Found by a bug bash: `finetune quantize BASE BASE --force` replaced the bf16 base with its own 4-bit copy (and
    quantized_from.json then named itself), and `quantize models/base models --force` deleted models/ with the base
    and the user's other files. OUT that is BASE (also through a link), holds it, or is inside it is refused before
    anything is read."""
    from finetune.errors import ModelLoadError
    from finetune.model.quantization.writer import write_quantized

    models = tmp_path / "models"
    base = models / "base"
    shutil.copytree(tiny_llama, base)
    (models / "other-notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(base)
    before = tree(tmp_path)
    assert main(["quantize", str(base), str(base), "--force"]) == 2
    refused(capsys, f"{base} is the base folder itself", "Nothing was read or written", "Fix: choose OUT outside")
    assert main(["quantize", str(base), str(models), "--force"]) == 2
    refused(capsys, f"{models} holds the base", "would delete the base")
    assert main(["quantize", str(base), str(tmp_path / "link"), "--force"]) == 2
    refused(capsys, "is the base folder itself")
    assert main(["quantize", str(base), str(base / "nf4")]) == 2
    refused(capsys, "is inside the base folder")
    with pytest.raises(ModelLoadError, match="is the base folder itself"):  # the writer itself, for other callers
        write_quantized(base, base, bnb_config=None, dtype=None, device=None, replace=True)
    assert tree(tmp_path) == before


def test_quantize_force_replaces_a_folder_only_and_bad_destinations_are_one_paragraph(tiny_llama, tmp_path, capsys,
                                                                                       monkeypatch):
    """Found by a bug bash: `quantize BASE FILE --force` moved the user's file aside to a hidden `.FILE.old-<pid>`,
    `quantize BASE . --force` was `OSError: [Errno 16] Device or resource busy`, and OUT under a file a
    FileExistsError traceback."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "keep.txt").write_text("mine")
    before = tree(tmp_path)
    assert main(["quantize", str(tiny_llama), str(tmp_path / "notes.txt"), "--force"]) == 2
    refused(capsys, "notes.txt is a file; --force replaces a folder")
    assert main(["quantize", str(tiny_llama), str(tmp_path / "notes.txt" / "sub")]) == 2
    refused(capsys, "notes.txt is a file, not a folder", "Fix: choose another OUT")
    monkeypatch.chdir(tmp_path / "here")
    assert main(["quantize", str(tiny_llama), ".", "--force"]) == 2
    refused(capsys, ". is the current folder or holds it")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------------- tiny-model
def test_tiny_model_refuses_a_folder_that_holds_anything_or_a_file(tiny_llama, tmp_path, capsys):
    """Found by a bug bash: `finetune tiny-model mymodel` over a folder holding a model overwrote its config.json and
    model.safetensors with a random-init model (a mistyped path wrecks a real model), and `tiny-model FILE` was a
    FileExistsError traceback."""
    from finetune.cli.tiny_arch import build_tiny_arch
    from finetune.errors import FinetuneError

    mine = tmp_path / "mymodel"
    shutil.copytree(tiny_llama, mine)
    (mine / "NOTES.md").write_text("my notes")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    before = tree(tmp_path)
    assert main(["tiny-model", str(mine), "--family", "qwen2"]) == 2
    refused(capsys, f"{mine} already exists and holds NOTES.md", "nothing was written", "--force")
    with pytest.raises(FinetuneError, match="already exists"):  # `tiny-model --arch`'s builder
        build_tiny_arch("llama", mine)
    assert main(["tiny-model", str(tmp_path / "rows.jsonl")]) == 2
    refused(capsys, "rows.jsonl is a file, not a folder")
    assert tree(tmp_path) == before


def test_tiny_model_force_replaces_the_folder_whole(tmp_path):
    """Found by a bug bash: writing a tiny model into a folder with a sharded model left the old shards and index beside
    the new weights (a mixed model). With force the folder is replaced whole; without it, refused."""
    from transformers import AutoConfig

    from finetune.cli.tiny import build_tiny_model

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "NOTES.md"):
        (folder / name).write_text("old")
    assert build_tiny_model(folder, family="qwen2", force=True) == folder
    names = {path.name for path in folder.iterdir()}
    assert "model.safetensors" in names and not names & {"model-00001-of-00002.safetensors", "NOTES.md",
                                                         "model.safetensors.index.json"}
    assert AutoConfig.from_pretrained(folder).model_type == "qwen2"
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # no temporary folder left


# ---------------------------------------------------------------------------------------------------- quickstart
def test_quickstart_refuses_a_folder_it_did_not_write_before_writing_anything(tmp_path, capsys):
    """Found by a bug bash: `finetune quickstart --out <a finished run>` wrote data/ledger_stamp.jsonl and tiny-model/
    into it, then the run refused with "Nothing was changed"."""
    other = tmp_path / "run1"
    (other / "adapter").mkdir(parents=True)
    (other / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (other / "recipe.yaml").write_text("# mine\n")
    (other / "metrics.jsonl").write_text("{}\n")
    before = tree(tmp_path)
    assert main(["quickstart", "--tiny", "--out", str(other)]) == 2
    refused(capsys, f"--out {other}: the folder holds adapter, metrics.jsonl, recipe.yaml, which no quickstart wrote",
            "Nothing was written")
    assert main(["quickstart", "--tiny", "--dpo", f"output.dir={other}"]) == 2
    refused(capsys, "which no quickstart wrote")
    assert tree(tmp_path) == before


def test_quickstart_into_its_own_finished_folder_is_refused_with_nothing_written(tmp_path, capsys):
    """Found by a bug bash: "Nothing was changed" came after data/ and tiny-model/ were written. The run's own guard
    is now asked first (with the user's overrides), so its words hold."""
    own = tmp_path / "qs"
    (own / "data").mkdir(parents=True)
    (own / "data" / "ledger_stamp.jsonl").write_text("the 400 rows of an earlier, full quickstart\n")
    (own / "adapter").mkdir()
    (own / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    before = tree(tmp_path)
    assert main(["quickstart", "--tiny", "--out", str(own)]) == 2
    refused(capsys, f"output.dir {own}", "Nothing was changed")  # the run's guard (outputs/run_folder.py) says why
    assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------- export and recipes copy
def test_export_and_recipes_copy_destinations_are_one_paragraph_errors(tmp_path, capsys):
    """Found by a bug bash: `export RUN afile/sub` (a file above) was a FileExistsError traceback, `export RUN dang`
    (a link to nothing) a NotADirectoryError after all the work, `recipes copy quickstart dang.yaml` a FileExistsError,
    and `recipes copy quickstart nd/` wrote a file named nd."""
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere")
    (tmp_path / "dang.yaml").symlink_to(tmp_path / "nothere.yaml")
    before = tree(tmp_path)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "afile" / "sub")]) == 2
    refused(capsys, f"{tmp_path / 'afile'} is a file, not a folder", "nothing was written")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "dang")]) == 2
    refused(capsys, "already exists (a symbolic link to", "nothing was overwritten")
    assert main(["recipes", "copy", "quickstart", str(tmp_path / "dang.yaml")]) == 2
    refused(capsys, "dang.yaml already exists (a symbolic link to")
    assert main(["recipes", "copy", "quickstart", str(tmp_path / "afile" / "r.yaml")]) == 2
    refused(capsys, "is a file, not a folder")
    assert tree(tmp_path) == before
    assert main(["recipes", "copy", "quickstart", str(tmp_path / "nd") + "/"]) == 0
    assert (tmp_path / "nd" / "quickstart.yaml").is_file()


# ---------------------------------------------------------------------------------------------------------- plot
def metrics_run(folder: Path) -> Path:
    folder.mkdir()
    rows = [{"step": step, "loss": 3.0 / step, "learning_rate": 1e-4} for step in range(1, 6)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_plot_replaces_only_images_it_wrote_and_says_so(tmp_path, capsys, monkeypatch):
    """Found by a bug bash: `finetune plot --out existing.png` (and the default compare.png) overwrote a user's image
    without a word, `--out adir.png` (a folder) was an IsADirectoryError traceback. An image finetune wrote (its
    metadata says so) and a run's own plot.png are replaced, and the line says it; any other file is refused."""
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir.png").mkdir()
    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n a picture of mine")
    before = tree(tmp_path)
    assert main(["plot", str(run), "--out", "adir.png"]) == 2
    refused(capsys, "--out adir.png: is a folder")
    assert main(["plot", str(run), "--out", "mine.png"]) == 2
    refused(capsys, "--out mine.png: already exists and its metadata does not name", "nothing was overwritten")
    assert main(["plot", str(run), str(run), "--out", "mine.png/x.png"]) == 2
    refused(capsys, "is a file, not a folder")
    assert tree(tmp_path) == before
    for said in ("", " (it replaces the plot written there before)"):
        assert main(["plot", str(run), str(run), "--out", "ours.svg"]) == 0
        assert capsys.readouterr().out.strip() == f"plot written to ours.svg{said}"
    for said in ("", " (it replaces the plot written there before)"):  # JPEG carries no mark: replaced, and said
        assert main(["plot", str(run), "--out", "loss.jpg"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip() == f"plot written to loss.jpg{said}"
    (run / "plot.png").write_bytes(b"an older finetune's plot")  # a run's own plot.png is always regenerated
    assert main(["plot", str(run)]) == 0
    assert "replaces" in capsys.readouterr().out and (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
