"""Every dataset of the recipe: weighted, mixed, the eval set split off (or read from eval files), packed."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import numpy as np

from finetune.data.cache import dataset_store
from finetune.data.examples import DataStats, Example, PreparedData, weighted_share
from finetune.data.packing import batch_efficiency, pack_lengths, packing_problem
from finetune.data.ported_rows import kto_spec, unpaired_note
from finetune.data.prompts import prompt_examples
from finetune.data.store import ExampleView, PackedView, TokenStore, sequence_lengths
from finetune.data.template_facts import note_turn_end
from finetune.errors import DataError, FinetuneError
from finetune.recipe import Recipe

# Counts of tokenize.ChunkResult that DataStats has no field for: kept with each dataset's stats.per_dataset entry.
LENGTH_COUNTS = ("cut_tokens", "tokens_before_cut", "split_rows", "split_pieces", "blank_lines", "own_prompt_rows",
                 "served_turns", "prefill_rows", "arrow_null_rows", "template_kwargs_rows", "unpaired_pairs")
# Where the first row of a count is (tokenize.ChunkResult's first_* fields), kept the same way, for the notes.
FIRST_ROWS = ("first_own_prompt_row", "first_prefill_row", "first_arrow_null_row", "first_template_kwargs_row",
              "first_unpaired_pair")
CUT_WARNING_SHARE = 0.10  # truncation cutting more of the tokens than this is said as a warning


# ------------------------------------------------------------------------------------------------ the datasets
def _count(stats: DataStats, store: TokenStore, counts: dict, spec, key: str, recipe: Recipe, *,
           role: str | None = None) -> None:
    """Add one file's counts to `stats`; a file with no usable rows is an error naming its recipe key."""
    for name in ("rows", "skipped", "truncated", "dropped", "prompt_truncated", "response_truncated"):
        setattr(stats, name, getattr(stats, name) + counts.get(name, 0))
    stats.skipped_reasons += counts["skipped_reasons"]
    stats.dropped_rows += counts.get("dropped_rows", [])
    stats.cached_datasets += int(counts["cached"])
    if not len(store):
        first = f" First problem: {counts['skipped_reasons'][0]}" if counts["skipped_reasons"] else ""
        raise DataError(f"{key} ({spec.path}): no usable rows ({counts['rows']} read, {counts['skipped']} skipped, "
                        f"{counts['dropped']} dropped as too long).{first}{_too_long_fix(counts, spec, recipe)}")
    entry = {"path": spec.path, "format": spec.format, "rows": counts["rows"], "examples": len(store),
             "weight": spec.weight, "cached": counts["cached"],
             **{name: counts.get(name, 0) for name in LENGTH_COUNTS}, **{name: counts.get(name) for name in FIRST_ROWS}}
    stats.per_dataset.append({**entry, "role": role} if role else entry)


def _too_long_fix(counts: dict, spec, recipe: Recipe) -> str:
    """The fix for a file whose rows were dropped for their length (data.overlong), naming the first of them; a file
    whose rows were all skipped names its first problem instead (each skip reason carries its own fix)."""
    if not counts["dropped"] or counts["skipped_reasons"]:
        return ""
    data, rows = recipe.data, counts.get("dropped_rows") or []
    where = f"; rows past it: {', '.join(rows)}{', ...' if counts['dropped'] > len(rows) else ''}" if rows else ""
    if data.overlong == "drop":
        other = "or data.overlong: truncate (a long row keeps its first max_length tokens)"
    elif spec.format == "text":
        other = "or data.overlong: split (each long row cut into max_length pieces, every token trained)"
    else:  # truncate (error stops at the row): what is left of each row within max_length has no answer to learn
        other = ("or shorten the rows' prompts: each of these rows keeps only its first max_length tokens, and its "
                 "answer starts after them")
    return f" Fix: raise data.max_length (now {data.max_length}{where}), {other}."


