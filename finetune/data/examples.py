"""What the data stage produces: tokenized examples (ids, labels, packed position ids) and statistics."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from finetune.errors import DataError

IGNORE_INDEX = -100


@dataclass
class Example:
    """One training row: token ids, labels (IGNORE_INDEX where untrained), position ids when packed.

    A preference pair is its chosen sequence with the rejected one attached (`rejected`); `reference_logps` holds the
    reference model's (chosen, rejected) log-probabilities when dpo.reference is precomputed. An unpaired preference
    row (KTO) is one sequence whose `desirable` says whether its completion is desirable (its label). A GRPO prompt
    (format: prompt) is its prompt's ids, nothing trained, with `row`: the dataset row ({"prompt": text or messages,
    the other columns}) its reward functions read, `prompt_index`: its place among the rows of data.datasets read in
    order, from 0, kept or not (the sampling seed of its completions), `copy`: which repeat of it a dataset's weight
    made (0: the first; its completions are drawn from seeds of their own), and `place`: its file and line.
    A KTO row cut to data.max_length keeps the completion tokens the cut removed in `completion_tail` (as many as a
    mismatched row can hold): the KL row that borrows its completion takes the whole of it, as TRL's does.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    rejected: Example | None = None
    reference_logps: tuple[float, float] | None = None
    desirable: bool | None = None
    row: dict | None = None
    prompt_index: int | None = None
    copy: int = 0
    place: str | None = None
    completion_tail: Example | None = None

    @property
    def num_trained(self) -> int:
        """Targets: a label past the first token (nothing predicts an example's first token, packed or not)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass
class DataStats:
    rows: int = 0
    skipped: int = 0
    truncated: int = 0
    dropped: int = 0
    pairs: bool = False  # preference pairs: tokens_min/median/max count a pair's two sequences together
    prompt_truncated: int = 0  # preference pairs: pairs whose prompt lost its beginning
    response_truncated: int = 0  # preference pairs: pairs whose responses lost their ends
    train_examples: int = 0
    eval_examples: int = 0
    skipped_reasons: list[str] = field(default_factory=list)
    dropped_rows: list[str] = field(default_factory=list)  # where the first rows dropped for length were (file, line)
    train_sequences: int = 0  # rows the BatchStream walks over: packed rows, or train_examples unpacked
    tokens_min: int = 0
    tokens_median: float = 0.0
    tokens_max: int = 0
    total_tokens: int = 0
    trained_tokens: int = 0
    batch_efficiency: float = 0.0  # non-pad / all tokens of the train micro-batches of one epoch, as the run collates
    unpacked_efficiency: float = 0.0  # the same without packing, for comparison
    cached_datasets: int = 0  # datasets read from the tokenization cache instead of tokenized
    per_dataset: list[dict] = field(default_factory=list)
    eval_in_train: int = 0  # eval examples whose tokens equal a training example's (build._eval_in_train)


@dataclass
class PreparedData:
    """Everything `prepare` builds: the examples before packing (for previews) and what training consumes."""

    examples: Sequence[Example]
    train: Sequence[Example]
    eval: Sequence[Example]
    stats: DataStats
    eval_files: Sequence[Example] = field(default_factory=list)  # the examples of data.eval_datasets (first in `eval`)


def weighted(examples: list, weight: float, seed: int) -> list:
    """Repeat (weight > 1) or subsample (weight < 1) a dataset's examples for mixing."""
    if weight == 1.0:
        return examples
    whole, fraction = int(weight), weight - int(weight)
    rng = random.Random(seed)
    extra = rng.sample(examples, k=round(fraction * len(examples)))
    return examples * whole + extra


def weighted_share(examples: list, weight: float, seed: int, *, where: str) -> list:
    """`weighted`, and a weight that leaves a dataset none of its training examples refused (`where`: its recipe key
    and path), naming the least weight that keeps one: SFT, preference and GRPO data alike."""
    kept = weighted(examples, weight, seed)
    if examples and not kept:
        raise DataError(f"{where}: weight {weight} of its {len(examples)} training examples keeps round({weight} x "
                        f"{len(examples)}) = 0, so it would not be trained on. Fix: a weight of at least "
                        f"{1 / len(examples):.3g} (one example), or remove the dataset.")
    return kept
