"""model.dtype: auto: bf16 where the device computes it natively, fp32 elsewhere; one line says which and why.

A CPU of the other kind than this machine's is taken through FINETUNE_NATIVE_BF16 (the probe's override); a GPU is
simulated in the test process by patching torch.cuda's device queries (no CUDA here), which is all the choice reads.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from finetune import cli, precision
from finetune.recipe import load_recipe, validate_recipe

BASE = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "data.jsonl"}]}}


def _recipe(tmp_path, **model):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": {**BASE["model"], **model}}))
    return path


@pytest.fixture
def no_launcher(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("native,expected", [("1", "bfloat16"), ("0", "float32")])
def test_auto_follows_the_cpu_and_says_why_in_one_line(native, expected, tmp_path, monkeypatch, capsys, no_launcher):
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, native)
    recipe = load_recipe(_recipe(tmp_path))
    assert recipe.model.dtype == expected and recipe.compute_dtype == expected
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[finetune] dtype:")]
    assert lines == [f"[finetune] dtype: {expected} (model.dtype: auto; FINETUNE_NATIVE_BF16={native})"]


def test_the_real_cpu_probe_reads_the_flags_and_onednn():
    """Without the override the answer is the CPU's own: native only with AVX512-BF16/AMX and oneDNN's bf16 path."""
    native, reason = precision.native_bf16("cpu")
    flags = precision.cpu_bf16_flags()
    assert native == (bool(flags) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    assert ("AVX512-BF16" in reason or "AMX" in reason) if native else "neither AVX512-BF16 nor AMX" in reason


def test_an_explicit_bf16_without_native_bf16_warns_once_with_the_fix(tmp_path, monkeypatch, capsys, no_launcher):
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    recipe = load_recipe(_recipe(tmp_path, dtype="bfloat16"))
    assert recipe.model.dtype == "bfloat16"  # the user's word stands
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("[finetune] warning:")]
    assert len(warnings) == 1 and "without native bf16" in warnings[0] and "Fix: model.dtype=auto" in warnings[0]
    assert "[finetune] dtype:" not in err  # nothing was chosen: the recipe said it
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "1")
    load_recipe(_recipe(tmp_path, dtype="bfloat16"))
    assert "warning" not in capsys.readouterr().err


def test_a_config_that_says_bf16_decides_auto_and_fp16_stays_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    # accelerate launch's environment (the variable alone is a shell's, ignored: tests/cli/test_bb25_user_environment.py)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "False")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    recipe = load_recipe(_recipe(tmp_path))
    assert recipe.model.dtype == "bfloat16" and "mixed_precision: bf16" in recipe.dtype_choice.reason
    assert "remove mixed_precision from the config" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what accelerate writes for a config without the key
    assert load_recipe(_recipe(tmp_path)).model.dtype == "float32"
    with pytest.raises(Exception, match="float16 is not supported for training"):
        load_recipe(_recipe(tmp_path, dtype="float16"))


@pytest.mark.parametrize("capability,expected", [((8, 0), "bfloat16"), ((9, 0), "bfloat16"), ((7, 0), "float32"),
                                                 ((7, 5), "float32")])
def test_auto_on_a_gpu_follows_its_compute_capability(capability, expected, monkeypatch, no_launcher):
    """Simulated GPU: torch.cuda's queries patched (this machine has no CUDA); the CPU override must not matter."""
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0" if expected == "bfloat16" else "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Simulated GPU")
    monkeypatch.setenv("LOCAL_RANK", "1")
    recipe = validate_recipe(BASE)
    assert recipe.model.dtype == expected
    assert f"compute capability {capability[0]}.{capability[1]}" in recipe.dtype_choice.reason


def test_the_planner_resolves_auto_for_gpus_on_any_machine(tmp_path, monkeypatch, no_launcher):
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    assert load_recipe(_recipe(tmp_path), dtype_device="gpu").model.dtype == "bfloat16"
    assert load_recipe(_recipe(tmp_path)).model.dtype == "float32"


def test_the_run_folder_keeps_the_resolved_dtype(tiny_llama, tmp_path, monkeypatch, no_launcher):
    """A run with the default trains in the chosen dtype and its resolved recipe says so (export/generate reload it)."""
    from conftest import recipe_dict, write_recipe

    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"instruction": "say {i}", "output": "{i}"}}\n' for i in range(24)))
    values = recipe_dict(tiny_llama, data, tmp_path / "run", train={"max_steps": 1, "micro_batch_size": 2})
    del values["model"]["dtype"]
    assert cli.main(["train", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["model"]["dtype"] == "float32"


def test_ddp_yaml_takes_a_float32_recipe_as_shipped(tiny_llama, tmp_path, capsys, no_launcher):
    """The shipped DDP config no longer contradicts an fp32 recipe (it used to be refused in FSDP's words); a user's
    config that says bf16 is refused in DDP's words."""
    from conftest import REPO, recipe_dict, write_recipe

    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n' * 8)
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run"))
    shipped = REPO / "accelerate_configs" / "ddp.yaml"
    assert cli.main(["validate", str(recipe), "model.dtype=float32", "--accelerate-config", str(shipped)]) == 0
    stated = tmp_path / "ddp-bf16.yaml"
    stated.write_text(shipped.read_text() + "mixed_precision: bf16\n")
    capsys.readouterr()
    assert cli.main(["validate", str(recipe), "model.dtype=float32", "--accelerate-config", str(stated)]) == 2
    err = capsys.readouterr().err
    assert "under DDP finetune trains in model.dtype" in err and "FSDP" not in err, err


@pytest.mark.slow
def test_a_launched_run_says_the_dtype_once(tiny_llama, tmp_path, monkeypatch, capfd, no_launcher):
    """`finetune train --accelerate-config ddp`: the parent's pre-flight and rank 0 both validate the recipe; the
    line comes once (from rank 0), and on a CPU without native bf16 the shipped DDP config trains in fp32."""
    from conftest import REPO, recipe_dict, write_recipe
    from shipped import CPU_SWITCH

    for name, value in CPU_SWITCH.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")  # inherited by the launched ranks
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"instruction": "say {i}", "output": "{i}"}}\n' for i in range(24)))
    values = recipe_dict(tiny_llama, data, tmp_path / "run", train={"max_steps": 1, "micro_batch_size": 2})
    del values["model"]["dtype"]
    recipe = write_recipe(tmp_path / "r.yaml", values)
    code = cli.main(["train", str(recipe), "--accelerate-config", str(REPO / "accelerate_configs" / "ddp.yaml")])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    lines = [line for line in (out + err).splitlines() if line.startswith("[finetune] dtype:")]
    assert lines == ["[finetune] dtype: float32 (model.dtype: auto; FINETUNE_NATIVE_BF16=0)"], lines
    attention = [line for line in (out + err).splitlines() if line.startswith("[finetune] model.attn_implementation:")]
    assert len(attention) == 1, attention  # the attention line too (said by the parent as well, found in a bug bash)
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["model"]["dtype"] == "float32"
