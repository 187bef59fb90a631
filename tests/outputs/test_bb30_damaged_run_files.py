"""Found by a bug bash (bb30: reading damaged files): a finished run folder whose adapter files were cut short, emptied
or hand-edited, and checkpoint manifests with fields of the wrong type, met `finetune generate`, `export` and
`checkpoints` as tracebacks or wrong diagnoses. Each is now one paragraph naming the file and the way out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import recipe_dict

from finetune.cli import main
from finetune.errors import CheckpointError
from finetune.outputs import checkpoint, step_folders
from finetune.outputs.export import (
    ExportError,
    clean_adapter_tensors,
    export_adapter,
    load_tokenizer_for,
    resolve_source,
)

CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
          "base_model_name_or_path": "unused-base", "task_type": "CAUSAL_LM", "bias": "none"}


def _finished_run(root: Path, *, steps: tuple[int, ...] = (3, 6)) -> Path:
    """A run folder as a finished run leaves it, as far as these readers look: adapter/ (config + weights) and the
    kept checkpoint folders."""
    from safetensors.torch import save_file

    adapter = root / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight": torch.ones(8, 64) for i in range(4)},
              str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    for step in steps:
        (root / "run" / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    return root / "run"


def _refusal(run: Path, capsys) -> str:
    """`finetune generate RUN` (exit 2, one paragraph) and resolve_source's ExportError: the same paragraph."""
    assert main(["generate", str(run), "--prompt", "1 and 2"]) == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said and said.startswith("finetune: error: ")
    with pytest.raises(ExportError) as caught:
        resolve_source(run)
    return str(caught.value)


def test_a_truncated_adapter_weights_file_is_named_with_the_way_out(tmp_path):
    """Found by a bug bash (bb30 #3): adapter_model.safetensors cut short was `SafetensorError: Error while
    deserializing header: incomplete metadata, file not fully covered` in generate and export (both read the weights
    through clean_adapter_tensors)."""
    run = _finished_run(tmp_path)
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    with pytest.raises(ExportError) as caught:
        clean_adapter_tensors(resolve_source(run).adapter_dir)
    said = str(caught.value)
    assert "adapter_model.safetensors is not a readable safetensors file (incomplete metadata" in said, said
    assert "--step 6" in said and "train.resume=auto" in said and "did not finish" not in said, said


@pytest.mark.parametrize("damage, expected", [
    (lambda text: text[:120], "adapter_config.json is unreadable (Unterminated string"),
    (lambda text: "", "adapter_config.json is empty"),
    (lambda text: json.dumps({**CONFIG, "r": "eight"}), 'adapter_config.json says r: "eight", where PEFT needs a whole'),
    (lambda text: json.dumps({**CONFIG, "lora_alpha": None}), "adapter_config.json says lora_alpha: null"),
], ids=["truncated", "empty", "r text", "alpha null"])
def test_a_damaged_adapter_config_is_named_with_the_way_out(tmp_path, capsys, damage, expected):
    """Found by a bug bash (bb30 #4): a truncated adapter_config.json was a JSONDecodeError traceback in generate and
    export, `"r": "eight"` a TypeError inside PEFT (`'<=' not supported between instances of 'str' and 'int'`)."""
    run = _finished_run(tmp_path)
    config = run / "adapter" / "adapter_config.json"
    config.write_text(damage(config.read_text()))
    said = _refusal(run, capsys)
    assert expected in said and "--step 6" in said, said


@pytest.mark.parametrize("damage", ["empty", "missing"])
def test_a_finished_run_with_empty_or_missing_weights_is_not_said_to_be_unfinished(tmp_path, capsys, damage):
    """Found by a bug bash (bb30 #10): a finished run whose adapter_model.safetensors was emptied (0 bytes) or removed
    was "holds no adapter (looked for adapter_config.json and adapter_model.safetensors ...). The run did not finish or
    saved nothing", naming a file that was there."""
    run = _finished_run(tmp_path)
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(b"") if damage == "empty" else weights.unlink()
    said = _refusal(run, capsys)
    assert "did not finish" not in said and "holds no adapter" not in said, said
    assert f"adapter_model.safetensors is {damage}" in said and "after the run finished" in said, said
    assert "--step 6" in said and "train.resume=auto" in said, said


