"""The packed 4-bit bytes under FSDP2 (finetune/parallel/byte_guard.py), on real 2-process FSDP2 runs.

CUDA's `torch._foreach_copy_` (FSDP2's all-gather copy) writes every bf16 NaN as one canonical pattern; the CPU keeps
the bits, so a CPU run cannot show the corruption by itself. These tests make the copy canonicalize NaNs the way CUDA
does, in the test's worker processes only (this file, run as the worker script, patches that one op), and check that
the guard notices it and trains on the intact bytes, and that a copy that breaks even uint8 bytes is refused.
"""

from __future__ import annotations

import sys

import pytest

if __name__ != "__main__":  # the worker processes (this file run as a script) need none of the suite's helpers
    from conftest import (
        REPO,
        addition_rows,
        child_env,
        free_port,
        recipe_dict,
        run_cmd,
        train_losses,
        write_jsonl,
        write_recipe,
    )

STEPS = ["train.max_steps=3", "train.micro_batch_size=2", "parallel.strategy=fsdp", "parallel.fsdp_version=2"]


@pytest.fixture(scope="module")
def recipe(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("byte-guard")
    data = write_jsonl(root / "train.jsonl", addition_rows(48))
    return write_recipe(root / "recipe.yaml", recipe_dict(tiny_llama, data, root / "unused", model={"dtype": "bfloat16"}))


def launch(recipe, out, mode: str):
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            __file__, mode, str(recipe), f"output.dir={out}", *STEPS]
    return run_cmd(args, env=child_env())


