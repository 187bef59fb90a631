"""Epochs: a recipe sets train.max_steps or train.num_epochs; an epoch ends on a whole optimizer step and is reshuffled
from the seed; num_epochs becomes max_steps for the launch (scheduler, progress, checkpoints, recipe.yaml); `epoch` is
on every training line of metrics.jsonl and in the trackers; a run stopped in the middle of epoch 2 and resumed ends
with the uninterrupted run's adapter, bitwise; `finetune data` says the steps per epoch of the recipe's launch."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import RUN_PY, read_metrics, recipe_dict, run_cmd, step_tokens, train_losses, write_jsonl, write_recipe

from finetune.data import BatchStream, DataError, Example, checked_steps_per_epoch
from finetune.errors import RecipeError
from finetune.outputs import step_folders
from finetune.recipe import load_recipe, recipe_to_yaml, steps_for_epochs, validate_recipe

ROWS, MICRO_BATCH, GRAD_ACCUM = 26, 2, 2
STEPS_PER_EPOCH = ROWS // MICRO_BATCH // GRAD_ACCUM  # 6 steps of 4 rows; 2 rows left out of each epoch
MAX_STEPS = 2 * STEPS_PER_EPOCH  # train.num_epochs: 2
STOP_STEP = 8  # in the middle of epoch 2

# run.py's main with a real SIGTERM sent to the process itself during step STOP_STEP (when the loop says it starts that
# step's forward), as a cluster's preemption notice: the loop finishes the step, checkpoints and stops. Deterministic,
# unlike a signal from outside, which lands at whatever step the run has reached by then.
SIGTERM_DURING_STEP = """
import os, signal, sys
from finetune import distributed, run

doing = distributed.doing
def doing_then_sigterm(what):
    if what.startswith("step {step}'s forward"):
        os.kill(os.getpid(), signal.SIGTERM)
    return doing(what)
distributed.doing = doing_then_sigterm
sys.exit(run.main(sys.argv[1:]))
"""


def base_recipe(model_dir: Path, data: Path, out: Path, **train) -> dict:
    return recipe_dict(model_dir, data, out, data={"eval_fraction": 0.0}, train={
        "max_steps": None, "num_epochs": 2, "micro_batch_size": MICRO_BATCH, "grad_accum": GRAD_ACCUM,
        "save_every": 0, "log_every": 1, **train})


def documented_order(count: int, seed: int, epoch: int) -> list[int]:
    """The rows of an epoch in the order docs/data.md gives: a torch.randperm seeded with `seed + epoch`. Written out
    here, not finetune.data.epoch_permutation (the function under test), so that a wrong order is caught too."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def distinct_rows(count: int) -> list[dict]:
    """Rows of distinct lengths, so the tokens of a step tell which rows it took."""
    return [{"instruction": "Repeat the word.", "input": "word", "output": " ".join(["word"] * (i + 1))} for i in range(count)]