def test_a_cut_short_adapter_tokenizer_is_named_and_never_exported(tmp_path, tokenizer):
    """Found by a bug bash (bb30 #5): adapter/tokenizer.json cut short was a UnicodeDecodeError traceback in generate
    and export --merge, and `finetune export` copied it and said VALID for every runtime."""
    run = _finished_run(tmp_path)
    tokenizer.save_pretrained(run / "adapter")
    saved = run / "adapter" / "tokenizer.json"
    saved.write_bytes(saved.read_bytes()[:5000])
    source = resolve_source(run)
    with pytest.raises(ExportError, match=r"adapter: tokenizer.json is cut short or not JSON \('utf-8' codec") as caught:
        load_tokenizer_for(source, None)  # generate's tokenizer, and export --merge's
    assert "copy the tokenizer files of the base" in str(caught.value)
    with pytest.raises(ExportError, match="tokenizer.json is cut short"):
        export_adapter(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_cut_short_run_recipe_is_replaced_by_its_checkpoints_copy(tmp_path, capsys):
    """Found by a bug bash (bb30 #11): with the run's recipe.yaml cut short, generate rendered prompts with the chat
    template instead of the run's alpaca template, although every checkpoint held an intact copy of the recipe."""
    run = _finished_run(tmp_path)
    text = yaml.safe_dump(recipe_dict(tmp_path / "base", tmp_path / "train.jsonl", run))
    for step in (3, 6):
        (run / "checkpoints" / f"step-{step:08d}" / "recipe.yaml").write_text(text)
    (run / "recipe.yaml").write_text(text[:150])
    source = resolve_source(run)
    said = capsys.readouterr().out
    assert source.recipe is not None and source.recipe.data.datasets[0].format == "alpaca"
    assert f"{run / 'recipe.yaml'} is not a valid recipe" in said and "its checkpoint of step 6" in said, said


def _saved(run: Path, step: int) -> Path:
    model = torch.nn.Linear(4, 3)
    return checkpoint.save_checkpoint(run, step, model, torch.optim.AdamW(model.parameters()),
                                      {name for name, _ in model.named_parameters()},
                                      {"step": step, "world_size": 1, "strategy": "single"}, "a: 1\n", keep_last=5)


@pytest.mark.parametrize("edit, said", [
    (lambda m: m.update(files="x"), 'manifest.json is unreadable (files is "x", not a table of files)'),
    (lambda m: m.update(step="2"), 'manifest.json is unreadable (step is "2", not a whole number)'),
    (lambda m: m["files"]["trainer_state.json"].update(bytes=str(m["files"]["trainer_state.json"]["bytes"])),
     "manifest.json is unreadable (trainer_state.json's bytes is \""),
], ids=["files text", "step text", "bytes text"])
def test_a_hand_edited_manifest_is_unreadable_not_a_traceback(tmp_path, capsys, edit, said):
    """Found by a bug bash (bb30 #9): `"files": "x"` was an AttributeError in `checkpoints`, `export --step` and resume
    (so not even the intact step could be listed); `"step": "6"` passed as intact and crashed the resume later; and
    `"bytes": "690"` read "trainer_state.json has 690 bytes, the manifest says 690"."""
    run = tmp_path / "run"
    _saved(run, 1)
    damaged = _saved(run, 2)
    manifest = json.loads((damaged / "manifest.json").read_text())
    edit(manifest)
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert said in step_folders.checkpoint_problem(damaged)
    table = step_folders.checkpoints_table(run)
    assert re.search(r"^1 +- +- +intact ", table, re.MULTILINE) and f"damaged: {said}" in table, table
    assert step_folders.newest_good_checkpoint(run).name == "step-00000001"
    assert "has 690 bytes, the manifest says 690" not in table
    with pytest.raises(CheckpointError, match="cannot be used: manifest.json is unreadable"):
        step_folders.step_checkpoint(run, 2)  # export --step / generate --step
