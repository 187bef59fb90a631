"""Hybrid shard (HSDP) without processes: what the accelerate config's sharding strategy says, the plan it gives on
2 nodes x 2 processes (replicas, shard groups, the sharded loader's ranks), the refusals, and the planner's row.
The 4-process run is tests/parallel/test_hybrid_shard.py."""

from __future__ import annotations

import pytest
import torch

from finetune import parallel
from finetune.cli import main as cli_main
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.model import load_config
from finetune.parallel.launcher import sharding_settings
from finetune.planner import GB, Hardware, estimate, facts_from_config, held_parameter_bytes
from finetune.recipe import validate_recipe

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "true"}  # accelerate's defaults


def two_nodes(rank: int = 0, *, world: int = 4, per_node: int = 2) -> DistInfo:
    return DistInfo(rank=rank, world_size=world, local_rank=rank % per_node, local_world_size=per_node,
                    device=torch.device("cpu"), backend="gloo")


def plan(model_dir, *, env=None, dist=None, **parallel_keys):
    recipe = validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32"},
                              "data": {"datasets": [{"path": "x.jsonl"}]}, "parallel": parallel_keys})
    launcher = parallel.launcher_settings(env) if env is not None else {}
    return parallel.resolve_plan(recipe, dist or two_nodes(), load_config(recipe), launcher=launcher)


@pytest.mark.parametrize("strategy,reshard,expected", [
    ("FULL_SHARD", "true", {"reshard_after_forward": True}),
    ("HYBRID_SHARD", "true", {"reshard_after_forward": True, "hybrid_shard": True}),  # fsdp_sharding_strategy
    ("FULL_SHARD", "HYBRID_SHARD", {"reshard_after_forward": True, "hybrid_shard": True}),  # `accelerate config`'s FSDP1 key
    ("4", "true", {"reshard_after_forward": True, "hybrid_shard": True}),  # accelerate's number for HYBRID_SHARD
    ("SHARD_GRAD_OP", "true", {"reshard_after_forward": False}),  # was read as full shard under accelerate launch
    ("FULL_SHARD", "false", {"reshard_after_forward": False}),
    (None, None, {}),
])
def test_the_sharding_strategy_from_either_variable(strategy, reshard, expected):
    assert sharding_settings(strategy, reshard) == expected


@pytest.mark.parametrize("name,needle", [("_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2 (hybrid shard without resharding"),
                                         ("NO_SHARD", "that is DDP"), ("ZERO3", "'ZERO3' is not an FSDP sharding strategy")])
def test_unsupported_sharding_strategies_are_refused_before_loading(tiny_llama, name, needle):
    with pytest.raises(LaunchError) as error:
        plan(tiny_llama, env={**FSDP2_ENV, "FSDP_SHARDING_STRATEGY": name})
    assert needle in str(error.value) and f"fsdp_sharding_strategy: {name}" in str(error.value)
    assert "Fix: set fsdp_sharding_strategy" in str(error.value)


def test_hybrid_shard_from_the_config_gives_a_two_dimensional_plan(tiny_llama):
    """2 nodes x 2 processes: 2 replicas of a model sharded over a node's 2 ranks; the sharded loader reads by the
    rank's place in its node's shard group (rank % 2 of 2), not its global rank (of 4)."""
    hybrid = plan(tiny_llama, env={**FSDP2_ENV, "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"})
    assert (hybrid.strategy, hybrid.replicas, hybrid.shard_size, hybrid.reshard_after_forward) == ("fsdp", 2, 2, True)
    assert "hybrid shard: sharded over the 2 processes of each node, replicated across 2 nodes" in hybrid.describe()
    shards = [(s.rank, s.world_size) for s in (hybrid.own_shard(rank) for rank in range(4))]
    assert shards == [(0, 2), (1, 2), (0, 2), (1, 2)]
    full = plan(tiny_llama, env=FSDP2_ENV)
    assert (full.replicas, full.shard_size, full.own_shard(3).rank, full.own_shard(3).world_size) == (1, 4, 3, 4)
    assert "hybrid" not in full.describe()


