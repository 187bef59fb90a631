"""FSDP1 on real 2-process runs: the final adapter gather unshards only LoRA leaf units (never a decoder layer's, which
would put the whole base on every GPU after training); so do saving and loading a checkpoint (FSDP1's own sharded
state dict unshards and copies every unit, the whole base shard at each save); buffers keep their dtype after the
wrap (rotary `inv_freq` stays fp32; FSDP1 used to cast it to bf16). This file, run as the worker script, records it:
every flat parameter unsharded while gathering, saving or loading, by kind and bytes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

if __name__ != "__main__":
    from conftest import addition_rows, child_env, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe


@pytest.mark.slow
def test_fsdp1_gathers_lora_units_only_and_keeps_buffer_dtypes(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", model={"dtype": "bfloat16"},
                                                          lora={"dropout": 0.05},
                                                          train={"max_steps": 2, "save_every": 1}))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            __file__, str(recipe), "parallel.strategy=fsdp", "parallel.fsdp_version=1", "train.micro_batch_size=2"]
    result = run_cmd(args, env=child_env(REPORT_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensors of 1 MiB and more are mmapped" in result.stdout  # FSDP on CPU bounds glibc's heap (host_memory.py)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["full_state_dict_calls"] == 0, report
        assert report["summoned_lora_units"] == 28 and report["summoned_frozen_units"] == 0, report  # 7 targets x 2 x 2
        assert set(report["inv_freq"]) == {"torch.float32"}, report
        # 2 checkpoints, each reloaded at once. Each LoRA unit unsharded once per save, twice per load (DCP's template,
        # then the write-back); never a frozen unit.
        for phase, per_unit in (("save", 1), ("load", 2)):
            assert report[phase]["frozen_unshards"] == 0 and report[phase]["frozen_bytes"] == 0, (phase, report[phase])
            assert report[phase]["lora_unshards"] == 2 * per_unit * 28, (phase, report[phase])
            assert report[phase]["lora_bytes"] == 2 * per_unit * report["lora_full_bytes"], (phase, report[phase])
        assert report["reloaded_equal"] == [True, True], report  # LoRA zeroed after each save, the load restores it
        assert report["saved_model_keys"] and all(".lora_" in key for key in report["saved_model_keys"]), report


@pytest.mark.slow  # ~20 s: three 2-rank FSDP1 runs (accelerate_configs/fsdp1.yaml)
def test_fsdp1_with_a_tensor_of_fewer_rows_than_ranks_checkpoints_and_resumes_as_one_run(tiny_llama, tmp_path):
    """lora.r 1 under 2 FSDP1 ranks: rank 1 holds no shard of each [1, in] LoRA A (nor of a reward model's [1, hidden]
    head), so its state lacks those keys, and DCP's load fell back to pre-torch-2.4 keys that no checkpoint has: every
    such run died at its first checkpoint's read-back ("Missing key in checkpoint state_dict: optim.param_groups") and
    wrote no adapter. Now the run finishes, and 2 steps + a resume to 3 equal 3 steps in one run (the reference; a
    constant learning rate, so that the first run's max_steps 2 schedules the same rates)."""
    from conftest import accelerate_launch
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    adapters = {}
    for name, steps in (("whole", ("3",)), ("resumed", ("2", "3"))):
        recipe = write_recipe(tmp_path / f"{name}.yaml", recipe_dict(
            tiny_llama, data, tmp_path / name, lora={"r": 1, "alpha": 2, "dropout": 0.0},
            train={"micro_batch_size": 2, "save_every": 1, "resume": "auto", "lr_schedule": "constant"}))
        for max_steps in steps:
            result = accelerate_launch("fsdp1", recipe, f"train.max_steps={max_steps}")
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        adapters[name] = load_file(tmp_path / name / "adapter" / "adapter_model.safetensors")
    assert "resum" in result.stdout, result.stdout[-2000:]
    assert adapters["whole"].keys() == adapters["resumed"].keys() and adapters["whole"]
    for key, value in adapters["whole"].items():
        assert torch.equal(value, adapters["resumed"][key]), key


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch
    import torch.distributed.checkpoint.state_dict as dcp_state
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    import finetune.outputs.checkpoint as checkpoint_module
    import finetune.outputs.checkpoint_load as load_module
    import finetune.parallel.wrapping as wrap_module
    from finetune.run import main

    report = {"full_state_dict_calls": 0, "summoned_lora_units": 0, "summoned_frozen_units": 0, "inv_freq": [],
              "reloaded_equal": [], "lora_full_bytes": 0, "saved_model_keys": []}
    phase = [None]
    unshard = FlatParamHandle.unshard

    def counted_unshard(handle):
        if phase[0] is not None:
            kind = "lora" if handle.flat_param.requires_grad else "frozen"
            counts = report.setdefault(phase[0], {"lora_unshards": 0, "frozen_unshards": 0, "lora_bytes": 0,
                                                  "frozen_bytes": 0})
            counts[f"{kind}_unshards"] += 1
            counts[f"{kind}_bytes"] += handle.flat_param._unpadded_unsharded_size.numel() * handle.flat_param.element_size()
        return unshard(handle)

    save, load = checkpoint_module.save_checkpoint, load_module.load_checkpoint

    def save_then_reload(out_dir, step, model, optimizer, names, *args, **kwargs):
        phase[0] = "save"
        saved = save(out_dir, step, model, optimizer, names, *args, **kwargs)
        phase[0] = None
        flats = {id(m._flat_param): m._flat_param for m in model.modules() if getattr(m, "_flat_param", None) is not None}
        lora = [flat for flat in flats.values() if flat.requires_grad]  # the unit and its wrapped module share it
        report["lora_full_bytes"] = sum(f._unpadded_unsharded_size.numel() * f.element_size() for f in lora)
        before = [flat.detach().clone() for flat in lora]
        with torch.no_grad():
            for flat in lora:
                flat.zero_()
        phase[0] = "load"
        load(checkpoint_module.checkpoint_dir(out_dir, step), model, optimizer, names)
        phase[0] = None
        report["reloaded_equal"].append(all(torch.equal(a, b) for a, b in zip(before, lora, strict=True)))
        report["saved_model_keys"] = sorted(checkpoint_module.trainable_state(model, optimizer, names)["model"])
        return saved
    full_state_dict = dcp_state.get_model_state_dict

    def counted_state_dict(*args, **kwargs):
        report["full_state_dict_calls"] += 1
        return full_state_dict(*args, **kwargs)

    summon = FSDP.summon_full_params

    def counted_summon(module, *args, **kwargs):
        flat = getattr(module, "_flat_param", None)
        report["summoned_lora_units" if flat is not None and flat.requires_grad else "summoned_frozen_units"] += 1
        return summon(module, *args, **kwargs)

    wrap_fsdp1 = wrap_module._wrap_fsdp1

    def recording_wrap(*args, **kwargs):
        wrapped = wrap_fsdp1(*args, **kwargs)
        report["inv_freq"] = sorted({str(b.dtype) for n, b in wrapped.named_buffers() if n.endswith("inv_freq")})
        return wrapped

    FlatParamHandle.unshard = counted_unshard
    checkpoint_module.save_checkpoint = save_then_reload
    dcp_state.get_model_state_dict = counted_state_dict
    FSDP.summon_full_params = staticmethod(counted_summon)
    wrap_module._wrap_fsdp1 = recording_wrap
    code = main(sys.argv[1:] + [f"output.dir={os.environ['REPORT_DIR']}/run"])
    path = Path(os.environ["REPORT_DIR"]) / f"rank{os.environ['RANK']}.json"
    path.write_text(json.dumps(report))
    sys.exit(code)
