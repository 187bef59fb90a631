"""Bug bash bb58 (step arithmetic at the edges): a preference eval batch of only filler rows in bf16, GRPO's epochs
under grpo.num_iterations (TRL's arithmetic as the oracle), a num_epochs that rounds to no step, the streaming counts
line at the last step, train.eval_every with no eval rows, the warmup clamp's note, and the phase a lost peer is
reported in during the reference precompute."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import (
    RUN_PY,
    accelerate_launch,
    free_port,
    objective_recipe,
    read_metrics,
    recipe_dict,
    run_cmd,
    write_jsonl,
    write_recipe,
)

from finetune.data import BatchStream, Example, steps_per_epoch
from finetune.recipe import steps_for_epochs, validate_recipe
from finetune.training import loop
from finetune.training.loss import IGNORE_INDEX, head_loss, sequence_logps

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ #1 a filler-only eval batch in bf16
def test_a_batch_of_only_filler_rows_scores_zero_in_bf16(tiny_llama):
    """Found by a bug bash (bb58 #1): DPO / KTO on 2+ processes in bf16 died in the evaluation (and DPO's precomputed
    reference before step 1) when a rank's batch was only the filler row eval_batches tops a short share up with: the
    head returned its empty per-token loss in the model's dtype (bf16), and sequence_logps' fp32 index_add refused it
    (`index_add_(): self (Float) and source (BFloat16)`), even empty. The filler now adds 0, as in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    filler = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, IGNORE_INDEX)}
    with torch.no_grad():  # the evaluation's and the precompute's way
        logps, counts = sequence_logps(model, filler, CPU)
    assert logps.dtype == torch.float32 and logps.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]
    logps, _ = sequence_logps(model, filler, CPU)  # with the graph: every rank's backward reaches every layer
    logps.sum().backward()
    assert all(p.grad is not None for p in model.model.parameters())  # (the head is not used: nothing is scored)
    hidden = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.long)
    for per_token in (True, False):
        value = head_loss(lambda h: h, hidden, empty, empty, trainable_head=False, softcap=None, chunk=4,
                          per_token=per_token)
        assert value.dtype == torch.float32 and value.numel() == (0 if per_token else 1)


PREFERENCE_RUNS = {  # name: (objective, format, shipped accelerate config, rows, data keys, dpo keys)
    # 3 eval rows on 2 ranks, micro_batch_size 1: rank 1's second eval batch is only filler (the bug bash's repro)
    "dpo-eval": ("dpo", "preference", "ddp", 10, {"eval_fraction": 0.3}, {}),
    "kto-eval": ("kto", "unpaired_preference", "ddp", 10, {"eval_fraction": 0.3}, {}),
    # the precompute scores 7 train rows (and 3 eval rows) with eval_batches: filler on rank 1, before step 1
    "dpo-precomputed": ("dpo", "preference", "fsdp2", 10, {"eval_fraction": 0.3}, {"reference": "precomputed"}),
}


