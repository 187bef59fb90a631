"""data.streaming: the same tokens as the cached path, packed greedily in order; ranks' shares; a resume that continues
at the next row with any world size; the eval hold-out; what streaming refuses; the preview; real runs, one SIGKILLed
and resumed to the same adapter bitwise (2 processes), and resumed with 1 process."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import RUN_PY, addition_rows, free_port, read_metrics, recipe_dict, step_tokens, write_jsonl, write_recipe
from processes import finish, outline, start, worker_pids

from finetune import data
from finetune.data import BatchStream, StreamingBatches, collate, concat_examples, real_token_count
from finetune.errors import DataError, RecipeError
from finetune.outputs import step_folders
from finetune.recipe import validate_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

MAX_LENGTH = 64


def varied_rows(n: int, seed: int) -> list[dict]:
    """Addition rows of 1 to 6 repeated answers (so packed rows hold 1 to 3 examples), one too long for MAX_LENGTH and
    one with an empty answer."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}",
                     "output": " ".join([str(a + b)] * rng.randint(1, 6))})
    rows[7]["output"] = "many words " * 60  # past MAX_LENGTH: dropped (overlong: drop)
    rows[n // 2]["output"] = ""  # no trained token: skipped (bad_rows: skip)
    return rows


@pytest.fixture
def two_sources(tmp_path) -> list[dict]:
    """A JSON Lines file with blank lines and a broken line (read line by line) and a Parquet file (a `datasets`
    IterableDataset): the datasets of the recipes below."""
    import datasets

    lines = [json.dumps(row) for row in varied_rows(30, seed=1)]
    lines[12:12] = ["", "{not json"]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    parquet = tmp_path / "b.parquet"
    datasets.Dataset.from_list(varied_rows(20, seed=2)).to_parquet(str(parquet))
    return [{"path": str(jsonl)}, {"path": str(parquet)}]


def make_recipe(datasets: list[dict], **data_keys):
    section = {"datasets": datasets, "max_length": MAX_LENGTH, "overlong": "drop", "bad_rows": "skip",
               "eval_fraction": 0.0, **data_keys}
    return validate_recipe({"model": {"name_or_path": "unused"}, "data": section, "train": {"micro_batch_size": 4}})


def greedy_rows(examples: list, max_length: int) -> list:
    """The reference packing: each example into the open row if it fits, else the row is closed and a new one opened."""
    rows, members, size = [], [], 0
    for example in examples:
        if members and size + len(example.input_ids) > max_length:
            rows.append(concat_examples(members))
            members, size = [], 0
        members.append(example)
        size += len(example.input_ids)
    return rows + ([concat_examples(members)] if members else [])


def reference_sequences(recipe, tokenizer, *, passes: int) -> list:
    """What a stream must yield: the cached (non-streaming) path's examples in file order, packed greedily per pass."""
    cached = recipe.model_copy(deep=True)
    cached.data.streaming, cached.data.packing = False, False
    examples = list(data.prepare(cached, tokenizer).examples)
    one_pass = greedy_rows(examples, recipe.data.max_length) if recipe.data.packing else examples
    return one_pass * passes


def take(stream, count: int) -> list[dict]:
    batches = iter(stream)
    return [next(batches) for _ in range(count)]


def streams(recipe, tokenizer, *, world_size: int, micro_batch_size: int) -> list[StreamingBatches]:
    rows, _, _ = data.stream_examples(recipe, tokenizer)
    return [data.batch_stream(rows, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=0,
                              pad_id=tokenizer.pad_token_id) for rank in range(world_size)]


def assert_same_batch(batch: dict, expected: dict) -> None:
    assert batch.keys() == expected.keys()
    for key, value in batch.items():
        assert torch.equal(value, expected[key]), key


# ---------------------------------------------------------------------------------------------- same tokens
@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_hold_the_cached_paths_tokens_in_order_for_every_world_size(two_sources, tokenizer, packing):
    recipe = make_recipe(two_sources, streaming=True, packing=packing)
    expected = reference_sequences(recipe, tokenizer, passes=3)
    pad = tokenizer.pad_token_id
    per_pass = len(expected) // 3
    steps = (2 * per_pass) // 4 + 1  # past the end of the first pass, into the third
    assert packing is False or any(len(row.input_ids) > 40 for row in expected)  # rows really hold several examples
    single = take(streams(recipe, tokenizer, world_size=1, micro_batch_size=4)[0], steps)
    for g, batch in enumerate(single):
        assert_same_batch(batch, collate(expected[4 * g : 4 * g + 4], pad))
    ranks = [take(stream, steps) for stream in streams(recipe, tokenizer, world_size=2, micro_batch_size=2)]
    for g in range(steps):  # rank r: every second sequence of global micro-batch g
        for rank in (0, 1):
            assert_same_batch(ranks[rank][g], collate(expected[4 * g + rank : 4 * g + 4 : 2], pad))


def test_preference_pairs_stream_as_the_cached_path_tokenizes_them(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {a} plus {a}?", "chosen": f"{2 * a}.", "rejected": f"{2 * a + 1}."} for a in range(9)]
    rows[4]["rejected"] = ""  # no token to score: skipped
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    raw = {"model": {"name_or_path": "unused"}, "train": {"objective": "dpo", "micro_batch_size": 2},
           "data": {"datasets": [{"path": str(path), "format": "preference"}], "streaming": True, "bad_rows": "skip",
                    "eval_fraction": 0.0, "max_length": MAX_LENGTH}}
    recipe = validate_recipe(raw)
    expected = reference_sequences(recipe, tokenizer, passes=2)
    assert len(expected) == 16 and all(e.rejected is not None for e in expected)
    stream = streams(recipe, tokenizer, world_size=2, micro_batch_size=1)[1]
    for g, batch in enumerate(take(stream, 6)):  # rank 1: the second pair of each global micro-batch, chosen+rejected
        assert_same_batch(batch, collate(expected[2 * g + 1 : 2 * g + 2], tokenizer.pad_token_id))


def test_a_skipped_or_dropped_row_is_consumed_and_the_broken_line_counted(two_sources, tokenizer):
    recipe = make_recipe(two_sources, streaming=True)
    rows, _, _ = data.stream_examples(recipe, tokenizer)
    found = [(position.dataset, position.row) for _, position in rows.pass_examples(0, 0, 0)]
    first = [row for dataset, row in found if dataset == 0]
    # 31 rows in a.jsonl (30 + the broken line; the blank line is no row): row 7 dropped, 12 broken, 16 empty
    assert len(first) == 28 and not {8, 13, 17} & set(first)  # no example from rows 7, 12 and 16
    assert rows.counts["rows"] == 51 and rows.counts["dropped"] == 2 and rows.counts["skipped"] == 3


# ----------------------------------------------------------------------------------------------- resume
def test_resume_continues_at_the_next_row_without_tokenizing_what_it_skips_with_another_world_size(
        two_sources, tokenizer, monkeypatch):
    recipe = make_recipe(two_sources, streaming=True, packing=True)
    pad = tokenizer.pad_token_id
    expected = reference_sequences(recipe, tokenizer, passes=3)
    halves = streams(recipe, tokenizer, world_size=2, micro_batch_size=2)
    for half in halves:
        take(half, 14)  # 44 packed rows a pass: 11 global micro-batches of 4, then 3 of the second pass
    state = json.loads(json.dumps(halves[0].state_dict()))
    assert state == halves[1].state_dict() and state["row"] > 0  # every rank saves the same position
    from finetune.data import streaming

    places = []
    tokenize = streaming.tokenize_chunk
    monkeypatch.setattr(streaming, "tokenize_chunk", lambda rows, kept, *rest: places.append(kept) or
                        tokenize(rows, kept, *rest))
    whole = streams(recipe, tokenizer, world_size=1, micro_batch_size=4)[0]
    places.clear()
    whole.load_state_dict(state)
    resumed = take(whole, 6)  # one process, micro-batch 4: the same rows per optimizer step as 2 x 2
    for offset, batch in enumerate(resumed):
        g = 14 + offset
        assert_same_batch(batch, collate(expected[4 * g : 4 * g + 4], pad))
    # Rows before the position were read past, never tokenized: the first row tokenized is the position's
    assert (state["epoch"], state["dataset"]) == (1, 0) and state["row"] > 12, state
    assert places[0][0] == f"line {state['row'] + 2}"  # a.jsonl: a blank line before row 12 (the broken one)


def test_a_checkpoint_of_the_other_mode_or_other_data_is_refused(two_sources, tokenizer):
    recipe = make_recipe(two_sources, streaming=True, packing=True)
    stream = streams(recipe, tokenizer, world_size=1, micro_batch_size=4)[0]
    take(stream, 2)
    state = stream.state_dict()
    sampled = BatchStream([concat_examples([e]) for e in reference_sequences(recipe, tokenizer, passes=1)],
                          micro_batch_size=4, rank=0, world_size=1, seed=0, pad_id=0)
    with pytest.raises(DataError, match="with data.streaming, whose position is a row of the stream"):
        sampled.load_state_dict(state)
    with pytest.raises(DataError, match="without data.streaming"):
        stream.load_state_dict(sampled.state_dict())
    other = streams(make_recipe(two_sources, streaming=True, packing=False), tokenizer, world_size=1,
                    micro_batch_size=4)[0]
    with pytest.raises(DataError, match="packing=True, this run has False"):
        other.load_state_dict(state)


# ------------------------------------------------------------------------------------------------------ eval
def test_eval_fraction_holds_out_the_streams_first_rows_and_training_skips_them(two_sources, tokenizer, tmp_path):
    recipe = make_recipe(two_sources, streaming=True, eval_fraction=0.5, eval_max_rows=5)
    rows, evaluation, stats = data.stream_examples(recipe, tokenizer)
    everything = reference_sequences(recipe, tokenizer, passes=1)
    assert [e.input_ids for e in evaluation] == [e.input_ids for e in everything[:5]]  # rows 0-4: none dropped
    assert rows.start == (0, 5)
    trained = [example for example, _ in rows.pass_examples(0, *rows.start)]
    assert [e.input_ids for e in trained] == [e.input_ids for e in everything[5:]]
    assert "5 eval examples (5 held out: the stream's first 5 rows)" in data.streaming_line(stats, recipe)
    files = make_recipe(two_sources, streaming=True, eval_datasets=[two_sources[1]])  # eval_fraction -> 0
    rows, evaluation, _ = data.stream_examples(files, tokenizer)
    assert rows.start == (0, 0) and len(evaluation) == 18  # b.parquet's 20 rows but the dropped and the empty one
    small = write_jsonl(tmp_path / "small.jsonl", addition_rows(3))
    with pytest.raises(DataError, match="gave no training example after the held-out eval rows"):
        data.stream_examples(make_recipe([{"path": str(small)}], streaming=True, eval_fraction=0.1), tokenizer)


def test_every_later_pass_also_starts_after_the_held_out_rows(two_sources, tokenizer):
    """Found by a bug bash (mutant S02): only the first pass of a stream was checked to skip the held-out eval rows;
    later passes starting at row 0 (training on the eval rows from pass 2 on) passed every test."""
    from finetune.data.streaming import Position

    recipe = make_recipe(two_sources, streaming=True, eval_fraction=0.5, eval_max_rows=5)
    rows, evaluation, _ = data.stream_examples(recipe, tokenizer)
    everything = [e.input_ids for e in reference_sequences(recipe, tokenizer, passes=1)]
    held_out = [e.input_ids for e in evaluation]
    assert held_out == everything[:5]
    stream = rows.sequences(Position(0, *rows.start))
    three_passes = [next(stream)[0].input_ids for _ in range(3 * (len(everything) - 5))]
    assert three_passes == everything[5:] * 3  # oracle: the file's examples but the first 5, pass after pass
    assert not any(ids in held_out for ids in three_passes)


# ---------------------------------------------------------------------------------------------- refusals
def test_what_streaming_cannot_do_is_refused_naming_every_key(tmp_path):
    raw = {"model": {"name_or_path": "unused"}, "train": {"objective": "dpo"},
           "data": {"streaming": True, "datasets": [{"path": "a.jsonl", "format": "preference"},
                                                    {"path": "b.jsonl", "format": "preference", "weight": 2.0}]},
           "dpo": {"reference": "precomputed"}}
    with pytest.raises(RecipeError) as caught:
        validate_recipe(raw)
    text = str(caught.value)
    assert "data.datasets[1].weight (2.0): a weight repeats" in text and "dpo.reference: precomputed" in text
    assert "data.datasets[0].weight" not in text
    raw["data"]["datasets"][1]["weight"], raw["dpo"]["reference"] = 1.0, "adapter_off"
    assert validate_recipe(raw).data.streaming  # DPO with the reference computed per step streams
    raw["data"]["streaming"], raw["dpo"]["reference"], raw["data"]["datasets"][1]["weight"] = False, "precomputed", 2.0
    assert not validate_recipe(raw).data.streaming


def test_streaming_refuses_num_epochs():
    with pytest.raises(RecipeError, match="train.num_epochs: a stream's length is unknown"):
        validate_recipe({"model": {"name_or_path": "unused"}, "train": {"num_epochs": 1},
                         "data": {"streaming": True, "datasets": [{"path": "a.jsonl"}]}})


# ------------------------------------------------------------------------------------------------- preview
def test_preview_shows_the_first_rows_and_never_reads_the_whole_stream(tmp_path, tiny_llama, capsys):
    from finetune.cli.preview import cli_data

    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(200))
    with open(path, "a") as handle:
        handle.write("{broken far down\n")  # bad_rows: error would stop a run that read this far
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name_or_path": str(tiny_llama)},
                                                "data": {"datasets": [{"path": str(path)}], "streaming": True,
                                                         "eval_max_rows": 4}})
    assert cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=2)) == 0
    out = capsys.readouterr().out
    fifth = addition_rows(5)[4]  # the first training row: rows 0-3 are held out for eval
    assert out.count("--- example") == 2 and f"### Input:\n{fifth['input']}\n" in out
    assert "eval: 4 examples (0 from data.eval_datasets, 4 from the stream's first 4 rows" in out
    assert "totals: unknown (streaming" in out and " read, " not in out  # no count of rows read


