"""Fixtures of the data tests: the tiny tokenizer, and a tokenization cache of each test's own."""

from __future__ import annotations

import pytest

from finetune.cli.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
