"""What an export (or `finetune generate`) starts from: a run folder, an adapter folder, a checkpoint folder, or a run
folder's kept checkpoint `--step N` (its adapter written first by finetune/outputs/checkpoint_adapter.py), with the
recipe that says how to build the base.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FinetuneError, RecipeError
from finetune.model.lora.saved_adapter import config_problem, weights_problem
from finetune.outputs.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AS_TRAINED, as_trained
from finetune.outputs.step_folders import (
    CHECKPOINTS,
    checked_checkpoint,
    checkpoint_facts,
    is_checkpoint,
    list_checkpoints,
    step_checkpoint,
)
from finetune.recipe import Recipe


class ExportError(FinetuneError):
    """The export source, base or output folder cannot be used as asked."""


@dataclass
class Source:
    """What an export or generation starts from: the adapter folder and, when known, the run's recipe."""

    adapter_dir: Path
    recipe: Recipe | None
    adapter_config: dict
    checkpoint: Path | None = None  # the training checkpoint the adapter was read from (adapter_dir is then temporary)

    @property
    def origin(self) -> Path:
        """What the user pointed at, for messages: the checkpoint, else the adapter folder."""
        return self.checkpoint or self.adapter_dir

    @property
    def base_name(self) -> str:
        if self.recipe is not None:
            model = self.recipe.model
            return f"{model.name_or_path} ({model.gguf_file})" if model.gguf_file else model.name_or_path
        return str(self.adapter_config.get("base_model_name_or_path") or "?")


