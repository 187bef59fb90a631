"""GRPO: objective.py (sample and score at a cycle's start, train on the rollouts' chunks), loss.py (advantages, the
clipped loss, its aggregations: TRL's formulas), rewards.py (reward functions on a batch), rollouts.py (one
generation batch: sample, score, advantages, TRL's metrics), sampling.py (G completions per prompt by the policy)."""

from finetune.training.objectives.grpo.objective import GRPO

__all__ = ["GRPO"]