def test_validate_checks_the_first_rows_only(tmp_path, tiny_llama, capsys):
    from finetune.cli.command import main

    path = write_jsonl(tmp_path / "a.jsonl", addition_rows(200))
    with open(path, "a") as handle:
        handle.write("{broken far down\n")
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name_or_path": str(tiny_llama)}, "output": {"dir": str(
        tmp_path / "out")}, "data": {"datasets": [{"path": str(path)}], "streaming": True, "eval_max_rows": 4}})
    assert main(["validate", str(recipe)]) == 0
    assert "data: streaming 1 dataset in order (totals unknown" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- real runs
STEPS, SAVE_EVERY = 12, 2


@pytest.fixture(scope="module")
def stream_recipe(tiny_llama, tmp_path_factory) -> Path:
    """40 rows, two examples per packed row: 20 rows per pass, 5 global micro-batches of 4; 12 steps are 2.4 passes."""
    root = tmp_path_factory.mktemp("streaming")
    rows = write_jsonl(root / "train.jsonl", addition_rows(40))
    values = recipe_dict(tiny_llama, rows, root / "unused",
                         data={"streaming": True, "packing": True, "max_length": MAX_LENGTH, "eval_fraction": 0.0},
                         train={"max_steps": STEPS, "save_every": SAVE_EVERY, "keep_last": 3, "micro_batch_size": 2})
    return write_recipe(root / "recipe.yaml", values)


