"""GRPO gaps found by mutation testing round 5 (bb61): the nucleus boundary of the policy's sampling, the batch reward
std (logged, and what scale_rewards: batch divides advantages by) and the mean length of the completions that ended.

Oracles: transformers' TopPLogitsWarper, torch's unbiased std and TRL's advantage formula written out by hand, and
plain arithmetic over the fixed completions. The rollout tests sample nothing: the policy's generation is replaced by
fixed completions (as tests/training/test_grpo_reward_calls.py does), so each runs in well under a second."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import write_jsonl
from test_grpo import grpo_recipe

from finetune.training.objectives.grpo import rollouts
from finetune.training.objectives.grpo import sampling as rollout

CPU = torch.device("cpu")


@pytest.mark.parametrize("top_p,kept", [(0.25, 2), (0.5, 4), (0.75, 6)])
def test_a_token_whose_more_probable_mass_equals_top_p_is_outside_the_nucleus(top_p, kept):
    """Found by mutation testing (bb61 gs1): `before > top_p` in place of `>=` kept one token too many whenever the
    mass of the more probable tokens reached top_p exactly; the nucleus test's probabilities never summed to top_p.
    Eight equally likely tokens (probability 1/8 each, exact in binary): top_p k/8 keeps exactly k tokens, as
    transformers' TopPLogitsWarper (generate's do_sample) keeps."""
    from transformers import TopPLogitsWarper

    rows = 2000
    logits = torch.zeros(rows, 8)
    warped = TopPLogitsWarper(top_p=top_p)(torch.zeros(1, 8, dtype=torch.long), logits[:1].clone())
    assert int(torch.isfinite(warped).sum()) == kept  # the oracle: transformers' nucleus size
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    drawn = rollout.sample_tokens(logits, generators, temperature=1.0, top_p=top_p)
    counts = torch.bincount(drawn, minlength=8)
    assert int((counts > 0).sum()) == kept, counts.tolist()
    assert (counts[counts > 0] / rows).tolist() == pytest.approx([1 / kept] * kept, abs=0.05)  # uniform inside it


class _Policy(torch.nn.Module):
    """What the rollout asks of the policy when generation is replaced: a generation config, train / eval."""

    generation_config = None


def _rollout(tokenizer, recipe, examples, completions, rewards, monkeypatch):
    """One generation of `examples` (2 prompts, G = 4) whose completions are `completions` (token ids) and whose only
    reward function returns `rewards`: returns (objective, rollouts) as the training step gets them."""
    from finetune import data

    monkeypatch.setattr(rollouts, "generate_completions", lambda model, prompts, seeds, **options: completions)

    def fixed(prompts, completions, **kwargs):
        return list(rewards)

    recipe.grpo.reward_weights = [1.0]
    objective = SimpleNamespace(config=recipe.grpo, tokenizer=tokenizer, recipe=recipe, functions=[fixed], step=1,
                                vllm=None, reference=None, completions_log=None)
    batch = data.collate(examples, pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return objective, rollouts.grpo_rollouts(_Policy(), [batch], objective, CPU)


@pytest.fixture
def two_prompts(tiny_llama, tmp_path):
    """(tokenizer, recipe with scale_rewards: batch, 2 prompt examples) as data/prompts.py builds them."""
    from transformers import AutoTokenizer

    from finetune.data.prompts import prompt_examples
    from finetune.recipe import validate_recipe

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i}?"} for i in range(2)])
    values = grpo_recipe(tiny_llama, text, tmp_path / "out", grpo_keys={"scale_rewards": "batch"},
                         train={"micro_batch_size": 8, "max_steps": 10})
    recipe = validate_recipe(values)
    examples, _, _ = prompt_examples(recipe, tokenizer)
    assert len(examples) == 2
    return tokenizer, recipe, examples


def test_the_batch_reward_std_and_its_advantages_are_trls_unbiased_std(two_prompts, monkeypatch):
    """Found by mutation testing (bb61 gr2): reward_std divided by n instead of n - 1 (a population std) survived every
    test: it is logged as TRL's `reward_std` and is the std that scale_rewards: batch divides every advantage by, both
    off by sqrt(n / (n - 1)). Oracle: torch.std (unbiased, as TRL's `rewards.std()`) and TRL's advantage
    (reward - its group's mean) / (batch std + 1e-4)."""
    tokenizer, recipe, examples = two_prompts
    eos = tokenizer.eos_token_id
    rewards = [0.0, 1.0, 3.0, 2.0, 5.0, 4.0, 9.0, 1.5]
    objective, (roll,) = _rollout(tokenizer, recipe, examples, [[5, 6, eos]] * 8, rewards, monkeypatch)
    values = torch.tensor(rewards, dtype=torch.float64)
    std = float(values.std())  # unbiased (n - 1), TRL's
    assert objective.rollout_figures["reward_std"] == pytest.approx(std, rel=1e-12)
    assert objective.rollout_figures["rewards/fixed/std"] == pytest.approx(std, rel=1e-12)
    assert objective.rollout_figures["reward"] == pytest.approx(float(values.mean()), rel=1e-12)
    group_means = values.view(2, 4).mean(dim=1).repeat_interleave(4)
    expected = (values - group_means) / (std + 1e-4)
    torch.testing.assert_close(roll.advantages.double(), expected, rtol=1e-6, atol=1e-9)


def test_the_mean_terminated_length_counts_only_the_completions_that_ended(two_prompts, monkeypatch):
    """Found by mutation testing (bb61 gr3): completions/mean_terminated_length divided by every completion instead
    of the ones that ended (not clipped at max_completion_length), TRL's definition; no test had a batch with clipped
    completions. Oracle: arithmetic over the fixed completions (an EOS last: ended; none: clipped)."""
    tokenizer, recipe, examples = two_prompts
    eos = tokenizer.eos_token_id
    clipped = [7] * recipe.grpo.max_completion_length
    completions = [[5, eos], clipped, [5, 6, 7, eos], clipped, [eos], [5, 6, eos], clipped, [5, 6, 7, 8, 9, eos]]
    objective, (roll,) = _rollout(tokenizer, recipe, examples, completions, [1.0] * 8, monkeypatch)
    ended = [len(c) for c in completions if c[-1] == eos]
    assert roll.truncated.tolist() == [c[-1] != eos for c in completions]
    figures = objective.rollout_figures
    assert figures["completions/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))  # 16 / 5
    assert figures["completions/clipped_ratio"] == pytest.approx(3 / 8)
    assert figures["completions/mean_length"] == pytest.approx(sum(len(c) for c in completions) / 8)
