"""A kept checkpoint exported or generated from without resuming (`finetune export RUN OUT --step N`, a checkpoint
folder given directly), `finetune checkpoints RUN`, train.keep_best, and the run's summary naming the best step.

The adapter exported from a checkpoint is compared with what other code read from the same run: torch's own DCP
converter (`dcp_to_torch_save`) for any step, and the adapter/ that training gathered from the live model for the last
step (single process here; FSDP2, FSDP1 and DDP with two real processes below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    addition_rows,
    read_metrics,
    recipe_dict,
    run_cmd,
    write_jsonl,
    write_recipe,
)

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.outputs import checkpoint, step_folders

MAX_STEPS, EVERY = 6, 2
# lr 3e-2 on the tiny llama: the eval loss falls to step 4 and rises at step 6 (seeded, deterministic on CPU), so
# keep_last 1 alone would delete the best checkpoint.
TRAIN = {"max_steps": MAX_STEPS, "save_every": EVERY, "eval_every": EVERY, "keep_last": 1, "keep_best": True,
         "learning_rate": 3e-2, "log_every": 1}


@pytest.fixture(scope="module")
def stepped_run(tiny_llama, tmp_path_factory) -> tuple[Path, str]:
    """(run folder, training stdout) of a finished 6-step run that saved and evaluated every 2 steps, keep_best."""
    root = tmp_path_factory.mktemp("export-step")
    data = write_jsonl(root / "data.jsonl", addition_rows())
    recipe = write_recipe(root / "recipe.yaml", recipe_dict(tiny_llama, data, root / "run", train=TRAIN))
    result = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run", result.stdout


def eval_losses_from_metrics(run: Path) -> dict[int, float]:
    """The eval losses as the tracker logged them (metrics.jsonl), not as the checkpoints hold them."""
    return {m["step"]: m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m}


def torch_converted(checkpoint_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's LoRA tensors by torch's own DCP converter, under PEFT's file keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{checkpoint_dir.name}.pt"
    dcp_to_torch_save(checkpoint_dir / "trainable", target)
    model = torch.load(target, weights_only=False)["model"]
    return {key.replace(".default.", "."): value for key, value in model.items()}


def exported(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def assert_equal_tensors(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and len(got) > 0
    differ = [key for key in got if not torch.equal(got[key], expected[key])]
    assert differ == [], f"{len(differ)} tensors differ, e.g. {differ[:1]}"


# ------------------------------------------------------------------------------------------------ keep_best
@pytest.mark.slow  # stepped_run launches `finetune train`
def test_keep_best_keeps_the_lowest_eval_loss_and_the_summary_names_it(stepped_run):
    run, stdout = stepped_run
    evals = eval_losses_from_metrics(run)
    best = min(evals, key=evals.get)
    assert sorted(evals) == [2, 4, 6] and best != MAX_STEPS, f"the run's eval losses changed shape: {evals}"
    kept = [step for step, _ in step_folders.list_checkpoints(run)]
    assert kept == sorted({best, MAX_STEPS})  # keep_last 1 keeps the last; keep_best also the best
    assert f'"best_eval_step": {best}' in stdout  # the done: line is JSON
    assert f"best eval loss {evals[best]:.4f} at step {best}" in stdout and f"--step {best}` exports it" in stdout


def test_rotation_never_removes_the_best_checkpoint(tmp_path):
    for step in (2, 4, 6, 8, 10):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    evals = [(2, 3.0), (4, 1.5), (6, 2.0), (8, 2.5), (10, 2.2)]
    checkpoint.prune_checkpoints(tmp_path, keep_last=2, newest=10, eval_losses=evals)
    assert [step for step, _ in step_folders.list_checkpoints(tmp_path)] == [4, 8, 10]
    checkpoint.prune_checkpoints(tmp_path, keep_last=2, newest=10)  # keep_best off: the best goes too
    assert [step for step, _ in step_folders.list_checkpoints(tmp_path)] == [8, 10]


@pytest.mark.parametrize("train, data, words", [
    ({"eval_every": 3, "save_every": 10}, {}, "save_every (10)"),
    ({"eval_every": 0, "save_every": 10}, {}, "eval_every (0)"),
    ({"eval_every": 5, "save_every": 10}, {"eval_fraction": 0.0}, "no eval data"),
])
def test_keep_best_without_an_eval_at_every_checkpoint_is_refused(tmp_path, alpaca_file, train, data, words):
    from finetune.recipe import load_recipe

    values = recipe_dict(tmp_path / "model", alpaca_file, tmp_path / "run", train={"keep_best": True, **train}, data=data)
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path / "r.yaml", values))
    assert "train.keep_best" in str(err.value) and words in str(err.value) and "Fix:" in str(err.value)


# ------------------------------------------------------------------------------------------------ export --step
@pytest.mark.slow  # stepped_run launches `finetune train`
def test_export_step_loads_in_plain_peft_and_holds_the_checkpoints_weights(stepped_run, tiny_llama, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, _ = stepped_run
    evals = eval_losses_from_metrics(run)
    best = min(evals, key=evals.get)
    out = tmp_path / "best"
    assert main(["export", str(run), str(out), "--step", str(best)]) == 0
    printed = capsys.readouterr().out
    assert "verify: adapter read back bit-identical" in printed and "PEFT (PeftModel.from_pretrained): VALID" in printed
    tensors = exported(out)
    assert_equal_tensors(tensors, torch_converted(step_folders.list_checkpoints(run)[0][1], tmp_path))
    final = exported(run / "adapter")
    assert any(not torch.equal(tensors[key], final[key]) for key in final), "step 4 must not be the final adapter"
    assert (out / "tokenizer.json").exists()

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        reference = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, str(out))  # plain PEFT, no finetune code
        loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
        assert_equal_tensors(loaded, tensors)
        assert (model(input_ids=ids).logits - reference).abs().max() > 1e-4


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_the_last_checkpoint_exports_the_runs_own_adapter(stepped_run, tmp_path):
    """--step of the last step, and that checkpoint's folder given directly: bit-identical to adapter/ (gathered from
    the live model by training), with the adapter_config.json an export of the run writes."""
    run, _ = stepped_run
    by_step, by_folder, by_run = tmp_path / "step", tmp_path / "folder", tmp_path / "run"
    last = step_folders.list_checkpoints(run)[-1][1]
    assert main(["export", str(run), str(by_step), "--step", str(MAX_STEPS)]) == 0
    assert main(["export", str(last), str(by_folder)]) == 0
    assert main(["export", str(run), str(by_run)]) == 0
    for folder in (by_step, by_folder):
        assert_equal_tensors(exported(folder), exported(run / "adapter"))
        assert adapter_config(folder) == adapter_config(by_run)


def adapter_config(folder: Path) -> dict:
    config = json.loads((folder / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}  # PEFT writes a set: any order


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_a_step_that_is_not_kept_lists_the_kept_steps(stepped_run, tmp_path, capsys):
    run, _ = stepped_run
    kept = [step for step, _ in step_folders.list_checkpoints(run)]
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("finetune: error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "no checkpoint of step 3 is kept" in err and "--step" in err
    assert all(f"step {step} (eval loss " in err for step in kept), err
    assert not out.exists()


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_step_on_an_adapter_folder_or_another_checkpoint_is_refused(stepped_run, tmp_path, capsys):
    run, _ = stepped_run
    assert main(["export", str(run / "adapter"), str(tmp_path / "a"), "--step", "4"]) == 2
    assert "is not a run folder" in capsys.readouterr().err
    last = step_folders.list_checkpoints(run)[-1][1]
    assert main(["export", str(last), str(tmp_path / "b"), "--step", "4"]) == 2
    assert f"checkpoint of step {MAX_STEPS}, and --step says 4" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_a_damaged_checkpoint_is_refused(stepped_run, tmp_path, capsys):
    import shutil

    run, _ = stepped_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _, first = step_folders.list_checkpoints(copy)[0]
    shard = next((first / "trainable").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    assert main(["export", str(copy), str(tmp_path / "out"), "--step", first.name.split("-")[1].lstrip("0")]) == 2
    err = capsys.readouterr().err
    assert "cannot be used" in err and "truncated" in err and not (tmp_path / "out").exists()


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_a_deepspeed_checkpoint_is_refused_with_the_way_out(stepped_run, tmp_path, capsys):
    """DeepSpeed writes its own format (deepspeed/ instead of trainable/): refused in one paragraph."""
    import shutil

    run, _ = stepped_run
    folder = tmp_path / "run" / "checkpoints" / "step-00000006"
    shutil.copytree(step_folders.list_checkpoints(run)[-1][1], folder)
    (folder / "trainable").rename(folder / "deepspeed")
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "strategy": "DeepSpeed ZeRO-3 over 2 processes"}))
    checkpoint._write_manifest(folder, 6, state)
    assert main(["export", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeed ZeRO-3" in err and "holds no trainable/" in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_checkpoints_lists_each_kept_step_with_its_eval_loss(stepped_run, capsys):
    run, _ = stepped_run
    evals = eval_losses_from_metrics(run)
    best = min(evals, key=evals.get)
    assert main(["checkpoints", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:] if line.split() and line.split()[0].isdigit()}
    assert sorted(int(step) for step in rows) == [step for step, _ in step_folders.list_checkpoints(run)]
    for step, line in rows.items():
        assert f"{evals[int(step)]:.4f}" in line and "intact" in line
        assert (line.split()[1] == "best") == (int(step) == best)


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_generate_from_a_step(stepped_run, capsys):
    run, _ = stepped_run
    assert main(["generate", str(run), "--step", str(MAX_STEPS), "--prompt", "Add the two numbers.",
                 "--max-new-tokens", "3"]) == 0
    assert f"base + adapter {step_folders.list_checkpoints(run)[-1][1]}" in capsys.readouterr().out


# -------------------------------------------------------------------------------------- sharded checkpoints
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1", "ddp"])
def test_export_step_of_a_two_process_run(strategy, checkpointed_run, tmp_path):
    """Every rank wrote its shard (FSDP) or the same whole tensors (DDP): the export reads them whole in one process,
    equal to the adapter training gathered at the last step and to torch's converter at an earlier one. The runs are
    the session's checkpointed runs (tests/conftest.py: 12 steps, saved every 3, the last 2 kept), also the references
    of tests/outputs/test_checkpoint.py; exported from a copy."""
    import shutil

    from conftest import CHECKPOINT_STEPS

    run = tmp_path / "run"
    shutil.copytree(checkpointed_run(strategy), run)
    (first_step, first), (last_step, _) = step_folders.list_checkpoints(run)  # steps 9 and 12
    assert last_step == CHECKPOINT_STEPS > first_step
    if strategy.startswith("fsdp"):
        assert len(list((first / "trainable").glob("*.distcp"))) == 2  # one shard file per rank
    assert main(["export", str(run), str(tmp_path / "last"), "--step", str(CHECKPOINT_STEPS)]) == 0
    assert_equal_tensors(exported(tmp_path / "last"), exported(run / "adapter"))
    assert main(["export", str(first), str(tmp_path / "first")]) == 0
    assert_equal_tensors(exported(tmp_path / "first"), torch_converted(first, tmp_path))


@pytest.mark.slow  # stepped_run launches `finetune train`
def test_export_step_builds_the_checkpoints_adapter_on_the_base_given(stepped_run, tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: after the base folder moved, `export RUN OUT --step N --base NEW` ignored --base (the
    checkpoint's recipe.yaml named the old folder, and editing it damages the checkpoint: its manifest checks it), so
    no kept step could be exported. --base is now the checkpoint's base too."""
    import shutil

    from finetune.outputs import checkpoint_adapter

    moved = shutil.copytree(tiny_llama, tmp_path / "moved-base")
    seen = []
    real = checkpoint_adapter.meta_peft_model
    monkeypatch.setattr(checkpoint_adapter, "meta_peft_model",
                        lambda recipe: seen.append(recipe.model.name_or_path) or real(recipe))
    run, _ = stepped_run
    step = step_folders.list_checkpoints(run)[0][0]
    assert main(["export", str(run), str(tmp_path / "out"), "--step", str(step), "--base", str(moved)]) == 0
    assert seen == [str(moved)], seen
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(moved)