def preference_rows(objective: str, count: int) -> list[dict]:
    if objective == "kto":
        return [{"prompt": f"q {i}", "completion": f"ans {i}", "label": i % 2 == 0} for i in range(count)]
    return [{"prompt": f"q {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("name", PREFERENCE_RUNS)
def test_two_processes_in_bf16_with_a_filler_only_batch_train_evaluate_and_save(name, tiny_llama, tmp_path):
    """Found by a bug bash (bb58 #1): the shipped ddp.yaml / fsdp2.yaml, 2 processes, bf16, micro_batch_size 1 and an
    odd number of rows: the run died with `index_add_(): self (Float) and source (BFloat16)` in the evaluation after
    its last step (before its last checkpoint: nothing kept), or, with dpo.reference precomputed, before step 1."""
    from shipped import checkpointing_choices

    objective, data_format, config, count, data_keys, dpo_keys = PREFERENCE_RUNS[name]
    rows = write_jsonl(tmp_path / "rows.jsonl", preference_rows(objective, count))
    values = objective_recipe(objective, data_format, tiny_llama, rows, tmp_path / "run", model={"dtype": "bfloat16"},
                              data={"max_length": 64, **data_keys},
                              train={"max_steps": 2, "micro_batch_size": 1, "save_every": 0,
                                     "gradient_checkpointing": checkpointing_choices(config)[0]})
    if dpo_keys:
        values["dpo"] = dpo_keys
    result = accelerate_launch(config, write_recipe(tmp_path / "recipe.yaml", values))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert "over 2 processes" in result.stdout and "7 train / 3 eval examples" in result.stdout
    assert ("reference log-probs: 10 pairs (precomputed)" in result.stdout) == bool(dpo_keys), result.stdout[-2000:]
    evals = [m for m in read_metrics(tmp_path / "run") if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2] and math.isfinite(evals[0]["eval_loss"])
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------------ #2 GRPO's epochs, TRL's way
def trl_steps_per_epoch(prompts: int, *, per_device: int, generations: int, world_size: int, grad_accum: int,
                        iterations: int) -> int:
    """TRL 1.16's GRPOTrainer: its RepeatSampler (whose generation batch is per_device x processes x
    steps_per_generation completions; steps_per_generation defaults to grad_accum) repeats each prompt batch
    num_iterations x steps_per_generation times; the dataloader takes per_device x steps_per_generation of its indices
    per process per micro-step; HF's Trainer makes len(dataloader) // grad_accum optimizer steps of an epoch."""
    from trl.trainer.utils import RepeatSampler

    steps_per_generation = grad_accum
    generation_batch = per_device * world_size * steps_per_generation
    sampler = RepeatSampler(list(range(prompts)), mini_repeat_count=generations,
                            batch_size=generation_batch // generations,
                            repeat_count=iterations * steps_per_generation)
    micro_steps = len(sampler) // (per_device * steps_per_generation * world_size)
    return micro_steps // grad_accum


def grpo_values(tmp_path, *, iterations: int, **train) -> dict:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"what is {i}?", "answer": f"#### {i}"}
                                                       for i in range(10)])
    values = objective_recipe("grpo", "prompt", tmp_path / "model", prompts, tmp_path / "run",
                              data={"max_length": 64}, train={"max_steps": None, "num_epochs": 1, "micro_batch_size": 2,
                                                             "save_every": 0, **train})
    values["grpo"] = {"num_generations": 2, "max_completion_length": 4, "num_iterations": iterations,
                      "reward_functions": ["finetune.rewards:final_number"]}
    return values


@pytest.mark.parametrize("prompts, per_device, world_size, grad_accum, iterations", [
    (10, 2, 1, 1, 2), (10, 4, 2, 1, 3), (13, 2, 1, 3, 2), (10, 2, 1, 1, 1), (40, 4, 2, 2, 4)])