def prepare(recipe: Recipe, tokenizer) -> PreparedData:
    """Every dataset tokenized (or mapped from the cache), the eval set split off, weights applied, train rows packed.

    Only indices and lengths are handled here: the examples stay in their memory-mapped stores (store.py) until a
    batch is collated, so a rank's memory does not grow with the dataset's tokens. GRPO: its prompt rows (format:
    prompt), read whole (data/prompts.py).
    """
    if recipe.train.objective == "grpo":
        train, evaluation, prompt_stats = prompt_examples(recipe, tokenizer)
        return PreparedData(train, train, evaluation, prompt_stats)
    stats, stores, origin = DataStats(), [], []
    if any(spec.format == "chat" for spec in recipe.data.datasets):
        note_turn_end(tokenizer)  # said here too: rows mapped from the cache are not rendered again
    for index, spec in enumerate(recipe.data.datasets):
        store, counts = dataset_store(kto_spec(spec, recipe.train.objective), recipe, tokenizer)  # kto: pairs unpaired
        _count(stats, store, counts, spec, f"data.datasets[{index}]", recipe)
        stores.append(store)
        origin += [index] * len(store)
    eval_stores = _eval_stores(recipe, tokenizer, stats)
    count = len(origin)
    examples = ExampleView(stores + eval_stores, np.arange(count))
    eval_files = ExampleView(stores + eval_stores, np.arange(count, count + sum(len(s) for s in eval_stores)))
    train_ids, eval_ids = split_eval_indices(count, recipe, rows=_row_numbers(stores))
    train = ExampleView(examples.stores, _mix(train_ids, [origin[i] for i in train_ids], recipe, stats))
    # files first: the generation eval takes the first rows
    evaluation = ExampleView(examples.stores, np.concatenate([eval_files.picks, np.asarray(eval_ids, dtype=np.int64)]))
    sequences = train
    if recipe.data.packing:
        problem = packing_problem(recipe.model.attn_implementation)
        if problem:
            raise DataError(problem)
        sequences = PackedView(train, pack_lengths(train.lengths().tolist(), recipe.data.max_length))
    _fill_stats(stats, stores, train, evaluation, sequences, recipe)
    stats.eval_in_train = _eval_in_train(train, evaluation)
    return PreparedData(examples, sequences, evaluation, stats, eval_files)


def _row_numbers(stores: list[TokenStore]) -> np.ndarray:
    """Each example's row among the rows of every dataset (store.row_numbers, numbered on from one store to the next):
    with one example per row, the examples' own indices."""
    numbers, start = [], 0
    for store in stores:
        numbers.append(store.rows + start)
        start += int(store.rows.max()) + 1 if len(store.rows) else 0
    return np.concatenate(numbers or [np.zeros(0, np.int64)])


def _eval_stores(recipe: Recipe, tokenizer, stats: DataStats) -> list[TokenStore]:
    """The stores of data.eval_datasets (tokenized like training data, cached, never weighted, packed or capped)."""
    found: list[TokenStore] = []
    for index, spec in enumerate(recipe.data.eval_datasets):
        key = f"data.eval_datasets[{index}]"
        try:
            store, counts = dataset_store(kto_spec(spec, recipe.train.objective), recipe, tokenizer)
        except DataError as exc:  # the loaders name data.datasets; this is an eval file
            raise DataError(str(exc).replace("data.datasets[]", key).replace("data.datasets path", f"{key} path", 1)
                            ) from None
        _count(stats, store, counts, spec, key, recipe, role="eval")
        found.append(store)
    return found


def eval_file_examples(recipe: Recipe, tokenizer, stats: DataStats) -> ExampleView:
    """The examples of data.eval_datasets."""
    stores = _eval_stores(recipe, tokenizer, stats)
    return ExampleView(stores, np.arange(sum(len(s) for s in stores)))


