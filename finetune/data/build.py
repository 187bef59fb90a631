"""Every dataset of the recipe: weighted, mixed, the eval set split off (or read from eval files), packed."""

from __future__ import annotations

import random
import statistics

from finetune.data.cache import dataset_examples
from finetune.data.examples import DataStats, Example, PreparedData
from finetune.data.packing import batch_efficiency, pack_examples, packing_problem
from finetune.errors import DataError
from finetune.recipe import Recipe


# ------------------------------------------------------------------------------------------------ the datasets
def _count(stats: DataStats, dataset: list, counts: dict, spec, key: str, *, role: str | None = None) -> None:
    """Add one file's counts to `stats`; a file with no usable rows is an error naming its recipe key."""
    for name in ("rows", "skipped", "truncated", "dropped", "prompt_truncated", "response_truncated"):
        setattr(stats, name, getattr(stats, name) + counts.get(name, 0))
    stats.skipped_reasons += counts["skipped_reasons"]
    stats.cached_datasets += int(counts["cached"])
    if not dataset:
        first = f" First problem: {counts['skipped_reasons'][0]}" if counts["skipped_reasons"] else ""
        raise DataError(f"{key} ({spec.path}): no usable rows ({counts['rows']} read, {counts['skipped']} skipped, "
                        f"{counts['dropped']} dropped as too long).{first}")
    entry = {"path": spec.path, "format": spec.format, "rows": counts["rows"], "examples": len(dataset),
             "weight": spec.weight, "cached": counts["cached"]}
    stats.per_dataset.append({**entry, "role": role} if role else entry)


def prepare(recipe: Recipe, tokenizer) -> PreparedData:
    """Every dataset tokenized (or from the cache), the eval set split off, weights applied, train rows packed."""
    stats, examples, origin = DataStats(), [], []
    for index, spec in enumerate(recipe.data.datasets):
        dataset, counts = dataset_examples(spec, recipe, tokenizer)
        _count(stats, dataset, counts, spec, f"data.datasets[{index}]")
        examples += dataset
        origin += [index] * len(dataset)
    eval_files = eval_file_examples(recipe, tokenizer, stats)
    train_ids, eval_ids = split_eval_indices(len(examples), recipe)
    train = _mix([examples[i] for i in train_ids], [origin[i] for i in train_ids], recipe)
    evaluation = eval_files + [examples[i] for i in eval_ids]  # files first: the generation eval takes the first rows
    sequences = train
    if recipe.data.packing:
        problem = packing_problem(recipe.model.attn_implementation)
        if problem:
            raise DataError(problem)
        sequences = pack_examples(train, recipe.data.max_length)
    _fill_stats(stats, examples, train, evaluation, sequences, recipe)
    return PreparedData(examples, sequences, evaluation, stats, eval_files)


def eval_file_examples(recipe: Recipe, tokenizer, stats: DataStats) -> list[Example]:
    """The examples of data.eval_datasets (tokenized like training data, cached, never weighted, packed or capped)."""
    found: list[Example] = []
    for index, spec in enumerate(recipe.data.eval_datasets):
        key = f"data.eval_datasets[{index}]"
        try:
            dataset, counts = dataset_examples(spec, recipe, tokenizer)
        except DataError as exc:  # the loaders name data.datasets; this is an eval file
            raise DataError(str(exc).replace("data.datasets path", f"{key} path", 1)) from None
        _count(stats, dataset, counts, spec, key, role="eval")
        found += dataset
    return found


def build_examples(recipe: Recipe, tokenizer) -> tuple[list[Example], list[Example], DataStats]:
    """Train rows (packed when data.packing) and eval examples; every rank builds the same lists, BatchStream splits."""
    prepared = prepare(recipe, tokenizer)
    return prepared.train, prepared.eval, prepared.stats


def _mix(train: list[Example], origin: list[int], recipe: Recipe) -> list[Example]:
    """Apply each dataset's weight to its train examples: repeat (weight > 1) or subsample (weight < 1)."""
    weights = [spec.weight for spec in recipe.data.datasets]
    if all(weight == 1.0 for weight in weights):
        return train
    mixed = []
    for index, weight in enumerate(weights):
        mixed += _weighted([e for e, o in zip(train, origin) if o == index], weight, recipe.train.seed + index)
    return mixed


def _weighted(examples: list[Example], weight: float, seed: int) -> list[Example]:
    """Repeat (weight > 1) or subsample (weight < 1) a dataset's examples for mixing."""
    if weight == 1.0:
        return examples
    whole, fraction = int(weight), weight - int(weight)
    rng = random.Random(seed)
    extra = rng.sample(examples, k=round(fraction * len(examples)))
    return examples * whole + extra


def split_eval_indices(count: int, recipe: Recipe) -> tuple[list[int], list[int]]:
    """Indices of train and eval examples: a seeded choice of eval_fraction (at most eval_max_rows), order kept."""
    order = list(range(count))
    random.Random(recipe.train.seed).shuffle(order)
    n_eval = min(recipe.data.eval_max_rows, round(recipe.data.eval_fraction * count))
    if count - n_eval < 1:
        n_eval = 0
    eval_ids = set(order[:n_eval])
    return [i for i in range(count) if i not in eval_ids], sorted(eval_ids)


def split_eval(examples: list[Example], recipe: Recipe) -> tuple[list[Example], list[Example]]:
    train_ids, eval_ids = split_eval_indices(len(examples), recipe)
    return [examples[i] for i in train_ids], [examples[i] for i in eval_ids]


def _fill_stats(stats: DataStats, examples: list[Example], train: list[Example], evaluation: list[Example],
                sequences: list[Example], recipe: Recipe) -> None:
    lengths = [len(e.input_ids) for e in examples]
    stats.tokens_min, stats.tokens_max = min(lengths), max(lengths)
    stats.tokens_median = float(statistics.median(lengths))
    stats.total_tokens, stats.trained_tokens = sum(lengths), sum(e.num_trained for e in examples)
    stats.train_examples, stats.eval_examples, stats.train_sequences = len(train), len(evaluation), len(sequences)
    batch, seed = recipe.train.micro_batch_size, recipe.train.seed
    stats.batch_efficiency = batch_efficiency(sequences, micro_batch_size=batch, seed=seed)
    stats.unpacked_efficiency = batch_efficiency(train, micro_batch_size=batch, seed=seed)
