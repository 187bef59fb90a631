"""Training: the loop (accumulation, clipping, the optimizer step, eval and checkpoint cadence), the loss, the evals.

    loop.py    train (the whole step on one screen), evaluate, the numerical-fault and preemption policies; the run's
               length (train.num_epochs resolved to steps for the launch)
    loss.py    token_loss_sum: the loss of trained positions only, a chunk of logits at a time, inside the forward
    evals.py   generation evals: greedy answers to held-out prompts, scored
    objectives.py  what a step minimizes, side by side: SFT, preference (preference.py), KTO (kto.py), GRPO
    grpo.py    GRPO's rewards, advantages, clipped loss and its aggregations (TRL's formulas)
    grpo_rollouts.py  one GRPO generation batch: sample, score, advantages, TRL's metrics
    rollout.py generate_completions: G completions per prompt by the policy, KV cache, per-completion seeds
"""

from finetune.training.loop import TrainResult, evaluate, resolve_max_steps, train

__all__ = ["TrainResult", "evaluate", "resolve_max_steps", "train"]
