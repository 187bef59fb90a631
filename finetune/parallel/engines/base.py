"""The Engine contract, with a single process's behaviour as the defaults (layer split runs as one process too)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def normalize_key(key: str) -> str:
    """Strip every wrapper component: FSDP1 nests `_fsdp_wrapped_module.` at each unit, activation checkpointing and
    torch.compile add theirs, DDP prefixes `module.`."""
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key.removeprefix("module.")


def own_parameters(unit: nn.Module, unit_class: type) -> Iterator[nn.Parameter]:
    """The parameters a wrapped unit manages: its subtree's, less those of the units nested in it."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield from module.parameters(recurse=False)
        stack.extend(child for child in module.children() if not isinstance(child, unit_class))


class Engine:
    """What a strategy's wrapper does at each point finetune touches it. Subclasses override what differs."""

    own_checkpoint_format = False  # True: the engine writes and reads its checkpoints itself (DeepSpeed)

    # ---------------------------------------------------------------- which models
    def owns(self, model: nn.Module) -> bool:
        """Whether `model` was wrapped by this engine."""
        return True

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The PeftModel inside the wrapper."""
        return model

    # ---------------------------------------------------------------- a training step
    def gradient_sync(self, model: nn.Module, *, enabled: bool):
        """Context for one micro-batch: whether its gradients are reduced across ranks (the step's last one)."""
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()

    def torch_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """The optimizer an engine was built with (its scheduler drives it), or None when the loop owns one."""
        return None

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                       max_norm: float | None, *, allowed: bool) -> tuple[float, bool]:
        """Clip, step and zero the gradients unless the loss (`allowed`) or the norm is not finite."""
        norm = self.clip_grad_norm(model, parameters, max_norm)
        stepped = allowed and math.isfinite(norm)
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def clip_grad_norm(self, model: nn.Module, parameters: list[nn.Parameter], max_norm: float | None) -> float:
        """Clip by the global norm over all ranks' shards; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm is not None else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def reshard(self, model: nn.Module) -> None:
        """Parameters back to each rank's stored shard (parallel.steps.reshard says when); nothing to do unsharded."""

    # ---------------------------------------------------------------- generation
    @contextlib.contextmanager
    def generation_model(self, model: nn.Module) -> Iterator[nn.Module]:
        """The module to call `.generate()` on in evals, for every rank together."""
        yield self.unwrap(model)

    @contextlib.contextmanager
    def decoding_model(self, model: nn.Module, *, gather: str) -> Iterator[tuple[nn.Module, bool]]:
        """(the module GRPO decodes with a KV cache, whether its forwards are collectives) for the block."""
        yield self.unwrap(model), False

    # ---------------------------------------------------------------- state
    def trainable_state_dict(self, model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
        """The full tensors of the trainable parameters `names`, on every rank (a collective where sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=True)
        result = {}
        for key, value in get_model_state_dict(model, options=options).items():
            if normalize_key(key) not in names:
                continue
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            result[normalize_key(key)] = value.detach().to("cpu").clone()
        return result

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, options) -> tuple[dict, dict]:
        """(model state, optimizer state) for a DCP checkpoint: each rank's shards under FSDP."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer, options=options)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, options) -> None:
        """Put what DCP read (`checkpoint_state`'s shape) into the model and the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)

    def local_parameter_bytes(self, model: nn.Module) -> dict[str, int]:
        """Bytes of parameters this rank holds (its shard under FSDP and ZeRO-3), split frozen / trainable."""
        frozen = trainable = 0
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            size = local.numel() * local.element_size()
            if param.requires_grad:
                trainable += size
            else:
                frozen += size
        return {"frozen_bytes": frozen, "trainable_bytes": trainable}


class GreedyThroughRoot(nn.Module):
    """`generate(input_ids, attention_mask, max_new_tokens, ...)` as plain greedy decoding by full forwards of the
    root module (no KV cache: fine for the short answers of an eval). Every rank runs every step, so the FSDP1 and
    ZeRO-3 collectives line up whatever each rank's rows are."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.root = root  # a child module: .eval()/.train()/.parameters() reach the real model

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 **_ignored) -> torch.Tensor:
        """`eos_token_id`: one end token or several (transformers' generate takes both: the eval passes every end
        token the model lists)."""
        ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                            dtype=input_ids.dtype, device=input_ids.device)
        fill = pad_token_id if pad_token_id is not None else int(ends[0]) if len(ends) else 0
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
            logits = self.root(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               use_cache=False).logits
            token = torch.where(finished, torch.full_like(finished, fill, dtype=input_ids.dtype),
                                logits[:, -1].argmax(-1))
            ending = torch.isin(token, ends) & ~finished  # its end token is attended; what follows it is not
            finished |= ending
            input_ids = torch.cat([input_ids, token[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, (~finished | ending)[:, None].long()], dim=1)
        return input_ids