def test_hybrid_shard_from_the_recipe_and_a_contradiction(tiny_llama):
    assert plan(tiny_llama, env=FSDP2_ENV, hybrid_shard=True).replicas == 2  # fsdp2.yaml's defaults state nothing
    assert plan(tiny_llama, strategy="fsdp", hybrid_shard=True).replicas == 2  # torchrun
    with pytest.raises(LaunchError, match="parallel.hybrid_shard is false in the recipe but the accelerate config asks "
                                          "for HYBRID_SHARD"):
        plan(tiny_llama, env={**FSDP2_ENV, "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, hybrid_shard=False)


def test_hybrid_shard_on_one_node_is_full_shard_with_a_note(tiny_llama):
    one_node = plan(tiny_llama, strategy="fsdp", hybrid_shard=True, dist=two_nodes(world=2, per_node=2))
    assert one_node.replicas == 1 and any("hybrid shard asked for on one node" in n for n in one_node.notes)


@pytest.mark.parametrize("keys,needle", [
    ({"strategy": "fsdp", "fsdp_version": 1, "hybrid_shard": True}, "implemented for FSDP2 only"),
    ({"strategy": "ddp", "hybrid_shard": True}, "hybrid shard is an FSDP sharding"),
])
def test_hybrid_shard_refusals(tiny_llama, keys, needle):
    with pytest.raises(LaunchError, match=needle):
        plan(tiny_llama, **keys)


def test_fsdp1_hybrid_shard_from_the_config_is_refused_not_trained_as_full_shard(tiny_llama):
    env = {**FSDP2_ENV, "FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD"}
    with pytest.raises(LaunchError, match="implemented for FSDP2 only.*not trained as full shard"):
        plan(tiny_llama, env=env)


def test_uneven_nodes_are_refused(tiny_llama):
    with pytest.raises(LaunchError, match="5 processes do not split into nodes of 2"):
        plan(tiny_llama, strategy="fsdp", hybrid_shard=True, dist=two_nodes(world=5, per_node=2))


# ------------------------------------------------------------------------------------------------ the planner
def _facts_and_recipe():
    from finetune.model.architectures import stored_config

    recipe = validate_recipe({"model": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    return facts_from_config(stored_config("meta-llama/Llama-3.1-8B-Instruct"), recipe), recipe


def test_hsdp_per_rank_memory_is_fsdp_over_one_nodes_gpus():
    """2 nodes x 4 GPUs: an HSDP rank holds the base sharded over 4 (its node), not over 8; the held bytes come from
    the shard model (torch.chunk rows over the node's ranks), the training figures are FSDP full shard on 1 x 4."""
    facts, recipe = _facts_and_recipe()
    hsdp = estimate(facts, recipe, "hsdp", Hardware(4, 80 * GB, nodes=2))
    over_node = estimate(facts, recipe, "fsdp", Hardware(4, 80 * GB, nodes=1))
    over_all = estimate(facts, recipe, "fsdp", Hardware(4, 80 * GB, nodes=2))
    held_4 = held_parameter_bytes(facts, strategy="fsdp", world_size=4)["frozen_bytes"]
    assert hsdp.parts["base"] == held_4 == over_node.parts["base"]
    assert hsdp.parts == over_node.parts and hsdp.load_peak_bytes == over_node.load_peak_bytes
    assert hsdp.parts["base"] == pytest.approx(2 * over_all.parts["base"], rel=0.01)
    assert hsdp.world_size == 8 and hsdp.label == "FSDP hybrid shard"
    assert hsdp.reads.node_bytes == pytest.approx(2 * over_all.reads.node_bytes, rel=0.01)  # each node reads it all


def test_plan_cli_lists_hybrid_shard_for_several_nodes(capsys):
    assert cli_main(["plan", "llama-3.1-8b", "--gpus", "4", "--nodes", "2", "--gpu-memory", "80GB", "--json"]) == 0
    import json

    rows = {e["strategy"]: e for e in json.loads(capsys.readouterr().out)["estimates"]}
    assert rows["hsdp"]["world_size"] == 8 and rows["hsdp"]["parts"]["base"] > 1.9 * rows["fsdp"]["parts"]["base"]
    assert cli_main(["plan", "llama-3.1-8b", "--gpus", "4", "--nodes", "2", "--gpu-memory", "80GB"]) == 0
    text = capsys.readouterr().out
    assert "FSDP hybrid shard" in text and "replicated across 2 nodes" in text
    assert cli_main(["plan", "llama-3.1-8b", "--gpus", "4", "--gpu-memory", "80GB"]) == 0
    assert "hybrid" not in capsys.readouterr().out  # one node: nothing to replicate across


def test_validate_the_multi_node_template_with_its_hybrid_shard_line(tmp_path, capsys):
    """The template's commented HYBRID_SHARD line, uncommented (the file is otherwise as shipped): `finetune validate`
    plans 2 machines x 8 processes as hybrid shard over each machine's 8 (num_machines gives the processes per node)."""
    from pathlib import Path

    shipped = (Path(__file__).resolve().parents[2] / "accelerate_configs" / "multi_node.yaml").read_text()
    assert "  # fsdp_sharding_strategy: HYBRID_SHARD\n" in shipped  # the template offers it
    hybrid = tmp_path / "multi_node_hybrid.yaml"
    hybrid.write_text(shipped.replace("  # fsdp_sharding_strategy: HYBRID_SHARD\n", "  fsdp_sharding_strategy: HYBRID_SHARD\n"))
    assert cli_main(["validate", "llama-3.1-8b", "--accelerate-config", str(hybrid)]) == 0
    assert "hybrid shard: sharded over the 8 processes of each node, replicated across 2 nodes" in capsys.readouterr().out


def test_a_process_count_that_does_not_split_over_the_machines_is_refused(tmp_path, capsys):
    """Found by a bug bash (bb22 #4): `--num-processes 3` with a 2-machine config: validate planned 3 processes (and,
    with hybrid shard asked for, dropped it for a full shard without a word) while accelerate launched 3 // 2 = 1 per
    machine, 2 in all, with other steps per epoch. Refused now, naming the count that splits."""
    from pathlib import Path

    shipped = (Path(__file__).resolve().parents[2] / "accelerate_configs" / "multi_node.yaml").read_text()
    hybrid = tmp_path / "multi_node_hybrid.yaml"
    hybrid.write_text(shipped.replace("  # fsdp_sharding_strategy: HYBRID_SHARD\n", "  fsdp_sharding_strategy: HYBRID_SHARD\n"))
    assert cli_main(["validate", "llama-3.1-8b", "--accelerate-config", str(hybrid), "--num-processes", "3"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "3 processes do not split over the 2 machines" in said and "1 on each machine, 2 in all" in said, said
    assert "a multiple of 2" in said
    assert cli_main(["validate", "llama-3.1-8b", "--accelerate-config", str(hybrid), "--num-processes", "4"]) == 0
    assert "replicated across 2 nodes" in capsys.readouterr().out
