"""Resume decided before any weight loads (finetune/outputs/resume_checks.py): every changed recipe key that changes
the result is noted, key by key, with the harmless ones exempt; a change the checkpoint cannot take (seed, optimizer,
LoRA layout, the rows, the strategy's format, a max_steps below its step, other steps under train.num_epochs) is one
paragraph with the fix, from `finetune validate` too; a matching global batch is no change; the logged epoch counts on
from the checkpoint. Slow: a refused resume launches no model load, and ZeRO-2 continues on another number of ranks.

The fast tests write checkpoint folders by hand (recipe.yaml, trainer_state.json, a manifest): the checks read
nothing else.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import RUN_PY, addition_rows, recipe_dict, run_cmd, torchrun, write_jsonl, write_recipe

from finetune.data.examples import Example
from finetune.data.loader import BatchStream
from finetune.errors import CheckpointError, FinetuneError
from finetune.outputs import checkpoint, resume_changes, resume_checks
from finetune.parallel import zero
from finetune.parallel.decision import ParallelPlan
from finetune.recipe import load_recipe, recipe_to_yaml

SINGLE = ParallelPlan(strategy="single", world_size=1)


# ---------------------------------------------------------------------------------------------------- helpers
@pytest.fixture
def recipe_file(tmp_path) -> Path:
    values = recipe_dict(tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run",
                         train={"max_steps": 12, "micro_batch_size": 2, "seed": 7})
    return write_recipe(tmp_path / "recipe.yaml", values)


def fake_checkpoint(recipe, step: int, *, world_size: int = 1, micro_batch_size: int = 2, rows: int = 61,
                    strategy: str = "single process", deepspeed: bool = False) -> Path:
    """A checkpoint folder of `recipe`'s run as a save writes it, without tensors (the checks do not read them)."""
    folder = checkpoint.checkpoint_dir(Path(recipe.output.dir), step)
    (folder / ("deepspeed/state" if deepspeed else "trainable")).mkdir(parents=True)
    (folder / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    data = {"epoch": 0, "cursor": step, "world_size": world_size, "micro_batch_size": micro_batch_size, "rows": rows,
            "seed": recipe.train.seed}
    state = {"step": step, "data": data, "losses": [], "eval_losses": [], "tokens": 0, "world_size": world_size,
             "strategy": strategy}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    checkpoint._write_manifest(folder, step, state)
    return folder


def changes(source: Path, recipe_file: Path, *overrides: str, plan=SINGLE, rows: int | None = 61) -> list[str]:
    return resume_changes(source, load_recipe(recipe_file, ["train.resume=auto", *overrides]), plan, train_rows=rows)


def refusal(source: Path, recipe_file: Path, *overrides: str, plan=SINGLE, rows: int | None = 61) -> str:
    with pytest.raises(CheckpointError) as caught:
        changes(source, recipe_file, *overrides, plan=plan, rows=rows)
    return str(caught.value)


# ------------------------------------------------------------------------------------------ noted, key by key
def test_every_key_of_the_recipe_is_refused_noted_or_exempt_by_name(recipe_file):
    """Each leaf of the resolved recipe changed alone in the checkpoint: refused naming it, noted naming it, or one of
    the named harmless keys. A key added to the schema later is noted unless someone decides otherwise."""
    recipe = load_recipe(recipe_file)
    source = fake_checkpoint(recipe, 3)
    saved_text = (source / "recipe.yaml").read_text()
    leaves = [key for key, _, _ in resume_checks.differences(yaml.safe_load(saved_text), _sentinels(recipe))]
    assert len(leaves) > 100 and "train.weight_decay" in leaves and "data.datasets[0].path" in leaves
    silent = []
    for key in leaves:
        if resume_checks._under(key, resume_checks.BATCH):
            continue  # compared as the rows of a step (below)
        saved = yaml.safe_load(saved_text)
        _set(saved, key, "changed-value")
        (source / "recipe.yaml").write_text(yaml.safe_dump(saved))
        try:
            said = " ".join(resume_changes(source, recipe, SINGLE, train_rows=61))
        except CheckpointError as exc:
            assert f"{key} is " in str(exc) and f"{key}=" in str(exc), (key, str(exc))
            continue
        if key not in said:
            silent.append(key)
    assert all(resume_checks._under(key, resume_checks.HARMLESS) for key in silent), silent
    assert {"output.dir", "train.save_every", "train.log_every", "train.trackers"} <= set(silent)


def _sentinels(recipe) -> dict:
    """The recipe's dump with every leaf replaced: `differences` then lists every leaf key."""
    def walk(tree):
        if isinstance(tree, dict):
            return {key: walk(value) for key, value in tree.items()}
        if isinstance(tree, list) and tree and all(isinstance(item, dict) for item in tree):
            return [walk(item) for item in tree]
        return object()
    return walk(recipe.model_dump(mode="json"))


def _set(tree: dict, dotted: str, value) -> None:
    parts = dotted.replace("[", ".").replace("]", "").split(".")
    for part in parts[:-1]:
        tree = tree[int(part)] if part.isdigit() else tree[part]
    tree[parts[-1]] = value


def test_the_bug_bash_keys_are_noted_with_both_values(recipe_file):
    source = fake_checkpoint(load_recipe(recipe_file), 3)
    note, evaluation = changes(source, recipe_file, "train.weight_decay=0.1", "train.warmup_steps=2",
                               "train.min_lr_ratio=0.5", "train.max_grad_norm=0.5", "train.max_steps=20",
                               "lora.dropout=0.1", "data.max_length=64", "data.system_prompt=Be brief.",
                               "eval.generation_rows=2", "train.eval_every=3", "train.save_every=5",
                               "output.overwrite=true")
    for said in ("train.weight_decay 0.0 -> 0.1", "train.warmup_steps 0 -> 2", "train.min_lr_ratio 0.1 -> 0.5",
                 "train.max_grad_norm 1.0 -> 0.5", "train.max_steps 12 -> 20 (it reshapes the learning-rate schedule)",
                 "lora.dropout 0.0 -> 0.1", "data.max_length 128 -> 64", "data.system_prompt null -> Be brief."):
        assert said in note, (said, note)
    assert "save_every" not in note and "output" not in note and note.endswith("will differ from an uninterrupted one")
    # what is evaluated, not what is trained: said apart (it was "the run will differ")
    assert "eval.generation_rows" not in note and "train.eval_every" not in note, note
    assert evaluation.endswith("with train.eval_every 0 -> 3; eval.generation_rows 0 -> 2: the evaluation differs, "
                               "the training does not"), evaluation
    [only] = changes(source, recipe_file, "train.eval_every=3")
    assert only.endswith("train.eval_every 0 -> 3: the evaluation differs, the training does not"), only
    assert changes(source, recipe_file, "train.save_every=5", "train.keep_last=4") == []


def test_the_same_rows_per_step_is_no_change_and_other_rows_are_noted(recipe_file):
    source = fake_checkpoint(load_recipe(recipe_file), 3, world_size=2, strategy="DDP over 2 processes")
    assert changes(source, recipe_file, "train.grad_accum=2") == []  # 2 processes x 2 rows -> 1 x 2 rows x 2
    assert changes(source, recipe_file, "train.micro_batch_size=4") == []
    [note] = changes(source, recipe_file)
    assert "rows per optimizer step 4 -> 2" in note and "micro_batch_size" not in note.split("rows per")[0]


# ----------------------------------------------------------------------------------------------- refused
def test_seed_and_optimizer_are_refused_in_one_paragraph_with_the_fix_and_no_note(recipe_file, capsys):
    source = fake_checkpoint(load_recipe(recipe_file), 3)
    text = refusal(source, recipe_file, "train.seed=8", "train.optimizer=adamw_8bit", "train.learning_rate=0.1")
    assert "train.seed is 8 here, 7 in the checkpoint" in text and "train.optimizer is adamw_8bit here, adamw" in text
    assert ("Fix: resume with the checkpoint's values (train.optimizer=adamw train.seed=7), or start a new run "
            "(another output.dir, or output.overwrite=true)") in text
    assert "Nothing was loaded or written" in text and "note" not in text + capsys.readouterr().out


def test_the_fix_of_a_refusal_carries_whole_values_ready_to_paste(recipe_file):
    """The fix showed values cut at 80 characters (`lora.target_modules=["q_proj", ..., "down_proj",...)`), which no
    override can take, and unquoted, so a shell split a list with spaces into several arguments (a review found it)."""
    import re
    import shlex

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    source = fake_checkpoint(load_recipe(recipe_file, [f"lora.target_modules=[{','.join(targets)}]"]), 3)
    text = refusal(source, recipe_file, "lora.target_modules=all-linear")
    pasted = shlex.split(re.search(r"Fix: resume with the checkpoint's values \((.*)\), or start", text).group(1))
    assert load_recipe(recipe_file, pasted).lora.target_modules == targets, text


def test_other_rows_and_the_lora_layout_are_refused(recipe_file):
    source = fake_checkpoint(load_recipe(recipe_file), 3)
    text = refusal(source, recipe_file, rows=50)
    assert "the training rows are 50 here, 61 in the checkpoint" in text
    text = refusal(source, recipe_file, "lora.r=4", "lora.train_router=true")
    assert "lora.r is 4 here, 8 in the checkpoint" in text and "lora.train_router is true here" in text


def test_a_checkpoint_past_max_steps_names_the_newest_one_at_or_below_it(recipe_file):
    recipe = load_recipe(recipe_file)
    older = [fake_checkpoint(recipe, step) for step in (3, 6)]
    newest = fake_checkpoint(recipe, 9)
    text = refusal(newest, recipe_file, "train.max_steps=7")
    assert f"Fix: train.resume={older[1]} (the newest kept checkpoint at or below step 7)" in text, text
    assert "or train.max_steps=9 or more" in text
    text = refusal(newest, recipe_file, "train.max_steps=2")
    assert "train.resume=" not in text.split("Fix:")[1] and "no kept checkpoint is at or below step 2" in text
    assert changes(newest, recipe_file, "train.max_steps=9") == ["resuming " + str(newest) + " with train.max_steps "
                                                                 "12 -> 9 (it reshapes the learning-rate schedule): the "
                                                                 "run will differ from an uninterrupted one"]


@pytest.mark.parametrize(("written", "plan", "said"), [
    ("DDP over 2 processes", ParallelPlan(strategy="deepspeed", world_size=2, zero=zero.ZeroSettings(stage=3)),
     "which DeepSpeed does not load"),
    ("DeepSpeed ZeRO-2 over 2 processes", ParallelPlan(strategy="fsdp", world_size=2),
     "resume it with parallel.strategy=deepspeed parallel.zero_stage=2"),
    ("DeepSpeed ZeRO-2 over 2 processes", ParallelPlan(strategy="deepspeed", world_size=2, zero=zero.ZeroSettings(stage=3)),
     "resume it at ZeRO-2: with accelerate_configs/deepspeed_zero2.yaml"),  # (zero_stage alone disagreed with the
])                                                                          # ZeRO-3 config: refused again, bug bash)
def test_a_strategy_that_cannot_read_the_checkpoint_is_refused(recipe_file, written, plan, said):
    source = fake_checkpoint(load_recipe(recipe_file), 3, world_size=2, strategy=written,
                             deepspeed=written.startswith("DeepSpeed"))
    assert said in refusal(source, recipe_file, "train.micro_batch_size=2", plan=plan)


def test_a_deepspeed_runs_best_checkpoint_is_not_advised_to_an_export_that_refuses_it(recipe_file, capsys):
    """Found by a bug bash (ZeRO): the end-of-run line and `finetune checkpoints` said `finetune export RUN OUT --step
    N` exports the best checkpoint, which export always refuses for DeepSpeed's own format; the way out is named."""
    from finetune.outputs import step_folders

    recipe = load_recipe(recipe_file)
    source = fake_checkpoint(recipe, 3, world_size=2, strategy="DeepSpeed ZeRO-3 over 2 processes", deepspeed=True)
    run = Path(recipe.output.dir)
    table = step_folders.checkpoints_table(run)
    assert "--step 3" not in table and f"train.resume={source} train.max_steps=3 output.dir=NEW" in table, table
    step_folders.report_best_eval(run, [(3, 1.0), (6, 2.0)])
    said = capsys.readouterr().out
    assert f"export {run} OUT --step" not in said and "train.max_steps=3 output.dir=NEW" in said, said


def test_zero2_on_another_number_of_ranks_is_allowed(recipe_file):
    source = fake_checkpoint(load_recipe(recipe_file), 3, world_size=2, strategy="DeepSpeed ZeRO-2 over 2 processes",
                             deepspeed=True)
    one = ParallelPlan(strategy="deepspeed", world_size=1, zero=zero.ZeroSettings(stage=2))
    assert changes(source, recipe_file, "train.micro_batch_size=4", plan=one) == []


def test_a_resume_onto_another_micro_batch_says_how_many_rows_of_the_epoch_it_skips(recipe_file):
    """Found by a bug bash (determinism): 9 rows seen in micro-batches of 3, resumed with micro-batches of 2, went on
    at row 11 (the position rounded up to whole micro-batches), and row 10 of the epoch was never trained, while
    docs/data.md said the resume "continues at the next row" and the note said only that the run would differ."""
    source = fake_checkpoint(load_recipe(recipe_file, ["train.micro_batch_size=3"]), 3, micro_batch_size=3)
    [note] = changes(source, recipe_file)  # micro_batch_size 2
    assert "rows per optimizer step 3 -> 2" in note and "so 1 row(s) of this epoch are not trained" in note, note
    stream = BatchStream([Example([i, i + 1], [i, i + 1]) for i in range(40)], micro_batch_size=2, rank=0,
                         world_size=1, seed=7, pad_id=0)
    stream.load_state_dict({"epoch": 0, "cursor": 3, "world_size": 1, "micro_batch_size": 3, "rows": 40, "seed": 7})
    assert stream.cursor * 2 - 3 * 3 == 1  # the loader's rounding, which the note counts
    source = fake_checkpoint(load_recipe(recipe_file, ["train.micro_batch_size=1", "output.dir=" + str(recipe_file.parent / "b")]),
                             3, world_size=2, micro_batch_size=1, strategy="DDP over 2 processes")  # 6 rows seen
    [note] = changes(source, recipe_file, "train.micro_batch_size=4", "output.dir=" + str(recipe_file.parent / "b"))
    assert "rows per optimizer step 2 -> 4" in note and "so 2 row(s) of this epoch are not trained" in note, note


def test_a_stream_resumes_with_another_seed_which_shuffles_nothing_there(recipe_file, tmp_path):
    """Found by a bug bash (determinism): a streaming run resumed with another train.seed was refused "the saved data
    position is a place in the order train.seed shuffles the rows in", but a stream is never shuffled."""
    streaming = load_recipe(recipe_file, ["data.streaming=true", "data.eval_fraction=0"])
    source = fake_checkpoint(streaming, 3)
    [note] = changes(source, recipe_file, "data.streaming=true", "data.eval_fraction=0", "train.seed=8", rows=None)
    assert "train.seed 7 -> 8 (a stream is read in its order, unshuffled" in note, note
    assert "train.seed is 8 here" in refusal(fake_checkpoint(load_recipe(recipe_file, ["output.dir=" + str(tmp_path / "o")]), 3),
                                             recipe_file, "output.dir=" + str(tmp_path / "o"), "train.seed=8")


def test_num_epochs_refuses_other_rows_per_step_and_names_the_grad_accum_that_matches(recipe_file):
    recipe = load_recipe(recipe_file)
    source = fake_checkpoint(recipe, 3, world_size=2, strategy="DDP over 2 processes")
    epochs = load_recipe(recipe_file, ["train.max_steps=null", "train.num_epochs=2"])
    epochs.resolve_num_epochs(15, launch="61 rows")
    with pytest.raises(CheckpointError, match=r"train.num_epochs counts optimizer steps of 4 rows .* "
                                              r"\(train.grad_accum=2 with 1 process.* Fix: as said, or start"):
        resume_changes(source, epochs, SINGLE, train_rows=61)
    epochs = load_recipe(recipe_file, ["train.max_steps=null", "train.num_epochs=2", "train.grad_accum=2"])
    epochs.resolve_num_epochs(15, launch="61 rows")
    assert "rows per optimizer step" not in " ".join(resume_changes(source, epochs, SINGLE, train_rows=61))


def test_validate_refuses_what_the_run_refuses(tiny_llama, tmp_path):
    from finetune.cli.validate import validate

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", train={
        "max_steps": 6, "seed": 7}, model={"dtype": "float32", "attn_implementation": "sdpa"}))
    fake_checkpoint(load_recipe(path), 3, micro_batch_size=4, rows=30)  # 32 rows, 2 held out for eval
    report = validate(str(path), ["train.resume=auto"])
    assert "resume: from" in report and "note" not in report, report
    with pytest.raises(FinetuneError, match="train.seed is 8 here, 7 in the checkpoint"):
        validate(str(path), ["train.resume=auto", "train.seed=8"])
    with pytest.raises(FinetuneError, match="past train.max_steps 2"):
        validate(str(path), ["train.resume=auto", "train.max_steps=2"])
    with pytest.raises(FinetuneError, match="which DeepSpeed does not load"):
        validate(str(path), ["train.resume=auto", "parallel.strategy=deepspeed", "parallel.zero_stage=2"],
                 num_processes=2)


