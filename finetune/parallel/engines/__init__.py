"""Engines: what each training strategy's wrapper does at every point where the loop, checkpoints, generation and
the state dicts touch it, in one table: `engine_of(model)` is the only place that asks which wrapper a model has
(parallel/wrapping.py's `wrap` is the one place that applies a plan).

    base.py      Engine: the contract, with the single-process behaviour as its defaults (layer split uses them too)
    plain.py     DDP: no_sync for all but a step's last micro-batch, the inner module for generation
    fsdp2.py     FSDP2 (fully_shard, HSDP): per-unit gradient sync and reshard, DTensor state dicts
    fsdp1.py     FSDP1: LoRA leaf units asked alone for state dicts, greedy generation through the root
    deepspeed.py DeepSpeed ZeRO-2/3: the engine steps, clips and checkpoints in its own format

How to add an engine (docs/architecture.md says it at length): a module here with a subclass of `Engine` that
overrides what differs from a single process (`owns` and `unwrap` at least), one line in ENGINES, its branch in
parallel/wrapping.py's `wrap`, and the strategy's pre-flight checks in parallel/checks.py and plan.py. Nothing
outside finetune/parallel/ changes: tests/test_architecture.py fails on an isinstance of a wrapper class elsewhere.
"""

from __future__ import annotations

from torch import nn

from finetune.parallel.engines.base import Engine
from finetune.parallel.engines.deepspeed import ZeroEngine
from finetune.parallel.engines.fsdp1 import FSDP1Engine
from finetune.parallel.engines.fsdp2 import FSDP2Engine
from finetune.parallel.engines.plain import DDPEngine

# Asked in this order: the first whose `owns(model)` is true runs the model; Engine (single process) owns the rest.
ENGINES: tuple[Engine, ...] = (ZeroEngine(), FSDP2Engine(), FSDP1Engine(), DDPEngine())
SINGLE = Engine()


def engine_of(model: nn.Module) -> Engine:
    """The engine that wrapped `model` (single process when none did)."""
    for engine in ENGINES:
        if engine.owns(model):
            return engine
    return SINGLE


__all__ = ["ENGINES", "Engine", "engine_of"]
