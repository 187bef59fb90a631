"""DeepSpeed's own checkpoints of the trainable state: save, load into the same number of ranks, or convert to its
universal checkpoint to load into another number of ranks (ZeRO-3 and ZeRO-2)."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

from finetune.errors import CheckpointError
from finetune.files import on_main

CHECKPOINT_FOLDER = "deepspeed"  # inside checkpoints/step-N/
CHECKPOINT_TAG = "state"


def save_state(engine, folder: Path) -> None:
    """DeepSpeed's own checkpoint of the trainable state (collective): ZeRO partitions of the fp32 LoRA weights and
    AdamW moments, one file per rank, plus the module's trainable tensors. Frozen base weights are never written."""
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False, exclude_frozen_parameters=True)


def load_state(engine, folder: Path, *, saved_world_size: int, saved_strategy: str) -> None:
    """Restore a DeepSpeed checkpoint into a fresh engine: the ZeRO stage that wrote it, any number of ranks (another
    number through the universal checkpoint). The run refuses the rest before any weight loads
    (finetune/outputs/resume_checks.py); the refusals here guard a caller that did not ask."""
    from finetune import distributed

    world = distributed.info().world_size
    if not (folder / CHECKPOINT_TAG).is_dir():
        raise CheckpointError(f"train.resume: checkpoint {folder.parent} was written by {saved_strategy}, not by DeepSpeed; "
                              "DeepSpeed resumes only its own checkpoints. Fix: resume it with the strategy that wrote it, "
                              "or start a new run.")
    stage = engine.zero_optimization_stage()
    if f"ZeRO-{stage}" not in saved_strategy:
        raise CheckpointError(
            f"train.resume: checkpoint {folder.parent} was written by {saved_strategy}; this run is ZeRO-{stage}. DeepSpeed "
            "partitions the optimizer state differently per stage and loads a checkpoint only into the stage that wrote "
            "it (its universal format converts between numbers of ranks, not stages). Fix: resume with "
            f"parallel.zero_stage set to the stage in '{saved_strategy}'.")
    if saved_world_size == world:
        _load(engine, folder)
        return
    universal = folder.parent.parent / f".{folder.parent.name}.universal"  # removed with the save's leftovers
    on_main(lambda: to_universal(folder / CHECKPOINT_TAG, universal / CHECKPOINT_TAG))
    distributed.print0(f"[finetune] the checkpoint was written by {saved_world_size} ranks, this run has {world}: "
                       f"converted to DeepSpeed's universal checkpoint ({universal}) and loaded from it")
    engine._config.load_universal_checkpoint = True  # read by engine.load_checkpoint; set in the config at init otherwise
    try:
        _load(engine, universal)
    finally:
        engine._config.load_universal_checkpoint = False
    on_main(lambda: shutil.rmtree(universal, ignore_errors=True))


def _load(engine, folder: Path) -> None:
    path, _ = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False,
                                     load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        raise CheckpointError(f"train.resume: DeepSpeed could not load {folder} (see its log above).")


def to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal conversion (one parameter file per LoRA tensor: fp32 weights and AdamW moments,
    loadable by any number of ranks), in this process and without worker processes."""
    from types import SimpleNamespace

    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(target.parent, ignore_errors=True)
    target.mkdir(parents=True)
    # ZeRO-1/2 checkpoints of a plain data-parallel engine carry no `universal_checkpoint_info` (only tensor- or
    # pipeline-parallel clients such as Megatron-DeepSpeed write one), and ds_to_universal asserts on it ("Required
    # universal_checkpoint_info state is missing"). Its own `inject_missing_state` option adds the version key alone,
    # which is all a data-parallel checkpoint needs: no parameter is split by tensor parallelism. ZeRO-3 reads its
    # parameter shapes from the model-state files and never asks for it. Measured: a ZeRO-2 checkpoint of 2 ranks
    # resumed by 1 (tests/outputs/test_resume_review.py).
    args = SimpleNamespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
            ds_to_universal.main(args)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError, KeyError) as exc:
        shutil.rmtree(target.parent, ignore_errors=True)
        raise CheckpointError(f"train.resume: DeepSpeed cannot convert {source.parent.parent} to its universal "
                              f"checkpoint, which a resume on another number of ranks needs: {exc}. Fix: resume with the "
                              "number of ranks that wrote it.") from None
