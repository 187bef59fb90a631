"""A run writes nothing through a symbolic link in its output.dir, and its weights follow the umask (bug bash bb26,
findings 2, 7 and 10).

Before: the lock file was opened through a link (the linked file truncated, the run's pid written into it), a resume in
place wrote recipe.yaml through a link and left plot.png's link for the plot to be drawn into, a linked
`.step-N.tmp` was written into (the checkpoint published as a link to an unrelated folder), a linked step was never
pruned, a linked adapter/ left `.adapter.old-<pid>` behind, and safetensors' weights were 0600 whatever the umask.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from finetune.errors import CheckpointError
from finetune.outputs import LOCK_FILE, checkpoint, output_dir_problem, run_folder
from finetune.outputs.adapter_files import ADAPTER_WEIGHTS, save_adapter
from finetune.outputs.run_folder import begin_outputs, release_output_dir, take_output_dir
from finetune.outputs.step_folders import list_checkpoints

PRECIOUS = "precious content, do not lose\n"


def _outside(tmp_path: Path, name: str, text: str = PRECIOUS) -> Path:
    path = tmp_path / "elsewhere" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_symlinked_lock_file_is_refused_and_its_target_kept(tmp_path):
    """Found by a bug bash (bb26): `.finetune.lock -> ../../precious_target.txt` was truncated and given the run's
    pid (os.open followed the link)."""
    run, target = tmp_path / "run", _outside(tmp_path, "precious_target.txt")
    run.mkdir()
    (run / LOCK_FILE).symlink_to(target)
    problem = output_dir_problem(run, overwrite=False, resume="auto")
    assert problem is not None and f"{LOCK_FILE} is a symbolic link (to {target})" in problem
    assert f"rm {run / LOCK_FILE}" in problem and "nothing was changed" in problem
    try:
        with pytest.raises(CheckpointError, match="is a symbolic link"):
            take_output_dir(run)  # O_NOFOLLOW: a link made after the check is refused too
    finally:
        if run in run_folder._HELD:  # taken (the code before): let go
            release_output_dir(run)
    assert target.read_text() == PRECIOUS and (run / LOCK_FILE).is_symlink()


def test_a_resume_in_place_replaces_linked_run_files_never_their_targets(tmp_path):
    """Found by a bug bash (bb26): recipe.yaml was written through its link (the linked file became the resolved
    recipe) and plot.png's link was kept, so the plot was saved into the linked file."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 1, "files": {}}))
    records = json.dumps({"step": 1, "loss": 1.0}) + "\n" + json.dumps({"step": 2, "loss": 0.5}) + "\n"
    targets = {"recipe.yaml": _outside(tmp_path, "my_recipe.yaml"), "plot.png": _outside(tmp_path, "my_plot.txt"),
               "metrics.jsonl": _outside(tmp_path, "metrics.txt", records)}
    for name, target in targets.items():
        (run / name).symlink_to(target)

    begin_outputs(run, "model: {}\n", resume_from=step)

    assert targets["recipe.yaml"].read_text() == PRECIOUS and targets["plot.png"].read_text() == PRECIOUS
    assert targets["metrics.jsonl"].read_text() == records
    assert not (run / "recipe.yaml").is_symlink() and (run / "recipe.yaml").read_text() == "model: {}\n"
    assert not os.path.lexists(run / "plot.png")  # drawn anew at the end of the run, into a file of its own
    assert not (run / "metrics.jsonl").is_symlink()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def _linear() -> tuple[torch.nn.Module, torch.optim.Optimizer, set[str]]:
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters()), {name for name, _ in model.named_parameters()}


def _save(run: Path, step: int, *, keep_last: int = 5) -> Path:
    return checkpoint.save_checkpoint(run, step, *_linear(), {"step": step, "world_size": 1, "strategy": "single"},
                                      "a: 1\n", keep_last=keep_last)


def test_a_linked_step_tmp_folder_is_removed_not_written_into(tmp_path):
    """Found by a bug bash (bb26): with `checkpoints/.step-00000004.tmp -> outside_ck`, rmtree did nothing to the link,
    the checkpoint was written into outside_ck/ beside the user's files and published as a link to it."""
    run, outside = tmp_path / "run", tmp_path / "outside_ck"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep\n")
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / ".step-00000002.tmp").symlink_to(outside)
    saved = _save(run, 2)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert not saved.is_symlink() and (saved / "manifest.json").is_file()


def test_pruning_a_linked_step_removes_the_link_never_its_files(tmp_path):
    """Found by a bug bash (bb26): rmtree(link, ignore_errors=True) failed silently, so a linked step was listed
    forever beyond keep_last."""
    run, outside = tmp_path / "run", tmp_path / "outside_ck"
    outside.mkdir()
    (outside / "trainer_state.json").write_text("{}")
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001").symlink_to(outside)
    _save(run, 2, keep_last=1)
    assert [step for step, _ in list_checkpoints(run)] == [2]
    assert (outside / "trainer_state.json").read_text() == "{}"


def _adapter(out_dir: Path):
    from peft import LoraConfig

    tensors = {"x.lora_A.weight": torch.ones(2, 4), "x.lora_B.weight": torch.zeros(3, 2)}
    keys = {name: f"base_model.model.{name}" for name in tensors}
    return save_adapter(LoraConfig(r=2, target_modules=["x"]), keys, tensors, out_dir)


def test_a_linked_adapter_folder_becomes_a_folder_of_its_own_and_no_link_is_left(tmp_path, capsys):
    """Found by a bug bash (bb26): adapter/ -> scratch_ad became a real folder while `.adapter.old-<pid>` (the link)
    stayed in the run folder, and nothing said that scratch_ad/ kept the old adapter."""
    run, scratch = tmp_path / "run", tmp_path / "scratch_ad"
    scratch.mkdir()
    (scratch / "old.txt").write_text("the adapter of step 2\n")
    run.mkdir()
    (run / "adapter").symlink_to(scratch)
    _adapter(run / "adapter")
    assert not (run / "adapter").is_symlink() and (run / "adapter" / ADAPTER_WEIGHTS).is_file()
    assert sorted(p.name for p in run.iterdir()) == ["adapter"]  # no .adapter.old-<pid>
    assert sorted(p.name for p in scratch.iterdir()) == ["old.txt"]
    said = " ".join(capsys.readouterr().out.split())
    assert f"{run / 'adapter'} was a symbolic link to {scratch}" in said and "keeps what it held" in said


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)], ids=["umask022", "umask077"])
def test_the_adapter_weights_follow_the_umask(tmp_path, umask, mode):
    """Found by a bug bash (bb26): under umask 022 adapter_model.safetensors was 0600 (safetensors' save_file) while
    adapter_config.json beside it was 0644."""
    old = os.umask(umask)
    try:
        _adapter(tmp_path / "adapter")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "adapter").iterdir()}
    assert modes == {ADAPTER_WEIGHTS: mode, "adapter_config.json": mode}
