"""A base model given a chat template whose end of turn is no token of its vocabulary (model.chat_template: chatml on a
Llama 2 / Mistral-style tokenizer: `<|im_end|>` is ordinary pieces) learns to write the marker as text and never the
EOS. Found by a bug bash (bb12, finding 4): nothing said so, and every generation (the generation eval, `finetune
generate`, GRPO's sampling, builtin and vLLM) stopped on the EOS alone, so answers ran on (`ok<|im_end|>im_end|>...`)
and the generation eval scored exact_match 0% on answers equal to their references. The oracle is plain transformers:
generate(stop_strings=[marker], tokenizer=...) on the same model, the marker cut from its decoded text by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.cli.tiny import CHATML_TEMPLATE
from finetune.data import IGNORE_INDEX
from finetune.data.chat import chat_examples
from finetune.data.templates import tokenize_segments

MARKER = "<|im_end|>"
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Say ok 1. Say ok 2. Say ok 3. ok ok user assistant",
          "What is the capital of France? The capital of France is Paris.", "abcdefghijklmnopqrstuvwxyz 0123456789"]


def base_tokenizer():
    """A base model's tokenizer: <s>, </s> and <unk> its only special tokens (no <|im_start|>/<|im_end|>), no pad (the
    EOS pads, as finetune sets it), given ChatML as a recipe's model.chat_template gives it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 5, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def ok_example(tokenizer, number: int):
    messages = [{"role": "user", "content": f"Say ok {number}."}, {"role": "assistant", "content": "ok"}]
    return tokenize_segments(chat_examples(messages, tokenizer, f"row {number}")[0], tokenizer)


@pytest.fixture(scope="module")
def trained():
    """(model, tokenizer, eval examples): a tiny Llama trained in full on ChatML rows answering `ok`, as the bug bash's
    run: it writes `ok<|im_end|>` in pieces, then whatever it likes (nothing after the marker is trained)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = base_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    examples = [ok_example(tokenizer, n) for n in range(1, 5)]
    width = max(len(e.input_ids) for e in examples)
    ids = torch.tensor([e.input_ids + [tokenizer.pad_token_id] * (width - len(e.input_ids)) for e in examples])
    labels = torch.tensor([e.labels + [IGNORE_INDEX] * (width - len(e.labels)) for e in examples])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):  # loss ~0.015: each trained token the argmax by a margin of ~3
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
    return model, tokenizer, examples


def test_the_note_says_once_that_the_end_of_turn_is_trained_as_pieces(capsys):
    """Before, nothing said that `<|im_end|>` is no token of a base tokenizer (trained as 10 pieces); now the first
    chat row rendered says it once (as `finetune data`, `finetune validate` and a run tokenize them), naming the
    pieces and how to have one token; a tokenizer that has the marker says nothing."""
    from finetune.cli.tiny import build_tokenizer
    from finetune.data.template_facts import turn_end_note

    tokenizer = base_tokenizer()
    pieces = tokenizer(MARKER, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1
    ok_example(tokenizer, 1), ok_example(tokenizer, 2)
    out = capsys.readouterr().out
    assert out.count("[finetune] note:") == 1 and f"`{MARKER}`, which is not a token" in out
    assert f"{len(pieces)} pieces" in out and "{{ eos_token }}" in out and "llama-3.1" in out
    assert turn_end_note(build_tokenizer()) is None  # ChatML's own specials: <|im_end|> is one token


def test_the_stop_is_the_marker_text_where_it_is_no_token():
    """The end of turn is a stop string (and no end id) for the base tokenizer; the tokenizer with ChatML's specials
    keeps its end token id and no stop string, as before."""
    from finetune.cli.tiny import build_tokenizer
    from finetune.data.prompts import cut_at_stops, turn_end_ids, turn_end_stops

    tokenizer = base_tokenizer()
    assert turn_end_stops(tokenizer) == [MARKER] and turn_end_ids(tokenizer) == []
    chatml = build_tokenizer()
    assert turn_end_stops(chatml) == [] and turn_end_ids(chatml) == [chatml.convert_tokens_to_ids(MARKER)]
    assert cut_at_stops("ok<|im_end|>im_end|>", [MARKER]) == "ok" and cut_at_stops("ok", []) == "ok"


def _oracle(model, tokenizer, prompt: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Plain transformers: greedy generate with stop_strings, the new ids through the stop, the text cut by hand."""
    output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, stop_strings=[MARKER], tokenizer=tokenizer,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = output[0, len(prompt):].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert MARKER in text  # the model writes the marker: the oracle stopped on it
    return new, text.split(MARKER)[0]