# --------------------------------------------------------------------------------------------------- the recipe
def test_a_recipe_sets_max_steps_or_num_epochs(tmp_path):
    raw = {"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "d.jsonl"}]}}
    with pytest.raises(RecipeError, match=r"train: max_steps \(5\) and num_epochs \(2\) are both set.*train.max_steps=null"):
        validate_recipe({**raw, "train": {"max_steps": 5, "num_epochs": 2}})
    assert validate_recipe(raw).train.max_steps == 100  # neither: the default
    with pytest.raises(RecipeError, match="train.num_epochs: Input should be greater than 0"):
        validate_recipe({**raw, "train": {"num_epochs": 0}})
    # A recipe with max_steps (as every library recipe) switched to epochs on the command line.
    path = write_recipe(tmp_path / "r.yaml", {**raw, "train": {"max_steps": 1000, "warmup_steps": 30}})
    with pytest.raises(RecipeError, match="both set"):
        load_recipe(path, ["train.num_epochs=1.5"])
    recipe = load_recipe(path, ["train.num_epochs=1.5", "train.max_steps=null"])
    assert recipe.train.num_epochs == 1.5 and recipe.notes == []  # warmup is checked once the steps are known

    # At the run's start: max_steps for the launch, then the warmup check; the resolved recipe reloads as written.
    told = recipe.resolve_num_epochs(4, launch="the test's launch")
    assert told == "train.max_steps 6 = ceil(train.num_epochs 1.5 x 4 steps per epoch; the test's launch)"
    assert (recipe.train.max_steps, recipe.train.num_epochs, recipe.train.warmup_steps) == (6, None, 5)
    assert recipe.notes == ["train.warmup_steps (30) is not below train.max_steps (6): warming up over 5 steps instead."]
    text = recipe_to_yaml(recipe)
    assert text.startswith(f"# {told}\n")
    again = validate_recipe(yaml.safe_load(text))
    assert again == recipe and again.train.max_steps == 6


def test_steps_for_epochs_rounds_up_to_a_whole_step():
    assert steps_for_epochs(2, 6) == 12
    assert steps_for_epochs(1.5, 3) == 5  # 4.5: the half step is a step
    assert steps_for_epochs(0.1, 30) == 3  # 3.0000000000000004 in floats
    assert steps_for_epochs(0.01, 3) == 1


# ------------------------------------------------------------------------------------------------- the stream
def numbered(count: int) -> list[Example]:
    return [Example([i + 1, i + 1], [i + 1, i + 1]) for i in range(count)]


def steps_of(stream: BatchStream, steps: int, grad_accum: int) -> list[list[int]]:
    """The rows (first token) of each optimizer step: its `grad_accum` micro-batches together."""
    batches = iter(stream)
    return [sorted(row for _ in range(grad_accum) for row in next(batches)["input_ids"][:, 0].tolist())
            for _ in range(steps)]


def test_an_epoch_ends_on_a_whole_step_and_the_next_is_reshuffled():
    # 10 rows, 2 per micro-batch, 2 micro-batches per step: 5 micro-batches, 2 whole steps per epoch.
    stream = BatchStream(numbered(10), micro_batch_size=2, rank=0, world_size=1, seed=7, pad_id=0, grad_accum=2)
    assert stream.batches_per_epoch == 4 and stream.epoch_at(1) == 0.5
    steps = steps_of(stream, 4, grad_accum=2)
    for epoch in (0, 1):  # each step holds the next 4 rows of that epoch's own shuffle (seed + epoch)
        order = [row + 1 for row in documented_order(10, 7, epoch)]
        assert steps[2 * epoch : 2 * epoch + 2] == [sorted(order[0:4]), sorted(order[4:8])]
    first, second = steps[0] + steps[1], steps[2] + steps[3]
    assert first != second and len(set(first)) == len(set(second)) == 8  # no row twice in an epoch; 2 left out
    # The same epochs with 2 processes x 1 row: a step takes the same rows whatever the world size.
    ranks = [steps_of(BatchStream(numbered(10), micro_batch_size=1, rank=r, world_size=2, seed=7, pad_id=0,
                                  grad_accum=2), 4, grad_accum=2) for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(*ranks)] == steps


def test_fewer_rows_than_one_step_num_epochs_refuses_max_steps_spans_epochs():
    with pytest.raises(DataError, match=r"train.num_epochs: only 7 training rows for one optimizer step of 8 rows "
                                        r"\(train.micro_batch_size=2 x 1 process x train.grad_accum=4"):
        checked_steps_per_epoch(7, micro_batch_size=2, world_size=1, grad_accum=4)
    # train.max_steps (a smoke run of a big-batch recipe on a few rows, as tests/parallel/test_shipped.py makes): epochs
    # of whole micro-batches, as before epochs ended on whole steps; a step takes 4 micro-batches of a 3-batch epoch.
    stream = BatchStream(numbered(7), micro_batch_size=2, rank=0, world_size=1, seed=0, pad_id=0, grad_accum=4)
    assert stream.batches_per_epoch == 3 and stream.epoch_at(1) == 1.3333
    steps_of(stream, 1, grad_accum=4)
    assert (stream.epoch, stream.cursor) == (1, 1)  # the first step took epoch 0's 3 micro-batches and one of epoch 1


# -------------------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def epoch_runs(tiny_llama, tmp_path_factory) -> dict:
    """num_epochs: 2 to the end (with TensorBoard); the same run stopped by SIGTERM during step 8 (epoch 2), then
    resumed with train.resume=auto."""
    root = tmp_path_factory.mktemp("epochs")
    data = write_jsonl(root / "train.jsonl", distinct_rows(ROWS))
    recipe = write_recipe(root / "recipe.yaml", base_recipe(tiny_llama, data, root / "unused"))
    ref, stopped = root / "ref", root / "stopped"
    runs = {"recipe": recipe, "ref": ref, "stopped": stopped}
    runs["ref_run"] = run_cmd([sys.executable, str(RUN_PY), str(recipe), f"output.dir={ref}", "train.trackers=[tensorboard]"])
    assert runs["ref_run"].returncode == 0, runs["ref_run"].stderr[-3000:]
    script = SIGTERM_DURING_STEP.replace("{step}", str(STOP_STEP))
    runs["stop_run"] = run_cmd([sys.executable, "-c", script, str(recipe), f"output.dir={stopped}"])
    runs["stop_checkpoints"] = step_folders.list_checkpoints(stopped)
    runs["resume_run"] = run_cmd([sys.executable, str(RUN_PY), str(recipe), f"output.dir={stopped}", "train.resume=auto"])
    return runs


@pytest.mark.slow
def test_num_epochs_sets_the_run_length_the_schedule_and_the_saved_recipe(epoch_runs):
    ref, output = epoch_runs["ref"], epoch_runs["ref_run"].stdout
    assert (f"[finetune] length: train.max_steps {MAX_STEPS} = ceil(train.num_epochs 2 x {STEPS_PER_EPOCH} steps per "
            f"epoch; {ROWS} rows // (micro_batch_size {MICRO_BATCH} x 1 process x grad_accum {GRAD_ACCUM}))") in output
    assert f"step {MAX_STEPS}/{MAX_STEPS} loss" in output  # the progress line counts to the resolved steps
    metrics = [m for m in read_metrics(ref) if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    # the cosine schedule spans the resolved steps, each step logging the rate it trained at (docs/recipes.md; the log
    # was one step ahead: step 1 showed step 2's rate and the last step the minimum, which no step trained at)
    cosine = [3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / MAX_STEPS))) for s in range(MAX_STEPS)]
    assert [m["learning_rate"] for m in metrics] == pytest.approx(cosine, rel=1e-9)
    assert [step for step, _ in step_folders.list_checkpoints(ref)] == [MAX_STEPS]  # the last step's checkpoint
    saved = (ref / "recipe.yaml").read_text()
    assert saved.startswith(f"# train.max_steps {MAX_STEPS} = ceil(train.num_epochs 2 x")
    assert yaml.safe_load(saved)["train"]["max_steps"] == MAX_STEPS and yaml.safe_load(saved)["train"]["num_epochs"] is None