def build_examples(recipe: Recipe, tokenizer) -> tuple[Sequence[Example], Sequence[Example], DataStats]:
    """Train rows (packed when data.packing) and eval examples; every rank maps the same stores, BatchStream splits."""
    try:
        prepared = prepare(recipe, tokenizer)
    except FinetuneError as exc:  # a row, a column, no usable rows: every rank reads the same files and finds it alike
        vars(exc).setdefault("alike_on_every_rank", True)  # rank 0 prints it, once; the others wait for its
        # paragraph (run.py main). One this machine or rank alone meets (a killed tokenizing process, a hub that
        # did not answer) says so where it is raised: that rank prints its own at once (a review: it waited 30 s)
        raise
    return prepared.train, prepared.eval, prepared.stats


def _mix(train: list[int], origin: list[int], recipe: Recipe, stats: DataStats) -> list[int]:
    """Apply each dataset's weight to its train examples (indices): repeat (weight > 1) or subsample (weight < 1).
    Each dataset's train count (after the eval hold-out and its weight) goes to its stats entry, for `finetune data`.
    A dataset left no training example, by its weight or by the eval hold-out, is an error: it would never train."""
    ids, origins = np.asarray(train, dtype=np.int64), np.asarray(origin, dtype=np.int64)
    mixed = []
    for index, spec in enumerate(recipe.data.datasets):
        own = ids[origins == index].tolist()
        where = f"data.datasets[{index}] ({spec.path})"
        if not own:
            raise DataError(_held_out_whole(where, stats.per_dataset[index]["examples"], len(train), recipe))
        kept = weighted_share(own, spec.weight, recipe.train.seed + index, where=where)
        stats.per_dataset[index]["train_examples"] = len(kept)
        mixed += kept
    return mixed


def _held_out_whole(where: str, examples: int, train: int, recipe: Recipe) -> str:
    """The eval hold-out (drawn from every dataset's examples together) took all of one dataset's examples."""
    data = recipe.data
    return (f"{where}: the eval hold-out took all {examples} of its examples (data.eval_fraction {data.eval_fraction}, "
            f"at most data.eval_max_rows {data.eval_max_rows} rows, drawn by train.seed {recipe.train.seed} from the rows "
            f"of every dataset together; {train} left to train, none of them this dataset's), so it would never be "
            "trained on. Fix: evaluate on a file of its own (data.eval_datasets: the hold-out is then 0 unless "
            "data.eval_fraction is set too), set data.eval_fraction: 0, or give the dataset more rows.")


def _eval_in_train(train: ExampleView, evaluation: ExampleView) -> int:
    """Eval examples whose tokens and trained tokens equal a training example's: an eval file that is a training
    file, or duplicate rows split across. The eval side's digests are held (it is small); the training examples of a
    length some eval example has are hashed one at a time, so memory does not grow with the training data."""
    if not len(evaluation) or not len(train):
        return 0

    def digest(view: ExampleView, index: int) -> bytes:
        store, local = view.locate(index)
        hasher = hashlib.blake2b(digest_size=16)
        for row in (2 * local, 2 * local + 1) if store.pairs else (local,):
            start, end = int(store.bounds[row]), int(store.bounds[row + 1])
            hasher.update(store.ids[start:end].tobytes() + store.trained[start:end].tobytes())
        return hasher.digest()

    held = [digest(evaluation, i) for i in range(len(evaluation))]
    wanted, found = set(held), set()
    for index in np.nonzero(np.isin(train.lengths(), np.unique(evaluation.lengths())))[0]:
        if (key := digest(train, int(index))) in wanted:
            found.add(key)
    return sum(1 for key in held if key in found)


def data_line(stats: DataStats, recipe: Recipe) -> str:
    """The run's one line about its data (rank 0 prints it), and its warnings."""
    packed = f", packed into {stats.train_sequences} rows" if recipe.data.packing else ""
    counts = stats_counts(stats)
    warnings = [line for line in (cut_warning(counts, recipe), eval_overlap(stats) if stats.eval_in_train else None)
                if line]
    return (f"[finetune] data: {stats.train_examples} train / {stats.eval_examples} eval examples{packed} "
            f"({row_counts(counts)}{dropped_note(stats)}; batch efficiency {stats.batch_efficiency:.1%})"
            + "".join(f"\n[finetune] warning: {line}" for line in warnings)
            + "".join(f"\n[finetune] note: {line}" for line in prompt_notes(stats)))


