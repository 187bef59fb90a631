"""Pre-quantized 4-bit checkpoints (finetune/model/quantization/prequantized.py), `finetune quantize` (quantize.py) and the
quantized cache (quantized_cache.py): the same bytes and the same training as quantizing the bf16 base at load.

The 4-bit checkpoint under test is written by transformers' own `save_pretrained` of a model loaded with a
BitsAndBytesConfig (uint8 storage, transformers' default and what the hub's "-bnb-4bit" repositories hold), not by
this project.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    LIBRARY_LORA,
    accelerate_launch,
    addition_rows,
    recipe_dict,
    train_losses,
    write_jsonl,
    write_recipe,
)
from loading_check import held_tensors


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    """The bf16 base, transformers' 4-bit checkpoint of it, and `finetune quantize`'s (3 shards + index)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("prequantized")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16, quantization_config=config)
    model.save_pretrained(root / "transformers-4bit")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(root / "transformers-4bit")
    from finetune.cli.command import main  # in this process: the verb as the console script runs it, minus the start

    assert main(["quantize", str(tiny_llama), str(root / "quantized"), "--max-shard-size", "0.0001"]) == 0
    return {"base": tiny_llama, "transformers": root / "transformers-4bit", "quantized": root / "quantized"}


def _recipe(name_or_path, **model):
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": str(name_or_path), "dtype": "bfloat16", **model},
                                  "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                                  "data": {"datasets": [{"path": "x.jsonl", "format": "alpaca"}]}})


def _load(recipe):
    from finetune.model import loading

    loaded = loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                                gradient_checkpointing=False)
    return held_tensors(loaded.model)


