"""Training: the loop (accumulation, clipping, the optimizer step, eval and checkpoint cadence), the loss, the evals.

    loop.py    train (the whole step on one screen), evaluate, the numerical-fault and preemption policies; the run's
               length (train.num_epochs resolved to steps for the launch)
    loss.py    token_loss_sum: the loss of trained positions only, a chunk of logits at a time, inside the forward
    evals.py   generation evals: greedy answers to held-out prompts, scored
"""

from finetune.training.loop import TrainResult, evaluate, resolve_max_steps, train

__all__ = ["TrainResult", "evaluate", "resolve_max_steps", "train"]
