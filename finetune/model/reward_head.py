"""A reward model's scalar head (train.objective: reward): `score`, a Linear(hidden, 1, bias=False) on the causal LM,
as transformers' *ForSequenceClassification models name theirs, trained in full beside the LoRA; its weight is saved
in the adapter as PEFT saves a modules_to_save head (`base_model.model.score.weight`, task_type SEQ_CLS), so the
exported adapter loads with plain PEFT onto AutoModelForSequenceClassification(num_labels=1)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SCORE = "score"
SCORE_KEY = f"base_model.model.{SCORE}.weight"  # the model's parameter name and the adapter's key


class ScoreHead(nn.Linear):
    """Linear(hidden, 1) whose input is cast to its weight's dtype inside its own forward: fp32 in one process (the
    hidden states are bf16), the compute dtype under FSDP (the wrapper's view of the weight)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight)


def causal_lm_of(peft_model: nn.Module) -> nn.Module:
    return peft_model.base_model.model


def attach_score_head(peft_model: nn.Module, *, seed: int, device: torch.device) -> ScoreHead:
    """`score` on the causal LM inside the PeftModel, fp32, trainable, initialized as transformers initializes a
    classification head (normal, std initializer_range), from `seed`: the same on every rank."""
    lm = causal_lm_of(peft_model)
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    head = ScoreHead(config.hidden_size, 1, bias=False, device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * getattr(config, "initializer_range", 0.02))
    head.weight.requires_grad_(True)
    lm.add_module(SCORE, head)
    return head


def sequence_classification_config(peft_config):
    """The adapter config of a reward model: PEFT's SEQ_CLS task with the head saved beside the LoRA."""
    config = copy.deepcopy(peft_config)
    config.task_type = "SEQ_CLS"
    config.modules_to_save = [SCORE]
    return config
