"""GRPO and reward-model defects a bug bash (2026-12-06, a user new to the code) reproduced, each fixed here and
checked by a test that fails on the code before: a reward module beside the recipe not found by the `finetune`
command, reward errors naming a shifted row, an overwritten run's completions mixed into the new run's, bnpo's loss
changed by train_chunk_size, mapped reward columns dropped, a causal LM taken as a reward model (a random head), a
text-trained reward model scoring raw text, completion tokens left out of num_tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, write_jsonl, write_recipe
from test_grpo import grpo_recipe, sums


@pytest.mark.slow
def test_a_reward_module_in_the_folder_you_run_from_is_found_by_the_finetune_command(tiny_llama, tmp_path):
    """The console script puts its own bin/ first on sys.path, not the working folder, so `my_rewards:f` beside the
    recipe was "cannot be imported ... (or in the folder you run from)" though it was there."""
    (tmp_path / "my_rewards.py").write_text("def length(prompts, completions, **kw):\n"
                                            "    return [float(len(c)) for c in completions]\n")
    values = grpo_recipe(tiny_llama, write_jsonl(tmp_path / "p.jsonl", sums()), tmp_path / "out",
                         {"reward_functions": ["my_rewards:length"]})
    write_recipe(tmp_path / "grpo.yaml", values)
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    command = Path(sys.executable).parent / "finetune"
    done = subprocess.run([str(command), "validate", "grpo.yaml"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    write_recipe(tmp_path / "typo.yaml", {**values, "grpo": {**values["grpo"], "reward_functions": ["my_rewards:lenght"]}})
    done = subprocess.run([str(command), "validate", "typo.yaml"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 2 and "my_rewards has no `lenght`" in done.stderr and "(its functions: length)" in \
        done.stderr and "PYTHONPATH" not in done.stderr, done.stderr[-2000:]


def test_a_replaced_runs_completions_vllm_adapters_and_plot_go_and_a_resume_trims_its_completions(tmp_path):
    """output.overwrite=true (or a fresh start) cleared adapter, checkpoints, ranks and metrics only: the old run's
    completions/rank0.jsonl (24 lines of 3 steps) stayed, and the new run's 24 were appended to it (and trackers.json
    kept, so the new run logged into the old MLflow run: a review); a resume appended the steps it sampled again
    beside the killed run's lines of them."""
    import json

    from finetune import outputs

    out = tmp_path / "out"
    for folder in ("adapter", "checkpoints/step-00000002", "completions", "vllm/step3"):
        (out / folder).mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / "manifest.json").write_text(json.dumps({"step": 2}))
    lines = "".join(json.dumps({"step": step, "completion": "x"}) + "\n" for step in (1, 1, 2, 2, 3, 3))
    for rank in (0, 1):
        (out / "completions" / f"rank{rank}.jsonl").write_text(lines)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    (out / "plot.png").write_bytes(b"png")
    (out / "tensorboard").mkdir()
    (out / "trackers.json").write_text('{"mlflow": "run-1"}')  # the tracker runs a resume continues
    outputs.begin_outputs(out, "model: {}\n", out / "checkpoints" / "step-00000002")  # this folder's run resumed
    assert (out / "trackers.json").exists() and (out / "tensorboard").exists()
    for rank in (0, 1):
        kept = [json.loads(line)["step"] for line in (out / "completions" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert kept == [1, 1, 2, 2]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    outputs.begin_outputs(out, "model: {}\n", None)  # a fresh start (output.overwrite)
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]


def test_a_prompt_after_a_dropped_row_keeps_its_place_in_the_data(tiny_llama, tmp_path):
    """prompt_index counted kept rows only: after one overlong row was dropped, a reward error on file row 41 said
    "prompt row 39 ... counted from 0", and the completions log's prompt_index was one off."""
    from transformers import AutoTokenizer

    from finetune.data.prompts import prompt_examples
    from finetune.recipe import Recipe

    rows = [{"prompt": f"What is {i}?", "answer": str(i)} for i in range(6)]
    rows[2]["prompt"] = "many words " * 80  # over the prompt budget: dropped
    first, second = write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", rows[:2])
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "tiny"}, "train": {"objective": "grpo", "micro_batch_size": 8},
        "grpo": {"reward_functions": ["finetune.rewards:exact_match"], "max_completion_length": 64},
        "data": {"datasets": [{"path": str(first), "format": "prompt"}, {"path": str(second), "format": "prompt"}],
                 "max_length": 128, "overlong": "drop"}})
    examples, _, stats = prompt_examples(recipe, AutoTokenizer.from_pretrained(tiny_llama))
    assert stats.dropped == 1
    assert [e.prompt_index for e in examples] == [0, 1, 3, 4, 5, 6, 7]
    assert examples[2].place == f"prompt row 4 of {first} (data.datasets[0])"
    assert examples[-1].place == f"prompt row 2 of {second} (data.datasets[1])"


