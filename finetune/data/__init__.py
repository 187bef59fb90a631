"""Data: load rows, render them to text segments, tokenize with exact loss masks, pack, batch per rank.

Every format is reduced to a list of `(text, trained)` segments. The segments are joined and tokenized once with
character offsets; a token is trained when its characters overlap a trained segment. So the labels are exactly
the tokens of the rendered text the model sees (no drift between a separately tokenized prompt and response), and
masking works for any chat template that renders each conversation prefix as a prefix of the whole.

Flow: `prepare()` reads each dataset (or its tokenized cache), weights and mixes them, splits off the eval set and,
with `data.packing`, packs the train examples into rows of at most `data.max_length` tokens whose position ids
restart per example. `BatchStream` then shuffles those rows per epoch and hands each rank its disjoint share.

The stage is a package, one module per job, read in this order:

    examples.py   Example, DataStats, PreparedData, IGNORE_INDEX
    sources.py    rows from files, folders and hub datasets; the pre-flight check of local files
    templates.py  formats and chat templates -> (text, trained) segments -> tokens with exact labels
    cache.py      one dataset tokenized (or read from the tokenization cache)
    build.py      every dataset: weights, the eval set (held out and/or eval files), packing; prepare()
    packing.py    packing and its attention check
    loader.py     collate, BatchStream (per-rank sampler with exact resume), eval_batches

Everything callers use is importable from `finetune.data` itself.
"""

from finetune.data.build import build_examples, eval_file_examples, prepare, split_eval, split_eval_indices
from finetune.data.cache import CACHE_VERSION, cache_dir, dataset_examples, tokenizer_fingerprint
from finetune.data.examples import IGNORE_INDEX, DataStats, Example, PreparedData
from finetune.data.loader import (
    BatchStream,
    checked_steps_per_epoch,
    collate,
    epoch_permutation,
    eval_batches,
    real_token_count,
    steps_per_epoch,
)
from finetune.data.packing import (
    PACKING_ATTENTION,
    batch_efficiency,
    concat_examples,
    pack_examples,
    packing_problem,
    verify_packing,
)
from finetune.data.sources import check_local_files, load_rows
from finetune.data.templates import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_WITH_INPUT,
    FORMAT_FIELDS,
    ROLE_ALIASES,
    check_row,
    normalize_messages,
    render_segments,
    tokenize_many,
    tokenize_segments,
)
from finetune.errors import DataError

__all__ = [
    "ALPACA_PROMPT", "ALPACA_PROMPT_WITH_INPUT", "CACHE_VERSION", "FORMAT_FIELDS", "IGNORE_INDEX", "PACKING_ATTENTION",
    "ROLE_ALIASES", "BatchStream", "DataError", "DataStats", "Example", "PreparedData", "batch_efficiency",
    "build_examples", "cache_dir", "check_local_files", "check_row", "checked_steps_per_epoch", "collate",
    "concat_examples", "dataset_examples",
    "epoch_permutation", "eval_batches", "eval_file_examples", "load_rows", "normalize_messages", "pack_examples",
    "packing_problem", "prepare", "real_token_count", "render_segments", "split_eval", "split_eval_indices",
    "steps_per_epoch", "tokenize_many", "tokenize_segments", "tokenizer_fingerprint", "verify_packing",
]
