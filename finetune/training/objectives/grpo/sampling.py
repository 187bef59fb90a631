"""GRPO's completions, sampled by the policy itself: G per prompt, batched, with a KV cache, under every strategy.

`generate_completions(model, prompts, seeds, ...)` is the whole job ("G completions for a batch of prompts with the
policy"), reusable outside the loop (a planner, a quickstart). Sampling as transformers' generate with
do_sample=True: logits / temperature, then nucleus (top_p) filtering, then one draw per row. Each row draws from its
own torch.Generator seeded by `sampling_seed(seed, step, prompt_index, generation)`, one number per decoding step
whether the row is done or not: a completion depends only on its prompt, the step and the weights, never on which
rank or micro-batch holds it or on the batch's other rows. So the same prompts get the same completions at any world
size (up to float noise of different batch shapes), and a resumed run samples what the uninterrupted one sampled:
the sampling RNG state is a function of the checkpoint's step, nothing to save beside it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from finetune import distributed
from finetune.parallel import decoding_model


def _kv_cache_name() -> str:
    """The name of the KV cache in a forward's arguments and outputs: `cache` from transformers 5.25 (where
    `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before (the declared floor is 5.17:
    there `cache=` was swallowed and the output had no `cache`)."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("transformers").split(".")[:2])
    return "cache" if (major, minor) >= (5, 25) else "past_key_values"


KV_CACHE = _kv_cache_name()

_MIX = (1_000_003, 1_000_033, 10_007)


def sampling_seed(seed: int, step: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion: (train.seed, the step that generates it, the prompt's row, its number in the group)."""
    value = seed
    for part, factor in zip((step, prompt_index, generation), _MIX):
        value = (value * factor + part) % (2**63 - 1)
    return value


def sample_tokens(logits: torch.Tensor, generators: list[torch.Generator], *, temperature: float,
                  top_p: float) -> torch.Tensor:
    """One token per row from (rows, vocab) logits: temperature, nucleus filtering (the smallest set of the most
    probable tokens whose mass reaches top_p; the most probable always kept), then an inverse-CDF draw from each
    row's generator. At top_p 1 nothing is sorted (a sort of the whole vocabulary at every decoding step is a cost at
    150k tokens)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = None
    if top_p < 1.0:  # the nucleus needs the tokens by probability; without it the vocabulary's order will do
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more probable tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(cdf.device)
    picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None]).clamp(max=cdf.size(-1) - 1)
    return (picked if order is None else order.gather(-1, picked)).squeeze(-1)


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate_completions(model: nn.Module, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int,
                         temperature: float, top_p: float, eos_ids: list[int], pad_id: int, device: torch.device,
                         gather: str = "once", stop_strings: list[str] | None = None,
                         tokenizer=None) -> list[list[int]]:
    """The completion of every prompt row (each row its own seed; repeat a prompt G times for its group): token ids
    up to and including the first EOS, or the token that completes a stop string (`stop_strings`, with the
    `tokenizer`: a chat template's end of turn that is text to it, prompts.turn_end_stops), or max_new_tokens of
    them. Every rank calls this together under FSDP and ZeRO-3 (each forward is a collective); `gather`: how FSDP2
    gathers (parallel.decoding_model).

    The model is in eval mode for the call and restored after."""
    was_training = model.training
    model.eval()
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    ids, mask = _left_padded(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(eos_ids, device=device)
    stops = _stop_criteria(tokenizer, stop_strings)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    lengths = torch.full((len(prompts),), max_new_tokens, dtype=torch.long, device=device)
    tokens, cache, current = [], None, ids
    try:
        with decoding_model(model, gather=gather) as (root, sharded):
            for step in range(max_new_tokens):
                out = root(input_ids=current, attention_mask=mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{KV_CACHE: cache})
                cache = getattr(out, KV_CACHE)
                token = sample_tokens(out.logits[:, -1].float(), generators, temperature=temperature, top_p=top_p)
                token = torch.where(done, torch.full_like(token, pad_id), token)
                tokens.append(token)
                ending = torch.isin(token, eos)
                if stops is not None:  # the window of the last tokens: a stop string ends in the newest one
                    ending |= stops(torch.stack(tokens[-stops.maximum_token_len:], dim=1), None).to(device)
                ending &= ~done
                lengths = torch.where(ending, step + 1, lengths)
                done = done | ending
                running = not bool(done.all())
                if not (distributed.any_rank(running) if sharded else running):  # every rank stops at the same step
                    break
                current, positions = token[:, None], positions[:, -1:] + 1
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    finally:
        model.train(was_training)
    if not tokens:
        return [[] for _ in prompts]
    table = torch.stack(tokens, dim=1).tolist()
    return [row[:end] for row, end in zip(table, lengths.tolist())]


_STOP_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stop_criteria(tokenizer, stop_strings: list[str] | None):
    """transformers' StopStringCriteria of the stop strings (what generate(stop_strings=...) stops with: the string
    written in any split into tokens, ending in the newest token), or None without stop strings. Kept per tokenizer:
    building one reads the whole vocabulary, and every GRPO step samples."""
    if not stop_strings:
        return None
    if tokenizer is None:
        raise ValueError("generate_completions: stop_strings need the tokenizer, to match them in the tokens")
    from transformers import StopStringCriteria

    known = _STOP_CRITERIA.get(tokenizer)
    if known is None or known[0] != tuple(stop_strings):
        known = _STOP_CRITERIA[tokenizer] = (tuple(stop_strings), StopStringCriteria(tokenizer, list(stop_strings)))
    return known[1]
