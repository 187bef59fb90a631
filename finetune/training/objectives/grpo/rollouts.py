"""One GRPO generation batch: the step's prompts -> G sampled completions each -> rewards -> advantages (and the
log-probs kept from generation when the loss needs them), with TRL's metrics of the batch.

Every rank samples its own prompts' completions (training/rollout.py) and scores them with the reward functions in
its own process; a prompt's group stays in one micro-batch, so its advantages need no gather. What spans ranks is
summed once (distributed.all_reduce_sum): the batch's reward std (scale_rewards batch) and the logged figures. A
reward function that fails on one rank stops every rank after the same step (none updates), naming the function.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import time
from pathlib import Path

import torch
from torch import nn

from finetune import distributed, host_memory
from finetune.data import IGNORE_INDEX
from finetune.data.conversations import convert_turns
from finetune.data.prompts import cut_at_stops, turn_end_ids, turn_end_stops
from finetune.data.replies import completion_message
from finetune.data.templates import row_system, with_system
from finetune.errors import RewardError
from finetune.parallel import unwrap
from finetune.recipe import DatasetSpec
from finetune.training.loss import token_logps
from finetune.training.objectives.grpo import loss as grpo
from finetune.training.objectives.grpo import rewards as reward_table
from finetune.training.objectives.grpo.sampling import generate_completions, sampling_seed


def generation_gather(configured: str = "once") -> str:
    """How FSDP2 gathers for generation: `once` per generate call (default), or `per_forward` (FSDP2's own hooks at
    every decoding step): the recipe's grpo.generation_gather, unless FINETUNE_GENERATION_GATHER is set (the switch
    that measures one against the other, docs/grpo.md). Other strategies ignore it."""
    gather = os.environ.get("FINETUNE_GENERATION_GATHER", configured)
    if gather not in ("once", "per_forward"):
        raise ValueError(f"FINETUNE_GENERATION_GATHER={gather!r}: must be `once` or `per_forward`")
    return gather


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, the model's generation config's (a chat model's
    end-of-turn token) and the token the chat template closes an assistant turn with (a base model given
    model.chat_template lists none). Where that end of turn is text to the tokenizer (ChatML's `<|im_end|>` on a
    Llama 2 base), generation stops on the text instead (prompts.turn_end_stops)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    ids |= set(turn_end_ids(tokenizer))
    configured = getattr(getattr(unwrap(model), "generation_config", None), "eos_token_id", None)
    listed = configured if isinstance(configured, list) else [configured] if configured is not None else []
    ids |= {value for value in listed if _token_id(value)}
    _say_unread_generation_config(unwrap(model), [value for value in listed if not _token_id(value)])
    return sorted(ids)


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_SAID: set[str] = set()  # each note once per process (eos_token_ids runs at every generation)


def _say_unread_generation_config(model: nn.Module, wrong: list) -> None:
    """A note for the stop ids the model's generation_config.json should have given and did not: a value that is no
    token id (ignored; it was a TypeError traceback in `sorted`, bb30), or a file transformers could not read (cut
    short: transformers drops it without a word, and an instruct model's extra end-of-turn ids with it)."""
    folder = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    path = Path(folder) / "generation_config.json" if folder and Path(folder).is_dir() else None
    if wrong:
        where = path or "the model's generation config"
        shown = json.dumps(wrong[0] if len(wrong) == 1 else wrong, default=str)[:80]
        note = (f"{where} says eos_token_id {shown}, which is not a token id: ignored, so generation stops at the "
                "tokenizer's end token and the chat template's end of turn only. Fix: set eos_token_id there to the end "
                "token's id (or a list of ids), or remove it")
    elif path is not None and path.is_file() and not _readable_json(path):
        note = (f"{path} cannot be read (cut short or not JSON), so the stop ids it lists (an instruct model's end of "
                "turn, e.g. Llama 3's <|eot_id|>) are not used: generation stops at the tokenizer's end token and the "
                "chat template's end of turn only. Fix: copy or download that file again")
    else:
        return
    if note not in _SAID:
        _SAID.add(note)
        distributed.print0(f"[finetune] note: {note}.")


@functools.cache
def _readable_json(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (OSError, ValueError):
        return False


def grpo_rollouts(model: nn.Module, micro_batches: list[dict], objective, device: torch.device) -> list[grpo.Rollout]:
    """The step's rollouts, one per prompt micro-batch (`objective`: the GRPO objective: its recipe, tokenizer,
    reward functions and reference); sets `objective.rollout_figures`."""
    config = objective.config
    started = time.perf_counter()
    rollouts, failure, log = [], None, reward_table.RewardLog()
    served = _served(model, micro_batches, objective) if objective.vllm is not None else [None] * len(micro_batches)
    for batch, sampled in zip(micro_batches, served):
        rollout, problem = sample_and_score(model, batch, objective, device, sampled, log=log)
        rollouts.append(rollout)
        failure = failure or problem
    # Decoding frees many small KV-cache and logits tensors that glibc keeps in the heap; handed back to the OS before
    # the training forward, they do not add to the step's host peak (CPU runs: -57 MiB of 1,146 on the GRPO bench's
    # SmolLM2, docs/benchmarks.md). Host memory only: CUDA's cache is left alone (emptying it would cost speed).
    host_memory.release_freed_memory()
    if distributed.any_rank(failure is not None):  # every rank stops after the same step
        # What each rank's failure says, but for its rows: alike on every rank, rank 0 alone says it, once
        raise reward_table.stopped_by(failure, distributed.gather_objects(reward_table.without_rows(failure)))
    seconds = time.perf_counter() - started
    weights = config.weights()
    weighted = [reward_table.weighted_rewards(r.rewards, weights) for r in rollouts]
    figures = {**_figures(rollouts, weighted, objective), **logged_metrics(log)}
    batch_std = figures["reward_std"] if config.scale_rewards == "batch" else None
    for rollout, rewards in zip(rollouts, weighted):
        rollout.advantages, rollout.zero_std = grpo.advantages(rewards, config.num_generations, config.scale_rewards,
                                                               batch_std)
    zero = distributed.all_reduce_sum([sum(float(r.zero_std.sum()) for r in rollouts),
                                       sum(r.zero_std.numel() for r in rollouts)])
    figures["frac_reward_zero_std"] = zero[0] / max(zero[1], 1)
    correct = objective.vllm is not None and config.vllm_importance_sampling_correction
    with torch.no_grad(), _as_sampled(model):  # the policy that sampled them: no dropout (sampling.py)
        for rollout in rollouts:
            if config.num_iterations > 1 or correct:  # the ratio's denominator: the policy at generation
                rollout.old_logps = grpo.dense(token_logps(model, rollout.batch, device, temperature=config.temperature),
                                               rollout.mask)
            if objective.reference is not None:
                with objective.reference.active(model):
                    rollout.ref_logps = grpo.dense(
                        token_logps(model, rollout.batch, device, temperature=config.temperature), rollout.mask)
    if correct:
        for rollout in rollouts:
            rollout.is_ratio = grpo.sampler_correction(rollout.old_logps, rollout.sampling_logps, rollout.mask, config)
        figures.update(sampler_figures(rollouts, config))
    figures["generation_s"] = seconds
    objective.rollout_figures = figures
    objective.completion_rows = completion_rows(objective.step, rollouts, weighted, objective.functions)
    if objective.completions_log is not None:
        with open(objective.completions_log, "a", encoding="utf-8") as out:  # plain JSON: no NaN / Infinity token (json_safe)
            out.writelines(json.dumps(record, default=str) + "\n" for record in objective.completion_rows)
    return rollouts


def json_safe(value):
    """`value` with every float that is not finite as its text ("inf", "nan"), as metrics.jsonl writes them: JSON has
    no such numbers (JSON.parse and jq refuse Python's `Infinity` / `NaN`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def logged_metrics(log: reward_table.RewardLog) -> dict[str, float]:
    """The metrics the reward functions logged with TRL's `log_metric` in this generation, each the mean of its values
    over the calls of every rank (TRL's: the sum over ranks / the count over ranks); the names are gathered first, as
    a rank may log a name another does not."""
    names = sorted({name for names in distributed.gather_objects(sorted(log.metrics)) for name in names})
    if not names:
        return {}
    sums = distributed.all_reduce_sum([x for name in names for x in (sum(log.metrics.get(name, [])),
                                                                      len(log.metrics.get(name, [])))])
    return {name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names)}


def completion_rows(step: int, rollouts: list[grpo.Rollout], weighted: list[torch.Tensor], functions) -> list[dict]:
    """One record per completion sampled at `step` (this rank's), as TRL logs them: the prompt, the completion, each
    reward function's value (None: not scored), the weighted reward, the advantage and, when the functions logged
    columns with log_extra, `extra` ({column: value}): the completions log's lines and the trackers' table, in plain
    JSON's numbers (json_safe)."""
    names = [reward_table.reward_name(f) for f in functions]
    number = lambda value: None if math.isnan(value) else round(value, 6)
    records = []
    for rollout, rewards in zip(rollouts, weighted):
        for row, shown in enumerate(rollout.shown):
            scores = {name: number(float(v)) for name, v in zip(names, rollout.rewards[row].tolist())}
            shown = dict(shown)
            extra = {"extra": shown.pop("extra")} if "extra" in shown else {}  # log_extra's columns: last
            records.append(json_safe({"step": step, **shown, "rewards": scores, "reward": number(float(rewards[row])),
                                      "advantage": round(float(rollout.advantages[row]), 6), **extra}))
    return records


@contextlib.contextmanager
def _as_sampled(model: nn.Module):
    """The model in eval mode, as generate_completions samples with it (no dropout), restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _prompts(batch: dict) -> list[list[int]]:
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [ids[:n] for ids, n in zip(batch["input_ids"].tolist(), lengths)]


def _copies(batch: dict) -> list[int]:
    """Which weighted repeat each prompt of the micro-batch is (Example.copy; 0 in batches collated before it)."""
    copies = batch.get("prompt_copy")
    return copies.tolist() if copies is not None else [0] * len(batch["prompt_index"])


def completion_seeds(seed: int, step: int, batch: dict, g: int) -> list[int]:
    """The seed of each of the G completions of every prompt of a micro-batch, in order: (train.seed, step, the
    prompt's row, its number in the group); a weighted repeat of a prompt (copy c) takes numbers c*G to c*G+G-1."""
    return [sampling_seed(seed, step, index, copy * g + j)
            for index, copy in zip(batch["prompt_index"].tolist(), _copies(batch)) for j in range(g)]


def _served(model: nn.Module, micro_batches: list[dict], objective) -> list[tuple[list, list]]:
    """grpo.generation vllm: the step's completions and their sampler log-probs for every micro-batch, asked of the
    server in one round (it batches them all), each prompt's group drawn with the prompt's seed."""
    prompts = [_prompts(batch) for batch in micro_batches]
    g = objective.config.num_generations  # a weighted repeat of a prompt (copy c) draws generations c*G.. of its seeds
    seeds = [[sampling_seed(objective.recipe.train.seed, objective.step, index, copy * g)
              for index, copy in zip(batch["prompt_index"].tolist(), _copies(batch))] for batch in micro_batches]
    completions, logps = objective.vllm.sample([p for group in prompts for p in group],
                                               [s for group in seeds for s in group],
                                               eos_ids=eos_token_ids(model, objective.tokenizer),
                                               stop=turn_end_stops(objective.tokenizer))
    served, start, g = [], 0, objective.config.num_generations
    for group in prompts:
        end = start + len(group) * g
        served.append((completions[start:end], logps[start:end]))
        start = end
    return served


def sample_and_score(model: nn.Module, batch: dict, objective, device: torch.device,
                     served: tuple[list, list] | None = None, *,
                     log: reward_table.RewardLog | None = None) -> tuple[grpo.Rollout, RewardError | None]:
    """G completions of every prompt of a micro-batch (sampled here, or `served`: (completions, sampler log-probs)
    from the vLLM server), and their rewards (or the reward error, raised by the caller once every rank knows);
    `log` collects what the reward functions log (TRL's log_metric, log_extra)."""
    config, tokenizer, recipe = objective.config, objective.tokenizer, objective.recipe
    prompts = _prompts(batch)
    indices = batch["prompt_index"].tolist()
    g = config.num_generations
    expanded = [p for p in prompts for _ in range(g)]
    seeds = completion_seeds(recipe.train.seed, objective.step, batch, g)
    eos, stops = eos_token_ids(model, tokenizer), turn_end_stops(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampler_logps = None
    if served is not None:
        completions, sampler_logps = served
    else:
        completions = generate_completions(model, expanded, seeds, max_new_tokens=config.max_completion_length,
                                           temperature=config.temperature, top_p=config.top_p, eos_ids=eos,
                                           pad_id=pad, device=device, gather=generation_gather(config.generation_gather),
                                           stop_strings=stops, tokenizer=tokenizer)
    written = tokenizer.batch_decode(completions, skip_special_tokens=True)
    inputs, mask, truncated = _sequences(expanded, completions, written, eos, stops, pad=pad,
                                         mask_truncated=config.mask_truncated_completions)
    rows = [row for row in batch["rows"] for _ in range(g)]
    texts = [cut_at_stops(text, stops) for text in written]  # the answer, as an EOS is skipped in decoding
    # A text prompt's completion is its text, as TRL's; a chat prompt's TRL's message ({"role": "assistant",
    # "content": text}) with what a chat client reads beside it (replies.completion_message: `final`, `reasoning`,
    # `tool_calls`; harmony's channels read), so the built-in rewards score the final answer
    shown = [[completion_message(ids, tokenizer, prompt_ids=prompt, content=text, stops=stops)]
             if isinstance(row["prompt"], list) else text
             for ids, prompt, row, text in zip(completions, expanded, rows, texts)]
    table, problem = torch.full((len(rows), len(objective.functions)), math.nan, dtype=torch.float64), None
    # A prompt named by its row in its file (from 1) and its prompt_index in the completions log (from 0)
    places = [f"{place}, prompt_index {index} in the completions log" for place, index in zip(batch["places"], indices)
              for _ in range(g)]
    seen = [p for p in policy_prompts(batch["rows"], batch["places"], recipe) for _ in range(g)] \
        if any(getattr(f, "is_reward_model", False) for f in objective.functions) else None
    log = log if log is not None else reward_table.RewardLog()
    try:
        table = reward_table.rewards_per_function(objective.functions, [r["prompt"] for r in rows], shown,
                                                  reward_columns(rows), places, model_prompts=seen, log=log,
                                                  completion_ids=completions, trainer_state=trainer_state(objective))
    except RewardError as exc:
        problem = exc
    extra = [{column: values[row] for column, values in log.columns.items()} for row in range(len(rows))]
    if sampler_logps is not None:
        dense = torch.zeros(mask.shape, dtype=torch.float32)
        for row, values in enumerate(sampler_logps):
            dense[row, :len(values)] = torch.tensor(values[:mask.size(1)], dtype=torch.float32)
        sampler_logps = dense
    rollout = grpo.Rollout(batch=inputs, mask=mask, rewards=table, truncated=truncated, sampling_logps=sampler_logps,
                           lengths=torch.tensor([len(c) for c in completions], dtype=torch.float64),
                           shown=[{"prompt_index": index, "prompt": row["prompt"], "completion": text,
                                   **({"extra": columns} if columns else {})}
                                  for index, row, text, columns in zip([i for i in indices for _ in range(g)], rows,
                                                                       texts, extra)])
    return rollout, problem


def trainer_state(objective) -> reward_table.TrainerState:
    """TRL's `trainer_state` as the reward functions get it at the generation of `objective.step`: the optimizer steps
    done so far (global_step: that step minus 1, as TRL's state at generation), max_steps and the process flags."""
    info, train = distributed.info(), objective.recipe.train
    return reward_table.TrainerState(global_step=objective.step - 1, max_steps=train.max_steps,
                                     num_train_epochs=train.num_epochs or 0, is_local_process_zero=info.local_rank == 0,
                                     is_world_process_zero=info.rank == 0)


DATASET_KEY = re.compile(r"\(data\.datasets\[(\d+)\]\)")  # in a prompt's place (data/prompts.py): its dataset


def policy_prompts(rows: list[dict], places: list[str], recipe) -> list:
    """The prompts as the policy saw them, which the reward models score (reward functions get the rows' own, as
    TRL passes them): chat messages in the normal form of data/conversations.py (ShareGPT's, text parts, the dataset's
    role/content keys) with the system turn the policy's prompt got (the row's `system` column, else the dataset's
    or data.system_prompt, when the messages have none or a blank one: data/prompts.py); a text prompt as it is."""
    seen = []
    for row, place in zip(rows, places):
        if not isinstance(row["prompt"], list):
            seen.append(row["prompt"])
            continue
        found = DATASET_KEY.search(place or "")
        spec = recipe.data.datasets[int(found.group(1))] if found else DatasetSpec(path=str(place), format="prompt")
        messages = convert_turns(row["prompt"], spec, str(place))
        seen.append(with_system(messages, row_system(row, spec, recipe.data.system_prompt))[0])  # as data/prompts.py
    return seen


def _sequences(prompts: list[list[int]], completions: list[list[int]], written: list[str], eos: list[int],
               stops: list[str], *, pad: int, mask_truncated: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """grpo.sequences, where a completion also ends (is not truncated) on a stop string it wrote (`written`: its
    decoded text): the chat template's end of turn that is text to the tokenizer, ending the completion as an EOS
    does (sampling stops on the first, so one in the text ends it)."""
    inputs, mask, truncated = grpo.sequences(prompts, completions, pad_id=pad, eos_ids=eos, mask_truncated=False)
    if stops:
        truncated &= torch.tensor([not any(stop in text for stop in stops) for text in written])
    if mask_truncated:
        mask[truncated] = 0.0
        inputs["labels"][truncated] = IGNORE_INDEX
    return inputs, mask, truncated


def sampler_figures(rollouts: list[grpo.Rollout], config) -> dict:
    """TRL's sampling/ metrics over every rank: |trainer - sampler| log-prob per completion token (mean, max) and the
    correction's ratio (min, mean, max; per completion in the sequence modes, per token otherwise)."""
    diff_sum = diff_count = ratio_sum = ratio_count = 0.0
    diff_max, ratio_min, ratio_max = 0.0, math.inf, -math.inf
    for r in rollouts:
        kept = r.mask.bool()
        delta = (r.old_logps - r.sampling_logps).abs()[kept]
        delta = delta[~torch.isnan(delta)]
        ratios = r.is_ratio.flatten() if r.is_ratio.size(1) == 1 else r.is_ratio[kept]
        diff_sum, diff_count = diff_sum + float(delta.sum()), diff_count + delta.numel()
        ratio_sum, ratio_count = ratio_sum + float(ratios.sum()), ratio_count + ratios.numel()
        if delta.numel():
            diff_max = max(diff_max, float(delta.max()))
        if ratios.numel():
            ratio_min, ratio_max = min(ratio_min, float(ratios.min())), max(ratio_max, float(ratios.max()))
    sums = distributed.all_reduce_sum([diff_sum, diff_count, ratio_sum, ratio_count])
    high = distributed.all_reduce_max([diff_max, ratio_max, -ratio_min])
    return {"sampling/sampling_logp_difference/mean": sums[0] / max(sums[1], 1),
            "sampling/sampling_logp_difference/max": high[0],
            "sampling/importance_sampling_ratio/min": -high[2], "sampling/importance_sampling_ratio/mean":
            sums[2] / max(sums[3], 1), "sampling/importance_sampling_ratio/max": high[1]}


def reward_columns(rows: list[dict]) -> dict[str, list]:
    """The rows' columns as the reward functions' keyword lists: every column any row has (in order of first
    appearance), one value per row, None where a row lacks it (TRL takes the first row's columns only)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    return {key: [row.get(key) for row in rows] for key in names}


def _figures(rollouts: list[grpo.Rollout], weighted: list[torch.Tensor], objective) -> dict:
    """TRL's generation-batch metrics over every rank: reward, reward_std, rewards/<function>/mean and /std,
    completions/mean_length, completions/clipped_ratio, completions/mean_terminated_length."""
    def moments(values: torch.Tensor) -> list[float]:
        kept = values[~torch.isnan(values)]
        return [float(kept.sum()), float((kept**2).sum()), float(kept.numel())]

    rewards = torch.cat(weighted)
    table = torch.cat([r.rewards for r in rollouts])
    lengths, truncated = torch.cat([r.lengths for r in rollouts]), torch.cat([r.truncated for r in rollouts])
    local = [*moments(rewards)]
    for column in range(table.size(1)):
        local += moments(table[:, column])
    local += [float(lengths.sum()), float(lengths.numel()), float(truncated.sum()), float(lengths[~truncated].sum())]
    total = distributed.all_reduce_sum(local)
    figures = {}
    names = [reward_table.reward_name(f) for f in objective.functions]
    for name, (s, sq, n) in zip(["reward", *names], [total[i:i + 3] for i in range(0, 3 * (len(names) + 1), 3)]):
        mean = s / n if n else math.nan
        std = math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan
        keys = ("reward", "reward_std") if name == "reward" else (f"rewards/{name}/mean", f"rewards/{name}/std")
        figures.update(dict(zip(keys, (mean, std))))
    length_sum, count, clipped, terminated_sum = total[-4:]
    figures["completions/mean_length"] = length_sum / max(count, 1)
    figures["completions/clipped_ratio"] = clipped / max(count, 1)
    figures["completions/mean_terminated_length"] = terminated_sum / max(count - clipped, 1)
    return figures
