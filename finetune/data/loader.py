"""Batches: collation and padding, the per-rank sampler with an exact resume position, eval batches."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from finetune.data.examples import IGNORE_INDEX, Example
from finetune.errors import DataError


# ------------------------------------------------------------------------------------------------- batching
def collate(examples: list[Example], pad_id: int, *, kl_partners: list[Example] | None = None,
            max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; padding is never trained.

    Unpacked rows carry an attention_mask. Packed rows carry position_ids instead (no attention_mask: transformers
    derives the per-example block mask from restarting positions only when the mask is absent); the padding tail
    gets its own restarting positions, so it is a separate pseudo-example that no real token attends to.

    Preference pairs: the B chosen sequences, then the B rejected ones, in one batch of 2B rows (one forward scores
    both), with `reference_logps` (2B values, same order) when they were precomputed.

    Unpaired preference rows (KTO): the rows and their labels (`desirable`); given `kl_partners`, also the KL rows
    (`kl_input_ids`, `kl_labels`, `kl_attention_mask`): each row's prompt followed by its partner's completion.

    GRPO prompts: the prompt ids with `rows` (the dataset rows, for the reward functions), `prompt_index` and `places`.
    """
    if examples and examples[0].row is not None:
        batch = _collate_rows(examples, pad_id)
        batch["rows"] = [e.row for e in examples]
        batch["prompt_index"] = torch.tensor([e.prompt_index for e in examples], dtype=torch.long)
        batch["prompt_copy"] = torch.tensor([e.copy for e in examples], dtype=torch.long)
        batch["places"] = [e.place for e in examples]
        return batch
    if examples and examples[0].desirable is not None:
        batch = _collate_rows(examples, pad_id)
        batch["desirable"] = torch.tensor([bool(e.desirable) for e in examples], dtype=torch.bool)
        if kl_partners is not None:
            mismatched = [kl_sequence(e, partner, max_length=max_length) for e, partner in zip(examples, kl_partners)]
            batch.update({f"kl_{key}": value for key, value in _collate_rows(mismatched, pad_id).items()})
        return batch
    if examples and examples[0].rejected is not None:
        batch = _collate_rows(examples + [e.rejected for e in examples], pad_id)
        if all(e.reference_logps is not None for e in examples):
            batch["reference_logps"] = torch.tensor([e.reference_logps[0] for e in examples] +
                                                    [e.reference_logps[1] for e in examples], dtype=torch.float64)
        return batch
    return _collate_rows(examples, pad_id)


