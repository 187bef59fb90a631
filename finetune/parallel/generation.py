"""The model that samples GRPO's completions, for every rank together: how each strategy's parameters are whole
during a generate call (docs/grpo.md, Generation under each strategy).

  * single process, DDP: the inner model; no collective in a forward.
  * FSDP2 (`gather="once"`, the default): every unit is unsharded once for the whole call and resharded after, so a
    call of T decoding steps costs one all-gather of the model instead of T (the units are told not to reshard after
    their forwards for the duration). `gather="per_forward"`: FSDP2's own hooks all-gather every unit at every
    forward, as in training (one full model is never whole at once).
  * FSDP1: per forward (its own hooks). summon_full_params would hold the whole model, but FSDP1 refuses a forward
    inside it.
  * ZeRO-3 (`gather="once"`): every parameter gathered once for the call with DeepSpeed's module hooks taken off,
    then the hooks put back and the parameters partitioned again, as TRL's `unwrap_model_for_generation`
    (`ds3_gather_for_generation`) does; `gather="per_forward"`: DeepSpeed's own hooks gather each module's parameters
    as it runs, at every decoding step. ZeRO-2 keeps whole parameters: the inner model, as DDP.
Sharded strategies run every decoding step on every rank until every rank's rows are done (each forward is a
collective); `sharded` says whether the caller must keep the ranks in step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from torch import nn

from finetune.parallel.engines import engine_of

Gather = Literal["once", "per_forward"]


@contextlib.contextmanager
def decoding_model(model: nn.Module, *, gather: Gather = "once") -> Iterator[tuple[nn.Module, bool]]:
    """(the module to call forward on with a KV cache, whether its forwards are collectives) for the block."""
    with engine_of(model).decoding_model(model, gather=gather) as decoding:
        yield decoding
