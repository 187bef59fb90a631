"""The start adapter a run keeps: model.adapter's files copied into the run folder when the run starts (start-adapter/,
their SHA-256 recorded beside them), and what the run's resume, `export`, `export --step` and `generate` read in its
place; and the chat template that adapter was trained with.

Without the copy a run stayed bound to model.adapter's folder as it is later: retrained (an SFT recipe run again), a
DPO resume took another reference without a word; moved or deleted (the usual clean-up after SFT -> DPO), the finished
run could not be exported; retrained with another rank, every command refused the run's own recipe.yaml. A folder
that changed since the run started is now a note: the run continues from its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from finetune.distributed import print0
from finetune.errors import ModelLoadError
from finetune.files import _replace_dir, as_trained, remove_path

KEPT = "start-adapter"  # in the run folder; not one of the names a run clears (outputs/run_folder.py RUN_FOLDERS)
RECORD = "kept.json"  # {"adapter": model.adapter as the run started, "sha256": {file: digest}} (the path: said only)
CONFIG = "adapter_config.json"
# The adapter's weights: PEFT's file, or the pickle PEFT wrote before 0.6 (and with safe_serialization=False).
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TEMPLATE = "chat_template.jinja"  # the chat template a tokenizer's save_pretrained writes (transformers >= 4.43)
_READS = "_kept_start"  # the attribute of recipe.model naming the kept copy a run reads (not a recipe key)


def start_folder(recipe) -> Path:
    """The folder a run reads model.adapter from: the copy its run kept (`use_kept`: a run's recipe.yaml read back;
    `_continued_copy`: a recipe with train.resume), else model.adapter's own folder (a MoE run's adapter/: its
    as-trained twin)."""
    kept = getattr(recipe.model, _READS, None)
    if kept is None and recipe.train.resume is not None:
        kept = _continued_copy(recipe)
    return kept if kept is not None else as_trained(Path(recipe.model.adapter).expanduser())


def use_kept(recipe, *run_folders: Path) -> None:
    """Point a run's recipe.yaml, read back (export, `export --step`, generate), at the copy the first of
    `run_folders` kept of its model.adapter: what the run started with, whatever that folder holds now (moved, gone,
    retrained). The recipe's keys are unchanged (model.adapter still names the folder given)."""
    if not recipe.model.adapter:
        return
    kept = next((folder / KEPT for folder in run_folders if _owned(folder, run_folders) and _kept_record(folder / KEPT)),
                None)
    if kept is not None:
        _checked(kept, recipe.model.adapter, resuming=False)
        setattr(recipe.model, _READS, kept)
    else:  # a recipe.yaml an older finetune wrote: it dumped the lora defaults where it trained the adapter's layout
        default = type(recipe.lora)()
        recipe.lora.model_fields_set.difference_update(
            {key for key in type(recipe.lora).model_fields if getattr(recipe.lora, key) == getattr(default, key)})


def _continued_runs(resume: str | None, output_dir: str) -> list[Path]:
    """The run folder a train.resume continues: output.dir for `auto`; the folder given, or the run of the checkpoint
    given (RUN/checkpoints/step-N)."""
    if resume is None:
        return []
    if resume == "auto":
        return [Path(output_dir).expanduser()]
    given = Path(resume).expanduser()
    return [given, given.parent.parent]


def _continued_copy(recipe) -> Path | None:
    """With train.resume, the copy the run folder it continues kept of model.adapter (also where that folder has no
    checkpoint yet: the run starts again from what it first started with). A run written by an older finetune kept
    none: said once, where its recipe.yaml names the same adapter."""
    runs = _continued_runs(recipe.train.resume, recipe.output.dir)
    kept = next((run / KEPT for run in runs if _owned(run, runs) and _kept_record(run / KEPT)), None)
    if kept is not None:
        _checked(kept, recipe.model.adapter, resuming=True)
        return kept
    older = next((run for run in runs if not (run / KEPT).exists() and _names_adapter(run, recipe.model.adapter)), None)
    if older is not None and _say_once(older):
        print0(f"[finetune] note: model.adapter ({recipe.model.adapter}): the run in {older} kept no copy of the "
               "adapter it started from (written by an older finetune), so its starting values (and DPO/KTO's "
               "reference) are read from that folder as it is now")
    return None


