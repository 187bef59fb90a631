"""The data's token ids against the model's embedding: every id a run embeds (its examples', its padding's) needs a
row of the embedding matrix, checked before any weight loads. finetune does not resize embeddings, so a tokenizer with
more tokens than the model has rows (`model.tokenizer` pointing at a tokenizer someone added tokens to, or another
model's) trains only while its data keep to the ids below the rows: an id past them stopped step 1 with a raw
IndexError (a device-side assert on GPU)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from finetune.data.examples import Example
from finetune.errors import DataError
from finetune.recipe import Recipe


def embedding_rows(config) -> int | None:
    """The rows of the model's input embedding as its config states them (a multimodal model: its language model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if rows else None


def highest_token_id(examples: Sequence[Example]) -> int:
    """The highest token id in `examples` (-1 when none). Views over token stores (data/store.py) read their stores'
    mapped ids, whole (every sequence a run may pick from them, the rejected ones and the KTO tails included); other
    sequences of examples are read one by one."""
    base = getattr(examples, "base", examples)  # a PackedView packs the examples of an ExampleView
    stores = getattr(base, "stores", None)
    if stores is not None:
        arrays = [store.ids for store in stores] + [store.tails[0] for store in stores if store.tails is not None]
        return max((int(np.max(ids)) for ids in arrays if len(ids)), default=-1)
    highest = -1
    for example in examples:
        for sequence in (example, example.rejected, example.completion_tail):
            if sequence is not None and sequence.input_ids:
                highest = max(highest, max(sequence.input_ids))
    return highest


def check_token_ids(recipe: Recipe, tokenizer, *example_sets: Iterable[Example], config=None) -> None:
    """DataError when an id the run would embed has no row in the model's embedding (`config`: the model's, read from
    the recipe when None): the data's (each of `example_sets`) or the padding's. A stream (data.streaming) is not read
    whole before training, so with a tokenizer larger than the embedding it is refused whatever its first rows hold.
    Nothing is read when the tokenizer has no id past the rows (the usual case, and a vocabulary padded past the
    tokenizer's, as Qwen's)."""
    if config is None:
        from finetune.model import load_config

        config = load_config(recipe)
    rows = embedding_rows(config)
    if rows is None or len(tokenizer) <= rows:
        return
    reached = [("the padding", tokenizer.pad_token_id)] if (tokenizer.pad_token_id or 0) >= rows else []
    highest = max((highest_token_id(examples) for examples in example_sets if isinstance(examples, Sequence)),
                  default=-1)
    if highest >= rows:
        reached.append(("the data", highest))
    if recipe.data.streaming:
        reached.append(("the stream may reach them (data.streaming: it is not read whole before training)", None))
    if reached:
        error = DataError(vocabulary_refusal(recipe, tokenizer, rows, reached))
        error.alike_on_every_rank = True  # every rank holds the same ids: rank 0 prints it, once (run.py main)
        raise error


def vocabulary_refusal(recipe: Recipe, tokenizer, rows: int, reached: list[tuple[str, int | None]]) -> str:
    """The paragraph of `check_token_ids`: the tokenizer, both sizes, the tokens without a row, what reaches them, the
    fix."""
    extra = len(tokenizer) - rows
    shown = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 5))))
    tokens = ", ".join(f"`{token}`" for token in shown) + (", ..." if extra > len(shown) else "")
    which = (f"model.tokenizer ({recipe.model.tokenizer})" if recipe.model.tokenizer
             else f"the tokenizer of {recipe.model.name_or_path}")
    how = "; ".join(f"{what} reach{'es' if what == 'the padding' else ''} id {token_id}" if token_id is not None
                    else what for what, token_id in reached)
    other = ("use the model's own tokenizer (remove model.tokenizer) or one of at most {rows} tokens"
             if recipe.model.tokenizer else "set model.tokenizer to this model's tokenizer of at most {rows} tokens")
    plural = extra > 1
    return (f"{which} has {len(tokenizer)} tokens, but the model's embedding has {rows} rows (config vocab_size): "
            f"the {extra} token{'s' if plural else ''} from id {rows} on ({tokens}) ha{'ve' if plural else 's'} no "
            f"embedding, and {how}. Training would stop at the first batch that holds one (IndexError; a device-side "
            f"assert on GPU). finetune does not resize embeddings. Fix: {other.format(rows=rows)}, or keep the tokens "
            "without a row out of the data; to train added tokens, resize the base yourself (transformers: "
            "model.resize_token_embeddings(len(tokenizer)), then save_pretrained with the tokenizer) and point "
            "model.name_or_path at that folder.")