def _collate_rows(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    if pad_id is None:  # data preparation refuses such a tokenizer (tokenize.check_end_tokens); a library caller's
        raise DataError("the tokenizer has neither a pad token nor an EOS token, so the batch cannot be padded. Fix: "
                        "set its `pad_token` (and `eos_token`) in its tokenizer_config.json, or set model.tokenizer "
                        "to a tokenizer that has them.")
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    packed = any(e.position_ids is not None for e in examples)
    extra = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        if packed:
            positions = example.position_ids if example.position_ids is not None else range(n)
            extra[row, :n] = torch.tensor(list(positions))
            extra[row, n:] = torch.arange(width - n)
        else:
            extra[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, ("position_ids" if packed else "attention_mask"): extra}


def kl_sequence(example: Example, partner: Example, *, max_length: int | None) -> Example:
    """`example`'s prompt (its tokens before the first trained one) followed by `partner`'s whole completion (from its
    first trained token on, with the tokens its own cut to max_length removed: Example.completion_tail), cut to
    max_length as a row is (keep the start): the mismatched pair of KTO's KL estimate, as TRL concatenates prompt_ids
    and the rotated, uncut completion_ids. A cut that leaves no trained token scores nothing."""
    prompt, start, tail = _first_trained(example), _first_trained(partner), partner.completion_tail
    ids = example.input_ids[:prompt] + partner.input_ids[start:] + (tail.input_ids if tail is not None else [])
    labels = [IGNORE_INDEX] * prompt + partner.labels[start:] + (tail.labels if tail is not None else [])
    return Example(ids[:max_length], labels[:max_length])


def _first_trained(example: Example) -> int:
    return next((i for i, label in enumerate(example.labels) if label != IGNORE_INDEX), len(example.labels))


def real_token_count(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    """Non-pad tokens of a batch (for tokens/s): the attention mask's sum, or for packed rows everything before
    each row's padding tail (trailing pad ids with ignored labels)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    filler = (batch["input_ids"] == pad_id) & (batch["labels"] == IGNORE_INDEX)
    positions = torch.arange(1, filler.size(1) + 1) * (~filler).long()
    return int(positions.max(dim=1).values.sum())


def epoch_permutation(count: int, seed: int, epoch: int) -> list[int]:
    """The global order of one epoch: the same on every rank and for every world size."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(count, generator=generator).tolist()


def steps_per_epoch(rows: int, *, micro_batch_size: int, world_size: int, grad_accum: int, iterations: int = 1) -> int:
    """Whole optimizer steps in one pass over `rows` training rows. It depends only on the rows one step takes
    (micro_batch_size x world_size x grad_accum), so 1 process x batch 4 and 2 x 2 have the same epochs.
    `iterations`: the steps that train on each step's rows (GRPO's grpo.num_iterations: a cycle of that many steps
    takes one step's prompts, as TRL's RepeatSampler repeats each prompt batch, so an epoch has that many times the
    steps)."""
    return rows // (micro_batch_size * world_size) // grad_accum * iterations


def rows_left_note(rows: int, *, micro_batch_size: int, world_size: int, grad_accum: int) -> str:
    """"" or the words for the rows past an epoch's last whole step, which that epoch leaves out (a different few each
    epoch, as the order changes). Only docs/data.md said so: a 16-row epoch of 6-row steps left 4 rows, 39% of its
    tokens, with "0 dropped" printed and `epoch: 1.0` logged (bb23)."""
    steps = steps_per_epoch(rows, micro_batch_size=micro_batch_size, world_size=world_size, grad_accum=grad_accum)
    left = rows - steps * micro_batch_size * world_size * grad_accum
    if steps == 0 or left == 0:
        return ""
    return (f"; {left} of the {rows} rows left out of each epoch (past its last whole step of "
            f"{micro_batch_size * world_size * grad_accum} rows; a different {left} each epoch)")


def step_over_rows_note(rows: int, *, micro_batch_size: int, world_size: int, grad_accum: int) -> str:
    """"" or the words for one optimizer step that takes more rows than the data holds (train.max_steps: docs/data.md's
    smoke run of a grad_accum 32 recipe on 40 rows, which is allowed): `train.grad_accum=1000000` on 19 rows said "0
    steps per epoch" and "recipe OK", and its first step then went over the rows a million times (bb56). `finetune
    validate` and `finetune data` both say it."""
    step = micro_batch_size * world_size * grad_accum
    if rows >= step:
        return ""
    most = max(1, rows // (micro_batch_size * world_size))
    times = f"about {step / rows:,.0f} times" if rows and step >= 2 * rows else "more than once"
    return (f"one optimizer step takes {step:,} rows ({micro_batch_size} per micro-batch x {world_size} "
            f"process{'es' if world_size > 1 else ''} x train.grad_accum {grad_accum}) of {rows:,} training rows, so "
            f"each step goes over the same rows {times}; train.grad_accum={most} or less takes each row once at most")


def checked_steps_per_epoch(rows: int, *, micro_batch_size: int, world_size: int, grad_accum: int,
                            iterations: int = 1) -> int:
    """steps_per_epoch for train.num_epochs, which needs at least one whole step per epoch (DataError otherwise)."""
    steps = steps_per_epoch(rows, micro_batch_size=micro_batch_size, world_size=world_size, grad_accum=grad_accum,
                            iterations=iterations)
    if steps == 0:
        raise _alike(DataError(
            f"train.num_epochs: only {rows} training rows for one optimizer step of "
            f"{micro_batch_size * world_size * grad_accum} rows (train.micro_batch_size={micro_batch_size} x {world_size} "
            f"process{'es' if world_size > 1 else ''} x train.grad_accum={grad_accum}; with data.packing a row holds "
            "several examples), so an epoch holds no step. Fix: add data, lower the batch size or grad_accum, or set "
            "train.max_steps instead (each step then takes rows of more than one epoch)."
        ))
    return steps


def check_enough_rows(rows: int, *, micro_batch_size: int, world_size: int) -> None:
    """A global micro-batch needs that many training rows (the run's start and `finetune validate` ask alike)."""
    global_batch = micro_batch_size * world_size
    if rows < global_batch:
        raise _alike(DataError(
            f"only {rows} training rows for a global micro-batch of {global_batch} "
            f"(train.micro_batch_size={micro_batch_size} x {world_size} processes; with data.packing a row holds "
            "several examples). Add data or lower the batch size."
        ))


def _alike(error: DataError) -> DataError:
    """A count every rank makes of the same rows: the error is the same on every rank, so rank 0 prints it, once,
    while the others wait for its paragraph (run.py main; they printed their own copy, `(rank 1) ...`, first)."""
    error.alike_on_every_rank = True
    return error


class BatchStream:
    """Endless micro-batches for one rank: a seeded shuffle per epoch, each rank a disjoint, strided share.

    The global order is the same for every world size: global micro-batch g of size B*W holds rows
    perm[g*B*W : (g+1)*B*W], and rank r takes every W-th of them. So 1 process with batch 4 and 2 processes
    with batch 2 see the same rows per optimizer step. Position (epoch, cursor) is resumable state. An epoch ends
    on a whole optimizer step (`grad_accum` micro-batches): the rows past its last whole step are left out of that
    epoch (a different set each epoch), so no step mixes two epochs and epoch = step / steps_per_epoch exactly.
    """

    def __init__(self, examples: Sequence[Example], *, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 pad_id: int, grad_accum: int = 1, kl_max_length: int | None = None, iterations: int = 1):
        global_batch = micro_batch_size * world_size
        check_enough_rows(len(examples), micro_batch_size=micro_batch_size, world_size=world_size)
        self.examples, self.batch, self.rank, self.world = examples, micro_batch_size, rank, world_size
        self.seed, self.pad_id, self.grad_accum = seed, pad_id, grad_accum
        self.iterations = iterations  # steps per step's rows (steps_per_epoch's): GRPO's num_iterations cycle
        self.epoch, self.cursor = 0, 0  # cursor counts global micro-batches taken in this epoch
        self.counted_from = (0, 0.0)  # (step, epochs done then) epoch_at counts from: a resumed run's checkpoint
        self._fingerprint: str | None = None  # rows_fingerprint, at the first save
        # KTO rows, given kl_max_length (the loss has a KL term): each micro-batch carries its KL rows
        self.unpaired = kl_max_length is not None and examples[0].desirable is not None
        self.kl_max_length = kl_max_length
        if self.unpaired and global_batch * grad_accum == 1:
            raise DataError(
                "train.objective kto: an optimizer step of one row pairs its prompt with its own completion, so the KL "
                "estimate is the row's own reward (TRL refuses a batch of 1 too). Fix: raise train.micro_batch_size or "
                "train.grad_accum (the mismatched pairs are formed over the rows of a step).")
        steps = steps_per_epoch(len(examples), micro_batch_size=micro_batch_size, world_size=world_size,
                                grad_accum=grad_accum)
        # Rows for less than one step (a 2-step smoke run of a grad_accum 32 recipe on 40 rows; train.max_steps only,
        # num_epochs refuses it) keep epochs of whole micro-batches: a step then takes rows of more than one epoch.
        self.batches_per_epoch = steps * grad_accum or len(examples) // global_batch

    def epoch_at(self, step: int) -> float:
        """Epochs done after `step` optimizer steps (step / steps per epoch), 4 decimals as Hugging Face's Trainer.
        A resumed run counts on from its checkpoint's position, whose steps may have taken other rows per step."""
        return round(self.epochs_done(step), 4)

    def epochs_done(self, step: int) -> float:
        """epoch_at unrounded (what a checkpoint keeps). A GRPO cycle of `iterations` steps takes one step's rows: each
        step is 1/iterations of them (TRL's epoch: step / its steps per epoch, num_iterations x as many)."""
        first, done = self.counted_from
        return done + (step - first) * self.grad_accum / (self.batches_per_epoch * self.iterations)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (its shuffle is seed + epoch)."""
        self.epoch, self.cursor = epoch, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            perm = epoch_permutation(len(self.examples), self.seed, self.epoch)
            while self.cursor < self.batches_per_epoch:
                start = self.cursor * self.batch * self.world
                rows = perm[start : start + self.batch * self.world][self.rank :: self.world]
                partners = [self.examples[i] for i in self._kl_partners(perm)] if self.unpaired else None
                self.cursor += 1
                yield collate([self.examples[i] for i in rows], self.pad_id, kl_partners=partners,
                              max_length=self.kl_max_length)
            self.epoch, self.cursor = self.epoch + 1, 0

    def _kl_partners(self, perm: list[int]) -> list[int]:
        """KTO's KL rows for this rank's rows of the current global micro-batch: the rows of the optimizer step (its
        grad_accum global micro-batches, in order) each take the completion of the row before, the first the last's.
        TRL rotates by one within one device's batch; over the whole step instead, the KL rows, like the rows, are the
        same for any world size and micro-batch split."""
        size = self.batch * self.world
        first = self.cursor - self.cursor % self.grad_accum
        block = perm[first * size : min(first + self.grad_accum, self.batches_per_epoch) * size]
        offset = (self.cursor - first) * size
        return [block[position - 1] for position in range(offset + self.rank, offset + size, self.world)]

    def state_dict(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = rows_fingerprint(self.examples)
        return {"epoch": self.epoch, "cursor": self.cursor, "world_size": self.world, "micro_batch_size": self.batch,
                "rows": len(self.examples), "seed": self.seed, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saving run stopped, even if it had another world size or micro-batch size. `state`'s
        `step` (the checkpoint's; the loop adds it, with the epoch it logged then: GRPO's num_iterations cycles take
        fewer rows than steps) is where epoch_at counts on from."""
        if state.get("streaming"):
            raise DataError("resume: the checkpoint was written by a run with data.streaming, whose position is a row of "
                            "the stream, not of the shuffled rows. Resume with data.streaming: true, or start a new run.")
        for key, mine in (("rows", len(self.examples)), ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise DataError(f"resume: the checkpoint's data stream had {key}={state[key]}, this run has {mine}: the "
                                "data, data settings or seed changed since the checkpoint, so the position in the data "
                                "cannot be restored. Resume with the same data and recipe, or start a new run.")
        # Position is kept in global micro-batches of the saving run; convert if the global batch changed.
        saved_global = state["world_size"] * state["micro_batch_size"]
        rows_seen = state["cursor"] * saved_global
        self.epoch = state["epoch"]
        self.cursor = math.ceil(rows_seen / (self.batch * self.world))
        if "step" in state:  # the epoch the checkpoint's run logged at its step, else its data position's
            done = state.get("logged_epoch")
            self.counted_from = (state["step"], done if done is not None else
                                 self.epoch + min(1.0, self.cursor / self.batches_per_epoch))


def _filler(example: Example) -> Example:
    """A copy of `example` with nothing trained (a pair's two sequences alike): it adds no loss and no count."""
    ignored = Example(example.input_ids, [IGNORE_INDEX] * len(example.input_ids),
                      reference_logps=(0.0, 0.0) if example.reference_logps is not None else None,
                      desirable=example.desirable)
    if example.rejected is not None:
        ignored.rejected = Example(example.rejected.input_ids, [IGNORE_INDEX] * len(example.rejected.input_ids))
    return ignored


def eval_batches(examples: list[Example], *, micro_batch_size: int, rank: int, world_size: int, pad_id: int):
    """This rank's share of the eval set, in order.

    Every rank runs the same number of batches (FSDP needs every rank in every forward): a short share is topped
    up with a copy of an example whose labels are all ignored, which changes neither loss sum nor token count.
    """
    per_rank = math.ceil(len(examples) / world_size)
    share = examples[rank::world_size]
    filler = _filler(examples[0]) if examples else None
    share = share + [filler] * (per_rank - len(share))
    for start in range(0, per_rank, micro_batch_size):
        yield collate(share[start : start + micro_batch_size], pad_id)


def rows_fingerprint(examples: Sequence[Example]) -> str:
    """A hash of the training rows' tokens and labels in their order before the shuffle (what a saved data position
    indexes): a resume onto other rows of the same count is said (outputs/resume_checks.py). Tokenized stores are
    hashed from their mapped arrays (about 1 s per GB); a list (GRPO prompts, a library caller's) example by example."""
    known = getattr(examples, "_rows_fingerprint", None)  # a view's rows never change: hashed once per run
    if known is not None:
        return known
    digest = hashlib.blake2b(digest_size=16)
    view = getattr(examples, "base", examples)  # store.PackedView's examples (store imports this module)
    if hasattr(view, "stores"):  # a store.ExampleView: the stores its rows come from (not the eval files' after them)
        used = {int(number) for number in np.unique(np.searchsorted(np.asarray(view.starts), view.picks, side="right") - 1)}
        for number, store in enumerate(view.stores):
            if number not in used:
                continue
            for array in (store.ids, store.trained, store.bounds, *([store.desirable] if store.desirable is not None else [])):
                digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        digest.update(view.picks.tobytes())
        if view is not examples:
            digest.update(examples.members.tobytes() + examples.row_bounds.tobytes())
        examples._rows_fingerprint = digest.hexdigest()  # the start's cross-rank check, a resume's, the first save's
        return examples._rows_fingerprint
    for example in examples:
        for sequence in (example, example.rejected):
            if sequence is not None:
                digest.update(np.asarray(sequence.input_ids, np.int64).tobytes())
                digest.update(np.asarray(sequence.labels, np.int64).tobytes())
    return digest.hexdigest()
