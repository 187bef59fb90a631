"""Reading a training checkpoint back into a run (a resume): the LoRA tensors and the optimizer state through DCP,
resharded to this run's world size and strategy (or DeepSpeed's own checkpoint, at the ZeRO stage that wrote it), and
this rank's RNG state. The layout and the writing are finetune/outputs/checkpoint.py's; which checkpoint a resume takes,
and what it must match, finetune/outputs/step_folders.py and resume_checks.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune import distributed
from finetune.errors import CheckpointError
from finetune.outputs.base_record import misfit
from finetune.outputs.checkpoint import _dcp, _quiet_torch_distributed, set_rng_state, trainable_state
from finetune.outputs.step_folders import TRAINER_STATE
from finetune.parallel import zero_checkpoint
from finetune.parallel.engines import engine_of


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> dict:
    """Load trainable weights, optimizer state and this rank's RNG state from `path`; return the trainer state.

    DCP reshards to the current world size and strategy. A rank that did not exist in the saving run keeps its seed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    trainer_state = json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
    if engine_of(model).own_checkpoint_format:
        zero_checkpoint.load_state(model, path / zero_checkpoint.CHECKPOINT_FOLDER,
                                    saved_world_size=trainer_state["world_size"], saved_strategy=trainer_state["strategy"])
        _load_rng(path)
        return trainer_state
    if not (path / "trainable").is_dir():
        raise CheckpointError(f"train.resume: checkpoint {path} was written by {trainer_state['strategy']} (DeepSpeed's own "
                              "format). Fix: resume it with DeepSpeed at the ZeRO stage that wrote it (any number of ranks: another number is "
                              "converted to DeepSpeed's universal checkpoint), or start a new run.")
    state = trainable_state(model, optimizer, names)
    try:
        _dcp(dcp.load, state, path / "trainable")
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:  # DCP wraps per-rank failures
        _raise_refusal(exc)
        raise CheckpointError(misfit(path, exc)) from None  # the cause and the fix (bb41: a bare size mismatch)
    _set_trainable_state(model, optimizer, state)
    _load_rng(path)
    return trainer_state


def _raise_refusal(exc: BaseException) -> None:
    """The refusal of a checkpoint file that holds code (`dcp_reader`, `_load_planner`), which DCP wrapped into its
    CheckpointException of every rank's failure: raised as it is."""
    for failure in getattr(exc, "failures", {}).values():
        if isinstance(failure, tuple) and isinstance(failure[0], CheckpointError):
            raise failure[0] from None


def _set_trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put what DCP read into the model and the optimizer; FSDP1's LoRA units alone (as in `trainable_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(strict=False, ignore_frozen_params=True)
    with _quiet_torch_distributed():
        engine_of(model).load_checkpoint_state(model, optimizer, state, options)


def _load_rng(path: Path) -> None:
    rng_file = path / "rng" / f"rank{distributed.info().rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
