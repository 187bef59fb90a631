"""Data: load rows, render them to text segments, tokenize with exact loss masks, pack, batch per rank.

Every format is reduced to a list of `(text, trained)` segments. The segments are joined and tokenized once with
character offsets; a token is trained when its characters overlap a trained segment. So the labels are exactly
the tokens of the rendered text the model sees (no drift between a separately tokenized prompt and response), and
masking works for any chat template that renders each conversation prefix as a prefix of the whole.

Flow: `prepare()` maps each dataset's tokenized store (building it once per machine when the cache lacks it), weights
and mixes them, splits off the eval set and, with `data.packing`, packs the train examples into rows of at most
`data.max_length` tokens whose position ids restart per example, all on indices and lengths. `BatchStream` then
shuffles those rows per epoch and hands each rank its disjoint share, building only the rows it collates. With
`data.streaming`, `stream_examples()` reads nothing whole: `StreamingBatches` reads, tokenizes and packs the rows in
order as training asks for them (`batch_stream()` gives the loop one or the other).

The stage is a package, one module per job, read in this order:

    examples.py   Example, DataStats, PreparedData, IGNORE_INDEX
    sources.py    rows from files, folders and hub datasets, in chunks; the pre-flight check of local files
    readers.py    local files' readers (JSON Lines, JSON arrays, Parquet, text, Arrow), by chunk
    csv_files.py  CSV, every cell as its text (an empty one missing), short rows read on
    folders.py    which files of a folder are read: a hub README's configs and splits, else every data file
    templates.py  formats and chat templates -> (text, trained) segments -> tokens with exact labels
    tokenize.py   a chunk of rows rendered, tokenized and length-limited (data.overlong, data.bad_rows)
    store.py      tokenized examples on disk, memory-mapped; views that pick and pack them without copying
    cache.py      one dataset tokenized once per machine (data.num_proc processes) or mapped from the cache
    build.py      every dataset: weights, the eval set (held out and/or eval files), packing; prepare()
    packing.py    packing (on lengths) and its attention check
    vocab.py      the data's token ids against the embedding's rows (a tokenizer larger than the model's vocabulary)
    loader.py     collate, BatchStream (per-rank sampler with exact resume), eval_batches
    prompts.py    GRPO's prompt rows (format: prompt): rendered, tokenized, the rows kept for the reward functions
    streaming.py  data.streaming: rows read, tokenized and packed on the fly, each rank's share, exact resume

Everything callers use is importable from `finetune.data` itself.
"""

from finetune.data.build import (
    build_examples,
    data_line,
    dropped_note,
    eval_file_examples,
    prepare,
    split_eval,
    split_eval_indices,
)
from finetune.data.cache import CACHE_VERSION, cache_dir, cache_key, dataset_store, tokenizer_fingerprint
from finetune.data.examples import IGNORE_INDEX, DataStats, Example, PreparedData
from finetune.data.loader import (
    BatchStream,
    check_enough_rows,
    checked_steps_per_epoch,
    collate,
    epoch_permutation,
    eval_batches,
    kl_sequence,
    real_token_count,
    rows_fingerprint,
    rows_left_note,
    step_over_rows_note,
    steps_per_epoch,
)
from finetune.data.packing import (
    PACKING_ATTENTION,
    batch_efficiency,
    check_packing_model,
    concat_examples,
    pack_examples,
    pack_lengths,
    packing_model_problem,
    packing_problem,
    verify_packing,
)
from finetune.data.prompts import prompt_examples, prompt_ids, prompt_text
from finetune.data.sources import check_local_files, load_rows, open_source
from finetune.data.store import ExampleView, PackedView, TokenStore, sequence_lengths, set_reference_logps
from finetune.data.streaming import (
    StreamedRows,
    StreamingBatches,
    batch_stream,
    stream_examples,
    stream_preview,
    streaming_line,
)
from finetune.data.templates import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_WITH_INPUT,
    FORMAT_FIELDS,
    ROLE_ALIASES,
    check_row,
    normalize_messages,
    render_examples,
    render_segments,
    tokenize_many,
    tokenize_segments,
)
from finetune.errors import DataError

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_WITH_INPUT",
    "CACHE_VERSION",
    "FORMAT_FIELDS",
    "IGNORE_INDEX",
    "PACKING_ATTENTION",
    "ROLE_ALIASES",
    "BatchStream",
    "DataError",
    "DataStats",
    "Example",
    "ExampleView",
    "PackedView",
    "PreparedData",
    "StreamedRows",
    "StreamingBatches",
    "TokenStore",
    "batch_efficiency",
    "batch_stream",
    "build_examples",
    "cache_dir",
    "cache_key",
    "check_enough_rows",
    "check_local_files",
    "check_packing_model",
    "check_row",
    "checked_steps_per_epoch",
    "collate",
    "concat_examples",
    "data_line",
    "dataset_store",
    "dropped_note",
    "epoch_permutation",
    "eval_batches",
    "eval_file_examples",
    "kl_sequence",
    "load_rows",
    "normalize_messages",
    "open_source",
    "pack_examples",
    "pack_lengths",
    "packing_model_problem",
    "packing_problem",
    "prepare",
    "prompt_examples",
    "prompt_ids",
    "prompt_text",
    "real_token_count",
    "render_examples",
    "render_segments",
    "rows_fingerprint",
    "rows_left_note",
    "sequence_lengths",
    "set_reference_logps",
    "split_eval",
    "split_eval_indices",
    "step_over_rows_note",
    "steps_per_epoch",
    "stream_examples",
    "stream_preview",
    "streaming_line",
    "tokenize_many",
    "tokenize_segments",
    "tokenizer_fingerprint",
    "verify_packing",
]
