"""Packing: several examples per row with restarting position ids, and the check that attention keeps them apart."""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort

import numpy as np
import torch

from finetune.data.examples import IGNORE_INDEX, Example
from finetune.data.loader import epoch_permutation
from finetune.errors import DataError

# Attention implementations that turn restarting position_ids (with no attention_mask) into a block-diagonal mask
# in transformers 5: sdpa/eager/flex through masking_utils.find_packed_sequence_indices, flash through cu_seqlens.
# `auto` (finetune/model/attention.py) becomes sdpa or eager, both of them.
PACKING_ATTENTION = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


# ---------------------------------------------------------------------------------------------------- packing
def packing_problem(attn_implementation: str) -> str | None:
    """Why packed rows would let examples attend to each other with this setup, or None when packing is exact."""
    from importlib.metadata import version

    # Checked by version, not by importing masking_utils: that import pulls in torch._dynamo (seconds).
    if int(version("transformers").split(".")[0]) < 5:
        return ("data.packing needs transformers 5 (masking_utils.find_packed_sequence_indices builds the per-example "
                "mask from restarting position_ids); this transformers cannot keep packed examples apart. Upgrade "
                "transformers or set data.packing: false.")
    if attn_implementation not in PACKING_ATTENTION:
        return (f"data.packing: model.attn_implementation `{attn_implementation}` is not known to keep packed examples "
                f"apart (ones that do: {', '.join(PACKING_ATTENTION)}). Set model.attn_implementation: sdpa or "
                "data.packing: false.")
    return None


# Layer kinds whose packed examples stay apart given restarting position_ids (measured per architecture against the
# examples run apart: llama4's chunked attention and the top-k indexed attention of DeepSeek-V3.2 / Mistral Large 4
# included). Any other kind in a config's layer_types (the linear attention of Qwen3-Next / Qwen3.5 / MiniMax / OLMo
# hybrid / LARA, DeepSeek-V4's compressed attention) carries state or mixes tokens across the example boundary:
# transformers separates packed examples there only given cu_seq_lens.
APART_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "attention")
# Model types whose own mask code ignores position_ids (examples packed together attend to each other).
MASK_WITHOUT_POSITIONS = {"gpt_oss": "gpt-oss builds its attention masks without the position ids"}