# ------------------------------------------------------------------------------------------------ epochs
def test_the_logged_epoch_counts_on_from_the_checkpoint_at_another_global_batch():
    examples = [Example([1, 2, 3], [1, 2, 3]) for _ in range(61)]
    two = BatchStream(examples, micro_batch_size=2, rank=0, world_size=2, seed=7, pad_id=0)
    batches = iter(two)
    for _ in range(6):
        next(batches)
    saved = two.epoch_at(6)
    one = BatchStream(examples, micro_batch_size=2, rank=0, world_size=1, seed=7, pad_id=0)  # half the rows per step
    one.load_state_dict({**two.state_dict(), "step": 6})
    assert saved == 0.4 and one.epoch_at(6) == saved and one.epoch_at(7) == pytest.approx(0.4333, abs=1e-4)


# --------------------------------------------------------------------------------------------- with processes
@pytest.fixture
def tiny_recipe(tiny_llama, tmp_path) -> Path:
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(48))
    return write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, data, tmp_path / "unused", train={
        "max_steps": 4, "save_every": 2, "keep_last": 3, "micro_batch_size": 2, "seed": 7,
        "gradient_checkpointing": False}))


@pytest.mark.slow
def test_refused_resumes_stop_before_the_model_loads(tiny_recipe, tmp_path):
    run = tmp_path / "run"
    first = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={run}"])
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    for override, said in (("train.seed=8", "train.seed is 8 here, 7 in the checkpoint"),
                           ("train.max_steps=3", f"Fix: train.resume={run / 'checkpoints' / 'step-00000002'}")):
        result = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={run}", "train.resume=auto",
                          override])
        assert result.returncode == 2 and said in result.stderr, result.stderr[-3000:]
        assert "[finetune] model:" not in result.stdout and "note:" not in result.stdout + result.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.skipif(not zero.installed(), reason="deepspeed not installed (pip install 'finetune[deepspeed]')")