def prompt_notes(stats: DataStats) -> list[str]:
    """The notes about prompts (data line, `finetune data`): rows tokenized in pieces so that their prompts keep their
    own tokens (tokens.own_prompt_note), rows trained after less than the generation prompt (chat.prefill_note), ...,
    a pair file's pairs unpaired into KTO rows (ported_rows.unpaired_note)."""
    return count_notes(stats.per_dataset)


def count_notes(entries: list[dict]) -> list[str]:
    """`prompt_notes` of tokenize_chunk's counts summed per dataset (the cached path's stats.per_dataset) or per pass
    (a stream's counts)."""
    from finetune.data.chat import prefill_note
    from finetune.data.tokens import own_prompt_note, served_turns_note

    notes = []
    for count, first, say in (("own_prompt_rows", "first_own_prompt_row", own_prompt_note),
                              ("served_turns", "first_own_prompt_row", served_turns_note),
                              ("prefill_rows", "first_prefill_row", prefill_note),
                              ("arrow_null_rows", "first_arrow_null_row", _arrow_null_note),
                              ("template_kwargs_rows", "first_template_kwargs_row", _template_kwargs_note),
                              ("unpaired_pairs", "first_unpaired_pair", unpaired_note)):
        rows = sum(int(entry.get(count, 0)) for entry in entries)
        if rows:
            notes.append(say(rows, next((e[first] for e in entries if e.get(first)), "?")))
    return notes


def _arrow_null_note(rows: int, first: str) -> str:
    many = rows > 1
    return (f"{rows} row{'s' if many else ''} (the first: {first}) read through Arrow (Parquet, Arrow, a `datasets` "
            f"folder or the hub) {'have' if many else 'has'} tools or tool calls with null-valued keys: Arrow gives "
            "every row each key any row has, null where it had none, so those keys were left out (as TRL's "
            "remove_none_values). Nothing to fix; to keep a null argument, write the arguments as JSON text")


def _template_kwargs_note(rows: int, first: str) -> str:
    many = rows > 1
    return (f"{rows} row{'s' if many else ''} (the first: {first}) {'were' if many else 'was'} rendered with {'their' if many else 'its'} own "
            "`chat_template_kwargs`: serve with the same arguments (vLLM's and the OpenAI API's chat_template_kwargs, "
            "apply_chat_template(..., **kwargs)); `finetune generate` and the generation eval render with none")


def stats_counts(stats: DataStats) -> dict:
    """The row counts of `stats` as one dict (tokenize.ChunkResult's names): its fields and every dataset's
    LENGTH_COUNTS summed, and `examples`: the examples the rows gave before the length policy (kept, less the pieces
    split ones became, plus dropped), which `several_examples` compares with the rows."""
    counts = {name: getattr(stats, name) for name in ("rows", "skipped", "truncated", "dropped")}
    for name in LENGTH_COUNTS:
        counts[name] = sum(int(entry.get(name, 0)) for entry in stats.per_dataset)
    kept = sum(int(entry.get("examples", 0)) for entry in stats.per_dataset)
    counts["examples"] = kept - counts["split_pieces"] + counts["split_rows"] + counts["dropped"]
    return counts


def several_examples(counts: dict) -> int | None:
    """The examples the rows gave, where some row gave several (a conversation under a template that rewrites
    history: one per assistant turn; a KTO pair: two rows); None where each row gave one (or a stream's counts, which
    hold no such count). Truncated and dropped count examples: said as such then, not as rows (bb53: "40 read, 59
    dropped")."""
    examples = counts.get("examples", 0)
    return examples if examples > counts.get("rows", 0) - counts.get("skipped", 0) else None


def examples_said(counts: dict) -> str:
    """What joins the skipped rows to the truncated and dropped counts: `, ` (a row each) or `; of their N examples, `."""
    examples = several_examples(counts)
    return f"; of their {examples:,} examples, " if examples else ", "


