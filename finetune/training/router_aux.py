"""A mixture-of-experts model's router load-balancing loss (transformers' `aux_loss`), added to the step's loss as TRL
1.16's trainers add it (SFTTrainer.compute_loss; DPO, KTO, GRPO alike).

Weighting, TRL's: every training forward of the policy asks for its router logits (`output_router_logits=True`), and
the model's ForCausalLM returns the load-balancing loss of that forward's tokens (the Switch Transformer loss,
`load_balancing_loss_func`: a mean over the tokens its attention mask keeps). The step minimizes the objective's loss
plus coef x the mean of those losses over the step's forwards and ranks: each forward backpropagates coef x aux / (its
rank's forwards in the step), and DDP, FSDP and DeepSpeed average the gradients over the ranks (TRL: / the gradient
accumulation steps, then the same average). Unlike the token-weighted objective, this mean depends on how the global
batch is cut into micro-batches and ranks, as TRL's does.

No second forward: the loss comes out of the same forward as the objective's (finetune's LM head computes the
cross-entropy inside it, training/loss.py), read off its outputs by `collect`. Padding: a padded batch carries its
attention mask, which the model's own loss already leaves out; packed rows carry position ids and no mask, so the
model's loss would count each row's padding tail; there the loss is computed again from the same router logits with
transformers' own function and a mask of the real tokens (TRL's padding-free batches have no padding at all).
Gradient checkpointing (non-reentrant, finetune's) keeps the router logits' graph; the recomputed forward in backward
gives the same gradient (tests/training/test_router_aux.py).

The reference forwards (DPO, KTO), KTO's KL rows, GRPO's sampling and old log-probs and every evaluation ask for no
router logits, as TRL's; `eval_loss` stays the objective's own loss (TRL's adds coef x aux).
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from finetune.errors import FinetuneError, RecipeError
from finetune.recipe.router_aux import declared_coef, returns_aux_loss, router_aux_problem


class RouterAux:
    """The run's load-balancing term: its coefficient (0: off), and the losses of the step's forwards so far."""

    def __init__(self, coef: float = 0.0, *, lm: nn.Module | None = None, source: str = ""):
        self.coef, self.source = coef, source
        self.lm = transformers_model(lm) if lm is not None else None  # where the router settings and function are
        self.pad_id: int | None = None  # the tokenizer's: a packed row's padding tail is not counted (set by the loop)
        self._forwards = 1
        self._pending: list[torch.Tensor] = []  # the forward's loss, with its graph, until `added_to` takes it
        self._step: list[torch.Tensor] = []  # the step's losses, detached: summed once, with the step's other figures

    @classmethod
    def for_model(cls, lm: nn.Module | None, recipe, *, by_default: bool = True) -> RouterAux:
        """The recipe's term for the transformers causal LM `lm` (training.loss.causal_lm of the trained model; None:
        there is none): train.router_aux_loss_coef, or unset, the model config's own coefficient where `by_default`
        (the objective's TRL trainer adds it by default). Raises RecipeError for a weight the model's forward cannot
        give (`router_aux_problem`)."""
        given = recipe.train.router_aux_loss_coef
        lm = transformers_model(lm) if lm is not None else None
        problem = (router_aux_problem(recipe, lm.config, model_class(lm)) if lm is not None else
                   f"train.router_aux_loss_coef ({given:g}): the model is not a transformers causal LM, so it returns "
                   "no router load-balancing loss. Fix: remove train.router_aux_loss_coef." if given else None)
        if problem:
            error = RecipeError(problem)
            error.alike_on_every_rank = True  # every rank finds it: rank 0 prints it, once (finetune/run.py main)
            raise error
        if lm is None:
            return cls()
        if given is not None:
            return cls(given, lm=lm, source="train.router_aux_loss_coef") if given else cls()
        coef = declared_coef(lm.config) if by_default and returns_aux_loss(lm.config, model_class(lm)) else 0.0
        return cls(coef, lm=lm, source="the model config's router_aux_loss_coef") if coef else cls()

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0

    def describe(self) -> str | None:
        """The run's line about the term (None when off)."""
        if not self.enabled:
            return None
        return (f"[finetune] MoE load-balancing loss: {self.coef:g} ({self.source}) x aux_loss added to the loss, as "
                "TRL adds it (train.router_aux_loss_coef: 0 turns it off)")

    # ---------------------------------------------------------------------------------------- inside the forward
    def forward_kwargs(self) -> dict:
        return {"output_router_logits": True} if self.enabled else {}

    def collect(self, outputs, inputs: dict[str, torch.Tensor], labels: torch.Tensor | None) -> None:
        """Keep the load-balancing loss of the forward that returned `outputs` (training/loss.py calls this)."""
        if not self.enabled:
            return
        aux = getattr(outputs, "aux_loss", None)
        if aux is None or not isinstance(aux, torch.Tensor):
            raise FinetuneError(f"{model_class(self.lm).__name__} returned no aux_loss with output_router_logits=True, so "
                                "its router load-balancing loss cannot be added. Fix: set "
                                "train.router_aux_loss_coef: 0.")
        if "attention_mask" not in inputs and "position_ids" in inputs and labels is not None:
            aux = self._over_real_tokens(outputs, inputs["input_ids"], labels, aux)
        self._pending.append(aux)

    def _over_real_tokens(self, outputs, input_ids: torch.Tensor, labels: torch.Tensor,
                          aux: torch.Tensor) -> torch.Tensor:
        """Packed rows: the loss over the real tokens, without each row's padding tail (data.real_token_count's
        rule: the trailing pad ids with ignored labels), by transformers' own function of the model's module."""
        function = getattr(sys.modules.get(model_class(self.lm).__module__), "load_balancing_loss_func", None)
        experts, top_k = getattr(self.lm, "num_experts", None), getattr(self.lm, "num_experts_per_tok", None)
        if self.pad_id is None or function is None or experts is None or top_k is None:
            return aux
        if list(inspect.signature(function).parameters)[1:] != ["num_experts", "top_k", "attention_mask"]:
            return aux  # a function of another shape (doge): the model's own loss, padding included
        return function(outputs.router_logits, experts, top_k, real_tokens(input_ids, labels, self.pad_id))

    # ---------------------------------------------------------------------------------------------- the step
    def begin_step(self, forwards: int) -> None:
        """A step of `forwards` training forwards on this rank (its micro-batches; GRPO: its rollouts' chunks)."""
        self._forwards, self._pending, self._step = max(forwards, 1), [], []

    def added_to(self, to_backward: torch.Tensor) -> torch.Tensor:
        """`to_backward` plus coef x this forward's load-balancing loss / the step's forwards (unchanged when off)."""
        if not self.enabled:
            return to_backward
        if not self._pending:
            raise RuntimeError("the objective's training forward did not pass router_aux to training/loss.py")
        aux = torch.stack([value.to(to_backward.device).float() for value in self._pending]).mean()
        self._pending = []
        self._step.append(aux.detach())
        return to_backward + self.coef * aux / self._forwards

    def step_sums(self, device: torch.device) -> list:
        """[sum of the step's load-balancing losses, their count] on this rank, for the step's all-reduce ([] when
        off): device tensors, no host sync."""
        if not self.enabled:
            return []
        return [torch.stack([value.to(device) for value in self._step]).sum(), len(self._step)]

    def logged(self, loss: float, metrics: dict, sums: list[float]) -> tuple[float, dict]:
        """The step's logged loss plus coef x the mean load-balancing loss (what the step minimized, as TRL logs its
        loss), and `aux_loss`, that mean unweighted (TRL's name), from the all-reduced `step_sums`."""
        if not sums:
            return loss, metrics
        mean = sums[0] / max(sums[1], 1)
        return loss + self.coef * mean, {**metrics, "aux_loss": round(mean, 6)}


def transformers_model(lm: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's wrapper (training.loss.causal_lm finds the PeftModelForCausalLM first)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def model_class(lm: nn.Module) -> type:
    """The transformers class of `lm`, also under FSDP2 (which swaps in a subclass of its own)."""
    return next((cls for cls in type(lm).__mro__ if cls.__module__.startswith("transformers.models.")), type(lm))


def real_tokens(input_ids: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    """1 for every token before a row's padding tail (the trailing run of pad ids whose labels are ignored), else 0:
    the attention mask a packed batch does not carry. Device ops only (no host sync)."""
    filler = (input_ids == pad_id) & (labels == -100)
    places = torch.arange(1, input_ids.size(1) + 1, device=input_ids.device)
    length = (places * (~filler).long()).max(dim=1, keepdim=True).values
    return (places[None, :] <= length).long()
