"""`finetune export` and `finetune generate` of a run folder from elsewhere (bug bash bb26, findings 6 and 7): a
`model.trust_remote_code: true` inherited from the run's recipe.yaml is said before any of that code runs, a base
config class transformers builds no causal LM from is one paragraph, and a merged export's weights follow the umask."""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune.cli import main

CUSTOM_CONFIG = '''
from transformers import LlamaConfig


class CustomConfig(LlamaConfig):  # a class of its own: AutoModelForCausalLM has no model registered for it
    model_type = "llama"
'''


def _run_folder(base: Path, run: Path, **model) -> Path:
    """A finished run's folder (adapter/ as training saves it, recipe.yaml) of LoRA on q_proj and v_proj of `base`."""
    from peft import LoraConfig, get_peft_model

    from finetune import outputs, parallel
    from finetune.model.classes import from_pretrained

    torch.manual_seed(0)
    peft_model = get_peft_model(from_pretrained(str(base), dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    key_map = outputs.adapter_key_map(peft_model)
    outputs.save_adapter(peft_model.peft_config["default"], key_map, parallel.trainable_state_dict(peft_model, key_map),
                         run / "adapter")
    data = write_jsonl(run / "data.jsonl", addition_rows(8))
    write_recipe(run / "recipe.yaml", recipe_dict(base, data, run, model=model))
    return run


@pytest.fixture
def remote_code_run(tiny_llama, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A run folder trained on tiny_llama whose recipe.yaml now names a copy of it with a configuration file of its
    own (auto_map) and model.trust_remote_code: true; transformers copies that file into a modules cache of the test."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    custom = tmp_path / "custom_model"
    shutil.copytree(tiny_llama, custom)
    (custom / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    config = (custom / "config.json").read_text()
    (custom / "config.json").write_text(config.replace("{", '{"auto_map": {"AutoConfig": '
                                                             '"configuration_custom.CustomConfig"},', 1))
    run = _run_folder(tiny_llama, tmp_path / "run")
    text = (run / "recipe.yaml").read_text().replace(str(tiny_llama), str(custom))
    (run / "recipe.yaml").write_text(text.replace("model:\n", "model:\n  trust_remote_code: true\n", 1))
    return run, custom


def test_an_inherited_trust_remote_code_is_said_and_an_unknown_config_class_is_one_paragraph(remote_code_run,
                                                                                              tmp_path, capsys):
    """Found by a bug bash (bb26): export and generate ran the model folder's Python because the run's recipe.yaml
    said trust_remote_code: true, without a word; and export then died with a ValueError traceback ("Unrecognized
    configuration class ... AutoModelForCausalLM") where generate gave a `finetune: error`."""
    run, custom = remote_code_run
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    said = capsys.readouterr()
    note = " ".join(said.out.split())
    assert f"{run / 'recipe.yaml'} sets model.trust_remote_code: true, so loading its base {custom} runs the Python " \
           "files of that model folder or hub repo here" in note
    error = " ".join(said.err.split())
    assert "transformers builds no causal language model from its config (Unrecognized configuration class" in error
    assert "Traceback" not in said.err and "finetune: error: base " in error and "Fix: pass --base" in error
    assert not (tmp_path / "out").exists()

    assert main(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert "sets model.trust_remote_code: true" in capsys.readouterr().out


def test_a_merged_exports_weights_follow_the_umask(tiny_llama, tmp_path):
    """Found by a bug bash (bb26): under umask 022 the merged model.safetensors (transformers' save_pretrained, through
    safetensors' save_file) was 0600 while config.json and the tokenizer beside it were 0644."""
    run = _run_folder(tiny_llama, tmp_path / "run")
    old = os.umask(0o022)
    try:
        assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "merged").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
