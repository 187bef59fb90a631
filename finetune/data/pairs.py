"""Preference pairs tokenized: a chosen and a rejected sequence sharing their prompt, cut to fit data.max_length.

A pair is an `Example` (the chosen sequence) with the rejected sequence attached (`Example.rejected`). Labels mark
the response tokens only: those are the tokens whose log-probabilities the preference loss scores.

Truncation, when the longer sequence of a pair exceeds data.max_length: the prompt loses its beginning first (its end,
next to the answer, is what the answer depends on), but never below dpo.max_prompt_length tokens (default: half of
data.max_length); then the responses lose their ends. Both sequences score after one prompt (`share_prompt`) and lose
the same prompt tokens, so they still answer the same prompt. Every cut is counted (`prompt_truncated`,
`response_truncated`) and shown by `finetune data`; a pair the cut leaves a sequence without a token to score is dropped
with the count (the caller's, as a pair cut inside its reasoning).
"""

from __future__ import annotations

from finetune.data.chat import Opener, Reasoning
from finetune.data.examples import IGNORE_INDEX, Example
from finetune.data.templates import tokenize_many
from finetune.recipe import Recipe


def prompt_limit(recipe: Recipe) -> int:
    return recipe.dpo.max_prompt_length or recipe.data.max_length // 2


def _prompt_length(example: Example) -> int | None:
    return next((i for i, label in enumerate(example.labels) if label != IGNORE_INDEX), None)


def fit_pair(chosen: Example, rejected: Example, *, max_length: int, max_prompt: int) -> tuple[Example, Example, int, int]:
    """The pair cut to max_length: (chosen, rejected, prompt tokens cut, response tokens cut from the longer one)."""
    prompt = min(_prompt_length(chosen), _prompt_length(rejected))
    longest = max(len(chosen.input_ids), len(rejected.input_ids))
    excess = longest - max_length
    if excess <= 0:
        return chosen, rejected, 0, 0
    prompt_cut = min(excess, max(0, prompt - max_prompt))
    response_cut = excess - prompt_cut

    def cut(example: Example) -> Example:
        ids, labels = example.input_ids[prompt_cut:], example.labels[prompt_cut:]
        return Example(ids[:max_length], labels[:max_length])

    return cut(chosen), cut(rejected), prompt_cut, response_cut


def pair_examples(rendered: list[tuple], places: list[str], tokenizer, recipe: Recipe, counts: dict,
                  reasons: list[str], unanswered: list[str], *, bos: bool = True) -> list[Example]:
    """Tokenize rendered pairs ((chosen segments, rejected segments) per row) and fit each to data.max_length.

    Counts cuts in `counts` (truncated pairs, prompt_truncated, response_truncated); a pair left with no response token
    adds its reason to `reasons` (the caller refuses or skips it, by data.bad_rows); a pair whose cut leaves a response
    its reasoning opener and none of its answer (data.reasoning: context) is left out and its place added to
    `unanswered` (the caller drops or refuses it, by data.overlong). `bos`: as tokenize_many's.
    """
    segments = [segments for pair in rendered for segments in pair]
    sequences = tokenize_prompted(segments, tokenizer, bos=bos)
    answers = prompted_answer_starts(segments, tokenizer, bos=bos)
    limit, max_prompt = recipe.data.max_length, prompt_limit(recipe)
    examples = []
    for index, place in enumerate(places):
        chosen, rejected = sequences[2 * index], sequences[2 * index + 1]
        empty = [name for name, seq in (("chosen", chosen), ("rejected", rejected)) if _prompt_length(seq) is None]
        if empty:
            reasons.append(f"{place}: `{empty[0]}` has no token to score (the answer is empty after rendering).")
            continue
        if not any(_reasoned(side) for side in segments[2 * index: 2 * index + 2]):
            share_prompt(chosen, rejected)
        if recipe.data.overlong == "drop" and max(len(chosen.input_ids), len(rejected.input_ids)) > limit:
            counts["dropped"] += 1
            continue
        chosen, rejected, prompt_cut, response_cut = fit_pair(chosen, rejected, max_length=limit, max_prompt=max_prompt)
        if any(answer is not None and answer - prompt_cut >= limit for answer in answers[2 * index: 2 * index + 2]) \
                or not chosen.num_trained or not rejected.num_trained:
            unanswered.append(place)  # a response cut inside its reasoning (its opener alone would be scored), or
            continue  # a sequence the cut left no token to score: the pair would train one side only
        if prompt_cut or response_cut:
            counts["truncated"] += 1
            counts["prompt_truncated"] += int(prompt_cut > 0)
            counts["response_truncated"] += int(response_cut > 0)
        chosen.rejected = rejected
        examples.append(chosen)
    return examples