# ------------------------------------------------------------------------------------------------- the source
@contextmanager
def open_source(path: str | Path, *, step: int | None = None, base: str | None = None) -> Iterator[Source]:
    """The Source of a run folder, an adapter folder, a checkpoint folder, or a run folder's kept checkpoint `step`.

    A checkpoint's adapter is written into a temporary folder first (removed on leaving); its recipe is the
    checkpoint's own recipe.yaml, its base `base` where given (`export --base`: a base folder moved since)."""
    from finetune.outputs.checkpoint_adapter import write_checkpoint_adapter

    folder = Path(path).expanduser()
    checkpoint = _checkpoint_of(folder, step)
    if checkpoint is None:
        yield resolve_source(folder)
        return
    with tempfile.TemporaryDirectory(prefix="finetune-step-") as tmp:
        adapter_dir = Path(tmp) / "adapter"
        recipe = write_checkpoint_adapter(checkpoint, adapter_dir, base=base)
        print(f"[finetune] adapter of checkpoint {checkpoint} (step {checkpoint_facts(checkpoint).get('step')}) read "
              "from its training state")
        yield Source(adapter_dir, recipe, json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")), checkpoint=checkpoint)


def _checkpoint_of(folder: Path, step: int | None) -> Path | None:
    """The checkpoint folder a source names (a checkpoint folder, or a run folder with --step), or None."""
    if not folder.exists():
        raise ExportError(f"{folder}: not found. Pass a run folder (output.dir of a run), an adapter folder, or a "
                          f"checkpoint folder ({CHECKPOINTS}/step-N).")
    if is_checkpoint(folder):
        own = checkpoint_facts(folder).get("step")
        if step is not None and step != own:
            raise ExportError(f"{folder} is the checkpoint of step {own}, and --step says {step}. Fix: pass the run "
                              f"folder ({folder.parent.parent}) with --step {step}, or this folder without --step.")
        return checked_checkpoint(folder)
    if step is None:
        return None
    if (folder / CHECKPOINTS).is_dir() or (folder / "recipe.yaml").is_file():
        return step_checkpoint(folder, step)
    raise ExportError(f"--step {step}: {folder} is not a run folder (it has no {CHECKPOINTS}/ nor recipe.yaml); "
                      "--step picks a kept checkpoint of a run. Fix: pass the run folder (output.dir), or drop --step.")


def resolve_source(path: str | Path) -> Source:
    """A run folder (adapter/ inside) or an adapter folder -> Source; ExportError when it holds no usable adapter: none
    at all (the run did not finish), or one whose files are damaged (each named, with the way out: bb30)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ExportError(
            f"{folder}: not found. Pass a run folder (output.dir of a finished run) or an adapter folder."
        )
    run_adapter = folder / "adapter"
    adapter_dir = run_adapter if any((run_adapter / name).exists() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)) \
        else folder
    adapter_dir = as_trained(folder) if as_trained(folder) != folder else adapter_dir  # a MoE run: as trained
    if not any((adapter_dir / name).exists() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)):
        kept = [step for step, _ in list_checkpoints(folder)]
        fix = (f"it keeps the checkpoints of step{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))}: add "
               f"--step {kept[-1]} to use the newest, or finish the run (train.resume=auto)" if kept else
               "point at a finished run folder or an adapter folder (a checkpoint's adapter works too)")
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and not kept:
            raise ExportError(  # bug bash bb73: a merged export, said to be a run that "did not finish"
                f"{folder}: holds a whole model (config.json and its weights: a merged export, or a base), not an "
                "adapter. Fix: to generate with it, take it as the base without an adapter: `finetune generate RUN "
                f"--no-adapter --base {folder}` (RUN: the run it came from, whose recipe gives the chat template).")
        raise ExportError(
            f"{folder}: holds no adapter (looked for {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} in {folder}/adapter and "
            f"{folder}). The run did not finish or saved nothing. Fix: {fix}."
        )
    if problem := config_problem(adapter_dir) or weights_problem(adapter_dir, header=False):  # (read: export.py)
        raise ExportError(damaged_adapter(adapter_dir, problem))
    return Source(adapter_dir, _run_recipe(folder, adapter_dir), json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")))


def damaged_adapter(adapter_dir: Path, problem: str) -> str:
    """The paragraph for an adapter folder whose file is damaged: which file and how, whether the run had finished,
    and the ways out (a kept checkpoint with --step, a resume that writes adapter/ again, a fresh copy)."""
    run = adapter_dir.parent if adapter_dir.name in ("adapter", AS_TRAINED) else adapter_dir
    kept = [step for step, _ in list_checkpoints(run)]
    finished = ""
    if problem.startswith(ADAPTER_WEIGHTS) and (adapter_dir / ADAPTER_CONFIG).is_file():
        finished = (f" The adapter was written whole ({ADAPTER_CONFIG} is there: a run writes both at its end, in one "
                    "rename), so the file was damaged or removed after the run finished.")
        if (adapter_dir / "adapter_model.bin").is_file():
            finished += " (PEFT's older adapter_model.bin beside it is not read by export and generate.)"
    if kept:
        fix = (f"add --step {kept[-1]} to use the newest kept checkpoint of {run} (`finetune checkpoints {run}` lists "
               f"them), or run the run's recipe again with train.resume=auto, which continues from step {kept[-1]} and "
               f"writes {run}/adapter anew; or copy the adapter folder again from where it was made")
    else:
        fix = "copy the adapter folder again from where it was made (its run keeps no checkpoint to export instead)"
    return f"{adapter_dir}: {problem}.{finished} Nothing was read from it. Fix: {fix}."


def _run_recipe(folder: Path, adapter_dir: Path) -> Recipe | None:
    """The run's recipe.yaml (beside adapter/), else None. One this finetune cannot read (cut short, edited) is
    replaced by the newest checkpoint's copy (checkpoints/step-N/recipe.yaml, written by the same run), with a note:
    without it the base, the data format and the quantization were guessed (bb30: prompts went through the chat
    template instead of the run's alpaca template)."""
    from finetune.outputs.run_folder import saved_recipe

    recipe_file = next((p for p in (folder / "recipe.yaml", adapter_dir.parent / "recipe.yaml") if p.is_file()), None)
    if recipe_file is None:
        return None
    try:
        return saved_recipe(recipe_file)  # keys removed since the run are dropped, with a note
    except RecipeError as exc:  # the whole paragraph: every problem at its key, not only the header line
        problem = exc
    for step, checkpoint in reversed(list_checkpoints(recipe_file.parent)):
        try:
            recipe = saved_recipe(checkpoint / "recipe.yaml")
        except RecipeError:
            continue
        print(f"[finetune] note: {recipe_file} is not a valid recipe ({str(problem).splitlines()[-1].strip()}), so the "
              f"run's recipe is read from its checkpoint of step {step} ({checkpoint / 'recipe.yaml'}), which the "
              f"same run wrote. Fix {recipe_file} (or copy that one over it) to silence this.", flush=True)
        return recipe
    print(f"[finetune] note: {recipe_file} is not a valid recipe for this finetune, so the base is the adapter's "
          "base_model_name_or_path and the run's data format, system prompt and quantization are not known (fix those "
          f"keys in {recipe_file} to use them). {problem}", flush=True)
    return None
