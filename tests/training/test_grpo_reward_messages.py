"""What GRPO's reward functions receive for a chat prompt: the assistant message as a chat client reads it.

Found by a bug bash (bb53 #4): the rollout decoded completions with skip_special_tokens=True and passed
[{"role": "assistant", "content": text}]. Under gpt-oss (harmony) the channel words were glued into the content
(`analysisEasy.assistantfinalParis`, a tool call `analysisNeed weather ...assistant to=functions.get_weathercommentary
json{...}`), under Qwen3 the `<think>` block stayed in it (`<think>\\nEasy.\\n</think>\\n\\nParis`) and a tool call was
text, so finetune.rewards:exact_match scored 0 on any reply that reasons first. Now the message keeps TRL's
`content` (the completion as TRL decodes it: a reward written for TRL reads what it read; a review of the first fix,
which made `content` the final answer, found TRL's documented format reward scoring 0) and carries beside it what a
chat client reads (replies.reply_message, as `finetune generate` and the generation eval read replies): `final`,
`reasoning` / `reasoning_content` and `tool_calls`; the built-in rewards score `final`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_jsonl
from test_grpo import grpo_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
from chat_families import ROWS, WEATHER_TOOL, family_tokenizer

from finetune import rewards
from finetune.data import IGNORE_INDEX
from finetune.data.chat import chat_examples
from finetune.data.conversations import convert_turns
from finetune.data.templates import tokenize_segments
from finetune.recipe import DatasetSpec, validate_recipe
from finetune.training.objectives.grpo import rollouts

QUESTION = {"role": "user", "content": "What is the capital of France?"}
REASONED = {"role": "assistant", "reasoning_content": "Easy.", "content": "Paris"}
CALL = ROWS["tool_call"]["messages"][1] | {"reasoning_content": "Need weather for Paris."}


class _Policy(torch.nn.Module):
    generation_config = None


def trained_turn(tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
    """The token ids the data stage trains for the last assistant turn of `messages`: what a trained policy writes."""
    spec = DatasetSpec(path="rows.jsonl", format="chat")
    turns = convert_turns(messages, spec, "row 1")
    example = tokenize_segments(chat_examples(turns, tokenizer, "row 1", tools=tools)[-1], tokenizer)
    return [token for token, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX]


def rewarded(family, completion, tiny_llama, tmp_path, monkeypatch, *, tools=None):
    """(the completions the reward functions got, the completions log's records) for one chat prompt whose G = 4
    completions are `completion` (token ids), scored by a recorder and finetune.rewards:exact_match."""
    from finetune import data
    from finetune.data.prompts import prompt_examples

    tokenizer = family_tokenizer(family)
    row = {"prompt": [QUESTION], "answer": "Paris", **({"tools": tools} if tools else {})}
    values = grpo_recipe(tiny_llama, write_jsonl(tmp_path / "p.jsonl", [row]), tmp_path / "out",
                         data={"max_length": 2048}, grpo_keys={"max_completion_length": 64})
    recipe = validate_recipe(values)
    got = []

    def recorder(prompts, completions, **kwargs):
        got.extend(completions)
        return [0.0] * len(completions)

    monkeypatch.setattr(rollouts, "generate_completions", lambda model, prompts, seeds, **options: [completion] * len(prompts))
    recipe.grpo.reward_weights = [1.0, 1.0]
    objective = SimpleNamespace(config=recipe.grpo, tokenizer=tokenizer, recipe=recipe,
                                functions=[recorder, rewards.exact_match], step=1, vllm=None, reference=None,
                                completions_log=None)
    examples, _, _ = prompt_examples(recipe, tokenizer)
    batch = data.collate(examples, pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    rollouts.grpo_rollouts(_Policy(), [batch], objective, torch.device("cpu"))
    return got, objective.completion_rows


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3"])
def test_a_reply_that_reasons_first_reaches_the_reward_as_its_answer_and_exact_match_scores_it(
        family, tiny_llama, tmp_path, monkeypatch):
    """Before: exact_match scored 0 on `analysisEasy.assistantfinalParis` (gpt-oss) and
    `<think>\\nEasy.\\n</think>\\n\\nParis` (qwen3). Now `final` is `Paris`, the reasoning beside it, `content` TRL's
    text unchanged; exact_match 1."""
    tokenizer = family_tokenizer(family)
    completion = trained_turn(tokenizer, [QUESTION, REASONED])
    got, records = rewarded(family, completion, tiny_llama, tmp_path, monkeypatch)
    (message,) = got[0]
    trls = tokenizer.decode(completion, skip_special_tokens=True).strip()  # TRL's decoding (the end of turn cut)
    assert message == {"role": "assistant", "content": message["content"], "final": "Paris", "reasoning": "Easy.",
                       "reasoning_content": "Easy."}
    assert message["content"].strip() == trls and "Easy." in message["content"]
    assert [record["rewards"]["exact_match"] for record in records] == [1.0] * 4
    assert records[0]["completion"] == message["content"]  # the completions log: TRL's text
    assert rewards.regex_match(None, got[:1], pattern=[r".*Easy\..*Paris.*"]) == [1.0]  # formats: TRL's text


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3"])
def test_a_tool_call_reaches_the_reward_as_tool_calls(family, tiny_llama, tmp_path, monkeypatch):
    """Before: the call was text in the content (gpt-oss: `analysisNeed weather for Paris.assistant
    to=functions.get_weathercommentary json{"city": "Paris"}`). Now it is `tool_calls`, `final` empty."""
    tokenizer = family_tokenizer(family)
    completion = trained_turn(tokenizer, [ROWS["tool_call"]["messages"][0], CALL], tools=[WEATHER_TOOL])
    got, _ = rewarded(family, completion, tiny_llama, tmp_path, monkeypatch, tools=[WEATHER_TOOL])
    (message,) = got[0]
    assert message["final"] == "" and message["reasoning"] == "Need weather for Paris."
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]


def test_trls_messages_without_text_are_still_read_by_the_built_in_rewards():
    """A reward written for TRL's messages ({"role", "content"} only) still scores: completion_text falls back to
    the content."""
    trl = [[{"role": "assistant", "content": "Paris"}]]
    assert rewards.exact_match(None, trl, answer=["Paris"]) == [1.0]
    assert rewards.regex_match(None, trl, pattern=["Par.*"]) == [1.0]
    assert rewards.length_penalty(None, trl) == [-0.005]


def test_only_tool_call_blocks_ending_the_reply_are_calls():
    """Found by a review: a reply that mentions the tags ("Wrap calls in <tool_call>NAME</tool_call> tags.") was read
    as a call named NAME, its block cut from the answer. As TRL's response schemas, only the blocks that end the reply
    are calls; the text before them is the content."""
    from finetune.data.replies import reply_message

    tokenizer = family_tokenizer("qwen3")
    mention = "Wrap calls in <tool_call>NAME</tool_call> tags."
    assert reply_message(mention, tokenizer) == {"role": "assistant", "content": mention}
    call = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    message = reply_message(call, tokenizer)
    assert message["content"] == "Let me look." and message["tool_calls"][0]["function"]["name"] == "get_weather"