def share_prompt(chosen: Example, rejected: Example) -> None:
    """Both sequences of a pair scored after one prompt: the common prefix of their prompt tokens, as TRL 1.16's
    DPOTrainer takes the shorter of the two sides' common prefixes with the prompt. The two differ where one answer's
    first token holds the prompt's last characters and the other's does not (a tokenizer that prepends `▁`, Llama 2's:
    `Answer: ` + `yes` is `Answer:` `▁yes`, + `42` is `Answer:` `▁` `4` `2`, tokenize_prompted): the side whose prompt
    is longer then scores its tokens past the shared prompt (that `▁`), as TRL does, instead of answering other prompt
    tokens than its partner, with a prompt character scored in one answer only. Labels are changed in place."""
    ends = (_prompt_length(chosen), _prompt_length(rejected))
    shared = next((i for i, (a, b) in enumerate(zip(chosen.input_ids[: ends[0]], rejected.input_ids[: ends[1]]))
                   if a != b), min(ends))
    for example, end in zip((chosen, rejected), ends):
        example.labels[shared:end] = example.input_ids[shared:end]


def tokenize_prompted(all_segments: list[list[tuple[str, bool]]], tokenizer, *, bos: bool = True) -> list[Example]:
    """Rows of a prompt and an answer (preference pairs, KTO rows), each answer after its prompt's own tokens.

    The joined text is tokenized once, as SFT rows are; but where the tokenizer merges the prompt's last characters
    into the answer's first token (Qwen's BPE: the `\\n` a generation prompt ends with, and an answer's `\\n`, are one
    `\\n\\n` token), the prompt's tokens would differ between the two answers of a pair, and a prompt character would
    be scored in one answer only. Such a row is tokenized with its prompt apart from its answer: the prompt alone, then
    the rest, provided the two spell the row's text: the prompt a server sends. That is not TRL 1.16's rule, which
    scores the joint ids after their common prefix with the prompt's ids (the merged `\\n\\n` scored, the prompt
    trained without its last `\\n`: docs/preference.md). A tokenizer whose normalizer prepends `▁` to what it
    encodes (Llama 2's and Mistral v0.1's tokenizer.json) writes the rest alone with a space the row does not have
    (`Answer: ` + `yes` scored as `Answer:  yes`); such a row keeps its joint tokens, its answer's first token the
    one that holds the prompt's last space (`▁yes`), as TRL 1.16 scores it, and a pair's two rows then share the
    shorter prompt (share_prompt). `bos`: as tokenize_many's (False for a chat template's renderings)."""
    return _tokenize_split(all_segments, [_first_trained(segments) for segments in all_segments], tokenizer, bos)


def prompted_answer_starts(all_segments: list[list[tuple[str, bool]]], tokenizer, *, bos: bool = True
                           ) -> list[int | None]:
    """templates.answer_starts of tokenize_prompted's rows: the token each row's answer starts at where it has a
    reasoning opener (trained, but no answer: chat.Opener), else None. The same text split at the same place gives
    the same tokens, so the row is tokenized again with its openers untrained and split where the row was."""
    opened = [i for i, segments in enumerate(all_segments) if any(isinstance(flag, Opener) for _, flag in segments)]
    bare = _tokenize_split([[(text, bool(flag) and not isinstance(flag, Opener)) for text, flag in all_segments[i]]
                            for i in opened], [_first_trained(all_segments[i]) for i in opened], tokenizer, bos)
    starts: list[int | None] = [None] * len(all_segments)
    for i, example in zip(opened, bare):
        starts[i] = _prompt_length(example)
    return starts


def _reasoned(segments: list[tuple[str, bool]]) -> bool:
    """Whether untrained reasoning (data.reasoning: context) stands between the prompt and the first trained token:
    then the tokens before that one are not all prompt, and share_prompt would score the reasoning the two share."""
    return any(isinstance(flag, Reasoning) for _, flag in segments[: _first_trained(segments)])


def _first_trained(segments: list[tuple[str, bool]]) -> int:
    return next((i for i, (_, trained) in enumerate(segments) if trained), len(segments))


def _tokenize_split(all_segments: list[list[tuple[str, bool]]], split: list[int], tokenizer, bos: bool
                    ) -> list[Example]:
    """tokenize_prompted with each row's prompt given as its first `split` segments."""
    whole = tokenize_many(all_segments, tokenizer, bos=bos)
    prompts = tokenize_many([segments[:k] for segments, k in zip(all_segments, split)], tokenizer, bos=bos)
    merged = [i for i, (example, prompt) in enumerate(zip(whole, prompts))
              if example.input_ids[: len(prompt.input_ids)] != prompt.input_ids]
    rests = tokenize_many([all_segments[i][split[i]:] for i in merged], tokenizer, bos=False)
    for i, rest in zip(merged, rests):
        ids = prompts[i].input_ids + rest.input_ids
        if _spelled(ids, tokenizer) == _spelled(whole[i].input_ids, tokenizer):  # else: the joint tokens (docstring)
            whole[i] = Example(ids, prompts[i].labels + rest.labels)
    return whole


def _spelled(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