def row_counts(counts: dict) -> str:
    """`N rows, S skipped, T truncated[: X of Y tokens (P%) cut], D dropped[, ...]` of tokenize.ChunkResult's counts
    (a dataset's, several summed, or a stream's so far): how many tokens truncation cut, not only how many rows."""
    blank = f" ({counts['blank_lines']} blank .txt lines left out)" if counts.get("blank_lines") else ""
    cut = f": {cut_share(counts)} cut" if counts.get("cut_tokens") else ""
    split = (f", {counts['split_rows']} split into {counts['split_pieces']} pieces of <= max_length"
             if counts.get("split_rows") else "")
    return (f"{counts.get('rows', 0)} rows{blank}, {counts.get('skipped', 0)} skipped{examples_said(counts)}"
            f"{counts.get('truncated', 0)} truncated{cut}{split}, {counts.get('dropped', 0)} dropped")


def cut_share(counts: dict) -> str:
    """`9,898 of 10,094 tokens (98%)`: the tokens truncation cut, of the kept rows' tokens before it."""
    cut, before = counts.get("cut_tokens", 0), counts.get("tokens_before_cut", 0)
    return f"{cut:,} of {before:,} tokens ({cut / max(before, 1):.0%})"


def cut_warning(counts: dict, recipe: Recipe) -> str | None:
    """A sentence when truncation cut more than CUT_WARNING_SHARE of the tokens, with the fix (data line, `finetune
    data`, a stream's reports); None otherwise."""
    cut, before = counts.get("cut_tokens", 0), counts.get("tokens_before_cut", 0)
    if not before or cut / before <= CUT_WARNING_SHARE:
        return None
    data = recipe.data
    text = all(spec.format == "text" for spec in (*data.datasets, *data.eval_datasets))
    fix = ("data.overlong: split (each long row cut into max_length pieces, every token trained: continued "
           "pretraining), or a larger data.max_length" if text else
           "a larger data.max_length, or the long rows split into shorter ones in the data")
    rows, noun = counts.get("truncated", 0), "example" if several_examples(counts) else "row"
    return (f"truncation cut {cut_share(counts)}: {rows} {noun}{'s' * (rows != 1)} longer than data.max_length "
            f"{data.max_length} {'keep' if rows != 1 else 'keeps'} only the first {data.max_length} tokens, and the "
            f"rest is never trained. Fix: {fix}")


def cut_lines(stats: DataStats, recipe: Recipe) -> list[str]:
    """`finetune data`'s lines about what the length policy did beyond the row counts: the tokens truncation cut (and
    a warning when that is much), the rows split into pieces, the blank .txt lines left out."""
    counts, lines = stats_counts(stats), []
    if warning := cut_warning(counts, recipe):  # (it says the counts)
        lines.append(f"warning: {warning}")
    elif counts["cut_tokens"]:
        lines.append(f"truncated: the rows longer than max_length {recipe.data.max_length} keep their first "
                     f"{recipe.data.max_length} tokens: {cut_share(counts)} cut, never trained")
    if counts["split_rows"]:
        lines.append(f"split: the {counts['split_rows']} rows longer than max_length {recipe.data.max_length} cut into "
                     f"{counts['split_pieces']} pieces of <= {recipe.data.max_length} tokens (data.overlong: split)")
    if counts["blank_lines"]:
        lines.append(f"blank lines: {counts['blank_lines']} blank lines of .txt files left out (no rows)")
    return lines


def eval_overlap(stats: DataStats) -> str:
    """The sentence of eval examples that are training examples too (data line, `finetune data`)."""
    return (f"{stats.eval_in_train} of {stats.eval_examples} eval examples are also training examples (the same "
            "tokens): the eval loss measures recall of trained rows, not generalization. Fix: an eval file apart from "
            "the training files (data.eval_datasets), or the duplicate rows removed from the data")


def dropped_note(stats: DataStats) -> str:
    """Where the rows dropped for their length were, for the data line: ` (too long: a.jsonl line 7, line 93, ...)`."""
    if not stats.dropped_rows:
        return ""
    more = ", ..." if stats.dropped > len(stats.dropped_rows) else ""
    return f" (past max_length: {', '.join(stats.dropped_rows)}{more})"


