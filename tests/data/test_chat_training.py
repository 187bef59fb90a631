"""A base model (a tokenizer with no chat template) trains on chat rows with reasoning and several turns once the
recipe names a template (model.chat_template: chatml); the preview shows the trained spans; the adapter's tokenizer
carries the template it was trained with."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_metrics, recipe_dict, write_jsonl, write_recipe

from finetune import cli
from finetune.chat_templates import named_templates

ROWS = [{"messages": [
    {"role": "user", "content": f"Pick colour number {i}."},
    {"role": "assistant", "reasoning_content": f"Number {i} is {'even' if i % 2 == 0 else 'odd'}.", "content": "Teal."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "<think>\nA second pick.\n</think>\n\nSlate grey."}]} for i in range(24)]


@pytest.fixture
def base_model(tmp_path):
    """A tiny Qwen2 whose tokenizer has no chat template, as a base checkpoint ships."""
    from transformers import AutoTokenizer

    from finetune.cli.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "base", family="qwen2")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert not AutoTokenizer.from_pretrained(folder).chat_template
    return folder


@pytest.fixture
def no_launcher(monkeypatch, tmp_path):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


@pytest.mark.slow
def test_base_model_trains_chat_rows_with_a_named_template(base_model, tmp_path, capsys, no_launcher):
    rows = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    values = recipe_dict(base_model, rows, tmp_path / "run", train={"max_steps": 2, "micro_batch_size": 2},
                         data={"datasets": [{"path": str(rows), "format": "chat"}], "max_length": 128})
    recipe = write_recipe(tmp_path / "r.yaml", values)
    assert cli.main(["data", str(recipe), "--rows", "1"]) == 2  # no template: refused, naming the key that fixes it
    assert "model.chat_template (e.g. chatml" in capsys.readouterr().err

    assert cli.main(["data", str(recipe), "--rows", "2", "model.chat_template=chatml"]) == 0
    out = capsys.readouterr().out
    assert "[[<think>\nNumber 0 is even.\n</think>\n\nTeal.<|im_end|>]]" in out  # a reasoning turn's trained span
    assert "[[<think>\nA second pick.\n</think>\n\nSlate grey.<|im_end|>]]" in out
    assert "<|im_start|>assistant\n[[" in out and "[[Pick" not in out  # the header and the user turns: context

    assert cli.main(["train", str(recipe), "model.chat_template=chatml"]) == 0
    adapter = tmp_path / "run" / "adapter"
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(adapter).chat_template == named_templates()["chatml"]
    assert (adapter / "adapter_model.safetensors").is_file()


def test_the_template_and_the_reasoning_setting_are_part_of_the_cache_key(tmp_path):
    """Another template or data.reasoning is a miss, never a stale hit; the rendering code (chat.py,
    conversations.py) is part of every key, so entries of earlier code are misses too."""
    from finetune.cli.tiny import build_tokenizer
    from finetune.data import cache
    from finetune.data.sources import open_source
    from finetune.recipe import validate_recipe

    rows = write_jsonl(tmp_path / "chat.jsonl", ROWS)

    def key(template: str, **data_keys) -> str:
        recipe = validate_recipe({"model": {"name_or_path": "x"}, "data": {
            "datasets": [{"path": str(rows), "format": "chat"}], **data_keys}})
        tokenizer = build_tokenizer()
        tokenizer.chat_template = named_templates()[template]
        spec = recipe.data.datasets[0]
        return cache.cache_key(spec, open_source(spec), recipe, tokenizer)

    assert key("chatml") == key("chatml")
    assert len({key("chatml"), key("qwen3"), key("chatml", reasoning="drop"), key("chatml", reasoning="context")}) == 4
    assert {"chat.py", "conversations.py"} <= set(cache._RENDERING_CODE)


def family_model(folder, family: str):
    """A tiny Qwen2 with the family's tokenizer (its special tokens and shipped template), embeddings sized to it."""
    from chat_families import family_tokenizer
    from transformers import AutoModelForCausalLM

    from finetune.cli.tiny import build_tiny_model

    build_tiny_model(folder, family="qwen2")
    tokenizer = family_tokenizer(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-3.1", "qwen2.5", "qwen3", "qwen3.5", "gpt-oss", "deepseek-r1", "glm-4.5"])
def test_each_familys_template_trains_tool_reasoning_and_multi_turn_rows(family, tmp_path, no_launcher):
    """Two steps on the three row kinds under the template the family's models ship, in one process: DeepSeek-R1
    with its shipped template on plain turns and finetune's named copy on reasoning rows (its shipped one drops the
    trained turn's reasoning, and renders no tools: those rows are refused, tests/data/test_conversations.py)."""
    from chat_families import ROWS

    model = family_model(tmp_path / "model", family)
    kinds = ["multi_turn", "reasoning"] if family == "deepseek-r1" else list(ROWS)
    rows = write_jsonl(tmp_path / "rows.jsonl", [ROWS[kind] for kind in kinds] * 8)
    values = recipe_dict(model, rows, tmp_path / "run", train={"max_steps": 2, "micro_batch_size": 2},
                         data={"datasets": [{"path": str(rows), "format": "chat"}], "max_length": 1024,
                               "eval_fraction": 0.0})
    overrides = ["model.chat_template=deepseek-r1"] if family == "deepseek-r1" else []
    assert cli.main(["train", str(write_recipe(tmp_path / "r.yaml", values)), *overrides]) == 0
    logged = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert logged[-1]["step"] == 2 and all(math.isfinite(m["loss"]) for m in logged)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