@pytest.mark.slow
def test_epoch_is_on_every_training_line_and_in_tensorboard(epoch_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = [round(step / STEPS_PER_EPOCH, 4) for step in range(1, MAX_STEPS + 1)]
    assert [m["epoch"] for m in read_metrics(epoch_runs["ref"]) if "loss" in m] == expected
    assert expected[:6] == [0.1667, 0.3333, 0.5, 0.6667, 0.8333, 1.0]
    events = EventAccumulator(str(epoch_runs["ref"] / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("epoch")] == list(zip(range(1, MAX_STEPS + 1), expected))


@pytest.mark.slow
def test_each_epoch_takes_whole_steps_of_its_own_shuffle(epoch_runs, tmp_path):
    """The tokens of every logged step are those of the rows the seeded order of its epoch gives it: epoch 2 starts
    a new order at step 7 (not the 13th micro-batch of epoch 1's), and that order is not epoch 1's."""
    from finetune import data, model

    recipe = load_recipe(epoch_runs["recipe"])
    examples, _, _ = data.build_examples(recipe, model.load_tokenizer(recipe))
    per_step = MICRO_BATCH * GRAD_ACCUM
    expected = []
    for epoch in (0, 1):
        order = documented_order(ROWS, recipe.train.seed, epoch)
        expected += [sum(len(examples[i].input_ids) for i in order[s * per_step : (s + 1) * per_step])
                     for s in range(STEPS_PER_EPOCH)]
    tokens = step_tokens(read_metrics(epoch_runs["ref"]))
    assert tokens == expected
    assert tokens[:STEPS_PER_EPOCH] != tokens[STEPS_PER_EPOCH:]


@pytest.mark.slow
def test_a_run_stopped_in_epoch_2_resumes_to_the_same_adapter_bitwise(epoch_runs):
    from safetensors.torch import load_file

    stop = epoch_runs["stop_run"]
    assert stop.returncode == 128 + 15 and f"stopped by SIGTERM after step {STOP_STEP}" in stop.stderr, stop.stderr[-3000:]
    [(step, path)] = epoch_runs["stop_checkpoints"]  # save_every 0: only the preemption checkpoint
    position = json.loads((path / "trainer_state.json").read_text())["data"]
    assert step == STOP_STEP and (position["epoch"], position["cursor"]) == (1, 4)  # 2 steps into epoch 2
    resumed = epoch_runs["resume_run"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {path} at step {STOP_STEP}" in resumed.stdout
    assert f"length: train.max_steps {MAX_STEPS} = ceil(train.num_epochs 2" in resumed.stdout  # resolved the same
    reference = load_file(str(epoch_runs["ref"] / "adapter" / "adapter_model.safetensors"))
    result = load_file(str(epoch_runs["stopped"] / "adapter" / "adapter_model.safetensors"))
    assert reference.keys() == result.keys() and len(reference) > 0
    for key, value in reference.items():
        assert torch.equal(value, result[key]), f"{key} differs (max {float((value - result[key]).abs().max())})"
    assert train_losses(epoch_runs["stopped"]) == train_losses(epoch_runs["ref"])
    assert [m["epoch"] for m in read_metrics(epoch_runs["stopped"]) if "loss" in m] == \
        [m["epoch"] for m in read_metrics(epoch_runs["ref"]) if "loss" in m]


# --------------------------------------------------------------------------------------------- finetune data
def test_finetune_data_says_steps_per_epoch_for_the_recipes_launch(tiny_llama, tmp_path, capsys):
    from finetune.cli import main

    data = write_jsonl(tmp_path / "train.jsonl", distinct_rows(ROWS))
    recipe = tmp_path / "r.yaml"
    body = yaml.safe_dump(base_recipe(tiny_llama, data, tmp_path / "run"), sort_keys=False)
    formula = "in general rows // (micro_batch_size x processes x grad_accum)"

    recipe.write_text(body)
    assert main(["data", str(recipe), "--rows", "0"]) == 0
    out = capsys.readouterr().out
    assert (f"steps per epoch: 6 at 1 process (the recipe names no accelerate config; --num-processes N for another "
            f"launch): 26 rows // (micro_batch_size 2 x 1 x grad_accum 2); 3 at 2 processes; {formula}") in out
    assert "train.num_epochs 2 = 12 steps at 1 process (train.max_steps = ceil(num_epochs x steps per epoch)" in out

    recipe.write_text("# accelerate config: accelerate_configs/fsdp2.yaml\n" + body)  # as the library recipes say it
    assert main(["data", str(recipe), "--rows", "0"]) == 0
    out = capsys.readouterr().out
    assert "steps per epoch: 3 at 2 processes (the launch the recipe names: accelerate_configs/fsdp2.yaml)" in out
    assert "1 at 4 processes" in out and "train.num_epochs 2 = 6 steps at 2 processes" in out

    assert main(["data", str(recipe), "--rows", "0", "--num-processes", "8"]) == 0
    out = capsys.readouterr().out
    assert "steps per epoch: 0 at 8 processes (--num-processes)" in out
    assert "train.num_epochs: a run at 8 processes stops at its start, an epoch holds no whole optimizer step" in out
    assert main(["data", str(recipe), "--rows", "0", "--num-processes", "8", "train.num_epochs=null"]) == 0
    assert ("train.max_steps 100 at 8 processes: one optimizer step takes 32 "
            "rows (2 per micro-batch x 8 processes x train.grad_accum 2) of 26 training rows, so each step goes over "
            "the same rows more than once; train.grad_accum=1 or less takes each row once at most") \
        in capsys.readouterr().out
    assert main(["data", str(recipe), "--rows", "0", "train.num_epochs=null", "train.max_steps=9"]) == 0
    assert "train.max_steps 9 = 3.00 epochs at 2 processes" in capsys.readouterr().out
    # validate takes a num_epochs recipe, and makes the run's check that the rows fill one optimizer step
    assert main(["validate", str(recipe), "--num-processes", "1"]) == 0
    assert "; 6 steps per epoch" in capsys.readouterr().out
    assert main(["validate", str(recipe), "--num-processes", "1", "train.grad_accum=16"]) == 2
    assert "only 26 training rows for one optimizer step of 32 rows" in capsys.readouterr().err
