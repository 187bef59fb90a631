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
from finetune.outputs.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, as_trained
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
def open_source(path: str | Path, *, step: int | None = None) -> Iterator[Source]:
    """The Source of a run folder, an adapter folder, a checkpoint folder, or a run folder's kept checkpoint `step`.

    A checkpoint's adapter is written into a temporary folder first (removed on leaving); its recipe is the
    checkpoint's own recipe.yaml."""
    from finetune.outputs.checkpoint_adapter import write_checkpoint_adapter

    folder = Path(path).expanduser()
    checkpoint = _checkpoint_of(folder, step)
    if checkpoint is None:
        yield resolve_source(folder)
        return
    with tempfile.TemporaryDirectory(prefix="finetune-step-") as tmp:
        adapter_dir = Path(tmp) / "adapter"
        recipe = write_checkpoint_adapter(checkpoint, adapter_dir)
        print(f"[finetune] adapter of checkpoint {checkpoint} (step {checkpoint_facts(checkpoint).get('step')}) read "
              "from its training state")
        yield Source(adapter_dir, recipe, json.loads((adapter_dir / ADAPTER_CONFIG).read_text()), checkpoint=checkpoint)


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
    """A run folder (adapter/ inside) or an adapter folder -> Source; ExportError when it holds no usable adapter."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ExportError(
            f"{folder}: not found. Pass a run folder (output.dir of a finished run) or an adapter folder."
        )
    adapter_dir = folder / "adapter" if (folder / "adapter" / ADAPTER_CONFIG).exists() else folder
    adapter_dir = as_trained(folder) if as_trained(folder) != folder else adapter_dir  # a MoE run: as trained
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not (adapter_dir / ADAPTER_CONFIG).exists() or not weights.exists() or weights.stat().st_size == 0:
        kept = [step for step, _ in list_checkpoints(folder)]
        fix = (f"it keeps the checkpoints of step{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))}: add "
               f"--step {kept[-1]} to use the newest, or finish the run (train.resume=auto)" if kept else
               "point at a finished run folder or an adapter folder (a checkpoint's adapter works too)")
        raise ExportError(
            f"{folder}: holds no adapter (looked for {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} in {folder}/adapter and "
            f"{folder}). The run did not finish or saved nothing. Fix: {fix}."
        )
    recipe_file = next((p for p in (folder / "recipe.yaml", adapter_dir.parent / "recipe.yaml") if p.is_file()), None)
    recipe = None
    if recipe_file is not None:
        from finetune.outputs.run_folder import saved_recipe

        try:
            recipe = saved_recipe(recipe_file)  # keys removed since the run are dropped, with a note
        except RecipeError as exc:  # the whole paragraph: every problem at its key, not only the header line
            print(f"[finetune] note: {recipe_file} is not a valid recipe for this finetune, so the base is the adapter's "
                  "base_model_name_or_path and the run's data format, system prompt and quantization are not known "
                  f"(fix those keys in {recipe_file} to use them). {exc}", flush=True)
    return Source(adapter_dir, recipe, json.loads((adapter_dir / ADAPTER_CONFIG).read_text()))
