"""Found by a bug bash (bb30 #8): a base whose generation_config.json says `"eos_token_id": "two"` trained fine and
then crashed `finetune generate` (and any eval generation or GRPO rollout) with `TypeError: '<' not supported between
instances of 'str' and 'int'` in eos_token_ids; a cut-short generation_config.json was dropped without a word, and
with it an instruct model's extra stop ids. Now the bad value is ignored with a note naming the file, and the
unreadable file is said."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from finetune.training.objectives.grpo import rollouts


def _model(folder, eos) -> nn.Module:
    model = nn.Linear(2, 2)
    model.generation_config = SimpleNamespace(eos_token_id=eos)
    model.config = SimpleNamespace(_name_or_path=str(folder))
    return model


def test_a_wrongly_typed_eos_token_id_is_ignored_with_a_note(tmp_path, tokenizer, capsys):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
    ids = rollouts.eos_token_ids(_model(tmp_path, "two"), tokenizer)
    assert ids == rollouts.eos_token_ids(_model(tmp_path, None), tokenizer) and tokenizer.eos_token_id in ids
    said = capsys.readouterr().out
    assert f'{tmp_path / "generation_config.json"} says eos_token_id "two", which is not a token id: ignored' in said
    assert rollouts.eos_token_ids(_model(tmp_path, [tokenizer.eos_token_id, 7, "x"]), tokenizer)[-1] >= 7


def test_a_cut_short_generation_config_is_said(tmp_path, tokenizer, capsys):
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 12')
    rollouts.eos_token_ids(_model(tmp_path, None), tokenizer)
    rollouts.eos_token_ids(_model(tmp_path, None), tokenizer)
    said = capsys.readouterr().out
    assert said.count(f"{tmp_path / 'generation_config.json'} cannot be read (cut short or not JSON)") == 1, said
