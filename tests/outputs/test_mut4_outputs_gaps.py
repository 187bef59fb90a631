"""Mutation testing round 4 (mut4): rules of outputs/run_folder.py and outputs/step_folders.py that no test read.

Found by a bug bash: each test below is the one check that a surviving mutant broke without any test failing
(SF05: the end-of-run "best eval loss" line after a single evaluation; RF01/RF02: which metrics.jsonl records a resume
keeps; RF03: a finished run continued in place from its own checkpoint; RF04: a lock file of another host on a
filesystem without flock). In-process, on files written here.
"""

from __future__ import annotations

import json
import os
import socket

from finetune.outputs import run_folder
from finetune.outputs.adapter_files import ADAPTER_WEIGHTS
from finetune.outputs.step_folders import report_best_eval


def test_the_best_eval_line_is_said_only_after_two_evaluations(tmp_path, capsys):
    """Found by a bug bash (mut4 SF05): with one evaluation there is no "best" to choose, and the docstring promises
    the line only with two or more; the bound `< 2` -> `< 1` printed it after a single eval and no test noticed."""
    assert report_best_eval(tmp_path, [(4, 1.5)]) == 4
    assert "best eval loss" not in capsys.readouterr().out
    assert report_best_eval(tmp_path, [(2, 1.5), (4, 1.25)]) == 4
    assert "best eval loss 1.2500 at step 4 of 2 evaluations" in capsys.readouterr().out


def test_a_resume_keeps_the_records_up_to_its_checkpoint_step_and_drops_the_after_eval(tmp_path):
    """Found by a bug bash (mut4 RF01, RF02): resuming from step 2 keeps metrics.jsonl's records of steps 1 and 2
    (step 2 itself is not trained again) and drops step 3 and the generation eval "after" training (the resumed run
    writes its own). `<=` -> `<` lost step 2's record; dropping the phase check kept two "after" evals."""
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "phase": "after", "score": 0.5},
               {"step": 3, "loss": 1.0}, {"elapsed_s": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n", encoding="utf-8")
    run_folder._trim_metrics(path, 2)
    kept = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert kept == [records[0], records[1], records[4]]


def test_a_finished_run_continued_in_place_from_its_own_checkpoint_is_refused(tmp_path):
    """Found by a bug bash (mut4 RF03): train.resume naming a checkpoint inside output.dir, where the run finished
    (adapter/), would remove the finished adapter; it is refused unless output.overwrite=true. With `not elsewhere`
    flipped, nothing refused it and no test noticed."""
    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / ADAPTER_WEIGHTS).write_bytes(b"x")
    step = out / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    problem = run_folder.output_dir_problem(out, overwrite=False, resume=str(step))
    assert problem is not None and "holds a finished run (adapter/)" in problem and "output.overwrite=true" in problem
    assert run_folder.output_dir_problem(out, overwrite=True, resume=str(step)) is None


def test_without_flock_a_lock_file_of_another_host_blocks_nothing(tmp_path, monkeypatch):
    """Found by a bug bash (mut4 RF04): on a filesystem without flock the lock file's pid is checked on its own host
    only (a pid of another host says nothing here); without the host check a live local pid of the same number
    blocked the folder, and no test noticed."""
    (tmp_path / run_folder.LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": "another-node"}),
                                                 encoding="utf-8")
    monkeypatch.setattr(run_folder, "_try_lock", lambda fd: None)  # the filesystem has no flock
    assert run_folder.running_owner(tmp_path) is None
    (tmp_path / run_folder.LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}),
                                                 encoding="utf-8")
    assert run_folder.running_owner(tmp_path) == f"PID {os.getpid()} on {socket.gethostname()}"