def test_a_generator_is_refused_as_a_reward_model(tiny_llama, tmp_path):
    """grpo.reward_models took any causal-LM folder (or an SFT run's adapter): transformers gave it a randomly
    initialized score head (one LOAD REPORT line, printed for a good reward run too) and GRPO trained on noise."""
    import json

    from test_grpo import REWARD
    from test_reward import _refused

    generator_adapter = tmp_path / "sft" / "adapter"
    generator_adapter.mkdir(parents=True)
    (generator_adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "peft_type": "LORA"}))
    three = tmp_path / "three-labels"
    three.mkdir()
    (three / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                   "id2label": {"0": "a", "1": "b", "2": "c"}}))
    one = tmp_path / "one-label"
    one.mkdir()
    (one / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "LABEL_0"}}))
    values = grpo_recipe(tiny_llama, tmp_path / "p.jsonl", tmp_path / "out",
                         {"reward_functions": [REWARD], "reward_models": [str(tiny_llama), str(tmp_path / "sft"),
                                                                          str(three), str(one)]})
    message = _refused(values)
    assert f"grpo.reward_models[0]: {tiny_llama} is not a sequence classifier (LlamaForCausalLM): loaded as a " \
           "sequence classifier, its score head would be random weights" in message
    assert f"grpo.reward_models[1]: {generator_adapter} is an adapter of a CAUSAL_LM" in message
    assert f"grpo.reward_models[2]: {three} is a classifier of 3 labels" in message
    assert "grpo.reward_models[3]" not in message


def test_a_reward_model_scores_a_text_prompt_as_its_reward_run_trained_on_it(tiny_llama):
    """A reward run renders a text pair through the chat template (a user turn, the answer), but GRPO scored a text
    prompt's completion as the raw `prompt + completion`, text the model never saw."""
    from transformers import AutoTokenizer

    from finetune.data.templates import render_segments
    from finetune.recipe import DatasetSpec
    from finetune.training.objectives.grpo.reward_models import RewardModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizer.chat_template
    chosen, _ = render_segments({"prompt": "Number 3:", "chosen": "aaaa", "rejected": "b"},
                                DatasetSpec(path="pairs.jsonl", format="preference"), tokenizer, None, "row 1")
    scorer = RewardModel.__new__(RewardModel)  # the rendering alone: no weights needed
    scorer.tokenizer = tokenizer
    assert scorer.texts(["Number 3:"], ["aaaa"]) == ["".join(text for text, _ in chosen)]
    tokenizer.chat_template = None  # a base model's tokenizer: the raw text, as its reward run joined it
    chosen, _ = render_segments({"prompt": "Number 3:", "chosen": "aaaa", "rejected": "b"},
                                DatasetSpec(path="pairs.jsonl", format="preference"), tokenizer, None, "row 1")
    assert scorer.texts(["Number 3:"], ["aaaa"]) == ["".join(text for text, _ in chosen).removesuffix(tokenizer.eos_token)]


