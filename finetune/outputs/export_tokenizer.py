"""The tokenizer an export or `finetune generate` uses: the one saved beside the adapter (checked: a damaged file is
named, never copied into an export that says VALID), else the run's recipe's, else the base's.
"""

from __future__ import annotations

from pathlib import Path

from finetune.outputs.export_source import ExportError, Source

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def load_tokenizer_for(source: Source, base: str | None):
    """The run's tokenizer (saved next to the adapter), else the recipe's, else the base's."""
    from transformers import AutoTokenizer

    from finetune.model import load_tokenizer

    if (source.adapter_dir / "tokenizer_config.json").exists():
        return adapter_tokenizer(source)
    if base is None and source.recipe is not None:
        return load_tokenizer(source.recipe)
    return AutoTokenizer.from_pretrained(base or source.adapter_config["base_model_name_or_path"])


def adapter_tokenizer(source: Source):
    """The tokenizer saved beside the adapter, loaded as anyone loading the folder loads it; ExportError naming the
    damaged file when it does not load. A cut-short tokenizer.json was a UnicodeDecodeError traceback in generate and
    export --merge, and `export` copied it and said VALID for every runtime (bb30)."""
    from transformers import AutoTokenizer

    if problem := _damaged_tokenizer_file(source.adapter_dir):
        raise ExportError(_tokenizer_refusal(source, problem))
    try:
        return AutoTokenizer.from_pretrained(source.adapter_dir)
    except Exception as exc:  # noqa: BLE001 (json's, the tokenizers library's and transformers' errors: one paragraph)
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ExportError(_tokenizer_refusal(source, f"its tokenizer files do not load ({reason})")) from None


def _damaged_tokenizer_file(folder: Path) -> str | None:
    """The first of the tokenizer's JSON files in `folder` that is not whole JSON, said; None when all parse."""
    from finetune.model.sources.hub import damaged_json

    damaged = damaged_json(folder, [name for name in TOKENIZER_FILES if name.endswith(".json")])
    return None if damaged is None else f"{damaged[0]} is cut short or not JSON ({damaged[1]})"


def _tokenizer_refusal(source: Source, problem: str) -> str:
    base = source.recipe.model.tokenizer or source.recipe.model.name_or_path if source.recipe is not None else \
        source.adapter_config.get("base_model_name_or_path") or "the base"
    return (f"{source.adapter_dir}: {problem}, so the tokenizer saved with the adapter does not load "
            "(AutoTokenizer.from_pretrained fails on that folder, as it would for anyone who loads the adapter's "
            "tokenizer: vLLM given a tokenizer path, transformers pipelines). Nothing was written. Fix: copy the tokenizer "
            f"files of the base ({base}) over those in {source.adapter_dir} (the run saved them from there), then run "
            "the same command again.")


def check_tokenizer_loads(source: Source) -> None:
    """ExportError unless the tokenizer files export copies from the adapter folder load (`adapter_tokenizer`)."""
    if (source.adapter_dir / "tokenizer_config.json").exists():
        adapter_tokenizer(source)
    elif problem := _damaged_tokenizer_file(source.adapter_dir):
        raise ExportError(_tokenizer_refusal(source, problem))
