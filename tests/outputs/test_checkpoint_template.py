"""A checkpoint keeps the chat template it was trained with, and `finetune export RUN --step N` / `finetune generate RUN
--step N` give the adapter that template, not the recipe's template as it is when they run.

Found by a bug bash (bb36 #3): a run without a final adapter/ (stopped before its end, or a checkpoint copied
elsewhere) exported with `--step` re-read the recipe's model.chat_template (a .jinja file edited since, a named
template a finetune upgrade changed, or the base's own), and said nothing: the exported adapter's chat_template.jinja
was the edited file. Checkpoints held no template (manifest.json, recipe.yaml, rng, trainable, trainer_state.json).

In-process and fast: the checkpoint is written by `save_checkpoint` as the training loop calls it (no tokenizer
given: the template is read from the run's recipe), from the tiny llama's LoRA layout built on the CPU without weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import recipe_dict, write_recipe

from finetune.outputs import checkpoint
from finetune.outputs.checkpoint_adapter import meta_peft_model, write_checkpoint_adapter
from finetune.outputs.export_source import open_source
from finetune.outputs.trained_template import TEMPLATE_FILE
from finetune.recipe import load_recipe, recipe_to_yaml

TRAINED = "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
EDITED = "{{ 'EDITED LATER\\n' }}" + TRAINED


def lora_layout(recipe):
    """(the recipe's PeftModel on the CPU, its trainable parameters by name), with LoRA values but no base weights."""
    model = meta_peft_model(recipe).to_empty(device="cpu")
    trainable = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    with torch.no_grad():
        for parameter in trainable.values():
            parameter.fill_(0.5)  # allocated, not initialized: a checkpoint refuses NaN
    return model, trainable


def stopped_run(tmp_path: Path, base: Path, template: str | None = "tmpl.jinja") -> tuple[Path, Path]:
    """(run folder, its checkpoint of step 2): a run on `base` with model.chat_template `template` (a file of
    tmp_path, a named template, or None: the base's own), stopped after its checkpoint (no adapter/); the template
    file is then edited."""
    (tmp_path / "tmpl.jinja").write_text(TRAINED)
    model_keys = {} if template is None else {"chat_template": str(tmp_path / template) if template.endswith(
        ".jinja") else template}
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", recipe_dict(
        base, tmp_path / "rows.jsonl", tmp_path / "run", model=model_keys)))
    model, trainable = lora_layout(recipe)
    state = {"step": 2, "world_size": 1, "strategy": "single process", "losses": [], "eval_losses": []}
    saved = checkpoint.save_checkpoint(tmp_path / "run", 2, model, torch.optim.AdamW(list(trainable.values())),
                                       set(trainable), state, recipe_to_yaml(recipe), keep_last=2)  # as the loop calls it
    (tmp_path / "tmpl.jinja").write_text(EDITED)
    return tmp_path / "run", saved


def test_export_step_gives_the_adapter_the_template_trained_with(tmp_path, tiny_llama, capsys):
    """Before: the adapter's chat_template.jinja was the file as edited after the run (`EDITED LATER` first)."""
    run, saved = stopped_run(tmp_path, tiny_llama)
    write_checkpoint_adapter(saved, tmp_path / "exported")
    assert (tmp_path / "exported" / "chat_template.jinja").read_text() == TRAINED
    assert json.loads((saved / TEMPLATE_FILE).read_text()) == {"chat_template": TRAINED}
    assert TEMPLATE_FILE in json.loads((saved / "manifest.json").read_text())["files"]  # checked as every file is
    with open_source(run, step=2) as source:  # `finetune generate RUN --step 2` (and export) open it so
        from finetune.outputs.export import load_tokenizer_for

        assert load_tokenizer_for(source, None).chat_template == TRAINED
    assert "today's template" not in capsys.readouterr().out


def test_a_checkpoint_that_records_no_template_says_the_adapter_gets_todays(tmp_path, tiny_llama, capsys):
    """Before: the same fallback, in silence. A checkpoint of an earlier finetune (no chat_template.json) still gets the
    recipe's template as it is now, and a note says so, naming where it came from."""
    _, saved = stopped_run(tmp_path, tiny_llama)
    (saved / TEMPLATE_FILE).unlink(missing_ok=True)
    write_checkpoint_adapter(saved, tmp_path / "exported")
    assert (tmp_path / "exported" / "chat_template.jinja").read_text() == EDITED
    note = " ".join(capsys.readouterr().out.split())
    assert f"checkpoint {saved} records no chat template" in note
    assert f"model.chat_template `{tmp_path / 'tmpl.jinja'}` as it is now" in note


def test_a_named_template_changed_by_an_upgrade_is_kept_as_trained(tmp_path, tiny_llama, monkeypatch):
    """Before: a named template (model.chat_template: deepseek-r1) was read as the installed finetune ships it."""
    from finetune.chat_templates import resolve_chat_template

    _, saved = stopped_run(tmp_path, tiny_llama, template="deepseek-r1")
    monkeypatch.setattr("finetune.chat_templates.named_templates", lambda: {"deepseek-r1": EDITED})  # the upgrade
    assert resolve_chat_template("deepseek-r1") == EDITED
    write_checkpoint_adapter(saved, tmp_path / "exported")
    assert (tmp_path / "exported" / "chat_template.jinja").read_text() != EDITED
    assert json.loads((saved / TEMPLATE_FILE).read_text())["chat_template"] == \
        (tmp_path / "exported" / "chat_template.jinja").read_text()


def test_the_bases_own_template_revised_since_is_kept_as_trained(tmp_path, tiny_llama):
    """Before: the base's template was read as the base folder (or hub repo) has it now."""
    from transformers import AutoTokenizer

    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    trained = tokenizer.chat_template
    _, saved = stopped_run(tmp_path, base, template=None)
    tokenizer.chat_template = EDITED
    tokenizer.save_pretrained(base)  # the base's template revised after the run
    write_checkpoint_adapter(saved, tmp_path / "exported")
    assert trained and (tmp_path / "exported" / "chat_template.jinja").read_text() == trained


def test_the_tokenizer_the_run_loaded_is_recorded_when_given(tmp_path, tiny_llama):
    """save_checkpoint(tokenizer=...): the template of the tokenizer the run trained with, not read again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TRAINED
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, tmp_path / "r.jsonl", tmp_path)))
    model, trainable = lora_layout(recipe)
    saved = checkpoint.save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(list(trainable.values())), set(trainable),
                                       {"step": 1, "world_size": 1}, recipe_to_yaml(recipe), keep_last=1,
                                       tokenizer=tokenizer)
    assert json.loads((saved / TEMPLATE_FILE).read_text()) == {"chat_template": TRAINED}
