"""DDP: every rank holds the whole model; gradients are all-reduced at a step's last micro-batch."""

from __future__ import annotations

from torch import nn

from finetune.parallel.engines.base import Engine


class DDPEngine(Engine):

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, nn.parallel.DistributedDataParallel)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def gradient_sync(self, model: nn.Module, *, enabled: bool):
        return super().gradient_sync(model, enabled=enabled) if enabled else model.no_sync()
