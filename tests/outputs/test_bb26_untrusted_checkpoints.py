"""Reading a checkpoint or an adapter from elsewhere runs none of its code (bug bash bb26, findings 1 and 11).

A checkpoint's trainable/.metadata was unpickled by torch's FileSystemReader with plain pickle.load, and DCP's load
planner read the saved optimizer values with torch.load(weights_only=False): a crafted checkpoint ran its code on
`finetune export --step`, `finetune generate --step` and every resume. Each payload here only creates a marker file:
it exists when the code ran.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from finetune.errors import CheckpointError, ModelLoadError
from finetune.outputs import checkpoint, checkpoint_adapter, checkpoint_load


class Payload:
    """Unpickled, it creates `marker` (builtins.open in write mode): harmless proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, set[str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, {name for name, _ in model.named_parameters()}


def _saved(tmp_path: Path) -> tuple[Path, tuple]:
    """A real checkpoint written by finetune in this process (no process group), and the model it was written from."""
    model, optimizer, names = _model()
    path = checkpoint.save_checkpoint(tmp_path / "run", 1, model, optimizer, names,
                                      {"step": 1, "world_size": 1, "strategy": "single"}, "a: 1\n", keep_last=2)
    return path, (model, optimizer, names)


def _fix_manifest(path: Path) -> None:
    """What anyone crafting a checkpoint does: recompute the manifest's sizes and checksums."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_whose_metadata_holds_code_is_refused_by_export_generate_and_resume(tmp_path):
    """Found by a bug bash (bb26): the payload in trainable/.metadata ran (read_trainable_tensors: `export --step`,
    `generate --step`; load_checkpoint: resume), and the commands then finished normally."""
    path, (model, optimizer, names) = _saved(tmp_path)
    whole = checkpoint_adapter.read_trainable_tensors(path)  # a real checkpoint reads: all DCP writes is allowed
    assert set(whole) == names
    marker = tmp_path / "PWNED"
    (path / "trainable" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _fix_manifest(path)

    for read in (lambda: checkpoint_adapter.read_trainable_tensors(path),  # export --step, generate --step
                 lambda: checkpoint_load.load_checkpoint(path, model, optimizer, names)):  # resume
        with pytest.raises(CheckpointError) as refused:
            read()
        message = str(refused.value)
        assert not marker.exists(), "the checkpoint's code ran"
        assert f"checkpoint {path}: trainable/.metadata holds code" in message
        assert "io.open" in message and "Fix:" in message and "\n" not in message


def test_a_checkpoint_whose_saved_optimizer_values_hold_code_is_refused_on_resume(tmp_path):
    """Found by a bug bash (bb26): DCP's default load planner reads the non-tensor values of a checkpoint (the
    optimizer's param_groups) with torch.load(weights_only=False): a payload there ran on every resume."""
    path, (model, optimizer, names) = _saved(tmp_path)
    import torch.distributed.checkpoint as dcp

    state = checkpoint.trainable_state(model, optimizer, names)
    marker = tmp_path / "PWNED"
    state["optim"]["param_groups"][0]["lr"] = Payload(marker)
    for file in (path / "trainable").iterdir():
        file.unlink()
    dcp.save(state, checkpoint_id=path / "trainable", no_dist=True)
    _fix_manifest(path)

    with pytest.raises(CheckpointError, match=r"trainable/ \(the saved optim\.param_groups\.0\.lr\) holds code") as no:
        checkpoint_load.load_checkpoint(path, model, optimizer, names)
    assert not marker.exists(), "the checkpoint's code ran"
    assert "io.open" in str(no.value)

    clean, (model, optimizer, names) = _saved(tmp_path / "clean")  # a real checkpoint still resumes
    assert checkpoint_load.load_checkpoint(clean, model, optimizer, names)["step"] == 1


def test_a_pickled_adapter_bin_is_refused_naming_the_global_it_asks_for(tmp_path):
    """Found by a bug bash (bb26): the refusal embedded 200 characters of torch's advice, terminal escapes (ESC[1m)
    included, cut mid-word ("In PyTorch 2.6, we changed the defa"), and not the global torch refused."""
    from finetune.model.lora.adapter import _saved_tensors

    class Evaluated:
        def __reduce__(self):
            return eval, ("1 + 1",)

    torch.save({"base_model.model.x.lora_A.weight": Evaluated()}, tmp_path / "adapter_model.bin")
    with pytest.raises(ModelLoadError) as refused:
        _saved_tensors(tmp_path)
    message = str(refused.value)
    assert "adapter_model.bin cannot be read as plain tensors (it asks for the global eval (Python code" in message
    assert "\x1b" not in message and "PyTorch 2.6" not in message and "\n" not in message
