"""Writing what a run produces: the output folder guard, the PEFT adapter, atomically and verified.

Everything is written into a temporary sibling folder, flushed, then renamed into place, so a run killed at any
moment leaves either the previous version or the new one, never a half-written folder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Iterator

import torch

from finetune.errors import CheckpointError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LOCK_FILE = ".finetune.lock"


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_dir(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `target` in one rename (the old one removed after)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists():
            if not replace:
                raise CheckpointError(f"{target} already exists; choose another folder or remove it first.")
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------- output folder
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def output_dir_problem(out_dir: Path, *, overwrite: bool, resume: str | None) -> str | None:
    """Why this run may not write into `out_dir` (None when it may). Checked on rank 0 before anything loads."""
    lock = out_dir / LOCK_FILE
    if lock.exists():
        try:
            owner = json.loads(lock.read_text())
        except (OSError, json.JSONDecodeError):
            owner = {}
        if owner.get("host") == socket.gethostname() and _pid_alive(int(owner.get("pid", -1))):
            return (
                f"output.dir {out_dir} is in use by a running run (pid {owner['pid']}). Wait for it, stop it, or choose "
                "another output.dir."
            )
    finished = (out_dir / "adapter" / ADAPTER_WEIGHTS).exists()
    if finished and not overwrite and resume is None:
        return (
            f"output.dir {out_dir} already holds a finished run (adapter/). Nothing was changed. Fix: choose another "
            "output.dir, pass output.overwrite=true to replace it, or train.resume=auto to continue it."
        )
    return None


def take_output_dir(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def release_output_dir(out_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (out_dir / LOCK_FILE).unlink()


# -------------------------------------------------------------------------------------------------- adapter
def adapter_key_map(peft_model) -> dict[str, str]:
    """Model parameter name -> PEFT's on-disk key, computed by PEFT itself on the unwrapped model.

    Call before the parallel wrap: PEFT finds adapter tensors by walking the module tree, and FSDP1 inserts
    `_fsdp_wrapped_module` levels into it, after which PEFT silently selects nothing (an empty adapter).
    """
    from peft.utils import get_peft_model_state_dict

    trainable = {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
    tagged = {name: torch.tensor([index]) for index, name in enumerate(trainable)}
    on_disk = get_peft_model_state_dict(peft_model, state_dict=tagged)
    names = list(trainable)
    return {names[int(value.item())]: key for key, value in on_disk.items()}


def save_adapter(peft_config, key_map: dict[str, str], trainable_state: dict[str, torch.Tensor], out_dir: Path) -> dict:
    """Write a standard PEFT adapter folder atomically, read it back and compare. Rank 0 only."""
    from safetensors.torch import load_file, save_file

    missing = [name for name in key_map if name not in trainable_state]
    if not key_map or missing:
        raise RuntimeError(
            f"adapter gather is missing {len(missing)} of {len(key_map)} tensors (e.g. {missing[:2]}): refusing to write a partial adapter"
        )
    tensors = {key_map[name]: trainable_state[name].detach().to("cpu").contiguous() for name in key_map}
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the adapter has NaN/inf values ({bad[0]} and {len(bad) - 1} more); not written over {out_dir}.")
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        _verify_adapter_files(tmp, tensors, load_file)
    return tensors


def _verify_adapter_files(folder: Path, tensors: dict[str, torch.Tensor], load_file) -> None:
    written = load_file(str(folder / ADAPTER_WEIGHTS))
    if written.keys() != tensors.keys():
        raise RuntimeError(f"adapter read back with {len(written)} tensors, {len(tensors)} were saved")
    for key, value in tensors.items():
        if not torch.equal(written[key], value):
            raise RuntimeError(f"adapter tensor {key} differs after reading it back")
    if not (folder / ADAPTER_CONFIG).exists():
        raise RuntimeError("adapter_config.json was not written")