def test_train_chunk_size_leaves_every_loss_type_unchanged():
    """docs/grpo.md: train_chunk_size gives "the loss and gradient the same sums". bnpo divided each chunk by its own
    tokens and by the number of chunks (TRL: a micro-batch's token mean, averaged over the micro-batches), so chunking
    a micro-batch changed its loss (-0.0093 whole, 0.0694 in chunks of 2, in the bug bash's example)."""
    from typing import get_args

    import torch

    from finetune.recipe import GRPOSection
    from finetune.training.objectives.grpo import loss

    torch.manual_seed(0)
    kinds = get_args(GRPOSection.model_fields["loss_type"].annotation)
    assert "bnpo" in kinds
    micro_batches = []
    for rows in (4, 6):  # two micro-batches of different completion tokens, as the step's
        lengths = torch.randint(1, 7, (rows,))
        mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
        micro_batches.append((torch.randn(rows, 6, dtype=torch.float64), loss.Rollout(batch={"input_ids": torch.zeros(rows, 6)}, mask=mask,
                                                                 rewards=torch.zeros(rows, 1), truncated=torch.zeros(rows),
                                                                 lengths=lengths.double())))
    completions = sum(r.mask.size(0) for _, r in micro_batches)
    tokens = sum(float(r.mask.sum()) for _, r in micro_batches)
    for kind in kinds:
        config = GRPOSection(loss_type=kind, reward_functions=["finetune.rewards:exact_match"], num_generations=2)
        whole = sum(loss.aggregate(values, r.mask, config, completions=completions, tokens=tokens, batches=2,
                                   batch_tokens=r.batch_tokens) for values, r in micro_batches)
        chunked = 0.0
        for values, r in micro_batches:
            for start, chunk in zip(range(0, r.mask.size(0), 3), r.chunks(3)):
                chunked += loss.aggregate(values[start:start + 3], chunk.mask, config, completions=completions,
                                          tokens=tokens, batches=2, batch_tokens=chunk.batch_tokens)
        assert float(chunked) == pytest.approx(float(whole), rel=1e-12, abs=1e-12), kind


def test_each_loss_type_over_two_micro_batches_is_trls_arithmetic():
    """Found by a bug bash (mutant G11): every oracle of the GRPO loss ran one micro-batch (`batches` = 1), so bnpo
    without its division by the step's micro-batches (k times TRL's loss and gradient under gradient accumulation k)
    passed. Oracle: TRL 1.16's per-loss-type formulas by hand, over a step of two micro-batches (4 and 6 rows)."""
    import torch

    from finetune.recipe import GRPOSection
    from finetune.training.objectives.grpo import loss

    torch.manual_seed(1)
    steps = []
    for rows in (4, 6):
        lengths = torch.randint(1, 7, (rows,))
        steps.append((torch.randn(rows, 6, dtype=torch.float64),
                      (torch.arange(6)[None, :] < lengths[:, None]).double()))
    completions, tokens = 10, sum(float(mask.sum()) for _, mask in steps)
    row_means = torch.cat([(v * m).sum(-1) / m.sum(-1) for v, m in steps])
    total = sum(float((v * m).sum()) for v, m in steps)
    expected = {
        "bnpo": sum(float((v * m).sum() / m.sum()) for v, m in steps) / 2,  # each micro-batch's token mean, averaged
        "grpo": float(row_means.mean()), "sapo": float(row_means.mean()),
        "dr_grpo": total / (completions * 6), "luspo": total / completions,
        "dapo": total / tokens, "cispo": total / tokens, "vespo": total / tokens,
    }
    from typing import get_args

    assert set(expected) == set(get_args(GRPOSection.model_fields["loss_type"].annotation))
    for kind, want in expected.items():
        config = GRPOSection(loss_type=kind, reward_functions=["finetune.rewards:exact_match"], num_generations=2,
                             max_completion_length=6)
        got = sum(float(loss.aggregate(v, m, config, completions=completions, tokens=tokens, batches=2,
                                       batch_tokens=float(m.sum()))) for v, m in steps)
        assert got == pytest.approx(want, rel=1e-12), kind


