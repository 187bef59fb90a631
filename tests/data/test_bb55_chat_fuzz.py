"""Chat masks a randomized differential fuzz (bb55) found wrong or refused with the wrong words.

Each was reproduced on the code before this file: GLM's appended stop token (`<|user|>`) was left untrained after an
answer whose text ends with a special token's spelling (`ok <|im_end|>`), because whether the template writes an end
of turn was read from the row's text; Llama 3.1's refusal of a turn with text beside its tool calls called the answer
"not whole" and offered the very template that refused it as the fix; a turn with reasoning and an empty answer was
refused as if only its end-of-turn token would train.
"""

from __future__ import annotations

import re

import pytest
from chat_families import WEATHER_TOOL, family_tokenizer, trl_template

from finetune import data
from finetune.chat_templates import named_templates
from finetune.data import chat
from finetune.data.conversations import convert_turns, template_messages
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

pytest.importorskip("trl")  # the oracle's templates (trl is a dev dependency)
SPEC = DatasetSpec(path="rows.jsonl", format="chat")


def _trained(row: dict, tokenizer) -> list[str]:
    """The trained text of each assistant turn of the row (one span each), over all its examples, in turn order."""
    examples = data.render_examples(row, SPEC, tokenizer, None, "rows.jsonl line 2")
    return [text for example in examples for text, trained in example if trained]


def _trl_glm_turn(messages: list[dict], tokenizer) -> str:
    """TRL's GLM training template's assistant mask of the conversation's last assistant turn (the oracle)."""
    template = trl_template("glm4moe_training.jinja")
    shaped = template_messages(convert_turns(messages, SPEC, "row"), template)
    out = tokenizer.apply_chat_template(shaped, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    last = max(i for i, m in enumerate(mask) if m)
    first = last
    while first > 0 and mask[first - 1]:
        first -= 1
    return tokenizer.decode(ids[first : last + 1])


@pytest.mark.parametrize("answer", ["ok <|im_end|>", "ok <|endoftext|>", "ok <|user|>", "ok"])
@pytest.mark.parametrize("template", ["finetune glm-4.5", "shipped"])
def test_glm_trains_its_stop_token_whatever_the_answer_ends_with(template, answer):
    """Found by a bug bash: under GLM-4.5's template (which writes no end of turn) an answer ending with the spelling
    of a special token (`ok <|im_end|>`) was trained without the `<|user|>` the model stops on: _stop_token took the
    row's text for the template's end of turn. The oracle: TRL's GLM training template's mask, turn by turn."""
    tokenizer = family_tokenizer("glm-4.5", template=named_templates()["glm-4.5"] if template != "shipped" else None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "fine"}]
    trained = _trained({"messages": messages}, tokenizer)
    assert trained == [f"\n<think></think>\n{answer}<|user|>", "\n<think></think>\nfine<|user|>"]
    assert trained == [_trl_glm_turn(messages[:2], tokenizer), _trl_glm_turn(messages, tokenizer)]


def test_a_template_that_ends_its_turns_gets_no_second_stop_token():
    """The other side of the GLM fix: where the template writes its own end of turn (ChatML's <|im_end|>), an answer
    ending with that token's spelling is trained with the template's end alone, nothing appended."""
    tokenizer = family_tokenizer("qwen2.5")
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok <|im_end|>"}]}
    assert _trained(row, tokenizer) == ["ok <|im_end|><|im_end|>"]


CALL_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "21 C"},
    {"role": "assistant", "content": "21 C."}], "tools": [WEATHER_TOOL]}


@pytest.mark.parametrize("template", ["finetune llama-3.1", "shipped"])
def test_llama_text_beside_tool_calls_is_refused_for_what_happened(template):
    """Found by a bug bash: Llama 3.1's template renders a call turn's calls alone, so text beside them cannot train;
    the refusal called the answer "not whole" and offered llama-3.1 (the template that refused it) as the fix. Now it
    says the template drops the text beside the calls, and every fix it names works: each named template offered
    renders this row (text and call trained), none is the one in use, and the row without the text trains."""
    in_use = named_templates()["llama-3.1"] if template != "shipped" else None
    with pytest.raises(DataError) as refused:
        _trained(CALL_ROW, family_tokenizer("llama-3.1", template=in_use))
    message = str(refused.value)
    assert message.startswith("rows.jsonl line 2: message 2 has both text and tool calls, and the chat template drops "
                              "the text beside the calls"), message
    assert "remove the text from that turn" in message and "data.bad_rows: skip" in message
    offered = re.search(r"model\.chat_template: ([\w.\- ]+?) \(finetune's templates that render this row", message)
    assert offered, message
    names = offered.group(1).split(" or ")
    assert "llama-3.1" not in names and "chatml" not in names  # in use (or refusing too); ChatML renders no calls
    for name in names:
        (first, second) = _trained(CALL_ROW, family_tokenizer("llama-3.1", template=named_templates()[name]))
        assert "Let me check." in first and "get_weather" in first and "21 C." in second, name
    without_text = {**CALL_ROW, "messages": [{**m, "content": ""} if m.get("tool_calls") else m
                                             for m in CALL_ROW["messages"]]}
    trained = _trained(without_text, family_tokenizer("llama-3.1", template=in_use))
    assert "get_weather" in trained[0]


def test_llama_text_beside_calls_with_no_other_template_names_none(monkeypatch):
    """A real Llama 3.1 tokenizer fits llama-3.1 alone among finetune's named templates (no ChatML tokens): the fix
    then offers a .jinja template that renders both, the text removed, or skipping; never llama-3.1."""
    monkeypatch.setattr(chat, "fitting_templates", lambda tokenizer: ["llama-3.1"])
    tokenizer = family_tokenizer("llama-3.1", template=named_templates()["llama-3.1"])
    with pytest.raises(DataError, match=r"drops the text beside the calls") as refused:
        _trained(CALL_ROW, tokenizer)
    message = str(refused.value)
    assert "a .jinja template that renders a turn's text beside its calls" in message
    assert "llama-3.1" not in message
    assert "llama-3.1" not in chat.named_fix(tokenizer, named_templates()["llama-3.1"])


def test_no_fix_names_the_template_in_use():
    """Found by a bug bash: named_fix listed every named template with the tokenizer's tokens, the one in use too."""
    tokenizer = family_tokenizer("qwen2.5", template=named_templates()["qwen2.5"])
    fix = chat.named_fix(tokenizer, named_templates()["qwen2.5"])
    assert "qwen2.5" not in fix and "qwen3" in fix
    assert "qwen2.5" in chat.named_fix(tokenizer, named_templates()["chatml"])


def test_an_empty_answer_after_reasoning_is_refused_for_the_true_reason():
    """Found by a bug bash: a turn with reasoning and an empty answer was refused saying "only its end-of-turn token
    would be trained", false where the reasoning trains (Qwen3 renders `<think>...</think>` before the end)."""
    tokenizer = family_tokenizer("qwen3")
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "", "reasoning_content": "Nothing to say."}]}
    with pytest.raises(DataError, match=r"line 2: message 2 is an empty assistant turn") as refused:
        _trained(row, tokenizer)
    message = str(refused.value)
    assert "only its end-of-turn token" not in message
    assert "it has reasoning, but no answer follows it" in message and "never answering" in message
    plain = {"messages": [row["messages"][0], {"role": "assistant", "content": ""}]}
    with pytest.raises(DataError, match=r"only its end-of-turn token would be trained"):
        _trained(plain, tokenizer)
