"""Training: the loop (accumulation, clipping, the optimizer step, eval and checkpoint cadence), the loss, the evals.

    loop.py    train (the whole step on one screen), evaluate, the numerical-fault and preemption policies; the run's
               length (train.num_epochs resolved to steps for the launch) and whether a checkpoint continues it
    loss.py    token_loss_sum: the loss of trained positions only, a chunk of logits at a time, inside the forward
    router_aux.py  a mixture-of-experts model's router load-balancing loss, from the same forward, weighted as TRL's
    evals.py   generation evals: greedy answers to held-out prompts, scored
    objectives/  what a step minimizes: the contract (base.py) and one module per objective: sft, preference (DPO
               family), kto, grpo/ (objective, loss, rewards, rollouts, sampling)
"""

from finetune.training.loop import TrainResult, evaluate, resolve_length, resolve_max_steps, train

__all__ = ["TrainResult", "evaluate", "resolve_length", "resolve_max_steps", "train"]