def test_mapped_reward_columns_reach_the_rewards_and_unknown_column_keys_are_refused(tiny_llama, tmp_path):
    """`columns: {prompt: question, answer: solution}` mapped the prompt only: exact_match failed at step 1 ("the
    prompt rows have none"), after validate said OK; a `columns` key no format has (`bogus: x`) was ignored."""
    from transformers import AutoTokenizer

    from finetune.data import check_local_files
    from finetune.data.prompts import prompt_examples
    from finetune.errors import DataError
    from finetune.recipe import Recipe

    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i}+{i}?", "solution": str(2 * i)} for i in range(4)])

    def recipe(columns: dict, fmt: str = "prompt") -> Recipe:
        objective = {"objective": "grpo", "micro_batch_size": 8} if fmt == "prompt" else {}
        return Recipe.model_validate({
            "model": {"name_or_path": "tiny"}, "train": objective,
            "grpo": {"reward_functions": ["finetune.rewards:exact_match"], "max_completion_length": 32},
            "data": {"datasets": [{"path": str(path), "format": fmt, "columns": columns}], "max_length": 128}}
            if fmt == "prompt" else {"model": {"name_or_path": "tiny"},
                                     "data": {"datasets": [{"path": str(path), "format": fmt, "columns": columns}]}})

    examples, _, _ = prompt_examples(recipe({"prompt": "question", "answer": "solution"}),
                                     AutoTokenizer.from_pretrained(tiny_llama))
    assert [e.row["answer"] for e in examples] == ["0", "2", "4", "6"]
    assert examples[1].row["prompt"] == "What is 1+1?"
    with pytest.raises(DataError, match=r"data.datasets\[0\].columns: `completions` is an argument of the reward "
                                        r"functions' call.*Fix: map `solution` to another name"):  # not the data's fault
        prompt_examples(recipe({"prompt": "question", "completions": "solution"}), AutoTokenizer.from_pretrained(tiny_llama))
    with pytest.raises(DataError, match=r"columns maps a field to `answr`, but no row has that column"):
        prompt_examples(recipe({"prompt": "question", "answer": "answr"}), AutoTokenizer.from_pretrained(tiny_llama))
    with pytest.raises(DataError, match=r"data.datasets\[0\].columns: `bogus` is not a field of format `chat` \(its "
                                        r"fields: completion, content, history, input, instruction, messages, output, prompt, reasoning, role, "
                                        r"system, tools\)"):
        check_local_files(recipe({"messages": "conversations", "bogus": "x"}, fmt="chat"))
    with pytest.raises(DataError, match=r"`answer` is not a field of format `completion`"):
        check_local_files(recipe({"prompt": "question", "answer": "solution"}, fmt="completion"))


