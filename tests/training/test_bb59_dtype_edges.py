"""Bug bash bb59 (dtypes x objectives x strategies at uneven edges): a rank with no trained token under a trainable
LM head (LoRA on lm_head) must still reach the head in its backward, or DDP's reducer stops the run."""

from __future__ import annotations

import pytest
import torch
from conftest import accelerate_launch, objective_recipe, read_metrics, write_jsonl, write_recipe

from finetune.training.loss import head_loss


def test_an_empty_batch_reaches_a_trainable_head_in_its_backward():
    """Found by a bug bash (bb59 #1): with no trained position, head_loss returned `hidden.sum() * 0`, a graph through
    every layer but not the head (the head's input is `hidden`). With LoRA on lm_head under DDP
    (find_unused_parameters off) the rank whose completions were all masked left the head's LoRA without a gradient
    and the run died at the next step. The zero loss now goes through the head when it trains; a frozen head is left
    out, as before (nothing to reduce)."""
    head = torch.nn.Linear(16, 32)
    hidden = torch.randn(2, 4, 16, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    for per_token in (False, True):
        head.zero_grad(set_to_none=True)
        value = head_loss(head, hidden, empty, empty, trainable_head=True, softcap=None, chunk=4, per_token=per_token)
        (value.sum() if per_token else value).backward()
        assert head.weight.grad is not None and head.weight.grad.abs().sum() == 0  # reached, and zero
        assert value.dtype == torch.float32 and value.numel() == (0 if per_token else 1)
    head.zero_grad(set_to_none=True)
    head_loss(head, hidden, empty, empty, trainable_head=False, softcap=None, chunk=4).backward()
    assert head.weight.grad is None
    with torch.no_grad():  # an evaluation: no head call at all
        assert head_loss(head, hidden, empty, empty, trainable_head=True, softcap=None, chunk=4).item() == 0.0


@pytest.mark.slow
def test_grpo_with_lora_on_lm_head_under_ddp_trains_when_a_rank_has_no_trained_token(tiny_llama, tmp_path):
    """Found by a bug bash (bb59 #1): GRPO, LoRA on [q_proj, lm_head], grpo.mask_truncated_completions on the shipped
    ddp.yaml, 2 processes: every completion of 2 tokens is cut (a random tiny model writes no EOS), so no token
    trains; step 1 logged loss 0 and both ranks died with DDP's "Expected to have finished reduction in the prior
    iteration ... parameters that were not used in producing loss"."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"what is {i}?", "answer": str(i)} for i in range(8)])
    values = objective_recipe("grpo", "prompt", tiny_llama, prompts, tmp_path / "run", data={"max_length": 64},
                              lora={"target_modules": ["q_proj", "lm_head"]},
                              train={"max_steps": 2, "micro_batch_size": 2, "save_every": 0})
    values["grpo"] = {"num_generations": 2, "max_completion_length": 2, "mask_truncated_completions": True,
                      "reward_functions": ["finetune.rewards:final_number"]}
    result = accelerate_launch("ddp", write_recipe(tmp_path / "recipe.yaml", values))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [1, 2]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
