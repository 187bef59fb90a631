"""A run's kept start adapter (start-adapter/, kept.json) matched by its content, not by the path model.adapter names
(finetune/model/lora/kept.py; bb46 finding 2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from conftest import recipe_dict

from finetune.model import base as model_stage
from finetune.model.lora import kept
from finetune.model.lora.attach import adapter_start
from finetune.outputs import begin_outputs
from finetune.outputs.run_folder import saved_recipe
from finetune.recipe import recipe_to_yaml, validate_recipe

_Q_B = "model.layers.0.self_attn.q_proj.lora_B.weight"


def _adapter(model_dir: Path, folder: Path, *, seed: int) -> torch.Tensor:
    """A PEFT adapter of `model_dir` saved in `folder` (B off zero by `seed`), as an SFT run leaves one; its q_proj B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(peft_model.named_parameters()):
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(folder)
    return peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.detach().clone()


def _recipe(model_dir: Path, adapter: Path, out_dir: Path, **train):
    values = recipe_dict(model_dir, out_dir.parent / "unused.jsonl", out_dir, model={"adapter": str(adapter)},
                         quantization={"method": "none"}, train=train)
    values["lora"] = {"dropout": 0.0}
    return validate_recipe(values)


def _starts_from(recipe) -> torch.Tensor:
    model_stage.load_config(recipe)
    return adapter_start(recipe)[_Q_B]


def test_a_resume_naming_the_adapters_new_place_keeps_using_the_kept_copy_after_it_moves_again(tiny_llama, tmp_path,
                                                                                               capsys):
    """Found by a bug bash: a DPO run kept its SFT start adapter (start-adapter/, kept.json naming run/adapter). The
    SFT folder moved; the user resumed the DPO run in place naming the new place (sft-moved/adapter: recipe.yaml now
    names it), and the copy was matched by kept.json's path only, so it stopped being used: once the SFT folder moved
    again, export, generate and resume of the DPO run failed ("not a PEFT adapter folder") with start-adapter/ holding
    the right files. Now the run's copy is used whatever model.adapter names; byte-identical files at another path are
    the same start adapter (nothing said, and `same_start_adapter` tells resume_checks so); another adapter named or
    the folder gone: the copy, with a note."""
    sft, dpo = tmp_path / "run" / "adapter", tmp_path / "dpo"
    started = _adapter(tiny_llama, sft, seed=1)
    recipe = _recipe(tiny_llama, sft, dpo)
    model_stage.load_config(recipe)
    dpo.mkdir()
    begin_outputs(dpo, recipe_to_yaml(recipe), None)  # the DPO run starts: start-adapter/ kept, naming run/adapter
    kept._CHECKED.clear()

    shutil.move(tmp_path / "run", tmp_path / "sft-moved")
    moved = tmp_path / "sft-moved" / "adapter"
    capsys.readouterr()
    resumed = _recipe(tiny_llama, moved, dpo, resume="auto")  # the resume naming the new place (the same bytes)
    assert kept.start_folder(resumed) == dpo / kept.KEPT and kept.same_start_adapter(resumed)
    assert torch.equal(_starts_from(resumed), started) and "note" not in capsys.readouterr().out
    (dpo / "recipe.yaml").write_text(recipe_to_yaml(resumed), encoding="utf-8")  # as the resume rewrites it

    shutil.move(tmp_path / "sft-moved", tmp_path / "sft-moved-again")  # ...and the SFT folder moves again
    finished = saved_recipe(dpo / "recipe.yaml")  # what export and generate of the DPO run read
    assert kept.start_folder(finished) == (dpo / kept.KEPT).resolve() and torch.equal(_starts_from(finished), started)
    kept._CHECKED.clear()  # (hashed, and said, once per process: each command is one)
    again = _recipe(tiny_llama, moved, dpo, resume="auto")  # a resume of it
    assert torch.equal(_starts_from(again), started)
    assert f"model.adapter ({moved}) is gone; the run continues from the copy it kept" in capsys.readouterr().out

    other = tmp_path / "other" / "adapter"  # another adapter named: the run's own start adapter still, said
    assert not torch.equal(_adapter(tiny_llama, other, seed=2), started)
    kept._CHECKED.clear()
    kept._SAID.clear()
    assert torch.equal(_starts_from(_recipe(tiny_llama, other, dpo, resume="auto")), started)
    assert f"model.adapter ({other}) is not the adapter this run started from ({sft})" in capsys.readouterr().out
    assert kept.start_folder(_recipe(tiny_llama, other, tmp_path / "new")) == other  # a new run: the folder named