STOPPING_REWARDS = '''
import os
import signal

CALLS = [0]


def digits(prompts, completions, **columns):
    """The share of digit characters; SIGTERMs its own process at call STOP_AT (a step that samples)."""
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("STOP_AT", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''


@pytest.mark.slow
def test_a_stop_signal_inside_a_num_iterations_cycle_finishes_the_cycle_and_resumes_bitwise(tiny_llama, tmp_path):
    """SIGTERM at step 3, the first of a num_iterations 2 cycle: the checkpoint of step 3 was saved, and the resume
    started a cycle there, sampling new completions for step 4 (its loss 0.0045 against -0.0513, the adapters apart by
    0.052). Now step 4 trains on the cycle's completions first, and the resume from step 4 is bitwise the
    uninterrupted run."""
    import torch
    from processes import finish
    from safetensors.torch import load_file
    from test_grpo_runs import _run, _untimed

    (tmp_path / "my_rewards.py").write_text(STOPPING_REWARDS)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", sums())
    values = grpo_recipe(tiny_llama, prompts, tmp_path / "unused",
                         {"reward_functions": ["my_rewards:digits"], "num_iterations": 2, "beta": 0.1, "temperature": 0.9},
                         train={"max_steps": 6, "save_every": 2, "learning_rate": 3e-2})
    recipe = write_recipe(tmp_path / "grpo.yaml", values)
    reference, run = tmp_path / "reference", tmp_path / "stopped"
    code, output = finish(*_run(recipe, f"output.dir={reference}", rewards_dir=tmp_path))
    assert code == 0, output[-3000:]
    code, output = finish(*_run(recipe, f"output.dir={run}", rewards_dir=tmp_path, env={"STOP_AT": "2"},
                                log=tmp_path / "stopped.log"))
    assert code == 128 + 15 and "finishing the grpo.num_iterations cycle first: step 4 train" in output, output[-3000:]
    assert "stopped by SIGTERM after step 4" in output, output[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    code, output = finish(*_run(recipe, f"output.dir={run}", "train.resume=auto", rewards_dir=tmp_path,
                                log=tmp_path / "resumed.log"))
    assert code == 0 and "step-00000004 at step 4" in output, output[-3000:]
    assert _untimed(run) == _untimed(reference)
    expected, resumed = (load_file(str(folder / "adapter" / "adapter_model.safetensors")) for folder in (reference, run))
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)


def test_grpo_num_tokens_counts_the_completions_it_trains_on():
    """num_tokens (and tokens/s) counted the prompt micro-batches only: 62 per step for 2 prompts of 31 tokens, the
    8 x 8 completion tokens left out (TRL counts each completion's prompt and completion tokens)."""
    from types import SimpleNamespace

    from finetune.training.objectives.grpo import loss
    from finetune.training.objectives.grpo.objective import GRPO

    prompts, completions = [[1, 2, 3], [1, 2, 3], [4], [4]], [[5, 6], [7], [8, 9, 10], []]
    inputs, mask, truncated = loss.sequences(prompts, completions, pad_id=0, eos_ids=[2], mask_truncated=False)
    rollout = loss.Rollout(batch=inputs, mask=mask, rewards=mask[:, :1], truncated=truncated,
                           lengths=mask.sum(-1).double())
    trl = sum(len(p) for p in prompts) + sum(len(c) for c in completions)  # attention_mask.sum() + completion_mask.sum()
    sampling, reusing = SimpleNamespace(generated_at=3, step=3), SimpleNamespace(generated_at=3, step=4)
    assert GRPO.seen_tokens(sampling, rollout.chunks(3), pad_id=0) == trl == 14
    assert GRPO.seen_tokens(reusing, rollout.chunks(3), pad_id=0) == 0  # num_iterations: TRL counts at generation


def test_a_vllm_url_that_answers_nothing_is_named_with_its_own_fix():
    """grpo.vllm_server_base_url with nothing listening said "Fix: read the log; a server that ran out of memory..."
    (there is no log of a server the user runs) and hid the connection's refusal."""
    import socket

    from finetune.errors import GenerationError
    from finetune.training.objectives.grpo.vllm_server import Server

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(GenerationError) as caught:
        Server(f"http://127.0.0.1:{port}", timeout=0.5).wait_ready()
    message = str(caught.value)
    assert f"the vLLM server at http://127.0.0.1:{port} did not answer /health within 0 s" in message
    assert "last: [Errno 111] Connection refused" in message and "Fix: check grpo.vllm_server_base_url" in message
    assert "read the log" not in message


def test_grpos_length_line_counts_prompts_per_micro_batch_by_name(tmp_path, capsys):
    """The length line said "micro_batch_size 2" of a recipe whose micro_batch_size is 8: GRPO's micro-batch of 8
    completions holds 2 prompts of 4 generations, which the line now says (a bug bash)."""
    from finetune.recipe import Recipe
    from finetune.training.loop import resolve_max_steps

    recipe = Recipe.model_validate({
        "model": {"name_or_path": "tiny"}, "train": {"objective": "grpo", "micro_batch_size": 8, "max_steps": 3},
        "grpo": {"reward_functions": ["finetune.rewards:exact_match"], "num_generations": 4, "max_completion_length": 32},
        "data": {"datasets": [{"path": str(tmp_path / "p.jsonl"), "format": "prompt"}], "max_length": 128}})
    resolve_max_steps(recipe, 24, 1)
    assert ("24 rows // (2 prompts per micro-batch (micro_batch_size 8 completions / grpo.num_generations 4) x 1 "
            "process x grad_accum 1)") in capsys.readouterr().out