def split_eval_indices(count: int, recipe: Recipe, *, rows: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """Indices of train and eval examples, order kept: a seeded choice of eval_fraction of the rows (at most
    eval_max_rows rows), each held out with all its examples. `rows`: each example's row, numbered from 0 in order
    (_row_numbers); None: one example per row. A conversation gives an example per assistant turn under templates
    that rewrite history (Qwen3, gpt-oss, GLM, R1: data/chat.py), and turn k+1's example holds turn k as history:
    drawing examples held turn k out while training turn k+1, so the eval loss measured recall (bug bash bb53)."""
    rows = np.arange(count) if rows is None else np.asarray(rows, dtype=np.int64)
    n_rows = int(rows.max()) + 1 if count else 0
    order = list(range(n_rows))  # one example per row: the same draw, over the same indices, as before rows were kept
    random.Random(recipe.train.seed).shuffle(order)
    fraction = recipe.data.eval_fraction
    n_eval = min(recipe.data.eval_max_rows, round(fraction * n_rows))
    if n_eval and n_eval >= n_rows:  # the eval set asked for would take every row: refused, not silently none
        what = f"{count} training examples" if n_rows == count else f"{n_rows} training rows ({count} examples)"
        raise DataError(f"data.eval_fraction {fraction} of the {what} holds out round({fraction} x "
                        f"{n_rows}) = {n_eval}, every one, leaving none to train on. Fix: a lower data.eval_fraction "
                        "(it holds out round(fraction x rows)), eval files in data.eval_datasets with "
                        "data.eval_fraction: 0, or more rows.")
    held = np.zeros(n_rows, dtype=bool)
    held[order[:n_eval]] = True
    return np.nonzero(~held[rows])[0].tolist(), np.nonzero(held[rows])[0].tolist()


def split_eval(examples: list[Example], recipe: Recipe) -> tuple[list[Example], list[Example]]:
    train_ids, eval_ids = split_eval_indices(len(examples), recipe)
    return [examples[i] for i in train_ids], [examples[i] for i in eval_ids]


def _fill_stats(stats: DataStats, stores: list[TokenStore], train: ExampleView, evaluation: ExampleView,
                sequences: Sequence[Example], recipe: Recipe) -> None:
    """The token counts `finetune data` shows (per example, in all, trained), and the rest of `stats`. A preference
    pair is one example of two sequences, both run and scored: its tokens are the chosen's and the rejected's
    together (before, the chosen's alone: a pair of 11 + 18 tokens, 2 + 9 scored, showed 11 tokens, 2 trained)."""
    counted = [_example_tokens(store) for store in stores]
    lengths = np.concatenate([tokens for tokens, _ in counted])
    stats.tokens_min, stats.tokens_max = int(lengths.min()), int(lengths.max())
    stats.tokens_median = float(np.median(lengths))
    stats.pairs = any(store.pairs for store in stores)
    stats.total_tokens = int(lengths.sum())
    stats.trained_tokens = int(sum(int(trained.sum()) for _, trained in counted))
    stats.train_examples, stats.eval_examples, stats.train_sequences = len(train), len(evaluation), len(sequences)
    batch, seed = recipe.train.micro_batch_size, recipe.train.seed
    rejected = train.rejected_lengths() if len(sequences) == len(train) else None  # pairs are never packed
    stats.batch_efficiency = batch_efficiency(sequence_lengths(sequences), micro_batch_size=batch, seed=seed,
                                              rejected=rejected)
    stats.unpacked_efficiency = batch_efficiency(train.lengths(), micro_batch_size=batch, seed=seed, rejected=rejected)


def _example_tokens(store: TokenStore) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, trained tokens) of each example of `store`: a pair's two sequences summed. The trained counts of
    every sequence are the store's, stored at build, so no token file is read."""
    if not store.pairs:
        return store.lengths(), store.trained_counts()
    return store.lengths() + store.rejected_lengths(), store.trained_counts() + store.rejected_trained_counts()
