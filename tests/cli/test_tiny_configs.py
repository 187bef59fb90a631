"""`finetune tiny-model`'s configs as transformers loads them without a word."""

from __future__ import annotations

import json

import pytest

from finetune.cli.tiny import build_tiny_model


@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_a_tiny_models_context_length_agrees_with_its_rope_stretch(tmp_path, family):
    """Found by a bug bash: a tiny gpt_oss stored max_position_embeddings 1,024 beside YaRN's factor 32 over 4,096
    original positions, and transformers warned "The explicitly set RoPE scaling factor ... does not match" on every
    train, data and generate on it. The context length is now original x factor where YaRN stretches it."""
    folder = build_tiny_model(tmp_path / family, family=family, hidden_size=32, num_layers=1)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        assert config["max_position_embeddings"] == rope["original_max_position_embeddings"] * rope["factor"]
    else:
        assert config["max_position_embeddings"] == 1024