def packing_model_problem(config) -> str | None:
    """Why packed examples would see each other in the model `config` describes (its layers, its mask code), read
    before any weight loads; None where packing is exact. `verify_packing` checks the loaded model again."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "?")
    kinds = [*(getattr(text, "layer_types", None) or ()), *(getattr(text, "layers_block_type", None) or ())]
    mixing = sorted({str(kind) for kind in kinds if str(kind) not in APART_LAYER_KINDS})
    if mixing:
        why = (f"its {', '.join(mixing)} layers carry state across the boundary between examples packed into one row "
               "(transformers keeps them apart only with flash-attention sequence lengths, which finetune does not pass)")
    elif model_type in MASK_WITHOUT_POSITIONS:
        why = MASK_WITHOUT_POSITIONS[model_type]
    else:
        return None
    return (f"data.packing: {model_type} cannot pack examples: {why}, so each example would be trained on the one "
            "before it. Set data.packing: false (each example then has a row of its own).")


def check_packing_model(recipe, config) -> None:
    """Refuse data.packing for a model that would let packed examples see each other (`packing_model_problem`)."""
    if recipe.data.packing and (problem := packing_model_problem(config)):
        raise DataError(problem)


def pack_examples(examples: list[Example], max_length: int) -> list[Example]:
    """Pack whole examples into rows of at most max_length tokens (pack_lengths decides which go together)."""
    rows = pack_lengths([len(e.input_ids) for e in examples], max_length)
    return [concat_examples([examples[i] for i in members]) for members in rows]


def pack_lengths(sizes: list[int], max_length: int) -> list[list[int]]:
    """The examples (by position in `sizes`) of each packed row: as few rows as best-fit-decreasing needs, balanced.

    Best fit decreasing (each example, longest first, into the fullest row it still fits in) finds how many rows
    are needed. The examples are then dealt again, longest first, to the least loaded of that many rows, so the
    rows come out nearly equally long and a micro-batch pads almost nothing (if balancing needs more rows than
    best fit, best fit is kept). Examples are never split, so none loses its beginning; position ids restart at
    0 per example so the attention mask built from them keeps examples apart. Only lengths are needed: the
    tokens stay where they are stored.
    """
    if any(size > max_length for size in sizes):
        raise ValueError(f"an example of {max(sizes)} tokens exceeds max_length {max_length}; apply the length policy first")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    rows = _best_fit_rows(order, sizes, max_length)
    balanced = _balanced_rows(order, sizes, max_length, len(rows))
    return balanced if len(balanced) == len(rows) else rows


def _best_fit_rows(order: list[int], sizes: list[int], max_length: int) -> list[list[int]]:
    """Rows by best fit. Open rows are kept by their free space, which has at most max_length distinct values: a
    sorted list of those values (bisect) and a heap of rows per value keep each step O(log max_length), whatever
    the number of rows (a sorted list of every row made 200k examples take minutes of list inserts)."""
    rows: list[list[int]] = []
    free_values: list[int] = []  # sorted distinct free spaces of open rows
    rows_by_free: dict[int, list[int]] = {}
    for i in order:
        at = bisect_left(free_values, sizes[i])
        if at == len(free_values):
            rows.append([i])
            left, row = max_length - sizes[i], len(rows) - 1
        else:
            value = free_values[at]
            stack = rows_by_free[value]
            row = heapq.heappop(stack)  # of equally full rows, the oldest (as a sorted list of (free, row) did)
            if not stack:
                del rows_by_free[value]
                free_values.pop(at)
            rows[row].append(i)
            left = value - sizes[i]
        if left > 0:
            if left not in rows_by_free:
                insort(free_values, left)
                rows_by_free[left] = []
            heapq.heappush(rows_by_free[left], row)
    return rows


def _balanced_rows(order: list[int], sizes: list[int], max_length: int, count: int) -> list[list[int]]:
    """Longest first to the least loaded row (a new row when even that one is too full)."""
    rows: list[list[int]] = [[] for _ in range(count)]
    loads = [(0, row) for row in range(count)]  # a heap of (tokens, row)
    for i in order:
        load, row = heapq.heappop(loads)
        if load + sizes[i] > max_length:
            heapq.heappush(loads, (load, row))
            load, row = 0, len(rows)
            rows.append([])
        rows[row].append(i)
        heapq.heappush(loads, (load + sizes[i], row))
    return rows


def concat_examples(examples: list[Example]) -> Example:
    """One packed row: ids and labels joined, positions restarting per example.

    The first token of each example is never a target (in an unpacked batch nothing predicts it), so its label
    is ignored here too: otherwise the last token of one example would be trained to predict the next example.
    """
    ids, labels, positions = [], [], []
    for example in examples:
        ids += example.input_ids
        labels += [IGNORE_INDEX] + example.labels[1:]
        positions += range(len(example.input_ids))
    return Example(ids, labels, positions)


def batch_efficiency(lengths, *, micro_batch_size: int, seed: int, rejected=None) -> float:
    """Non-pad tokens / all tokens over the micro-batches of epoch 0, in the order BatchStream takes them (`lengths`:
    tokens per row, or the rows themselves). Pairs (`rejected`: each pair's rejected tokens): a micro-batch pads its
    chosen and rejected sequences alike, to the longest of both (the figure counted the chosen sequences alone)."""
    rows = len(lengths) and isinstance(lengths[0], Example)
    sizes = np.asarray([len(e.input_ids) for e in lengths] if rows else lengths, dtype=np.int64)
    if not len(sizes):
        return 0.0
    order = np.asarray(epoch_permutation(len(sizes), seed, 0), dtype=np.int64)
    real_sizes = sizes if rejected is None else sizes + np.asarray(rejected, dtype=np.int64)
    widths = sizes if rejected is None else np.maximum(sizes, np.asarray(rejected, dtype=np.int64))
    real_sizes, widths, per_row = real_sizes[order], widths[order], 1 if rejected is None else 2
    padded = len(widths) - len(widths) % micro_batch_size
    whole = widths[:padded].reshape(-1, micro_batch_size)
    real, total = int(real_sizes[:padded].sum()), int(whole.max(axis=1).sum()) * micro_batch_size * per_row
    if padded < len(widths):
        tail = widths[padded:]
        real, total = real + int(real_sizes[padded:].sum()), total + int(tail.max()) * len(tail) * per_row
    return real / total


def verify_packing(model, *, device: torch.device | str = "cpu") -> float:
    """Run two short examples packed and apart through `model`; raise DataError if the packed logits differ.

    The check that the model's attention really honours restarting position ids (a model with its own mask code,
    or remote code, may not). Every rank must call it (it runs a forward). Returns the mean absolute logit
    difference relative to the logits' standard deviation. The limit is on that mean, not on the largest
    difference: a bf16 model's packed and separate forwards round differently (SmolLM2-135M: largest difference
    0.375 on logits up to 35, mean 0.006 of a standard deviation), while examples that see each other move the
    second example's logits by about one standard deviation (measured 0.6).
    """
    inner = getattr(model, "module", model)  # DDP keeps the model in .module (FSDP forwards attributes, DDP does not)
    vocab = inner.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab, (n,), generator=generator) for n in (5, 7))
    packed = {"input_ids": torch.cat([first, second])[None].to(device),
              "position_ids": torch.tensor(list(range(5)) + list(range(7)))[None].to(device)}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        together = model(**packed, use_cache=False).logits[0].float()
        apart = torch.cat([model(input_ids=x[None].to(device), use_cache=False).logits[0].float() for x in (first, second)])
    model.train(was_training)
    difference = float((together - apart).abs().mean() / apart.std().clamp_min(1e-6))
    if difference > 0.05:
        implementation = getattr(getattr(inner, "config", None), "_attn_implementation", "?")
        sdpa = implementation == "eager" and getattr(inner, "_supports_sdpa", False)
        raise DataError(f"data.packing: this model's attention ({implementation}) lets packed examples see each other: "
                        f"two examples packed into one row give logits {difference:.2f} standard deviations away from "
                        "the same examples run apart (numerical noise is below 0.05). The model's own code ignores "
                        "restarting position_ids. Set data.packing: false"
                        f"{', or model.attn_implementation: sdpa' if sdpa else ''}.")
    return difference