def test_zero2_checkpoint_of_two_ranks_resumes_on_one(tiny_recipe, tmp_path):
    """DeepSpeed's universal checkpoint, with its own inject_missing_state for ZeRO-2's missing version key."""
    from safetensors.torch import load_file

    run, copy = tmp_path / "run", tmp_path / "copy"
    deepspeed = ["parallel.strategy=deepspeed", "parallel.zero_stage=2", "parallel.deepspeed_config=null"]
    whole = torchrun(tiny_recipe, f"output.dir={run}", *deepspeed)
    assert whole.returncode == 0, whole.stderr[-3000:]
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "adapter")
    shutil.rmtree(copy / "checkpoints" / "step-00000004")
    resumed = torchrun(tiny_recipe, f"output.dir={copy}", *deepspeed, "train.micro_batch_size=4", "train.resume=auto",
                       nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "written by 2 ranks, this run has 1: converted to DeepSpeed's universal checkpoint" in resumed.stdout
    assert "note:" not in resumed.stdout + resumed.stderr  # 2 x 2 rows -> 1 x 4 rows: the same steps
    reference, adapter = (load_file(str(folder / "adapter" / "adapter_model.safetensors")) for folder in (run, copy))
    assert reference.keys() == adapter.keys() and reference
    for key, value in adapter.items():  # a wrong reshard is off by ~1e-2; 1 vs 2 processes by last bits
        torch.testing.assert_close(value, reference[key], rtol=1e-3, atol=5e-4)


@pytest.mark.slow
def test_a_resume_trains_with_the_recipes_learning_rate_and_weight_decay(tiny_recipe, tmp_path):
    """AdamW's own step is the oracle: from the same step-4 state and the same step-5 gradients (lora.dropout 0: no
    dropout mask; that a resume restores the RNG, and so draws the uninterrupted run's masks, is checked by
    test_other_rows_of_the_same_count_are_said_and_the_same_rows_are_not), the update p5 - p4 scales with the learning
    rate, and decoupled weight decay adds -lr * wd * p4 exactly. Before the fix (found in a bug bash) both changed
    resumes trained on with the checkpoint's lr 0.01 and weight decay 0, bitwise the unchanged resume, while the note
    said the run would differ."""
    from safetensors.torch import load_file

    constant = ["train.lr_schedule=constant", "train.warmup_steps=0", "train.learning_rate=0.01",
                "train.weight_decay=0.0"]
    run = tmp_path / "run"
    first = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={run}", *constant])
    assert first.returncode == 0, first.stderr[-3000:]
    p4 = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    p5 = {}
    for name, change in (("same", []), ("lr", ["train.learning_rate=0.02"]), ("wd", ["train.weight_decay=5.0"])):
        result = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={tmp_path / name}", *constant,
                          *change, "train.max_steps=5", f"train.resume={run / 'checkpoints' / 'step-00000004'}"])
        assert result.returncode == 0, result.stderr[-3000:]
        p5[name] = load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors"))
    for key, before in p4.items():
        update, ulps = p5["same"][key] - before, 4 * torch.finfo(torch.float32).eps * before.abs().max()
        assert update.abs().max() > 100 * ulps, key  # (differences of nearby fp32 values: off by a few ulps of p4)
        torch.testing.assert_close(p5["lr"][key] - before, 2 * update, rtol=1e-4, atol=ulps)
        torch.testing.assert_close(p5["wd"][key] - p5["same"][key], -0.01 * 5.0 * before, rtol=1e-3, atol=ulps)


