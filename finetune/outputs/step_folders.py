"""Finding checkpoints: the step folders of a run folder, each checked against its manifest, and the one a resume takes.

Below both the training checkpoints (finetune/outputs/checkpoint.py, which write these folders) and the output-folder
guard (finetune/outputs/run_folder.py, which refuses to start over a run that did not finish).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.files import _sha256
from finetune.outputs.adapter_files import ADAPTER_WEIGHTS

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STEP_PREFIX = "step-"
# Recipe keys that fix the shapes and meaning of the saved LoRA tensors: a resume must not change them.
SHAPE_KEYS = (("lora", "r"), ("lora", "target_modules"), ("lora", "dora"), ("lora", "bias"))
# Keys whose change is allowed on resume but makes the run differ from an uninterrupted one: reported.
NOTED_KEYS = (("model", "name_or_path"), ("model", "dtype"), ("quantization", "method"), ("lora", "alpha"),
              ("lora", "rslora"), ("train", "seed"), ("train", "micro_batch_size"), ("train", "grad_accum"),
              ("train", "learning_rate"), ("train", "lr_schedule"), ("data", "datasets"), ("data", "packing"))


# ------------------------------------------------------------------------------------ finding checkpoints
def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every renamed-into-place checkpoint folder, oldest first (good or not)."""
    root = Path(out_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for path in root.iterdir():
            digits = path.name.removeprefix(STEP_PREFIX)
            if path.is_dir() and path.name.startswith(STEP_PREFIX) and digits.isdigit():
                found.append((int(digits), path))
    return sorted(found)


def newest_kept(out_dir: Path) -> str:
    """A sentence on where a stopped run stands on disk: its newest checkpoint that matches its manifest, if any."""
    good = [(step, path) for step, path in list_checkpoints(out_dir) if checkpoint_problem(path) is None]
    if not good:
        return "no checkpoint was written yet (a resume starts again from step 1)."
    step, path = good[-1]
    return f"the newest checkpoint, {path} (step {step}), is intact and a resume continues from it."


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (None when every file matches its manifest)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest.json (the save did not finish: killed or crashed while writing)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is unreadable ({type(exc).__name__}: {exc})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated or changed)"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted or changed)"
    return None


def newest_good_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest; every damaged newer one is reported."""
    for step, path in reversed(list_checkpoints(out_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        distributed.print0(f"[finetune] warning: checkpoint {path} is damaged and skipped: {problem}")
    return None


def resume_source(recipe) -> Path | None:
    """The checkpoint train.resume points at (`auto`: the newest good one in output.dir, if any). Rank 0."""
    wanted, out_dir = recipe.train.resume, Path(recipe.output.dir)
    if wanted is None:
        return None
    if wanted == "auto":
        found = newest_good_checkpoint(out_dir)
        if found is None and (out_dir / "adapter" / ADAPTER_WEIGHTS).exists() and not recipe.output.overwrite:
            raise CheckpointError(
                f"train.resume=auto: output.dir {out_dir} holds a finished run but no usable checkpoint to continue from. "
                "Nothing was changed. Fix: choose another output.dir, or pass output.overwrite=true to start over."
            )
        if found is None and list_checkpoints(out_dir):
            distributed.print0(f"[finetune] warning: no good checkpoint in {out_dir / CHECKPOINTS}; starting from step 0")
    else:
        found = _explicit_checkpoint(Path(wanted).expanduser())
    if found is not None:
        check_compatible(found, recipe)
    return found


def _explicit_checkpoint(path: Path) -> Path:
    """train.resume=PATH: a checkpoint folder, or a run folder (its newest good checkpoint)."""
    if not path.exists():
        raise CheckpointError(f"train.resume: {path} does not exist. Fix: give a checkpoint folder "
                              f"(…/{CHECKPOINTS}/{STEP_PREFIX}N), a run folder, or `auto`.")
    if (path / CHECKPOINTS).is_dir():
        found = newest_good_checkpoint(path)
        if found is None:
            raise CheckpointError(f"train.resume: {path} has no usable checkpoint in {CHECKPOINTS}/ (all missing or damaged).")
        return found
    if path.is_dir() and (path.name.startswith(STEP_PREFIX) or (path / MANIFEST).exists()):
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"train.resume: checkpoint {path} cannot be used: {problem}. Fix: point train.resume at "
                                  "an older checkpoint, or use `auto` to take the newest good one.")
        return path
    raise CheckpointError(f"train.resume: {path} is not a checkpoint (no {MANIFEST}) nor a run folder "
                          f"(no {CHECKPOINTS}/). Fix: give …/{CHECKPOINTS}/{STEP_PREFIX}N, a run folder, or `auto`.")


def check_compatible(path: Path, recipe) -> None:
    """Refuse a checkpoint whose LoRA shapes differ from the recipe's; report other changed keys."""
    import yaml

    try:
        saved = yaml.safe_load((path / "recipe.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"train.resume: {path}/recipe.yaml is unreadable ({exc}).") from None
    current = recipe.model_dump(mode="json")

    def value(tree: dict, keys: tuple[str, str]) -> Any:
        return (tree.get(keys[0]) or {}).get(keys[1])

    clashes = [f"{'.'.join(k)}: checkpoint {value(saved, k)!r}, recipe {value(current, k)!r}"
               for k in SHAPE_KEYS if value(saved, k) != value(current, k)]
    if clashes:
        raise CheckpointError(f"train.resume: checkpoint {path} was trained with a different LoRA layout "
                              f"({'; '.join(clashes)}). Fix: use the recipe it was made with, or start a new run.")
    for keys in NOTED_KEYS:
        if value(saved, keys) != value(current, keys):
            distributed.print0(f"[finetune] note: resuming with {'.'.join(keys)} changed "
                               f"({value(saved, keys)!r} -> {value(current, keys)!r}): the run will differ from an uninterrupted one")
