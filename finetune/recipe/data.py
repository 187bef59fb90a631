"""The `data:` section of a recipe: the datasets (each file or hub dataset, its format and columns), the length limits,
the held-out split, packing, streaming and the tokenized cache."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused


class DatasetSpec(_Section):
    path: str = Field(description="Local file (.jsonl/.json/.csv/.parquet), load_from_disk folder, or `datasets` name.")
    format: Literal["alpaca", "chat", "completion", "text", "preference", "unpaired_preference", "prompt"] = "alpaca"
    split: str = "train"
    subset: str | None = None
    weight: float = Field(1.0, gt=0, description="Mixing weight: 2 repeats the train examples, 0.5 takes half.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Map of our field name -> column in the data (instruction, input, output, system, prompt, completion, "
        "text, messages, tools; for chat turns also role, content and reasoning).",
    )
    system_prompt: str | None = Field(None, description="System prompt for this dataset; default data.system_prompt.")
    tools: list[dict] | str | None = Field(None, description="Chat rows: the tools (function schemas) of rows without "
                                           "a `tools` column: a list or a JSON file.")
    max_rows: int | None = Field(None, gt=0, description="Read only the first N rows (previews, quick runs).")
    sample_by: Literal["line", "paragraph", "document"] | None = Field(
        None, description="A folder of .txt files: what one row is, by `datasets`' text builder's names. line (unset: "
        "line): each line, its line break dropped, a blank line left out; paragraph: lines up to a blank line; "
        "document: the whole file; both keep their line breaks. Only for .txt files (docs/data.md).")


class DataSection(_Section):
    datasets: list[DatasetSpec] = Field(min_length=1)
    eval_datasets: list[DatasetSpec] = Field(
        default_factory=list, description="Evaluation data, same fields as `datasets` (weight unused): evaluated instead "
        "of the held-out eval_fraction, or besides it when eval_fraction is set too. Used by the generation eval first."
    )
    max_length: int = Field(512, gt=8)
    system_prompt: str | None = None
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="Share of the training rows held out for evaluation "
                                 "(at most eval_max_rows); 0 when eval_datasets is set and this is not.")
    eval_max_rows: int = Field(64, ge=0)
    packing: bool = Field(False, description="Several examples per row, position ids restarting per example.")
    overlong: Literal["truncate", "drop", "error", "split"] = Field(
        "truncate", description="Rows longer than max_length. truncate: keep the first max_length tokens (the tokens cut "
        "are counted), and drop (with a count naming the first rows) a row whose answer lies wholly past them. drop: "
        "drop every such row. error: truncate, and stop on a row left with nothing to learn. split (format text "
        "only): cut the row into consecutive max_length pieces, each an example (continued pretraining).")
    bad_rows: Literal["skip", "error"] = Field("error", description="Empty or malformed rows: skip with a count, or fail.")
    reasoning: Literal["train", "context", "drop"] = Field("train", description="Chat rows' reasoning: trained as the "
                                                           "template renders it, context (not trained), or drop.")
    num_proc: int | None = Field(
        None, gt=0, description="Processes tokenizing a dataset that is not cached yet (once per machine); default: the CPU cores.")
    cache: bool = Field(True, description="Keep tokenized datasets in $FINETUNE_CACHE, else $XDG_CACHE_HOME/finetune, "
                        "else ~/.cache/finetune (docs/data.md).")
    streaming: bool = Field(
        False, description="Read the datasets lazily (larger than memory or disk): tokenized and packed on the fly, in "
        "the datasets' order (no shuffle), pass after pass; needs train.max_steps. eval_fraction > 0 holds out the "
        "first eval_max_rows rows. No weights, no dpo.reference: precomputed, no cache (docs/data.md, Streaming).")

    @model_validator(mode="after")
    def _split_needs_text(self) -> DataSection:
        """overlong: split cuts a row into pieces that each start without the row's beginning: text rows only (a
        conversation's or an answer's piece would lose its prompt)."""
        if self.overlong != "split":
            return self
        others = [f"data.{key}[{index}] (format {spec.format})" for key, specs in
                  (("datasets", self.datasets), ("eval_datasets", self.eval_datasets))
                  for index, spec in enumerate(specs) if spec.format != "text"]
        if others:
            raise ValueError(
                f"overlong: split cuts a long row into max_length pieces, each trained on its own, which only format "
                f"`text` rows allow (a piece of a conversation or of an answer would be trained without its prompt); "
                f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not text. Fix: data.overlong: truncate "
                "(the default), drop or error for these formats, or a larger data.max_length.")
        return self

    @model_validator(mode="before")
    @classmethod
    def _eval_files_replace_the_fraction(cls, values):
        """Eval files given and no eval_fraction: evaluate on the files only (no training rows held out). The resolved
        recipe then says eval_fraction: 0.0, so a reload (export, generate) splits the same way."""
        if isinstance(values, dict) and values.get("eval_datasets") and "eval_fraction" not in values:
            values = {**values, "eval_fraction": 0.0}
        return values