def _checked(kept: Path, adapter: str, *, resuming: bool) -> None:
    """The kept copy holds the files its record names (ModelLoadError otherwise); `resuming`: said once when
    model.adapter's folder changed since the run started, or is gone. Hashed once per process."""
    if kept in _CHECKED:
        return
    record = _kept_record(kept)
    if _digests(kept, saved_template([kept])[0]) != record["sha256"]:
        raise ModelLoadError(
            f"model.adapter: {kept}, the copy a run kept of the adapter it started from, no longer holds the files "
            f"recorded in its {RECORD} when the run started (finetune never writes them afterwards). Fix: restore them "
            "(e.g. copy the run folder back from a backup), or start a new run (another output.dir, or "
            "output.overwrite=true, without train.resume).")
    _CHECKED.add(kept)
    live = as_trained(Path(adapter).expanduser())
    if resuming and not _same_files(live, adapter, record):
        how = "is gone" if not (live / CONFIG).is_file() else "changed since this run started" if _same_path(
            record.get("adapter"), adapter) else f"is not the adapter this run started from ({record.get('adapter')})"
        if _say_once(kept):
            print0(f"[finetune] note: model.adapter ({adapter}) {how}; the run continues from the copy it kept when "
                   f"it started ({kept}): the same starting values, layout, chat template and reference as before")


_CHECKED: set[Path] = set()  # kept copies whose files were hashed in this process
_SAID: set = set()  # the notes said in this process


def _say_once(key) -> bool:
    """Whether a note is said here: not yet in this process, and not in `finetune train`'s muted pre-flight (the
    launched rank 0 says it)."""
    from finetune.recipe import announcing

    if key in _SAID or not announcing():
        return False
    _SAID.add(key)
    return True


def _names_adapter(run: Path, adapter: str) -> bool:
    """`run` holds a run's recipe.yaml whose model.adapter is `adapter` (the same folder, however named)."""
    import yaml

    try:
        saved = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8")) or {}  # UTF-8 whatever the locale
        named = (saved.get("model") or {}).get("adapter")
        return bool(named) and Path(named).expanduser().resolve() == Path(adapter).expanduser().resolve()
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return False


def keep_start(out_dir: Path, recipe_yaml: str) -> None:
    """Rank 0, when a run starts (fresh, or from another folder's checkpoint; a resume in place keeps its copy): copy
    the adapter it started from (`start_folder`'s) into out_dir/KEPT with the SHA-256 of each file, a replaced run's
    copy removed first. `recipe_yaml`: the run's resolved recipe. The chat template is kept as its text."""
    import yaml

    raw = yaml.safe_load(recipe_yaml) or {}
    adapter, train = (raw.get("model") or {}).get("adapter"), raw.get("train") or {}
    target = out_dir / KEPT
    if not adapter:
        remove_path(target)
        return
    named = Path(adapter).expanduser()
    runs = _continued_runs(train.get("resume"), str(out_dir))
    source = next((run / KEPT for run in runs if _owned(run, runs) and _kept_record(run / KEPT)), None) or as_trained(named)
    if source.resolve() == target.resolve():  # this folder's own copy (train.resume=auto before any checkpoint)
        return
    template = saved_template([source] if source.name == KEPT else [source, named])[0]
    staged = out_dir / f".{KEPT}.tmp-{os.getpid()}"
    remove_path(staged)
    try:
        staged.mkdir()
        for name in (CONFIG, *WEIGHTS):
            if (source / name).is_file():
                shutil.copyfile(source / name, staged / name)
        if template is not None:
            (staged / TEMPLATE).write_text(template, encoding="utf-8")
        digests = _digests(staged, template)
        (staged / RECORD).write_text(json.dumps({"adapter": adapter, "sha256": digests}, indent=1), encoding="utf-8")
        _replace_dir(staged, target)
        _CHECKED.discard(target)
    except OSError as exc:
        remove_path(staged)
        raise ModelLoadError(f"model.adapter ({adapter}): its files could not be kept in the run folder ({target}: "
                             f"{exc.strerror or exc}), so a resume or an export of this run could not read what it "
                             "started from. Fix: make room or allow writing there, then run the same command again.") from None


