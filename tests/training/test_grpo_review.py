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
