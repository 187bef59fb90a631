"""A train.tensorboard_dir shared by runs: a run removes or cuts only the event files its own output.dir wrote (their
names end in `.ft-<hash of output.dir>`), and a default run name another run already has there gets a folder of its
own (`<name>-<hash>`), which its resume finds again."""

from __future__ import annotations

import time

from finetune.recipe import validate_recipe
from finetune.tracking import Trackers
from finetune.tracking.trackers import event_suffix


def make_recipe(out, shared, **train):
    raw = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "d.jsonl"}]},
           "train": {"learning_rate": 3e-4, "trackers": ["tensorboard"], "tensorboard_dir": str(shared), **train},
           "output": {"dir": str(out)}}
    return validate_recipe(raw)


def train(out, shared, steps, *, resumed_step: int = 0, **train_keys) -> None:
    trackers = Trackers(make_recipe(out, shared, **train_keys), out, is_main=True, resumed_step=resumed_step)
    for step in steps:
        trackers.write(step=step, loss=10.0 - step / 10)
    trackers.close()


def loss_steps(folder) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    # sorted: the reader takes a folder's files in name order, and two writers of one process in one second are told
    # apart by a per-process counter compared as text ("10" before "9": the resumed file read first, CI stop 67)
    return sorted(event.step for event in events.Scalars("loss"))


def test_two_runs_whose_output_dirs_share_a_last_name_keep_each_others_tensorboard_history(tmp_path, capsys):
    """Found by a bug bash: exps/llama/final and exps/qwen/final both logged into <tensorboard_dir>/final (the default
    run name), and the second run's fresh start deleted the first run's event files without a word."""
    shared, llama, qwen = tmp_path / "tbs", tmp_path / "exps" / "llama" / "final", tmp_path / "exps" / "qwen" / "final"
    train(llama, shared, range(1, 4))
    train(qwen, shared, range(1, 3))
    assert loss_steps(shared / "final") == [1, 2, 3]  # the llama run's history, intact
    qwen_folder = shared / f"final-{event_suffix(qwen).removeprefix('.ft-')}"
    assert loss_steps(qwen_folder) == [1, 2]
    assert all(path.name.endswith(event_suffix(llama)) for path in (shared / "final").iterdir())
    train(llama, shared, range(1, 3))  # the llama run started over (output.overwrite): its own events replaced
    train(qwen, shared, range(2, 3), resumed_step=1)  # the qwen run resumed: back in its own folder, cut to step 1
    assert loss_steps(shared / "final") == [1, 2] and loss_steps(qwen_folder) == [1, 2]
    assert sorted(path.name for path in shared.iterdir()) == ["final", qwen_folder.name]
    assert "note" not in capsys.readouterr().out


def test_a_run_name_two_runs_share_removes_and_cuts_only_the_runs_own_event_files(tmp_path, capsys):
    """Found by a bug bash: a fresh start unlinked every event file under <tensorboard_dir>/<run_name>, another
    run's (even a live one's) too. A name the user set stays shared: one note says another run's files are there."""
    shared, first, second = tmp_path / "tbs", tmp_path / "a" / "run", tmp_path / "b" / "run"
    train(first, shared, range(1, 4), run_name="same")
    capsys.readouterr()
    train(second, shared, range(1, 6), run_name="same")
    note = capsys.readouterr().out
    assert "also holds 1 event file(s) of another run, kept" in note and "train.run_name" in note
    time.sleep(1.05)  # SummaryWriter names its file by the second: the resume's file is another one
    train(second, shared, range(3, 5), resumed_step=2, run_name="same")  # the second run resumed from step 2
    files = sorted((shared / "same").iterdir())
    firsts = [path for path in files if path.name.endswith(event_suffix(first))]
    assert len(firsts) == 1 and loss_steps(firsts[0]) == [1, 2, 3]  # neither removed nor cut
    seconds = [path for path in files if path.name.endswith(event_suffix(second))]
    assert [loss_steps(path) for path in seconds] == [[1, 2], [3, 4]]