def saved_template(folders: list[Path]) -> tuple[str | None, Path | None]:
    """The chat template an adapter folder was saved with, and its file: chat_template.jinja, else the chat_template
    of tokenizer_config.json (its `default` among named ones), in the first of `folders` that has one; (None, None)."""
    for folder in folders:
        if (folder / TEMPLATE).is_file():
            return (folder / TEMPLATE).read_text(encoding="utf-8"), folder / TEMPLATE
        try:
            template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if isinstance(template, str) and template:
            return template, folder / "tokenizer_config.json"
    return None, None


def use_start_template(recipe, tokenizer) -> None:
    """The chat template of a run from model.adapter: the adapter's own (the one it was trained with) when the recipe
    sets no model.chat_template, said in a note where the base's differs; the recipe's when it sets one, with a note
    where the adapter's differs. Before, the base's template rendered the rows without a word (SFT in `### role:`,
    then DPO in ChatML), and the run's adapter/ shipped the base's."""
    template, found = saved_template(_template_folders(recipe))
    if template is None or template == tokenizer.chat_template:
        return
    if recipe.model.chat_template:
        said = (f"model.chat_template is used (the recipe sets it), while model.adapter's own chat template ({found}), "
                "the one it was trained with, differs: rows are rendered otherwise than in the run that trained it")
    else:
        tokenizer.chat_template = template
        said = (f"model.adapter's chat template is used ({found}): the one it was trained with, as the recipe sets no "
                "model.chat_template (the base's differs); set model.chat_template to use another")
    if _say_once((found, said)):  # once per process (a checkpoint's template record loads the tokenizer again)
        print0(f"[finetune] note: {said}")


def _template_folders(recipe) -> list[Path]:
    """Where a run's start adapter keeps its chat template: the kept copy alone (what the run started with), else
    model.adapter's folder (a MoE run's as-trained twin, then its adapter/, which holds the tokenizer)."""
    folder = start_folder(recipe)
    return [folder] if (folder / RECORD).is_file() else [folder, Path(recipe.model.adapter).expanduser()]


def _kept_record(kept: Path) -> dict | None:
    """The record of the start adapter a run kept in `kept`, else None. Whatever path model.adapter names now: the
    copy is what the run started with (bb46: it was used only while model.adapter named the record's path, so a resume
    naming the adapter's new place, then a second move, left the run unexportable with its copy in place)."""
    try:
        record = json.loads((kept / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sha256"), dict) else None


def _owned(folder: Path, candidates) -> bool:
    """`folder` is the run of the first candidate (a run folder, or one of its checkpoints: RUN/checkpoints/step-N),
    not a folder that merely holds it: its kept copy is that run's, whatever model.adapter names."""
    first = Path(next(iter(candidates)))
    return folder == first or first.is_relative_to(folder / "checkpoints")


def _same_path(recorded, adapter: str) -> bool:
    try:
        return Path(recorded).expanduser().resolve() == Path(adapter).expanduser().resolve()
    except (TypeError, ValueError, OSError):
        return False


def _same_files(live: Path, adapter: str, record: dict) -> bool:
    """model.adapter's folder holds the files the run started from, byte for byte (by the SHA-256 its copy recorded):
    the same start adapter wherever it lies now."""
    return _digests(live, saved_template([live, Path(adapter).expanduser()])[0]) == record["sha256"]


def same_start_adapter(recipe) -> bool:
    """With train.resume: the run continues from the copy of its start adapter its run folder kept, so a model.adapter
    that names another path than the checkpoint's recipe changes nothing the run trains (moved with the same files:
    nothing said; other files or gone: said once by `_checked`). For outputs/resume_checks.py, which said such a
    model.adapter "the run will differ" (bb46)."""
    return bool(recipe.model.adapter) and recipe.train.resume is not None and _continued_copy(recipe) is not None


def _digests(folder: Path, template: str | None) -> dict[str, str]:
    """SHA-256 of the adapter's files in `folder` (config, weights) and of its chat template's text."""
    said = {}
    for name in (CONFIG, *WEIGHTS):
        if (folder / name).is_file():
            digest = hashlib.sha256()
            with open(folder / name, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            said[name] = digest.hexdigest()
    if template is not None:
        said[TEMPLATE] = hashlib.sha256(template.encode()).hexdigest()
    return said
