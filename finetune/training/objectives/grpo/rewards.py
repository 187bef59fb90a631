"""GRPO's reward functions called on a batch of completions, as TRL 1.16's _calculate_rewards calls them: a table of
each function's values (None and NaN: not scored), their weighted nansum, async functions awaited together, and what
the functions log through TRL's `log_metric` / `log_extra`. A function that fails is named (`grpo.reward_functions[i]`,
a model `grpo.reward_models[i]`) with what it did: raised (with the prompt row it raises on), returned no list, the
wrong count, or a value that is no finite number."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from finetune.errors import RewardError
from finetune.recipe.grpo import scorer_name, signature_problem

STOPPED = ("The run stopped before this step's update; the checkpoints it wrote are intact. {fix}, then continue with "
           "train.resume=auto (from the newest checkpoint; with none yet, the run starts over).")
FIX_FUNCTION = "Fix the function (it receives prompts, completions and every other column of the rows as keyword lists)"
FIX_MODEL = ("Fix: check that the reward model's tokenizer renders these prompts (docs/grpo.md, Reward models), or "
             "remove it from grpo.reward_models")
# The keys of the step's own figures and of the loop's metrics line: a metric logged under one would replace it.
OWN_METRICS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "num_tokens", "tokens_per_s", "elapsed_s",
               "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "generation_s", "aux_loss",
               "cispo_clip_ratio")
OWN_PREFIXES = ("rewards/", "completions/", "clip_ratio/", "sampling/")


def reward_name(function) -> str:
    return scorer_name(function)


@dataclass
class TrainerState:
    """TRL's `trainer_state` argument, with the names of transformers' TrainerState that finetune knows when it samples:
    global_step (optimizer steps done: the step being trained minus 1, as TRL's at generation), max_steps,
    num_train_epochs (train.num_epochs; 0 when the recipe gives max_steps, as transformers' default), epoch (None: the
    GRPO objective does not know the epoch when it samples) and the process flags. The rest of transformers' fields
    (log_history, total_flos, best_metric, ...) are absent."""

    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: float = 0
    epoch: float | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


@dataclass
class RewardLog:
    """What the reward functions log through TRL's callbacks in one generation: `log_metric(name, value)` -> the step's
    metric `name` (averaged over the calls and ranks, as TRL's), `log_extra(column, values)` -> a column of the
    completions log (one value per completion of the call). `size`: the completions of the current call."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)
    size: int = 0

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or name in OWN_METRICS or name.startswith(OWN_PREFIXES):
            raise ValueError(f"log_metric({name!r}, ...): a name of finetune's own metrics (or not text). Fix: name "
                             "yours otherwise, e.g. with the function's name in front")
        number = _number(value)
        if number is None:
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a number")
        self.metrics.setdefault(name, []).append(number)

    def log_extra(self, column: str, values: list) -> None:
        values = list(values)
        if len(values) != self.size:
            raise ValueError(f"log_extra({column!r}, ...): {len(values)} values for the {self.size} completions of "
                             "the call. Fix: one value per completion, in order")
        self.columns[str(column)] = values


def scorer_keys(functions: list) -> list[str]:
    """How each scorer is named in a message: `grpo.reward_functions[i]: `name`` or, for a reward model (after the
    functions, in the recipe's order), `grpo.reward_models[i]: `name` (path)`."""
    keys, counts = [], [0, 0]
    for function in functions:
        model = getattr(function, "is_reward_model", False)
        index, counts[model] = counts[model], counts[model] + 1
        keys.append(f"grpo.reward_models[{index}]: `{reward_name(function)}` ({function.path})" if model
                    else f"grpo.reward_functions[{index}]: `{reward_name(function)}`")
    return keys


def rewards_per_function(functions: list, prompts: list, completions: list, columns: dict[str, list],
                         places: list[str], *, model_prompts: list | None = None, log: RewardLog | None = None,
                         **extra) -> torch.Tensor:
    """(completions, functions) float64 rewards, NaN where a function returned None or NaN. Each function is called
    f(prompts=..., completions=..., **columns, **extra, log_extra=..., log_metric=...) (`extra`: completion_ids and
    trainer_state; TRL's names win over a column's); a reward model gets `model_prompts` (the conversations as the
    policy saw them) as its prompts. Async functions are awaited together (TRL's asyncio.gather). A function that
    cannot be called so, raises, returns no list, the wrong count or a value that is no finite number is a
    RewardError naming it and (`places`: each completion's prompt row) the row."""
    log = log if log is not None else RewardLog()
    log.size, log.columns = len(completions), {}  # this call's columns (the caller takes them after it)
    kwargs = {**columns, **extra, "log_extra": log.log_extra, "log_metric": log.log_metric}
    keys, outputs, pending = scorer_keys(functions), {}, {}
    scored = [model_prompts if getattr(f, "is_reward_model", False) and model_prompts is not None else prompts
              for f in functions]
    for column, function in enumerate(functions):
        if not getattr(function, "is_reward_model", False) and (why := signature_problem(function, list(columns))):
            _close(pending.values())
            raise RewardError(f"{keys[column]} {why}")
        try:
            outputs[column] = function(prompts=scored[column], completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001  (user code: any exception is named, with its row)
            _close(pending.values())
            raise _raised(keys[column], function, exc, scored[column], completions, kwargs, places) from None
        if inspect.isawaitable(outputs[column]):
            pending[column] = outputs[column]
    outputs.update(zip(pending, _awaited(list(pending.values()))))
    table = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float64)
    for column, function in enumerate(functions):
        if isinstance(outputs[column], Exception):  # an async function raised
            raise _raised(keys[column], function, outputs[column], scored[column], completions, kwargs, places)
        table[:, column] = torch.tensor(_values(keys[column], outputs[column], places), dtype=torch.float64)
    return table


def _values(key: str, output, places: list[str]) -> list[float]:
    """A function's output as one float per completion (NaN: not scored), or the RewardError saying what it returned."""
    values = _listed(output)
    if values is None:
        raise RewardError(f"{key} returned {_what(output)}, not a list of one float per completion ({len(places)} "
                          "here). Fix: return a list of one float (or None: not scored) per completion, in order (a "
                          "function without `return` returns None).")
    if len(values) != len(places):
        raise RewardError(f"{key} returned {len(values)} values for {len(places)} completions. Fix: return one float "
                          "(or None) per completion, in order.")
    numbers_ = []
    for row, value in enumerate(values):
        number = math.nan if value is None else _number(value)
        if number is None or math.isinf(number):
            raise _on_row(f"{key} returned {value!r} for the completion of {places[row]}. Fix: return finite "
                          "floats, or None / NaN for not scored.", places[row])
        numbers_.append(number)
    return numbers_


def _listed(output) -> list | None:
    """What TRL iterates: a list, a tuple, a 1-D tensor or array, any other iterable of values; None for None, a
    number, a 0-d tensor, text or a mapping (no list of rewards)."""
    if output is None or isinstance(output, (str, bytes, dict, numbers.Number)) or getattr(output, "shape", None) == ():
        return None
    return list(output) if isinstance(output, Iterable) else None


def _what(output) -> str:
    if output is None:
        return "None"
    if isinstance(output, str):
        return f"a str ({output[:40]!r})"
    if isinstance(output, numbers.Number) or getattr(output, "shape", None) == ():
        return f"a {type(output).__name__} ({output!r})"
    return f"a {type(output).__name__}"


def _number(value) -> float | None:
    """A reward as a float: any real number (Python's, numpy's scalars) or a one-element tensor or array, as TRL takes
    them (it makes a float tensor of the list); None for anything else (a string, a list)."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and tuple(getattr(value, "shape", (0,))) in ((), (1,)):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _awaited(awaitables: list) -> list:
    """The awaitables' results (an exception where one raised), run together on an event loop of their own, as TRL
    gathers its async reward functions; from inside a running loop (a notebook), on a thread of their own."""
    if not awaitables:
        return []

    async def gathered():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gathered())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gathered()).result()


def _close(awaitables) -> None:
    """Coroutines left unawaited when an earlier function failed: closed (no 'never awaited' warning)."""
    for awaitable in awaitables:
        getattr(awaitable, "close", lambda: None)()


def _raised(key: str, function, exc: BaseException, prompts, completions, kwargs, places) -> RewardError:
    where = _failing_row(function, prompts, completions, kwargs, places)
    fix = FIX_MODEL if getattr(function, "is_reward_model", False) else FIX_FUNCTION
    return _on_row(f"{key} raised {type(exc).__name__}: {exc} (on {where}). " + STOPPED.format(fix=fix), where)


def _on_row(message: str, row: str) -> RewardError:
    """A RewardError naming the prompt row it failed on; `without_rows` compares it with other ranks' without it."""
    error = RewardError(message)
    error.row = row
    return error


def without_rows(error: RewardError | None) -> str | None:
    """What `error` says but for the prompt row it names (each rank fails on its own rows): two ranks whose functions
    failed alike give the same text. None: no failure on this rank."""
    if error is None:
        return None
    row = getattr(error, "row", None)
    return str(error).replace(row, "") if row else str(error)


def stopped_by(failure: RewardError | None, failures: list[str | None]) -> RewardError:
    """The error this rank stops with once some rank's reward call failed (`failures`: every rank's `without_rows`,
    None where none failed). Failed alike on every rank (the same function, the same exception): one paragraph, said
    by rank 0, saying so (the ranks named different rows: it read as two problems). Else each failing rank says its
    own, and a rank that did not fail names the other rank."""
    if failure is None:
        return RewardError("grpo.reward_functions: a reward function or model failed on another rank (its message is "
                           "in that rank's output); the run stopped before this step's update.")
    if len(failures) < 2 or any(other != failures[0] for other in failures):
        return failure
    rows = ", each on its own prompt rows; the row named here is rank 0's" if getattr(failure, "row", None) else ""
    alike = RewardError(f"on every rank alike ({len(failures)} processes{rows}): {failure}")
    alike.alike_on_every_rank = True  # rank 0 prints it, once; the others wait for its paragraph (run.py main)
    return alike


def _failing_row(function, prompts, completions, kwargs, places) -> str:
    """The first prompt row on which the function raises alone (the batch call raised; which row did it?)."""
    for row in range(len(completions)):
        log = RewardLog(size=1)
        one = {key: values[row:row + 1] if isinstance(values, list) and len(values) == len(completions) else values
               for key, values in {**kwargs, "log_extra": log.log_extra, "log_metric": log.log_metric}.items()}
        try:
            output = function(prompts=prompts[row:row + 1], completions=completions[row:row + 1], **one)
            if inspect.isawaitable(output) and isinstance(_awaited([output])[0], Exception):
                return places[row]
        except Exception:  # noqa: BLE001
            return places[row]
    return f"the whole batch only (no prompt row raises alone: {'; '.join(dict.fromkeys(places))})"


def weighted_rewards(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """nansum of the weighted rewards per completion; NaN where every function left it unscored (as TRL)."""
    rewards = (table * torch.tensor(weights, dtype=table.dtype)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(table).all(dim=1), math.nan)