def test_the_checksum_is_the_position_weighted_byte_sum_exactly():
    """byte_guard.checksum (float64 dot products over a cached weight table) equals its definition computed in int64,
    sum(byte[i] * (i mod 65521 + 1)), for ranges that cross its steps; disjoint ranges add up; one changed byte shows."""
    import torch

    from finetune.parallel import byte_guard

    def definition(data, start, stop):
        values = data[start:stop].to(torch.int64)
        return int((values * (torch.arange(start, stop, dtype=torch.int64) % 65_521 + 1)).sum())

    data = torch.randint(0, 256, (3 * byte_guard._CHUNK + 12_345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data[: byte_guard._CHUNK] = 255  # the largest terms: exact all the same
    cut = byte_guard._CHUNK + 65_537
    for start, stop in [(0, data.numel()), (1, cut), (cut, data.numel() - 3), (5, 5)]:
        assert byte_guard.checksum(data, start, stop) == definition(data, start, stop), (start, stop)
    assert byte_guard.checksum(data, 0, cut) + byte_guard.checksum(data, cut) == byte_guard.checksum(data)
    changed = data.clone()
    changed[cut] ^= 1
    assert byte_guard.checksum(changed) != byte_guard.checksum(data)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_the_copy_probe_is_a_fixed_tensor_of_every_pattern_not_a_layers_bytes(dtype_name, monkeypatch):
    """The uint8 decision comes from a fixed tensor holding every NaN pattern of the storage dtype, so a first layer
    whose packed bytes hold no NaN cannot make it wrong (the old probe copied that layer's own bytes). CUDA's NaN
    canonicalization is simulated by patching the one op, torch._foreach_copy_ (this machine has no CUDA)."""
    import torch

    from finetune.parallel import byte_guard

    dtype = getattr(torch, dtype_name)
    patterns = byte_guard.bit_patterns(dtype, "cpu")
    assert torch.isnan(patterns).sum() >= (126 if dtype == torch.bfloat16 else 255)  # every NaN form is in it
    assert byte_guard.probe_copy(dtype, "cpu")  # the CPU copy keeps the bits
    original = torch._foreach_copy_

    def canonicalizing(dsts, srcs, *args, **kwargs):
        result = original(dsts, srcs, *args, **kwargs)
        for dst in dsts:
            if dst.is_floating_point():
                dst[torch.isnan(dst)] = float("nan")  # one canonical pattern, as CUDA writes them
        return result

    monkeypatch.setattr(torch, "_foreach_copy_", canonicalizing)
    assert not byte_guard.probe_copy(dtype, "cpu")
    assert byte_guard.probe_copy(torch.uint8, "cpu")  # integer storage has no NaN to rewrite


@pytest.mark.slow
def test_canonicalized_nans_are_caught_and_training_uses_the_intact_bytes(recipe, tmp_path):
    plain = launch(recipe, tmp_path / "plain", "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "rewrite NaN bit patterns" not in plain.stdout  # the CPU copy keeps the bits: bf16 storage as configured
    cuda_like = launch(recipe, tmp_path / "cuda-like", "canonicalize")
    assert cuda_like.returncode == 0, cuda_like.stderr[-3000:]
    assert "rewrite NaN bit patterns" in cuda_like.stdout and "all-gathered as uint8" in cuda_like.stdout
    assert "CANONICALIZED" in cuda_like.stdout  # the patch really rewrote NaNs (the probe's copy at least)
    assert train_losses(tmp_path / "cuda-like") == train_losses(tmp_path / "plain")  # the same bytes, bit for bit


@pytest.mark.slow
def test_a_copy_that_changes_any_bytes_is_refused(recipe, tmp_path):
    broken = launch(recipe, tmp_path / "broken", "break-bytes")
    assert broken.returncode != 0, broken.stderr[-3000:]  # each rank exits 2; torchrun reports 1
    assert "exitcode: 2" in broken.stderr and "FSDP2 changed the packed 4-bit bytes of decoder layer 0" in broken.stderr
    assert "[rank0]: Traceback" not in broken.stderr and not (tmp_path / "broken" / "adapter").exists()


@pytest.mark.slow
def test_below_torch_2_12_the_packed_bytes_travel_in_units_of_mixed_dtypes(recipe, tmp_path):
    """torch < 2.12, whose fully_shard refuses uint8 parameters (forced on a newer torch by raising
    byte_guard.UINT8_PARAMETERS_TORCH in the workers; real on the compat floor's 2.11), with the copy rewriting NaNs
    as CUDA's does (the patch above): the decoder layers are sharded with param_dtype None, so each is a unit of bf16
    bytes beside fp32 LoRA that FSDP2 gathers as uint8; the guard finds every byte intact and the losses are the
    plain run's, bit for bit. Before, FSDP2 + 4-bit on CUDA below 2.12 was refused (parallel/checks.py)."""
    plain = launch(recipe, tmp_path / "plain", "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    mixed = launch(recipe, tmp_path / "mixed", "canonicalize-below-2.12")
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    assert "all-gathered as uint8 under FSDP2, as uint8 views of units of mixed dtypes" in mixed.stdout, mixed.stdout
    assert "CANONICALIZED" in mixed.stdout  # the patch really rewrote NaNs (the probe's copy at least)
    assert train_losses(tmp_path / "mixed") == train_losses(tmp_path / "plain")
    single = run_cmd([sys.executable, str(REPO / "finetune" / "run.py"), str(recipe), f"output.dir={tmp_path / 'single'}",
                      "train.max_steps=3", "train.micro_batch_size=4"], env=child_env())  # 1 x 4 rows, the same batches
    assert single.returncode == 0, single.stderr[-3000:]
    # within bf16 rounding (tests/parallel/test_distributed.py's BF16_LOSS_TOLERANCE), and the curve really moves
    assert train_losses(tmp_path / "mixed") == pytest.approx(train_losses(tmp_path / "single"), abs=3e-3)


def test_the_route_of_the_packed_bytes_follows_the_copy_and_the_torch_version():
    """Where the copy keeps every bit pattern (CPUs) the storage dtype stays; where it rewrites NaNs (CUDA) they go as
    uint8 parameters from torch 2.12 on, else in units of mixed dtypes; such a unit needs its LoRA beside the bytes."""
    import torch
    from torch import nn

    from finetune.errors import LaunchError
    from finetune.parallel import byte_guard

    assert byte_guard.route(True, "2.11.0+cu130") == "storage" and byte_guard.route(True, "2.13.0") == "storage"
    assert byte_guard.route(False, "2.11.0+cu130") == "mixed" and byte_guard.route(False, "2.12.0") == "uint8"
    layer = nn.Module()
    layer.q_proj = nn.Module()
    layer.q_proj.weight = nn.Parameter(torch.zeros(8, 1, dtype=torch.bfloat16), requires_grad=False)
    layer.q_proj.weight.quant_state = object()  # what marks a bitsandbytes Params4bit
    with pytest.raises(LaunchError, match=r"decoder layer 3 holds 4-bit weights but no parameter of another dtype"):
        byte_guard.check_mixed_unit(layer, label="decoder layer 3")
    layer.lora_a = nn.Parameter(torch.zeros(2, 4))  # PEFT's fp32 LoRA: a unit of mixed dtypes
    byte_guard.check_mixed_unit(layer, label="decoder layer 3")


# ------------------------------------------------------------------------------------------- the worker processes
def _patch_copy(mode: str) -> None:
    """Make `torch._foreach_copy_` behave like CUDA's (`canonicalize`), or worse (`break-bytes`: every copy of a
    4-bit-sized buffer also changes one byte, whatever its dtype)."""
    import torch

    original = torch._foreach_copy_
    canonical = torch.tensor(float("nan"), dtype=torch.bfloat16)

    def copy(dsts, srcs, *args, **kwargs):
        result = original(dsts, srcs, *args, **kwargs)
        for dst in dsts:
            if dst.dtype == torch.bfloat16:
                nans = torch.isnan(dst)
                if nans.any():
                    dst[nans] = canonical
                    print("CANONICALIZED", flush=True)
            if mode == "break-bytes" and dst.numel() >= 64 and dst.dtype in (torch.bfloat16, torch.uint8):
                dst.view(torch.uint8).reshape(-1)[0] ^= 1
        return result

    torch._foreach_copy_ = copy


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if sys.argv[1] != "plain":
        _patch_copy(sys.argv[1])
    if sys.argv[1] == "canonicalize-below-2.12":  # the route of a torch whose fully_shard refuses uint8 parameters
        from finetune.parallel import byte_guard

        byte_guard.UINT8_PARAMETERS_TORCH = (99, 0)
    from finetune.run import main

    sys.exit(main(sys.argv[2:]))
