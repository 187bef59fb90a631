"""What the parallel stage decided for a run (the plan, a dataclass): below both the choice (plan.py) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from finetune.model.sources.shard_reads import RankShard
from finetune.parallel import zero

Strategy = Literal["single", "ddp", "fsdp", "deepspeed", "layer_split"]


@dataclass
class ParallelPlan:
    strategy: Strategy
    world_size: int
    fsdp_version: int = 2
    reshard_after_forward: bool = True
    # HSDP (FSDP hybrid shard): `replicas` groups of `shard_size` ranks each; every group holds the whole model sharded
    # over its ranks, and the groups are replicas (gradients all-reduced across them). 1 = shard over every rank.
    # The ranks of one node form a group (shard within a node, replicate across nodes): see parallel/plan.py.
    replicas: int = 1
    cpu_offload: bool = False
    layer_class: str | None = None
    activation_checkpointing: bool = True
    param_dtype: torch.dtype = torch.bfloat16
    zero: zero.ZeroSettings | None = None  # strategy deepspeed
    device_map: dict | None = None
    sharded_loading: bool = False  # FSDP: the wrap builds each unit from the checkpoint and shards it at once
    backward_prefetch: str | None = None  # the accelerate config's fsdp_backward_prefetch; None: FSDP's default
    forward_prefetch: bool = False  # the accelerate config's fsdp_forward_prefetch
    notes: list[str] = field(default_factory=list)

    @property
    def shard_size(self) -> int:
        """Ranks one FSDP shard group spans: the world, or a node's ranks under hybrid shard."""
        return self.world_size // max(1, self.replicas)

    def own_shard(self, rank: int) -> RankShard | None:
        """FSDP2 sharded loading: `rank` reads and quantizes only its chunk of each tensor (finetune/model/sources/shard_reads.py).
        FSDP1 reads whole units: its flat parameters cut a unit's concatenation, not each tensor.

        Under hybrid shard the chunk is the one of the rank's place in its shard group (the mesh's "shard" dimension,
        rank % shard_size: init_device_mesh lays the (replicate, shard) mesh out row-major over the global ranks), not
        of its global rank; each replica group reads the whole checkpoint once."""
        if self.strategy == "fsdp" and self.fsdp_version == 2 and self.sharded_loading:
            return RankShard(rank % self.shard_size, self.shard_size)
        return None

    @property
    def _processes(self) -> str:
        return f"{self.world_size} process{'es' if self.world_size != 1 else ''}"

    def describe(self) -> str:
        if self.strategy == "fsdp":
            shard = "full shard" if self.reshard_after_forward else "shard-grad-op"
            offload = ", params offloaded to CPU" if self.cpu_offload else ""
            prefetch = (f", backward prefetch {self.backward_prefetch}" if self.backward_prefetch else "") + (
                ", forward prefetch" if self.forward_prefetch else "")
            if self.replicas > 1:
                shard = (f"hybrid shard: sharded over the {self.shard_size} processes of each node, replicated across "
                         f"{self.replicas} nodes, " + shard)
            return (f"FSDP{self.fsdp_version} over {self._processes} ({shard}{offload}{prefetch}), "
                    f"unit = {self.layer_class}")
        if self.strategy == "ddp":
            return f"DDP over {self._processes}"
        if self.strategy == "deepspeed":
            return f"DeepSpeed {self.zero.describe()} over {self._processes}"
        if self.strategy == "layer_split":
            devices = sorted({str(d) for d in (self.device_map or {}).values()})
            return f"layer split over {', '.join(devices) or 'one device'} in one process"
        return "single process"


# ------------------------------------------------------------------------------------------- the plan + checks
