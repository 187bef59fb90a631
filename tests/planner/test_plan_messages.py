"""What `finetune plan` and a run's planner warning say when something does not fit: the figure that does not fit (the
load peak when loading needs more than training), the strategy as it will run, and only fixes that can help."""

from __future__ import annotations

import pytest
import torch
from conftest import write_recipe

from finetune import parallel, planner
from finetune.cli import main as cli_main
from finetune.distributed import DistInfo
from finetune.errors import LaunchError
from finetune.planner import GB, model_config_for
from finetune.recipe import validate_recipe

LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
GEMMA2_9B = "google/gemma-2-9b-it"
ZERO3 = {"strategy": "deepspeed", "zero_stage": 3}


def _raw(name: str, **sections) -> dict:
    raw = {"model": {"name_or_path": name, "dtype": "bfloat16"}, "lora": {"r": 16, "target_modules": "all-linear"},
           "data": {"datasets": [{"path": "x.jsonl"}], "max_length": 2048},
           "train": {"micro_batch_size": 1, "gradient_checkpointing": True}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def _decide(name: str, *, gpus: int, gb: float, **sections):
    recipe = validate_recipe(_raw(name, **sections), dtype_device="gpu")
    return planner.decide(recipe, model_config_for(recipe), gpus_per_node=gpus, gpu_memory_bytes=int(gb * GB))


def _plan(tmp_path, capsys, name: str, *flags: str, **sections) -> str:
    recipe = write_recipe(tmp_path / "r.yaml", _raw(name, **sections))
    assert cli_main(["plan", str(recipe), *flags]) == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------------- finding 2: the load peak, named
def test_a_run_that_cannot_load_is_warned_with_the_load_peak():
    """Found by a bug bash: ZeRO-3 of a 70B on 4 x 24 GB warned "needs 18.2 GiB per GPU, more than fits (19.0 GiB
    short)": the training peak, below the 22.4 GiB usable, while the 40.3 GiB load (each rank quantizes a full copy)
    was what did not fit. The refusal of parallel.strict said the same, and advised a smaller batch. Here FSDP without
    sharded loading, the same case (a full copy per rank) without DeepSpeed's import (~10 s)."""
    dist = DistInfo(0, 4, 0, 4, torch.device("cpu"), "gloo")  # rank 0 of a 4-GPU launch; gpus as detect_gpus says
    unsharded = {"strategy": "fsdp", "sharded_loading": False}
    loose = validate_recipe(_raw(LLAMA_70B, parallel=unsharded), dtype_device="gpu")
    plan = parallel.resolve_plan(loose, dist, model_config_for(loose), launcher={}, gpus=(4, 24 * GB))
    warning = next(n for n in plan.notes if n.startswith("WARNING: the memory planner"))
    assert "FSDP full shard needs 40.3 GiB per GPU to load (each rank quantizes a full copy" in warning, warning
    assert "the training peak is 20.0 GiB" in warning
    strict = validate_recipe(_raw(LLAMA_70B, parallel={**unsharded, "strict": True}), dtype_device="gpu")
    with pytest.raises(LaunchError) as refused:
        parallel.resolve_plan(strict, dist, model_config_for(strict), launcher={}, gpus=(4, 24 * GB))
    assert "40.3 GiB per GPU to load" in str(refused.value) and "lower the batch" not in str(refused.value)
    assert "load a shard per GPU instead of a full copy" in str(refused.value)


def test_the_recipe_strategy_line_gives_the_load_peak(tmp_path, capsys):
    """Found by a bug bash: "DeepSpeed ZeRO-3 on 4 GPU(s) does not fit (19.0 GiB short), 18.2 GiB per GPU": the
    shortfall was the load's, the figure the training peak's."""
    out = _plan(tmp_path, capsys, LLAMA_70B, "--gpus", "4", "--gpu-memory", "24GB", parallel=ZERO3)
    line = next(n for n in out.splitlines() if n.startswith("the recipe's parallel.strategy"))
    assert "does not fit (19.0 GiB short), 40.3 GiB per GPU to load" in line, line


def test_the_summary_says_loading_is_the_limit_and_gives_no_fix_that_cannot_help():
    """Found by a bug bash: gemma-2-9b on one 9 GB GPU at 1 x 64 tokens: "closest is single GPU at 7.5 GiB per GPU
    (0.4 GiB short). Fix: lower data.max_length or train.micro_batch_size, turn on train.gradient_checkpointing":
    7.5 GiB fits the 8.4 GiB usable, the 8.4 GiB load is the limit, and none of the three fixes changes it."""
    summary = _decide(GEMMA2_9B, gpus=1, gb=9.0, data={"max_length": 64}).summary
    assert "closest is single GPU at 8.4 GiB per GPU to load" in summary and "the training peak is 7.5 GiB" in summary
    assert "Loading is the limit, so a shorter data.max_length or a smaller micro-batch cannot help" in summary
    assert "gradient_checkpointing" not in summary and "lower data.max_length" not in summary, summary


def test_the_library_table_cell_gives_the_larger_of_training_and_loading():
    """Found by a bug bash: the docs table says "loading included" but printed the training peak alone."""
    from finetune.cli.plan import _library_cell

    chosen = next(e for e in _decide(GEMMA2_9B, gpus=1, gb=9.0, data={"max_length": 64}).estimates
                  if e.strategy == "single")
    assert chosen.load_peak_bytes > chosen.peak_bytes
    assert _library_cell(chosen, 0) == f"single GPU, {chosen.load_peak_bytes / 2**30:.1f} GiB to load, mb<=0"


# ----------------------------------------------------------- finding 3: hybrid shard on one node, layer split
def test_hybrid_shard_on_one_node_is_planned_as_the_full_shard_it_runs(tmp_path, capsys):
    """Found by a bug bash: "the recipe's parallel.strategy fsdp: not planned on 2 GPU(s) (it needs 2 or more ...)":
    hybrid shard on one node runs as FSDP full shard (parallel/plan.py), so that is its row."""
    out = _plan(tmp_path, capsys, LLAMA_8B, "--gpus", "2", "--gpu-memory", "24GB",
                parallel={"strategy": "fsdp", "hybrid_shard": True})
    line = next(n for n in out.splitlines() if n.startswith("the recipe's parallel.strategy"))
    assert line.startswith("the recipe's parallel.strategy fsdp: FSDP full shard on 2 GPU(s) (hybrid shard on one "
                           "node runs as FSDP full shard"), line
    assert "not planned" not in line and " fits, " in line


def test_layer_split_over_nodes_says_it_needs_gpus_in_one_node(tmp_path, capsys):
    """Found by a bug bash: `--gpus 1 --nodes 2` with layer split said "not planned on 2 GPU(s) (it needs 2 or
    more ...)", contradicting itself: layer split needs 2 or more GPUs in one node."""
    out = _plan(tmp_path, capsys, LLAMA_8B, "--gpus", "1", "--nodes", "2", "--gpu-memory", "24GB",
                parallel={"strategy": "layer_split"})
    line = next(n for n in out.splitlines() if n.startswith("the recipe's parallel.strategy"))
    assert "needs 2 or more GPUs per node, and --gpus says 1 (--nodes does not add to them)" in line, line
    assert "2 GPU(s)" not in line


# ------------------------------------------------------------------ finding 4: fixes that can help, only
def test_a_base_larger_than_the_gpu_gets_no_length_or_batch_advice():
    """Found by a bug bash: a 70B on one 24 GB GPU (the 4-bit base alone 35.8 GiB) was told to lower data.max_length
    or the micro-batch and to turn on checkpointing (already on). Only more GPUs or CPU offload can help; the one-GPU
    offload route (FSDP over one process) was never named."""
    summary = _decide(LLAMA_70B, gpus=1, gb=24).summary
    assert "alone take 37.6 GiB per GPU, so a shorter data.max_length or a smaller micro-batch cannot help" in summary
    assert "Fix: add GPUs" in summary and "set parallel.cpu_offload: true" in summary
    assert "--nproc_per_node 1" in summary and "FSDP + CPU offload, which fits" in summary
    assert "gradient_checkpointing" not in summary and "lower data.max_length" not in summary, summary


def test_a_micro_batch_too_large_is_told_the_largest_that_fits():
    """Found by a bug bash: Llama 3.1 8B at micro-batch 64 on one 24 GB GPU got no fix at all, though the planner had
    found that 12 fits (it said so only when the recipe fitted)."""
    decision = _decide(LLAMA_8B, gpus=1, gb=24, train={"micro_batch_size": 64})
    assert not decision.fits and 4 < decision.max_micro_batch < 64
    largest = f"Fix: lower train.micro_batch_size to {decision.max_micro_batch}, the largest that fits"
    assert largest in decision.summary, decision.summary


def test_checkpointing_is_advised_only_when_it_is_off():
    """Found by a bug bash: "turn on train.gradient_checkpointing" was said with checkpointing already on."""
    on = _decide(LLAMA_8B, gpus=1, gb=24, data={"max_length": 200_000}).summary
    assert "Fix: lower data.max_length" in on and "gradient_checkpointing" not in on, on
    off = _decide(LLAMA_8B, gpus=1, gb=24, data={"max_length": 200_000}, train={"gradient_checkpointing": False})
    assert "turn on train.gradient_checkpointing" in off.summary, off.summary


# --------------------------------------------------------------------- finding 5: the hub not reachable
def test_an_unreachable_hub_is_not_reported_as_the_users_hf_hub_offline(tmp_path, capsys, monkeypatch):
    """Found by a bug bash: with no HF_* variable set and no network, `finetune plan` on an uncached hub id said
    "(HF_HUB_OFFLINE is set: only the local cache is read ...)": finetune/hub.py had set it itself after its
    reachability check failed. Now: the hub is not reachable, the cache lacks the model, and how to get it."""
    import datasets.config
    from huggingface_hub import constants

    from finetune import hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "FINETUNE_HUB_UNREACHABLE"):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)  # no network (the suite never reaches the hub)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    recipe = write_recipe(tmp_path / "r.yaml", _raw("someorg/NotCached-7B"))
    assert cli_main(["plan", str(recipe), "--gpus", "2", "--gpu-memory", "24GB"]) == 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE is set" not in err, err
    assert "the hub is not reachable from this machine (only the local cache was read)" in err
    assert "hf download someorg/NotCached-7B --local-dir DIR" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the user's own setting is still named as such
    monkeypatch.delenv("FINETUNE_HUB_UNREACHABLE", raising=False)
    assert cli_main(["plan", str(recipe), "--gpus", "2", "--gpu-memory", "24GB"]) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_a_run_and_a_push_on_an_unreachable_hub_do_not_blame_the_users_hf_hub_offline(monkeypatch, tmp_path):
    """The same for a run's model load (model/sources/hub.py load_error) and `export --push-to-hub`, which named
    "HF_HUB_OFFLINE is set" where finetune had set it itself after the hub did not answer."""
    from finetune.model.sources.hub import load_error
    from finetune.outputs.export import ExportError
    from finetune.outputs.publish import push_to_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FINETUNE_HUB_UNREACHABLE", "1")
    said = str(load_error("config", "someorg/NotCached-7B", OSError("not in the cache")))
    assert "HF_HUB_OFFLINE is set" not in said and "the hub is not reachable" in said, said
    with pytest.raises(ExportError, match="the hub is not reachable from this machine, so nothing was uploaded"):
        push_to_hub(tmp_path, "me/repo")
    monkeypatch.delenv("FINETUNE_HUB_UNREACHABLE", raising=False)  # the user's own setting is named as such
    assert "HF_HUB_OFFLINE is set" in str(load_error("config", "someorg/NotCached-7B", OSError("not in the cache")))
