"""The contract between the training loop and an objective (what a step minimizes), with the defaults most share.

The loop (training/loop.py) is one loop whatever is trained. Per step it asks the objective, in this order:
  1. `take(batches, step, count)`: the step's micro-batches from the data stream (default: the next `count`);
  2. `counts(model, micro_batches, device)`: the numbers its normalization needs, as a list, summed over ranks once
     (SFT: trained tokens; preference: pairs and tokens; GRPO samples and scores its completions here);
  3. `train_batches(micro_batches)`: what the step runs one forward and backward on each (default: the micro-batches);
  4. `loss(model, batch, totals, device)` for each: (tensor to backpropagate, its contribution to the logged loss,
     metric sums or None); the tensor is the batch's share of the step loss times the world size, because DDP, FSDP
     and DeepSpeed average gradients over ranks;
  5. `step_loss(summed, totals)` and `metrics(sums, totals)`: the logged figures, identical on every rank; `tables()`:
     rows for the trackers' tables (GRPO: the step's completions).
Before step 1 `prepare(...)` (preference: the precomputed reference log-probs); at eval `evaluate(...)`. Before the
objective exists, the data stream asks its class `uses_kl_rows(recipe)` (KTO's mismatched rows).

A mixture-of-experts model's load-balancing loss (train.router_aux_loss_coef) is the objective's `router_aux`: its
`loss` passes it to the training forward (training/loss.py), and the loop adds coef x that forward's aux loss to the
tensor `loss` returns (training/router_aux.py). `router_aux_by_default` says whether an unset coefficient takes the
model config's (as the objective's TRL trainer does); an objective whose registry entry says `no_router_aux` has none.

A new objective is a module (or a sub-package) in training/objectives/ with a subclass of Objective, its recipe
section, and one line in OBJECTIVES (training/objectives/__init__.py): docs/architecture.md.
"""

from __future__ import annotations

import torch
from torch import nn

from finetune.data import Example, real_token_count
from finetune.recipe import Recipe
from finetune.recipe.objectives import OBJECTIVES
from finetune.training.loss import causal_lm
from finetune.training.router_aux import RouterAux


class Objective:
    """Defaults: take the next micro-batches, train on them, no work before step 1, the summed loss as logged, no
    extra metrics, no held-out figures. `counts` and `loss` are each objective's own."""

    def __init__(self, model: nn.Module, recipe: Recipe, tokenizer=None):
        self.recipe = recipe
        if OBJECTIVES[recipe.train.objective].no_router_aux:  # (a weight for it is refused with the recipe)
            self.router_aux = RouterAux()
        else:
            lm = causal_lm(model)
            self.router_aux = RouterAux.for_model(lm, recipe, by_default=lm is not None and self.router_aux_by_default(
                lm.config))

    def router_aux_by_default(self, model_config) -> bool:
        """Whether train.router_aux_loss_coef unset takes the model config's coefficient (TRL 1.16's SFT, DPO, KTO and
        GRPO trainers add the load-balancing loss by default)."""
        return True

    @classmethod
    def uses_kl_rows(cls, recipe: Recipe) -> bool:
        """Whether the train batches carry KTO's mismatched (KL) rows."""
        return False

    def prepare(self, model: nn.Module, train: list[Example], evaluation: list[Example], recipe: Recipe, **where) -> None:
        """Work before step 1 (`where`: pad_id, out_dir, resume_from)."""

    def take(self, batches, step: int, count: int) -> list[dict]:
        """The step's micro-batches from the stream."""
        return [next(batches) for _ in range(count)]

    def counts(self, model: nn.Module, micro_batches: list[dict], device: torch.device) -> list:
        raise NotImplementedError

    def train_batches(self, micro_batches: list[dict]) -> list:
        """What the step's forwards and backwards run on, one each (after `counts`)."""
        return micro_batches

    def loss(self, model: nn.Module, batch, totals: list[float], device: torch.device):
        raise NotImplementedError

    def seen_tokens(self, trained: list, pad_id: int) -> int:
        """The tokens of what the step trains on, not counting padding (num_tokens, tokens/s)."""
        return sum(real_token_count(batch, pad_id) for batch in trained)

    def resumable_after(self, step: int) -> bool:
        """Whether a checkpoint after `step` resumes exactly (a stop signal waits for such a step)."""
        return True

    def stop_note(self, step: int) -> str:
        """What a stop signal that must wait for `resumable_after` prints."""
        return ""

    def step_loss(self, summed: float, totals: list[float]) -> float:
        return summed

    def metrics(self, sums: list[float] | None, totals: list[float]) -> dict:
        return {}

    def tables(self) -> dict[str, list[dict]]:
        """Rows for the trackers' tables at a logged step ({name: rows}); rank 0's are sent. Default: none."""
        return {}

    def evaluate(self, model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> dict | None:
        """Held-out figures ({"eval_loss": ...}), identical for any world size; None: none."""
        return None