@pytest.mark.slow
def test_other_rows_of_the_same_count_are_said_and_the_same_rows_are_not(tiny_recipe, tmp_path):
    """docs/data.md said a resume refuses changed data, but only the row count and the seed were compared: a data
    file rewritten with as many other rows resumed without a word (found in a bug bash). The checkpoint keeps a hash
    of the training rows' tokens; the same data resumes silently, other rows are noted, by the run and by validate.
    With LoRA dropout 0.1 the same-data resume ends with the uninterrupted run's adapter, bitwise: the checkpoint's
    RNG states are restored, so steps 3-4 draw the same dropout masks (a bug bash (bb50 S3) removed the restore and
    every resume test passed: each trained without dropout, where a step draws nothing random)."""
    from safetensors.torch import load_file

    run, dropout = tmp_path / "run", "lora.dropout=0.1"
    first = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={run}", dropout])
    assert first.returncode == 0, first.stderr[-3000:]
    step2 = run / "checkpoints" / "step-00000002"
    uninterrupted = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    shutil.rmtree(run / "adapter")
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    resumed = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={tmp_path / 'same'}",
                       f"train.resume={step2}", dropout])
    assert resumed.returncode == 0 and "note:" not in resumed.stdout + resumed.stderr, resumed.stdout[-3000:]
    again = load_file(str(tmp_path / "same" / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == uninterrupted.keys() and uninterrupted
    for key, value in uninterrupted.items():
        assert torch.equal(again[key], value), f"{key} differs (max {float((again[key] - value).abs().max())})"
    write_jsonl(tmp_path / "train.jsonl", addition_rows(48, seed=5))  # as many rows, other numbers
    said = "the training rows (as many, other tokens: a data file, the tokenizer or a data setting changed)"
    checked = run_cmd([sys.executable, "-m", "finetune", "validate", str(tiny_recipe), f"output.dir={tmp_path / 'v'}",
                       f"train.resume={step2}", dropout])
    assert checked.returncode == 0 and said in checked.stdout, checked.stdout + checked.stderr[-3000:]
    other = run_cmd([sys.executable, str(RUN_PY), str(tiny_recipe), f"output.dir={tmp_path / 'other'}",
                     f"train.resume={step2}", dropout])
    assert other.returncode == 0 and said in other.stdout, other.stdout[-3000:]


def test_a_checkpoint_that_cannot_be_read_back_is_one_paragraph_not_a_traceback(tmp_path):
    """The read-back after each save raised DCP's own error (a traceback on every rank, then "lost a peer" claims) when
    the load failed outright, as it did for FSDP1 with a tensor of fewer rows than ranks; now a CheckpointError naming
    the checkpoint. Simulated in one process: the state read back has a key the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp

    saved = {"model": {"a": torch.ones(3)}}
    checkpoint._dcp(dcp.save, saved, tmp_path / "trainable")
    checkpoint.verify_readback(tmp_path, saved)  # as saved: equal
    with pytest.raises(CheckpointError, match=r"checkpoint .* could not be read back \(.*Missing key.*model\.b.*\)\. It "
                                              r"cannot be trusted"):
        checkpoint.verify_readback(tmp_path, {"model": {"a": torch.ones(3), "b": torch.ones(2)}})


def test_a_checkpoint_naming_a_data_file_relatively_is_no_change_from_its_absolute_path(recipe_file, tmp_path,
                                                                                       monkeypatch):
    """Recipes now keep local paths absolute; a checkpoint written before, with `train.jsonl` relative, and this
    run's absolute path to the same file are the same rows, not "the run will differ"; another file is noted."""
    recipe = load_recipe(recipe_file)
    source = fake_checkpoint(recipe, 3)
    saved = yaml.safe_load((source / "recipe.yaml").read_text())
    saved["data"]["datasets"][0]["path"] = "train.jsonl"
    (source / "recipe.yaml").write_text(yaml.safe_dump(saved))
    monkeypatch.chdir(tmp_path)
    assert changes(source, recipe_file) == []
    monkeypatch.chdir(tmp_path / "run")
    [note] = changes(source, recipe_file)
    assert "data.datasets[0].path train.jsonl -> /" in note and note.endswith("will differ from an uninterrupted one")