def command(recipe: Path, out_dir: Path, nproc: int, *extra: str) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    return [*launcher, str(RUN_PY), str(recipe), f"output.dir={out_dir}", f"train.micro_batch_size={4 // nproc}", *extra]


def run_to_end(args: list[str], log: Path) -> str:
    code, output = finish(start(args, log), log)
    assert code == 0, outline(output)
    return output


def adapter(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))


def saved_position(out_dir: Path, step: int) -> dict:
    return json.loads((out_dir / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text())["data"]


_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("streaming-runs")


def reference_run(recipe: Path, root: Path) -> Path:
    """The uninterrupted 2-process run, made once per module."""
    if "ref" not in _RUNS:
        run_to_end(command(recipe, root / "ref", 2), root / "ref.log")
        _RUNS["ref"] = root / "ref"
    return _RUNS["ref"]


@pytest.mark.slow
def test_streaming_packed_run_trains_on_the_streams_tokens(stream_recipe, runs_root):
    from finetune.model import load_tokenizer
    from finetune.recipe import load_recipe

    out = reference_run(stream_recipe, runs_root)
    recipe = load_recipe(stream_recipe)
    tokenizer = load_tokenizer(recipe)
    expected = reference_sequences(recipe, tokenizer, passes=3)
    steps = [m for m in read_metrics(out) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["loss"] == m["loss"] for m in steps) and steps[-1]["loss"] < steps[0]["loss"]
    pad = tokenizer.pad_token_id
    # Each step's real tokens are those of the cached path's examples, packed greedily, 4 rows per step, in order
    assert step_tokens(steps) == [real_token_count(collate(expected[4 * s : 4 * s + 4], pad), pad)
                                            for s in range(STEPS)]
    whole = streams(recipe, tokenizer, world_size=1, micro_batch_size=4)[0]
    take(whole, STEPS)
    final = saved_position(out, STEPS)
    assert (final["epoch"], final["row"]) == (whole.position.epoch, whole.position.row) and final["epoch"] == 2


def killed_run(recipe: Path, root: Path) -> Path:
    """A 2-process run SIGKILLed whole (launcher and workers, as a lost node) once a checkpoint of step >= 4 is
    complete; a copy of its folder as the kill left it. Made once per module."""
    if "killed" not in _RUNS:
        run, log = root / "killed", root / "killed.log"
        process = start(command(recipe, run, 2), log)
        deadline = time.monotonic() + 120
        while not any(step >= 4 and step_folders.checkpoint_problem(path) is None
                      for step, path in step_folders.list_checkpoints(run)):
            assert process.poll() is None and time.monotonic() < deadline, outline(log.read_text())
            time.sleep(0.005)
        for pid in [*worker_pids(process.pid).values(), process.pid]:
            os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
        assert not (run / "adapter").exists(), "the run finished before the kill landed"
        shutil.copytree(run, root / "killed-copy")
        _RUNS["killed"] = root / "killed-copy"
    return _RUNS["killed"]


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_adapter_bitwise(stream_recipe, runs_root):
    ref = reference_run(stream_recipe, runs_root)
    run = runs_root / "resumed"
    shutil.copytree(killed_run(stream_recipe, runs_root), run)
    output = run_to_end(command(stream_recipe, run, 2, "train.resume=auto"), runs_root / "resumed.log")
    resumed_step = int(output.split("at step ")[1].split()[0])
    assert 4 <= resumed_step < STEPS, output[-2000:]
    print(f"resumed at step {resumed_step}, at {saved_position(killed_run(stream_recipe, runs_root), resumed_step)}")
    for key, value in adapter(ref).items():
        assert torch.equal(value, adapter(run)[key]), key
    assert [m["loss"] for m in read_metrics(run) if "loss" in m] == [m["loss"] for m in read_metrics(ref) if "loss" in m]
    assert saved_position(run, STEPS) == saved_position(ref, STEPS)


@pytest.mark.slow
def test_the_killed_run_resumed_by_one_process_continues_the_same_stream(stream_recipe, runs_root):
    ref = reference_run(stream_recipe, runs_root)
    run = runs_root / "resumed-single"
    shutil.copytree(killed_run(stream_recipe, runs_root), run)
    output = run_to_end(command(stream_recipe, run, 1, "train.resume=auto"), runs_root / "resumed-single.log")
    assert "now single process: adapter and optimizer state resharded, data position converted" in output
    # One process with micro-batch 4 takes the same rows per step as 2 x 2; only the sums' order differs
    for key, value in adapter(ref).items():
        torch.testing.assert_close(adapter(run)[key], value, rtol=1e-3, atol=5e-4)
    mine, theirs = saved_position(run, STEPS), saved_position(ref, STEPS)
    assert (mine["epoch"], mine["dataset"], mine["row"]) == (theirs["epoch"], theirs["dataset"], theirs["row"])


def test_conversations_of_several_examples_stream_and_resume_inside_a_row(tmp_path):
    """Under Qwen3's template a three-turn row gives three examples (each turn in its inference context): the stream
    yields the cached path's examples in order, and a checkpoint taken between two examples of one row resumes at
    the next of them (the position's `part`), neither repeating nor skipping one."""
    from chat_families import ROWS, family_tokenizer

    tokenizer = family_tokenizer("qwen3")
    single = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    rows = [ROWS["multi_turn"], single, ROWS["reasoning"], single, ROWS["multi_turn"]]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    recipe = make_recipe([{"path": str(path), "format": "chat"}], streaming=True, packing=False, max_length=512)
    expected = reference_sequences(recipe, tokenizer, passes=2)
    per_pass = len(expected) // 2
    assert per_pass == 3 + 1 + 2 + 1 + 3
    pad, parts = tokenizer.pad_token_id, []
    for consumed in range(1, per_pass + 2):
        stream = streams(recipe, tokenizer, world_size=1, micro_batch_size=1)[0]
        take(stream, consumed)
        state = json.loads(json.dumps(stream.state_dict()))
        parts.append(state["part"])
        resumed = streams(recipe, tokenizer, world_size=1, micro_batch_size=1)[0]
        resumed.load_state_dict(state)
        for offset, batch in enumerate(take(resumed, 2)):
            assert_same_batch(batch, collate([expected[consumed + offset]], pad))
    assert parts[:4] == [1, 2, 0, 0]  # inside the first row twice, then at the start of the next rows


def test_a_streams_rows_say_the_notes_the_cached_paths_data_line_says(tmp_path, tiny_llama, capsys):
    """Found by a bug bash (bb44): under data.streaming the notes about the rows' prompts (here: rows rendered with
    their own `chat_template_kwargs`, which serving must pass too) were never said, by `finetune data` nor by the run's
    pass line, though the cached path's data line says them. They are said once, for the first pass."""
    from finetune.cli.preview import cli_data
    from finetune.data.streaming import stream_examples

    rows = [{"messages": [{"role": "user", "content": f"{a} plus 1?"}, {"role": "assistant", "content": str(a + 1)}],
             "chat_template_kwargs": {"enable_thinking": False}} for a in range(12)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    raw = {"model": {"name_or_path": str(tiny_llama)}, "data": {"datasets": [{"path": str(path), "format": "chat"}],
                                                              "streaming": True, "eval_fraction": 0}}
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    assert cli_data(argparse.Namespace(recipe=str(recipe), overrides=[], rows=1)) == 0
    note = "(the first: " + f"{path} line 1: " + "{'enable_thinking': False}) were rendered with their own"
    assert note in capsys.readouterr().out
    from finetune.model import load_tokenizer

    checked = validate_recipe(raw)
    train, _, _ = stream_examples(checked, load_tokenizer(checked))
    assert len(list(train.pass_examples(0, 0, 0))) == 12
    assert "12 rows " + note.removeprefix("(") in train.counts_line(0, ended=True).replace("rows (", "rows ")
    assert "note:" not in train.counts_line(1, ended=True)  # a later pass reads the same rows: said once