def test_the_generation_eval_stops_at_the_marker_and_scores_the_answers(trained):
    """Before: generation ran past `ok<|im_end|>` to max_new_tokens and the reference kept the literal marker, so
    exact_match was 0% on answers equal to the references. Now each answer is transformers' with stop_strings, cut at
    the marker, and the reference is cut the same way: 100%."""
    from finetune.cli.generate import answer
    from finetune.training.evals import generation_eval, prompt_and_reference

    model, tokenizer, examples = trained
    prompt, reference = prompt_and_reference(examples[0], tokenizer)
    assert reference == "ok"
    result = generation_eval(model, tokenizer, examples, max_new_tokens=24)
    assert result["score"] == 1.0 and result["samples"][0]["generated"] == "ok"
    oracle = [_oracle(model, tokenizer, prompt_and_reference(e, tokenizer)[0], 24)[1] for e in examples]
    assert oracle == ["ok"] * len(examples)
    assert answer(model, tokenizer, [prompt], max_new_tokens=24) == ["ok"]  # `finetune generate`'s answers


def test_grpo_sampling_stops_at_the_marker_and_the_completion_is_not_truncated(trained):
    """Before, GRPO's builtin sampler ran every completion to max_completion_length (only the EOS ended one), and a
    completion was `truncated` unless it ended on an EOS id (masked out with mask_truncated_completions). Now a
    completion ends with the token that completes the marker, the ids of transformers' generate with stop_strings
    (greedy: top_p keeps the most probable token only), it counts as ended, and its reward text has no marker."""
    from finetune.training.objectives.grpo.rollouts import _sequences
    from finetune.training.objectives.grpo.sampling import generate_completions

    model, tokenizer, examples = trained
    prompts = [ex.input_ids[:next(i for i, v in enumerate(ex.labels) if v != IGNORE_INDEX)] for ex in examples[:2]]
    eos = [tokenizer.eos_token_id]
    ours = generate_completions(model, prompts, [0, 1], max_new_tokens=24, temperature=1.0, top_p=1e-9, eos_ids=eos,
                                pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), stop_strings=[MARKER],
                                tokenizer=tokenizer)
    assert ours == [_oracle(model, tokenizer, prompt, 24)[0] for prompt in prompts]
    assert all(len(c) < 24 for c in ours)
    written = tokenizer.batch_decode(ours, skip_special_tokens=True)
    _, mask, truncated = _sequences(prompts, ours, written, eos, [MARKER], pad=tokenizer.pad_token_id,
                                    mask_truncated=True)
    assert not truncated.any() and bool(mask.sum(dim=1).eq(torch.tensor([len(c) for c in ours])).all())


def test_vllm_sampling_is_asked_to_stop_at_the_marker(monkeypatch):
    """Before, the vLLM server was asked to stop on the EOS ids only. Now the marker is a stop string (kept in the
    completion, as the builtin sampler keeps it, so both end the completion alike)."""
    from finetune.training.objectives.grpo import vllm_server

    asked = []
    monkeypatch.setattr(vllm_server, "sample_on_rank0", lambda server, requests, *, n, model, sampling:
                        asked.append(sampling) or [[([5, 6], [-0.1, -0.2])] * n for _ in requests])
    generation = vllm_server.VLLMGeneration.__new__(vllm_server.VLLMGeneration)
    generation.config = SimpleNamespace(temperature=1.0, top_p=1.0, max_completion_length=8, num_generations=2)
    generation.server, generation.served, generation.base = None, None, "base"
    completions, _ = generation.sample([[1, 2]], [7], eos_ids=[2], stop=[MARKER])
    assert completions == [[5, 6], [5, 6]]
    assert asked[0]["stop"] == [MARKER] and asked[0]["include_stop_str_in_output"] is True
    generation.sample([[1, 2]], [7], eos_ids=[2])
    assert "stop" not in asked[1]


def test_the_note_is_said_when_the_rows_come_from_the_data_cache(tmp_path, monkeypatch, capsys):
    """A second run (a new process: a new tokenizer) maps its rows from the data cache and renders none: the note was
    said only where a row was rendered, so every run after the first said nothing."""
    from conftest import write_jsonl

    from finetune import data
    from finetune.recipe import validate_recipe

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": f"Say ok {n}."}, {"role": "assistant", "content": "ok"}]}
            for n in range(8)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    recipe = validate_recipe({"model": {"name_or_path": "unused"}, "train": {"micro_batch_size": 2},
                              "data": {"datasets": [{"path": str(path), "format": "chat"}], "eval_fraction": 0}})
    for _ in range(2):  # built, then mapped from the cache
        data.prepare(recipe, base_tokenizer())
        assert capsys.readouterr().out.count("is not a token of this tokenizer") == 1
