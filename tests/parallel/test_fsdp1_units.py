"""FSDP1 on real 2-process runs: the final adapter gather unshards only LoRA leaf units (never a decoder layer's, which
would put the whole base on every GPU after training), and buffers keep their dtype after the wrap (rotary
`inv_freq` stays fp32; FSDP1 used to cast it to bf16). This file, run as the worker script, records both."""

from __future__ import annotations

import json
import os
import sys

import pytest

if __name__ != "__main__":
    from conftest import addition_rows, child_env, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe


@pytest.mark.slow
def test_fsdp1_gathers_lora_units_only_and_keeps_buffer_dtypes(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", model={"dtype": "bfloat16"},
                                                          lora={"dropout": 0.05}, train={"max_steps": 2}))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            __file__, str(recipe), "parallel.strategy=fsdp", "parallel.fsdp_version=1", "train.micro_batch_size=2"]
    result = run_cmd(args, env=child_env(REPORT_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["full_state_dict_calls"] == 0, report
        assert report["summoned_lora_units"] == 28 and report["summoned_frozen_units"] == 0, report  # 7 targets x 2 x 2
        assert set(report["inv_freq"]) == {"torch.float32"}, report


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch.distributed.checkpoint.state_dict as dcp_state
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import finetune.parallel.wrapping as wrap_module
    from finetune.run import main

    report = {"full_state_dict_calls": 0, "summoned_lora_units": 0, "summoned_frozen_units": 0, "inv_freq": []}
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

    dcp_state.get_model_state_dict = counted_state_dict
    FSDP.summon_full_params = staticmethod(counted_summon)
    wrap_module._wrap_fsdp1 = recording_wrap
    code = main(sys.argv[1:] + [f"output.dir={os.environ['REPORT_DIR']}/run"])
    path = Path(os.environ["REPORT_DIR"]) / f"rank{os.environ['RANK']}.json"
    path.write_text(json.dumps(report))
    sys.exit(code)