def test_a_grpo_epoch_takes_num_iterations_times_the_steps_as_trl(prompts, per_device, world_size, grad_accum,
                                                                   iterations, tmp_path, capsys):
    """Found by a bug bash (bb58 #2): with grpo.num_iterations μ > 1, train.num_epochs 1 ran rows // batch steps, but a
    μ-step cycle trains on one step's prompts, so "1 epoch" sampled 1/μ of the prompts while `epoch` was logged as 1.0.
    TRL's RepeatSampler repeats each prompt batch μ times: an epoch is μ x as many steps, and `epoch` = step / that."""
    trl = trl_steps_per_epoch(prompts, per_device=per_device, generations=2, world_size=world_size,
                              grad_accum=grad_accum, iterations=iterations)
    assert steps_per_epoch(prompts, micro_batch_size=per_device // 2, world_size=world_size, grad_accum=grad_accum,
                           iterations=iterations) == trl
    recipe = validate_recipe(grpo_values(tmp_path, iterations=iterations, micro_batch_size=per_device,
                                         grad_accum=grad_accum))
    loop.resolve_max_steps(recipe, prompts, world_size)  # the run's start
    assert recipe.train.max_steps == trl
    said = capsys.readouterr().out
    assert f"ceil(train.num_epochs 1 x {trl} steps per epoch;" in said
    assert (f"x grpo.num_iterations {iterations})" in said) == (iterations > 1), said
    examples = [Example([1, 2, 3], [IGNORE_INDEX] * 3) for _ in range(prompts)]
    stream = BatchStream(examples, micro_batch_size=per_device // 2, rank=0, world_size=world_size, seed=0, pad_id=0,
                         grad_accum=grad_accum, iterations=iterations)
    assert [stream.epoch_at(step) for step in (1, trl // 2, trl, 2 * trl)] == [
        round(1 / trl, 4), round((trl // 2) / trl, 4), 1.0, 2.0]


@pytest.mark.slow
def test_a_grpo_run_of_one_epoch_samples_every_prompt_and_logs_epoch_by_trls_count(tiny_llama, tmp_path):
    """Found by a bug bash (bb58 #2): 10 prompts, num_epochs 1, num_iterations 2 ran 10 steps that sampled 5 prompts
    (5 never seen) and logged epoch 1.0. Now 20 steps sample each prompt once and the logged epoch is step / 20. Its
    train.eval_every (GRPO evaluates nothing) is said in a note (bb58 #5), not ignored silently."""
    values = grpo_values(tmp_path, iterations=2, eval_every=4)
    values["model"]["name_or_path"] = str(tiny_llama)
    result = run_cmd([sys.executable, str(RUN_PY), str(write_recipe(tmp_path / "grpo.yaml", values))])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "train.max_steps 20 = ceil(train.num_epochs 1 x 20 steps per epoch;" in result.stdout, result.stdout[-2000:]
    assert "note: train.eval_every is 4, but the run has no eval examples (train.objective grpo" in result.stdout
    completions = [json.loads(line) for line in (tmp_path / "run" / "completions" / "rank0.jsonl").read_text().splitlines()]
    sampled = [row["prompt_index"] for row in completions]
    assert sorted(set(sampled)) == list(range(10)) and len(sampled) == 10 * 2  # each prompt once, 2 completions
    epochs = [m["epoch"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert epochs == [round(step / 20, 4) for step in range(1, 21)]


def test_finetune_data_and_validate_say_the_runs_grpo_steps_per_epoch(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb58 #2): `finetune data` and `finetune validate` said 10 steps per epoch for a GRPO
    recipe whose run (num_iterations 2) takes 20."""
    from finetune.cli.command import main

    values = grpo_values(tmp_path, iterations=2)
    values["model"]["name_or_path"] = str(tiny_llama)
    recipe = str(write_recipe(tmp_path / "grpo.yaml", values))
    assert main(["data", recipe]) == 0
    assert "steps per epoch: 20 at 1 process" in capsys.readouterr().out
    assert main(["validate", recipe]) == 0
    assert "; 20 steps per epoch" in capsys.readouterr().out


# --------------------------------------------------------------------------------- #3 a num_epochs of no whole step
def test_a_num_epochs_that_rounds_to_no_step_trains_one(tmp_path):
    """Found by a bug bash (bb58 #3): train.num_epochs 1e-7 of 3 steps per epoch rounded to max_steps 0, which the run
    refused with a pydantic traceback at its start while `finetune validate` (10 steps per epoch there) passed. A
    fraction of an epoch is a step: the run, `finetune data` and `validate` resolve it to 1 alike (steps_for_epochs)."""
    assert steps_for_epochs(1e-7, 3) == 1 and steps_for_epochs(1e-7, 10) == 1 and steps_for_epochs(0.1, 30) == 3
    recipe = validate_recipe(recipe_dict(tmp_path, tmp_path / "d.jsonl", tmp_path / "run",
                                         train={"max_steps": None, "num_epochs": 1e-7, "micro_batch_size": 3}))
    told = recipe.resolve_num_epochs(3, launch="10 rows // (micro_batch_size 3 x 1 process x grad_accum 1)")
    assert recipe.train.max_steps == 1 and told.startswith("train.max_steps 1 = ceil(train.num_epochs 1e-07 x 3 ")


# ---------------------------------------------------------------------------------- #4 the streaming counts line
def test_the_last_steps_counts_line_says_where_training_is_beside_the_rows_read_ahead(tmp_path, tokenizer, capsys):
    """Found by a bug bash (bb58 #4): a streaming run of 3 steps x 2 rows over a 40-row file ended with `pass 1 over
    the stream so far: 40 rows, ...`, the rows the tokenizer had read ahead, as if the file had been trained whole;
    its checkpoint said row 6. The line beside it now says which rows were trained (the position)."""
    from finetune import data

    rows = [{"instruction": "Repeat.", "input": f"{i}", "output": f"number {i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    for eval_keys, trained in (({"eval_fraction": 0.0}, "the first 6 rows of data.datasets[0]"),
                               ({"eval_fraction": 0.1, "eval_max_rows": 4},
                                "the first 10 rows of data.datasets[0] (6 past its 4 held-out eval rows)")):
        recipe = validate_recipe({"model": {"name_or_path": "unused"},
                                  "data": {"datasets": [{"path": str(path)}], "streaming": True, "max_length": 64,
                                           **eval_keys},
                                  "train": {"max_steps": 3, "micro_batch_size": 2}})
        stream_rows, _, _ = data.stream_examples(recipe, tokenizer)
        stream = data.batch_stream(stream_rows, micro_batch_size=2, rank=0, world_size=1, seed=0, pad_id=0)
        batches = iter(stream)
        capsys.readouterr()
        for _ in range(3):
            next(batches)
        said = capsys.readouterr().out.splitlines()
        read = next(line for line in said if "over the stream so far" in line)
        assert f": {40 - eval_keys.get('eval_max_rows', 0)} rows, 0 skipped" in read, said
        assert f"[finetune] data: trained in pass 1: {trained}; the counts above are of the rows read so far" in said[
            said.index(read) + 1], said
        assert stream.state_dict()["row"] == 6 + eval_keys.get("eval_max_rows", 0)


# ----------------------------------------------------------------------------------- #5 eval_every, no eval rows
@pytest.mark.parametrize("data_keys, objective, words", [
    ({"eval_fraction": 0.0}, "sft", "(data.eval_fraction is 0 and data.eval_datasets is empty)"),
    ({"eval_fraction": 0.05}, "sft", "(data.eval_fraction 0.05 of the rows rounds to none)"),
    ({"eval_fraction": 0.05}, "grpo", "(train.objective grpo holds out no rows and evaluates nothing"),
])
def test_eval_every_without_eval_rows_is_said_not_ignored(data_keys, objective, words, tmp_path):
    """Found by a bug bash (bb58 #5): train.eval_every 1 with no eval rows (eval_fraction 0, or 0.05 of 10 rows) ran
    with no evaluation and no word, while keep_best under the same condition is refused. A note says it at the run's
    start (not a refusal: docs/recipes.md runs a quick variation of a library recipe, such as data.eval_fraction=0 on
    one that evaluates every 200 steps, with a note); the library recipes stay valid (tests/cli/test_library.py)."""
    from finetune.recipe.checks import eval_every_note

    values = (grpo_values(tmp_path, iterations=1, eval_every=1) if objective == "grpo" else
              recipe_dict(tmp_path, tmp_path / "d.jsonl", tmp_path / "run", train={"eval_every": 1}, data=data_keys))
    recipe = validate_recipe(values)
    note = eval_every_note(recipe, 0)
    assert note.startswith(f"train.eval_every is 1, but the run has no eval examples {words}"), note
    assert "so no evaluation runs. To evaluate: " in note
    assert eval_every_note(recipe, 3) is None  # eval rows: evaluated
    recipe.train.eval_every = 0
    assert eval_every_note(recipe, 0) is None  # only at the end, as the data line's "0 eval examples" says


# --------------------------------------------------------------------------------------- #6 the warmup clamp note
def test_the_warmup_clamp_note_names_the_key_the_recipe_set(tmp_path):
    """Found by a bug bash (bb58 #6): warmup_ratio 0.9 of a 3-step run was clamped with a note naming
    `train.warmup_steps (3)`, a key the recipe never set."""
    def notes(**train) -> list[str]:
        return validate_recipe(recipe_dict(tmp_path, tmp_path / "d.jsonl", tmp_path / "run", train=train)).notes

    assert notes(max_steps=3, warmup_ratio=0.9) == [
        ("train.warmup_ratio 0.9 (= 3 warmup steps, rounded up) is not below train.max_steps (3): warming up over 2 "
         "steps instead.")]
    assert notes(max_steps=3, warmup_steps=30) == [
        "train.warmup_steps (30) is not below train.max_steps (3): warming up over 2 steps instead."]


# ------------------------------------------------------------------ #7 a rank lost during the reference precompute
DIES_IN_THE_PRECOMPUTE = """
import os, sys
from finetune import distributed, run
from finetune.training.objectives import preference

precompute = preference.precompute
def rank_1_dies(*args, **kwargs):
    if distributed.info().rank == 1:
        os._exit(9)  # as an out-of-memory kill would end it
    return precompute(*args, **kwargs)
preference.precompute = rank_1_dies
sys.exit(run.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_rank_lost_during_the_reference_precompute_is_said_in_that_phase(tiny_llama, tmp_path):
    """Found by a bug bash (bb58 #7): a rank that died in DPO's reference precompute (dpo.reference: precomputed) was
    reported as lost "during the wrap of the model", the last phase named before it."""
    rows = write_jsonl(tmp_path / "pairs.jsonl", preference_rows("dpo", 8))
    values = objective_recipe("dpo", "preference", tiny_llama, rows, tmp_path / "run", data={"eval_fraction": 0.0},
                              train={"max_steps": 1, "micro_batch_size": 1}, dpo={"reference": "precomputed"})
    script = tmp_path / "dies.py"
    script.write_text(DIES_IN_THE_PRECOMPUTE)
    # Cold, with torchrun checking its workers every 2 s: the warm launcher (and torchrun's 0.1 s default) SIGTERMed
    # rank 0 as soon as rank 1 was gone, at times before rank 0 had read the lost peer (a CI run).
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=2",
                      f"--master_port={free_port()}", str(script), str(write_recipe(tmp_path / "dpo.yaml", values)),
                      "parallel.strategy=ddp"], warm=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "rank 0 lost a peer during the reference log-probs (dpo.reference: precomputed)" in output, output[-3000:]
    assert "during the wrap of the model" not in output