def test_4bit_checkpoints_hold_the_bytes_of_the_base_quantized_at_load(checkpoints):
    """Every packed byte, absmax, nested absmax, code and norm: transformers' uint8 checkpoint (re-viewed as bf16) and
    `finetune quantize`'s (3 shards + index) give what loading the bf16 base gives; plain from_pretrained reads the
    latter as transformers' own."""
    from transformers import AutoModelForCausalLM

    from finetune.model import base as model_base

    quantized_index = json.loads((checkpoints["quantized"] / "model.safetensors.index.json").read_text())
    assert len(set(quantized_index["weight_map"].values())) == 3
    expected = _load(_recipe(checkpoints["base"]))
    for name in ("transformers", "quantized"):
        held = _load(_recipe(checkpoints[name]))
        assert sorted(held) == sorted(expected) and len(held) > 50
        assert [k for k in held if not torch.equal(held[k], expected[k])] == [], name
    plain = AutoModelForCausalLM.from_pretrained(checkpoints["quantized"])  # no quantization_config passed
    at_load = model_base.load_base_model(_recipe(checkpoints["base"]), device=torch.device("cpu"))
    assert type(plain.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    model_base.keep_4bit_weights_trainable_on_cpu(plain)  # the same CPU kernel as at_load (not the inference repack)
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(plain(ids).logits.float(), at_load(ids).logits.float())


@pytest.mark.parametrize("world", [2, 3])
def test_an_fsdp2_rank_reads_only_its_chunk_of_a_4bit_checkpoint(checkpoints, world):
    """Each rank of a simulated world (in this process; the real 2-rank runs are the FSDP2 trainings below), from
    transformers' uint8 checkpoint: its FSDP2 chunk of every packed weight, as the bf16 storage and as uint8 (the
    byte guard's re-view), is bitwise the whole weight's, and so is the quant state (read whole); of the packed bytes
    it reads only that chunk, widened to whole blocks."""
    import bitsandbytes as bnb

    from finetune.model.quantization import prequantized
    from finetune.model.sources import files as checkpoint_files
    from finetune.model.sources.shard_reads import RankShard, dim0_chunk

    folder = checkpoints["transformers"]
    index = checkpoint_files.checkpoint_index(folder)
    layout = prequantized.packed_layout(_recipe(folder), folder, index)
    keys = sorted(layout.states)
    assert len(keys) > 10

    def build(key, shard):
        meta = bnb.nn.Params4bit(torch.empty(layout.states[key]["shape"], device="meta"), blocksize=64,
                                 compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16,
                                 module=torch.nn.Module())
        reader = checkpoint_files.TensorReader(index)
        param = prequantized.packed_parameter(reader, key, meta, device=torch.device("cpu"), layout=layout, shard=shard)
        read = reader.bytes_read
        for name in layout.state_names(key):
            read -= reader.get(name).numel() * reader.get(name).element_size()
        return param, read  # the packed bytes read

    for key in keys:
        whole, whole_read = build(key, None)
        for rank in range(world):
            own, read = build(key, RankShard(rank, world))
            for view in (torch.bfloat16, torch.uint8):
                data, expected = own.data.view(view), whole.data.view(view)
                first, last = dim0_chunk(data.shape[0], rank, world)
                assert torch.equal(data[first:last].view(torch.uint8), expected[first:last].view(torch.uint8)), key
            for part in ("absmax", "code", "offset"):
                assert torch.equal(getattr(own.quant_state, part), getattr(whole.quant_state, part))
            assert torch.equal(own.quant_state.state2.absmax, whole.quant_state.state2.absmax)
            chunk = dim0_chunk(whole_read // 2, rank, world)
            assert read <= (chunk[1] - chunk[0]) * 2 + 2 * 32 + 4 < whole_read or chunk[0] == chunk[1], (key, read)


@pytest.mark.parametrize("world", [2, 3])
def test_an_fsdp2_rank_copies_only_its_chunk_of_a_4bit_checkpoint_to_its_gpu(checkpoints, world):
    """Each rank of a simulated world copies to its GPU only the packed bytes it read (its chunk, widened to whole
    blocks: ~1/world of the weight) plus the whole quant state, into a zero-filled tensor made on the GPU, and holds
    there bitwise what the same build on the CPU holds. Before, the packed tensor was filled on the host and moved
    whole: every rank copied the whole 4-bit model to its GPU. The whole sharded load of the model moves no more
    than it reads (the few-hundred-byte quant-state JSONs stay on the host) plus what is made on the host (LoRA,
    buffers, nested offsets).

    The GPU is simulated (tests/model/simulated_gpu.py): the build is asked for `cuda:0` and runs under a
    TorchFunctionMode that runs every op on the CPU, records the tensors made on or moved to the GPU and counts the
    bytes that cross from the host (moves to the GPU, host tensors copied into GPU tensors)."""
    import bitsandbytes as bnb
    from simulated_gpu import CUDA, SimulatedGpu

    from finetune.model import loading
    from finetune.model.quantization import prequantized
    from finetune.model.sources import files as checkpoint_files
    from finetune.model.sources.shard_reads import RankShard

    folder = checkpoints["transformers"]
    index = checkpoint_files.checkpoint_index(folder)
    layout = prequantized.packed_layout(_recipe(folder), folder, index)

    def build(key, shard, device):
        meta = bnb.nn.Params4bit(torch.empty(layout.states[key]["shape"], device="meta"), blocksize=64,
                                 compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16,
                                 module=torch.nn.Module())
        reader = checkpoint_files.TensorReader(index)
        param = prequantized.packed_parameter(reader, key, meta, device=device, layout=layout, shard=shard)
        state = [reader.get(name) for name in layout.state_names(key)]
        packed_read = reader.bytes_read - sum(t.numel() * t.element_size() for t in state) * 2  # each state read twice
        moved_state = sum(t.numel() * t.element_size() for t in state[:-1]) + 4  # not the JSON; + the nested offset
        return param, packed_read, moved_state

    for key in sorted(layout.states):
        whole_bytes = index.shapes[key][0] * index.shapes[key][1]  # uint8 checkpoint: one byte per element
        for rank in range(world):
            on_cpu, _, _ = build(key, RankShard(rank, world), torch.device("cpu"))
            with SimulatedGpu() as gpu:
                on_gpu, packed_read, moved_state = build(key, RankShard(rank, world), CUDA)
                assert gpu.holds(on_gpu) and gpu.holds(on_gpu.quant_state.absmax)
                assert gpu.host_to_device_bytes == packed_read + moved_state, (key, rank)
            assert packed_read <= -(-whole_bytes // world) + 2 * 32 + 4 < whole_bytes, (key, rank, packed_read)
            assert torch.equal(on_gpu.data.view(torch.uint8), on_cpu.data.view(torch.uint8))
            for part in ("absmax", "code", "offset"):
                assert torch.equal(getattr(on_gpu.quant_state, part), getattr(on_cpu.quant_state, part))

    recipe = _recipe(folder)
    for rank in range(world):
        loaded = loading.load_model(recipe, sharded=True, device=CUDA, device_map=None, gradient_checkpointing=False,
                                    shard=RankShard(rank, world))
        json_bytes = sum(index.shapes[name][0] for name in index.shapes if prequantized.PACKED_STATE in name)
        with SimulatedGpu() as gpu:
            for unit in [*loaded.model.base_model.model.model.layers, loaded.model]:
                loaded.materialize(unit)  # as the FSDP2 wrap does, one unit after another
            made_on_host = (sum(p.numel() * p.element_size() for name, p in loaded.model.named_parameters()
                                if ".lora_" in name) + sum(b.numel() * b.element_size() for b in loaded.model.buffers())
                            + 4 * len(layout.states))  # LoRA, buffers, each weight's nested offset (fp32)
            moved = gpu.host_to_device_bytes
        assert moved <= loaded.bytes_read - json_bytes + made_on_host, (rank, moved, loaded.bytes_read)


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """8 steps from each checkpoint, single process and FSDP2 (shipped fsdp2.yaml), library LoRA (dropout 0.05), bf16;
    and FSDP2 from the bf16 base with `model.quantized_cache: auto` and an empty cache: one of the two ranks builds the
    entry (`finetune quantize`'s writer) while the other waits on its lock, then both train from its 4-bit bytes."""
    import os

    root = tmp_path_factory.mktemp("prequantized-runs")
    data = write_jsonl(root / "train.jsonl", addition_rows(40))
    done = {}
    cases = [("base", "single", {}), ("transformers", "single", {}), ("base", "fsdp2", {}), ("transformers", "fsdp2", {}),
             ("base", "fsdp2-cache", {"quantized_cache": "auto"})]
    for model, launch, model_keys in cases:
        name = f"{model}-{launch}"
        recipe = recipe_dict(checkpoints[model], data, root / name, model={"dtype": "bfloat16", **model_keys},
                             lora=LIBRARY_LORA, train={"max_steps": 8, "micro_batch_size": 4 if launch == "single" else 2},
                             data={"eval_fraction": 0.0},
                             eval={"generation_rows": 0})
        path = write_recipe(root / f"{name}.yaml", recipe)
        if launch == "single":  # run.py's entry point in this process: the libraries are imported once for three runs
            from finetune.run import main as run_main

            assert run_main([str(path)]) == 0
        else:
            os.environ["FINETUNE_CACHE"] = str(root / "cache")  # the launch's environment is this process's
            try:
                result = accelerate_launch("fsdp2", path)
            finally:
                del os.environ["FINETUNE_CACHE"]
            assert result.returncode == 0, result.stderr[-4000:]
            done[f"{name}:output"] = result.stdout + result.stderr
            done[f"{name}:read"] = [json.loads((root / name / "ranks" / f"rank{r}.json").read_text())["checkpoint_bytes_read"]
                                    for r in (0, 1)]
        done[name] = train_losses(root / name)
    done["cache"] = root / "cache" / "quantized"
    return done


@pytest.mark.slow
def test_4bit_checkpoints_train_to_the_losses_of_the_bf16_base(runs):
    reference = runs["base-single"]
    assert len(reference) == 8 and reference[-1] < reference[0]
    assert runs["transformers-single"] == pytest.approx(reference, abs=1e-6)
    assert runs["transformers-fsdp2"] == pytest.approx(runs["base-fsdp2"], abs=1e-6)


@pytest.mark.slow
def test_fsdp2_ranks_read_their_share_of_a_4bit_checkpoint_as_the_planner_says(runs, checkpoints):
    """The 2-rank FSDP2 run from transformers' 4-bit checkpoint: each rank's count (ranks/rank{r}.json) is what
    `finetune plan` says (read/rank, within 5%), and well under the whole checkpoint that every rank read before."""
    from loading_check import planner_read_bytes

    folder = checkpoints["transformers"]
    whole = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    for rank, read in enumerate(runs["transformers-fsdp2:read"]):
        assert read == pytest.approx(planner_read_bytes(_recipe(folder), rank, 2, own_shard=True), rel=0.05)
        assert read < 0.65 * whole, (read, whole)  # half of the packed bytes and rows, every quant state whole


@pytest.mark.slow
def test_two_ranks_build_the_cache_once_and_train_from_it_to_the_same_losses(runs):
    """The cache's 4-bit checkpoint (written as `finetune quantize` writes) trains as the bf16 base quantized at load;
    it is built once for the two ranks of the node (one quantizing note, one entry, no half-written folder left)."""
    assert runs["base-fsdp2-cache"] == pytest.approx(runs["base-fsdp2"], abs=1e-6)
    output = runs["base-fsdp2-cache:output"]
    assert output.count("quantizing") == 1 and "once into" in output, output[-3000:]
    entries = [p for p in runs["cache"].iterdir() if p.is_dir()]
    assert len(entries) == 1, entries
    assert (entries[0] / "finetune_quantized.json").exists() and list(entries[0].glob("*.safetensors"))


def test_the_cache_is_built_once_then_its_4bit_bytes_are_read(checkpoints, tmp_path, monkeypatch, capsys):
    """First load: quantize into the cache, then read it. Second: only the cache's files are read (a quarter of the
    base's bytes, nothing quantized). A base changed since: rebuilt with a note, and the new weights are loaded."""
    from finetune.model.quantization import cache as quantized_cache
    from finetune.model.sources import files as checkpoint_files

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    base = shutil.copytree(checkpoints["base"], tmp_path / "base")
    recipe = _recipe(base, quantized_cache="auto")
    reads: list[tuple[Path, int]] = []
    read = checkpoint_files.TensorReader.get

    def counted(self, name):
        tensor = read(self, name)
        reads.append((self.index.files[name], tensor.numel() * tensor.element_size()))
        return tensor

    monkeypatch.setattr(checkpoint_files.TensorReader, "get", counted)
    expected = _load(_recipe(base))
    base_bytes = sum(size for _, size in reads)
    entry = quantized_cache.entry_folder(recipe, base)
    for attempt in range(2):
        reads.clear()
        held = _load(recipe)
        assert [k for k in held if not torch.equal(held[k], expected[k])] == []
        out = capsys.readouterr().out
        from_base = sum(size for path, size in reads if path.parent == base)
        from_cache = sum(size for path, size in reads if path.parent == entry)
        if attempt == 0:
            assert "quantizing" in out and from_base == base_bytes  # read once, to write the entry
        else:
            assert "quantizing" not in out and "the 4-bit cache of" in out
            assert from_base == 0 and 0 < from_cache < base_bytes / 3, (from_cache, base_bytes)
            # `finetune plan`'s read/rank counts a later start's reads of the entry (and the base's without the cache).
            assert _planned_read(recipe) == pytest.approx(from_cache, rel=0.05)
            assert _planned_read(_recipe(base)) == base_bytes
    reads.clear()
    _load(_recipe(checkpoints["transformers"]))  # transformers' own 4-bit checkpoint (uint8 storage): the same count
    assert _planned_read(_recipe(checkpoints["transformers"])) == pytest.approx(sum(size for _, size in reads), rel=0.05)
    # The base changes (retrained, re-downloaded): the entry is rebuilt, and the new weights are what is loaded.
    from safetensors.torch import load_file, save_file

    state = load_file(str(base / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"] * 2
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    held = _load(recipe)
    assert "the base changed since its quantized cache entry was written (model.safetensors" in capsys.readouterr().out
    assert [k for k in held if not torch.equal(held[k], expected[k])] != []
    changed = _load(_recipe(base))
    assert [k for k in held if not torch.equal(held[k], changed[k])] == []


def _planned_read(recipe) -> int:
    """The bytes `finetune plan` says one process reads at load (read/rank) for this recipe on one GPU."""
    from finetune.planner.facts import model_config_for
    from finetune.planner.fit import decide

    decision = decide(recipe, model_config_for(recipe), gpus_per_node=1, gpu_memory_bytes=24 * 1024**3)
    return decision.estimates[0].reads.rank_bytes


@pytest.mark.parametrize("problem", ["fp4", "double_quant", "blocksize", "truncated"])
def test_bad_4bit_checkpoints_are_refused_before_any_weight_is_read(checkpoints, tmp_path, problem):
    from bitsandbytes.utils import pack_dict_to_tensor, unpack_tensor_to_dict
    from safetensors.torch import load_file, save_file

    from finetune.errors import ModelLoadError

    folder = shutil.copytree(checkpoints["transformers"], tmp_path / "m")
    overrides, expected = {}, ""
    if problem == "fp4":
        overrides, expected = {"method": "fp4"}, "bnb_4bit_quant_type is nf4, the recipe's quantization.method is fp4"
    elif problem == "double_quant":
        overrides = {"double_quant": False}
        expected = "bnb_4bit_use_double_quant is true, the recipe's quantization.double_quant is false"
    elif problem == "blocksize":
        state = load_file(str(folder / "model.safetensors"))
        key = "model.layers.1.self_attn.o_proj.weight.quant_state.bitsandbytes__nf4"
        state[key] = pack_dict_to_tensor({**unpack_tensor_to_dict(state[key]), "blocksize": 128})
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        expected = "the quant states' blocksize is 64/128, finetune quantizes with 64"
    else:
        with open(folder / "model.safetensors", "r+b") as handle:
            handle.truncate((folder / "model.safetensors").stat().st_size - 1000)
        expected = "not a readable safetensors file"
    from finetune.recipe import Recipe

    recipe = Recipe.model_validate({"model": {"name_or_path": str(folder), "dtype": "bfloat16"},
                                    "quantization": overrides, "data": {"datasets": [{"path": "x.jsonl"}]}})
    with pytest.raises(ModelLoadError) as error:
        _load(recipe)
    assert expected in str(error.value)
    if problem != "truncated":
        assert "config.json" in str(error.value) and "Fix: set the recipe's quantization section" in str(error.value)


def test_a_settings_mismatch_exits_2_and_leaves_output_dir_alone(checkpoints, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(checkpoints["transformers"], data, out,
                                                           model={"dtype": "bfloat16"}, quantization={"method": "fp4"}))
    from finetune.cli.command import main
    from finetune.run import main as run_main

    assert main(["validate", str(recipe)]) == 2  # `finetune validate` refuses it too (config.json + quant states)
    assert "quantized with other settings than the recipe" in capsys.readouterr().err
    assert run_main([str(recipe)]) == 2  # run.py's entry point, in this process (no second start of the libraries)
    err = capsys.readouterr().err
    assert "is a 4-bit checkpoint quantized with other settings than the recipe" in err and "Traceback" not in err
    # one paragraph (beside the warning a CPU without native bf16 gets for the recipe's model.dtype: bfloat16)
    assert len([line for line in err.strip().splitlines()
                if not line.startswith(("[finetune] warning: model.dtype", "[finetune] model.attn_implementation"))]) == 1
    assert not out.exists()  # the run folder it created is removed again

    assert main(["quantize", str(checkpoints["base"]), str(checkpoints["quantized"])]) == 2
    assert "already exists and is not replaced" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_moe_models_cache_holds_4bit_experts_and_trains_as_a_cold_load(family, tiny_mixtral, tiny_gpt_oss, tmp_path,
                                                                         monkeypatch, capsys):
    """Mixture of experts through the quantized cache (the writer `finetune quantize` uses): Mixtral's per-expert
    tensors under the checkpoint's `block_sparse_moe.` names, gpt-oss's fused, transposed, interleaved experts with
    biases. The entry holds every expert projection as 4-bit codes + quant state under the model's per-expert names
    (before: the checkpoint's names, bf16, refused on reload), a cache hit loads bitwise what quantizing the bf16 base
    at load gives, and two training steps from each give the same losses."""
    from safetensors import safe_open

    from finetune.model import loading
    from finetune.model.quantization import cache as quantized_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    base = {"mixtral": tiny_mixtral, "gpt_oss": tiny_gpt_oss}[family]
    cold, cached = _recipe(base), _recipe(base, quantized_cache="auto")
    lora = {"r": 2, "alpha": 4, "target_modules": "all-linear", "dropout": 0.0}
    cold, cached = (r.model_copy(update={"lora": r.lora.model_copy(update=lora)}) for r in (cold, cached))
    expected = _load(cold)
    _load(cached)  # builds the entry
    assert "quantizing" in capsys.readouterr().out
    held = _load(cached)
    assert "the 4-bit cache of" in capsys.readouterr().out
    assert sorted(held) == sorted(expected) and [k for k in held if not torch.equal(held[k], expected[k])] == []
    entry = quantized_cache.entry_folder(cached, base)
    with safe_open(str(next(entry.glob("*.safetensors"))), "pt") as handle:
        keys = set(handle.keys())
    experts = [k for k in keys if ".experts.0." in k and k.endswith(".weight")]
    assert experts and all(f"{k}.absmax" in keys for k in experts), sorted(keys)[:8]

    def losses(recipe):
        model = loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                                   gradient_checkpointing=False).model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        batch, out = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0)), []
        for _ in range(2):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    assert losses(cached) == losses(cold)
