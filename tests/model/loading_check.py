"""Run under torchrun (2 ranks): load one model with transformers' `from_pretrained` and with sharded loading, wrap both with
FSDP (version argv[2]), and write what each rank holds to argv[3]/rank{R}.json:

  * mismatches: local shards (packed 4-bit bytes, norms, embeddings, LoRA) and bitsandbytes quant states
    (absmax, nested absmax and code) that are not bitwise equal between the two loaders;
  * the tensor bytes alive on the rank (gc accounting of every storage, loading.alive_tensor_bytes) right after the
    per-rank loader returned, and at the worst moment of sharded loading (right after a unit was built, before
    FSDP sharded it), both minus what was alive before loading;
  * the bound those must respect: this rank's shard of the base + the largest unit in model.dtype + the quant
    state (whole on every rank) + the full LoRA tensors;
  * the checkpoint bytes the sharded loader read on this rank (counted by its TensorReader), the whole checkpoint's
    tensor bytes, the bound on what a rank reading only its FSDP2 shard may read (computed here from the shapes:
    its chunk's share of each 4-bit weight + up to two quantization blocks at each edge + its rows of every other
    parameter + the buffers), and the planner's figure for this rank.

Used by tests/model/test_loading.py; not a test module itself.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from finetune import distributed, parallel
from finetune.model import base as model_base
from finetune.model import loading
from finetune.model.lora.init import lora_checksum
from finetune.recipe import Recipe


def held_tensors(model) -> dict[str, torch.Tensor]:
    """Every local parameter shard (FSDP1: the flat parameters) and every quant-state tensor, by a stable name."""
    held = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        held[parallel.normalize_key(name)] = local.detach().reshape(-1).view(torch.uint8).clone()
    for name, module in model.named_modules():
        state = getattr(module, "quant_state", None)
        if state is None:
            continue
        parts = {"absmax": state.absmax, "code": state.code}
        if state.state2 is not None:
            parts.update(nested_absmax=state.state2.absmax, nested_code=state.state2.code, offset=state.offset)
        for part, tensor in parts.items():
            held[f"{parallel.normalize_key(name)}.quant_state.{part}"] = tensor.detach().reshape(-1).view(torch.uint8).clone()
    return held


def unit_bytes(skeleton, layer_class: str, dtype_bytes: int) -> int:
    """The largest unit (a decoder layer, or everything outside the layers) in model.dtype, before quantization."""
    layers = [m for m in skeleton.modules() if type(m).__name__ == layer_class]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}

    def size(named) -> int:
        return sum(p.numel() * dtype_bytes for name, p in named if ".lora_" not in name)

    largest_layer = max(size(layer.named_parameters()) for layer in layers)
    return max(largest_layer, size((n, p) for n, p in skeleton.named_parameters() if id(p) not in in_layers))


def read_bounds(skeleton, index, rank: int, world_size: int) -> dict[str, int]:
    """The whole checkpoint's bytes the skeleton uses, and what a rank reading only its FSDP2 shard may read."""
    whole = bound = 0
    for name, param in skeleton.named_parameters():
        if ".lora_" in name:
            continue
        key = loading.checkpoint_name(name)
        elem = stored_bytes(index, key)
        whole += param.numel() * elem
        if type(param).__name__ == "Params4bit":
            rows = param.numel() // 4  # bf16 storage: 4 values per element, FSDP2 chunks these rows
            size = -(-rows // world_size)
            share = max(0, min(rows, (rank + 1) * size) - rank * size) * 4
            bound += min(param.numel(), share + 2 * 2 * param.blocksize) * elem
        else:
            size = -(-param.shape[0] // world_size)
            share = max(0, min(param.shape[0], (rank + 1) * size) - rank * size)
            bound += share * (param.numel() // param.shape[0]) * elem
    for name, buffer in skeleton.named_buffers():
        if buffer.is_meta:  # persistent buffers are read whole
            bytes_ = buffer.numel() * stored_bytes(index, loading.checkpoint_name(name))
            whole, bound = whole + bytes_, bound + bytes_
    return {"whole_checkpoint": whole, "shard_bound": bound}


def stored_bytes(index, key: str) -> int:
    """Bytes per value of `key` as the checkpoint file stores it."""
    from safetensors import safe_open

    stored = index.views.get(key, (key,))[0]  # a renamed or fused tensor (MoE): its name in the files
    with safe_open(str(index.files[stored]), framework="pt") as handle:
        return {"F32": 4, "BF16": 2, "F16": 2}[handle.get_slice(stored).get_dtype()]


def planner_read_bytes(recipe, rank: int, world_size: int, *, own_shard: bool) -> int:
    from finetune.model import load_config
    from finetune.planner import facts_from_config
    from finetune.planner.reads import rank_read_bytes

    facts = facts_from_config(load_config(recipe), recipe)
    return rank_read_bytes(facts, rank=rank, world_size=world_size, own_shard=own_shard)


def main() -> None:
    model_dir, fsdp_version, out_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    info = distributed.init_distributed()
    recipe = Recipe.model_validate({
        "model": {"name_or_path": model_dir, "dtype": "bfloat16"},
        "lora": {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        "data": {"datasets": [{"path": "unused.jsonl", "format": "alpaca"}]},
        "train": {"gradient_checkpointing": False},
    })
    from finetune.model import load_config

    config = load_config(recipe)
    meta = parallel.meta_model(config)
    plan = parallel.ParallelPlan(strategy="fsdp", world_size=info.world_size, fsdp_version=fsdp_version,
                                 layer_class=parallel.decoder_layer_class(meta).__name__, param_dtype=torch.bfloat16,
                                 activation_checkpointing=False, sharded_loading=True)

    def load(sharded: bool):
        distributed.seed_everything(0)
        gc.collect()
        before = loading.alive_tensor_bytes()
        if sharded:
            loaded = loading.load_model(recipe, sharded=True, device=info.device, device_map=None,
                                        gradient_checkpointing=False, trace=True, shard=plan.own_shard(info.rank))
            bounds = read_bounds(loaded.model, loaded.builder.reader.index, info.rank, info.world_size)
        else:  # transformers' from_pretrained, the reference for every byte
            whole = model_base.build_model(recipe, device=info.device, gradient_checkpointing=False)
            checksum = lora_checksum(whole)  # before the wrap shards the LoRA tensors
            loaded = loading.LoadedModel(whole, None, lambda: checksum)
        after_load = loading.alive_tensor_bytes() - before
        lora_bytes = sum(p.numel() * 4 for n, p in loaded.model.named_parameters() if ".lora_" in n)
        largest_unit = unit_bytes(loaded.model, plan.layer_class, 2) if sharded else 0
        wrapped = parallel.wrap(loaded.model, plan, info, materialize=loaded.materialize)
        figures = {"after_load": after_load, "lora_bytes": lora_bytes, "largest_unit": largest_unit,
                   "checksum": loaded.lora_checksum(),
                   "held_after_wrap": loading.alive_tensor_bytes() - before, **parallel.local_parameter_bytes(wrapped)}
        if sharded:
            figures["peak_while_loading"] = loaded.builder.peak_alive_bytes - before
            figures["trace"] = [(name, alive - before) for name, alive in loaded.builder.trace_log]
            figures.update(bounds, bytes_read=loaded.builder.reader.bytes_read,
                           planner_bytes_read=planner_read_bytes(recipe, info.rank, info.world_size,
                                                                 own_shard=plan.own_shard(info.rank) is not None))
        return wrapped, figures

    old_model, old = load(sharded=False)
    old_held = held_tensors(old_model)
    quant_state = sum(t.numel() for k, t in old_held.items() if ".quant_state." in k)
    del old_model
    new_model, new = load(sharded=True)
    new_held = held_tensors(new_model)
    mismatches = sorted(k for k in old_held.keys() | new_held.keys()
                        if k not in old_held or k not in new_held or not torch.equal(old_held[k], new_held[k]))
    result = {"rank": info.rank, "compared": len(old_held), "mismatches": mismatches, "old": old, "new": new,
              "quant_state_bytes": quant_state,
              "bound": new["frozen_bytes"] + new["largest_unit"] + quant_state + new["lora_bytes"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result, indent=1))
    distributed.teardown()


if __name__ == "__main__":
    main()
