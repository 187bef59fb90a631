"""The chat templates of 2026's most fine-tuned families as their models ship them (TRL's stored copies, beside TRL's
generation-tagged training versions), tiny tokenizers with each family's special tokens, and one row of each kind
people bring: a tool call, reasoning over two turns, three plain turns."""

from __future__ import annotations

from pathlib import Path

# family -> (TRL's stored original, TRL's training version or None, special tokens, bos, eos). The tag-like tokens
# (<think>, <tool_call>, <arg_key>, ...) are added tokens that are not special, as in those models' tokenizers.
PLAIN_TAGS = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
              "</arg_key>", "<arg_value>", "</arg_value>"}
FAMILIES = {
    "llama-3.1": ("llama3_1.jinja", None, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": ("qwen2_5.jinja", "qwen2_5_training.jinja", ["<|im_start|>", "<|im_end|>", "<tool_call>",
                "</tool_call>", "<tool_response>", "</tool_response>"], None, "<|im_end|>"),
    "qwen3": ("qwen3.jinja", "qwen3_training.jinja", ["<|im_start|>", "<|im_end|>", "<think>", "</think>",
              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], None, "<|im_end|>"),
    "qwen3.5": ("qwen3_5_think.jinja", "qwen3_5_think_training.jinja", ["<|im_start|>", "<|im_end|>", "<think>",
                "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], None, "<|im_end|>"),
    "gpt-oss": ("gptoss.jinja", "gptoss_training.jinja", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                "<|return|>", "<|call|>", "<|constrain|>"], None, "<|return|>"),
    "deepseek-r1": ("deepseek_r1_distill.jinja", "deepseek_r1_distill_training.jinja", ["<｜begin▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "glm-4.5": ("glm4moe.jinja", "glm4moe_training.jinja", ["[gMASK]", "<sop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"],
                None, "<|endoftext|>"),
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}

ROWS = {
    "tool_call": {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21 C and clear in Paris."}],
        "tools": [WEATHER_TOOL]},
    "reasoning": {"messages": [
        {"role": "user", "content": "Pick a colour for a calm room."},
        {"role": "assistant", "reasoning_content": "Calm suggests cool, muted tones.", "content": "Teal."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "reasoning_content": "Grey is neutral and quiet.", "content": "Slate grey."}]},
    "multi_turn": {"messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Slate grey."},
        {"role": "user", "content": "And a third?"},
        {"role": "assistant", "content": "Amber."}]},
}


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def family_tokenizer(family: str, *, template: str | None = None):
    """The tiny byte-level tokenizer with the family's special tokens, bos and eos, and its shipped template."""
    from finetune.cli.tiny import build_tokenizer

    original, _, specials, bos, eos = FAMILIES[family]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials
                                                                if s not in (bos, eos) and s not in PLAIN_TAGS]})
    tokenizer.add_tokens([s for s in specials if s in PLAIN_TAGS])
    tokenizer.add_special_tokens({"eos_token": eos, **({"bos_token": bos} if bos else {})})
    tokenizer.chat_template = template if template is not None else trl_template(original)
    return tokenizer


def llama2_like_tokenizer():
    """A Llama 2 / Mistral v0.1 style tokenizer.json: word pieces starting with `▁`, byte fallback, normalizer
    Prepend('▁') + Replace(' ', '▁'), no pre-tokenizer, `<s>` put first by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Is the sky blue? Answer: yes. Is grass red? Answer: no.", "Question: Answer: yes no maybe"] * 20
    model = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    model.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=320, show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    model.pre_tokenizer = None
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    model.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                         special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
