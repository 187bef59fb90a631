"""dpo.reference: precomputed, read back on a resume (bug bash bb63: caches that go stale). The stored log-probs are
keyed by the pairs' tokens, not only their count and length, and a resume into another output.dir carries the file,
so that run can be resumed in its turn. In process: the reference pass is replaced by fixed values (the file's keying
is the subject; tests/training/test_preference.py resumes real runs)."""
from __future__ import annotations

import json

import pytest

from finetune.data import Example
from finetune.errors import CheckpointError
from finetune.recipe import validate_recipe
from finetune.training.objectives import preference

IGNORE = -100


def _pairs(*, swapped: bool = False) -> list[Example]:
    pairs = []
    for offset in range(3):
        chosen = Example([1, 2, 3 + offset, 4], [IGNORE, IGNORE, 3 + offset, 4])
        rejected = Example([1, 2, 5, 6 + offset, 7], [IGNORE, IGNORE, 5, 6 + offset, 7])
        if swapped:
            chosen, rejected = rejected, chosen
        chosen.rejected = rejected
        pairs.append(chosen)
    return pairs


def _recipe():
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": {"datasets": [{"path": "p.jsonl",
                            "format": "preference"}]}, "train": {"objective": "dpo"}, "dpo": {"reference": "precomputed"}})


def _attach(pairs, out_dir, resume_from=None):
    preference.attach_reference(None, None, {"train": pairs}, _recipe(), pad_id=0, out_dir=out_dir,
                                resume_from=resume_from)
    return [example.reference_logps for example in pairs]


@pytest.fixture
def fixed_reference(monkeypatch):
    monkeypatch.setattr(preference, "precompute", lambda model, reference, examples, **_: [
        (-1.0 - i, -2.0 - i) for i in range(len(examples))])


def test_a_resume_onto_pairs_with_their_sides_swapped_is_refused(tmp_path, fixed_reference):
    """Found by a bug bash: the file was keyed by the pairs' count and summed length, which swapping chosen and
    rejected keeps, so a resume read the old values for the new pairs (resumed step-3 loss 9.72 where the right
    reference gives 0.727), with a general note only. The pairs' tokens and labels are in the key now."""
    run = tmp_path / "run"
    assert _attach(_pairs(), run) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]
    checkpoint = run / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    assert _attach(_pairs(), run, checkpoint) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]
    with pytest.raises(CheckpointError, match="the train pairs changed: other rows, or the same rows tokenized otherwise"):
        _attach(_pairs(swapped=True), run, checkpoint)


def _an_earlier_finetunes_run(tmp_path):
    """A run folder whose reference file holds each split's count and length alone, as finetune wrote it before
    bb63, and a checkpoint folder in it (no trainer_state.json)."""
    run = tmp_path / "run"
    _attach(_pairs(), run)
    stored = json.loads((run / preference.REFERENCE_FILE).read_text())
    stored["fingerprint"] = {name: value[:2] for name, value in stored["fingerprint"].items()}
    (run / preference.REFERENCE_FILE).write_text(json.dumps(stored))
    checkpoint = run / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    return run, checkpoint


def test_a_file_written_before_the_tokens_were_keyed_is_still_read(tmp_path, fixed_reference):
    """A run folder of an earlier finetune holds the count and length alone: its resume keeps working."""
    run, checkpoint = _an_earlier_finetunes_run(tmp_path)
    assert _attach(_pairs(), run, checkpoint) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]


def test_a_resume_into_another_output_dir_carries_the_file(tmp_path, fixed_reference):
    """Found by a bug bash: a run resumed into another output.dir (what the finished-run error advises) read the file
    from the first run's folder but never wrote it into its own, so resuming that run failed blaming changed data or
    adapter_off, neither of which happened."""
    first, second = tmp_path / "first", tmp_path / "second"
    _attach(_pairs(), first)
    checkpoint = first / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    _attach(_pairs(), second, checkpoint)
    assert (second / preference.REFERENCE_FILE).is_file()
    later = second / "checkpoints" / "step-00000004"
    later.mkdir(parents=True)
    assert _attach(_pairs(), tmp_path / "third", later) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]


def test_a_resume_whose_eval_pairs_alone_changed_names_the_eval_split(tmp_path, fixed_reference):
    """Bug bash bb69 #6: the refusal said "the pairs changed" when the training pairs (and their stored values) were
    the same and only the eval pairs differed; it names the split now."""
    run = tmp_path / "run"
    preference.attach_reference(None, None, {"train": _pairs(), "eval": _pairs()[:2]}, _recipe(), pad_id=0,
                                out_dir=run, resume_from=None)
    checkpoint = run / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"\(the eval pairs changed: "):
        preference.attach_reference(None, None, {"train": _pairs(), "eval": _pairs()}, _recipe(), pad_id=0,
                                    out_dir=run, resume_from=checkpoint)


def test_an_earlier_finetunes_file_is_checked_by_the_checkpoints_hash_of_its_rows(tmp_path, fixed_reference, capsys):
    """Bug bash bb70 F1: a file of a finetune before bb63 holds counts and lengths alone, which swapping chosen and
    rejected keeps: a resume took the old values in silence (step-4 loss 0.329 where the right reference gives 0.834).
    The checkpoint's own hash of its training rows (trainer_state.json, data.rows_fingerprint) decides now; a
    checkpoint without one is read with a note saying it cannot be checked."""
    from finetune.data import rows_fingerprint

    run, checkpoint = _an_earlier_finetunes_run(tmp_path)
    assert _attach(_pairs(swapped=True), run, checkpoint) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]
    assert "keyed by the pairs' counts alone, and this checkpoint holds no hash" in capsys.readouterr().out
    (checkpoint / "trainer_state.json").write_text(json.dumps({"data": {"fingerprint": rows_fingerprint(_pairs())}}))
    assert _attach(_pairs(), run, checkpoint) == [(-1.0, -2.0), (-2.0, -3.0), (-3.0, -4.0)]
    with pytest.raises(CheckpointError, match="the train pairs changed since the checkpoint"):
        _attach(_pairs(swapped=True), run, checkpoint)
