"""`finetune generate`: a quick look at what a run learned, from prompts or in an interactive chat.

    finetune generate runs/quickstart --prompt "Write 2023-07-04 as a ledger stamp."
    finetune generate runs/quickstart --prompt "..." --no-adapter     the base alone, for comparison
    finetune generate runs/quickstart                                 interactive chat (/reset, /exit)
    finetune generate runs/quickstart --step 20 --prompt "..."        a kept checkpoint's adapter (finetune checkpoints)

The base is loaded exactly as in training (the run's recipe: 4-bit, GGUF conversion, dtype), prompts are rendered
with the run's chat template and system prompt, and decoding is greedy, so the same prompt gives the same answer.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from finetune.data.prompts import prompt_ids
from finetune.outputs.export import (
    Source,
    clean_adapter_tensors,
    load_tokenizer_for,
    open_source,
    write_clean_adapter,
)


def load_for_generation(source: Source, *, no_adapter: bool):
    """(model, tokenizer): the run's base as trained, with the adapter on top unless `no_adapter`."""
    from finetune.model import load_base_model
    from finetune.model.classes import from_pretrained
    from finetune.model.experts import load_adapter

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if source.recipe is not None:
        model = load_base_model(source.recipe, device=device)
    else:
        model = from_pretrained(source.base_name, dtype=torch.bfloat16).to(device)
    tokenizer = load_tokenizer_for(source, None)
    if not no_adapter:
        # Through a clean copy: adapters gathered from wrapped models may carry wrapper prefixes in their keys.
        with tempfile.TemporaryDirectory() as folder:
            write_clean_adapter(Path(folder), clean_adapter_tensors(source.adapter_dir), source, None)
            model = load_adapter(model, folder)  # PeftModel.from_pretrained; MoE experts loaded per expert
    model.eval()
    return model, tokenizer


def render(tokenizer, messages: list[dict], system_prompt: str | None) -> list[int]:
    """Token ids of a conversation ready for the assistant's answer (plain text when there is no chat template)."""
    if not getattr(tokenizer, "chat_template", None):  # the tokenizer's BOS first, as text rows trained and GRPO's
        return prompt_ids(messages[-1]["content"], tokenizer, chat=False)  # text prompts (Llama 3's post-processor)
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int) -> list[str]:
    from finetune.training.evals import generate_batch

    return [text.strip() for text in generate_batch(model, tokenizer, prompts, max_new_tokens=max_new_tokens)]


def chat(model, tokenizer, *, system_prompt: str | None, max_new_tokens: int) -> None:
    """Read a line, answer it with the conversation so far; `/reset` forgets, `/exit` or an empty line quits."""
    history: list[dict] = []
    print("[finetune] chat: type a message; /reset starts over, /exit (or an empty line) quits.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line in ("", "/exit", "/quit"):
            return
        if line == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line})
        reply = answer(model, tokenizer, [render(tokenizer, history, system_prompt)], max_new_tokens=max_new_tokens)[0]
        history.append({"role": "assistant", "content": reply})
        print(f"model> {reply}")


def cli_generate(args: argparse.Namespace) -> int:
    """`finetune generate SOURCE [--step N] [--prompt P ...] [--max-new-tokens N] [--no-adapter]`."""
    with open_source(args.source, step=getattr(args, "step", None)) as source:
        model, tokenizer = load_for_generation(source, no_adapter=args.no_adapter)
    system_prompt = source.recipe.data.system_prompt if source.recipe is not None else None
    what = "base model alone" if args.no_adapter else f"base + adapter {source.origin}"
    print(f"[finetune] generating with the {what} (greedy, up to {args.max_new_tokens} new tokens)")
    if not args.prompt:
        chat(model, tokenizer, system_prompt=system_prompt, max_new_tokens=args.max_new_tokens)
        return 0
    prompts = [render(tokenizer, [{"role": "user", "content": text}], system_prompt) for text in args.prompt]
    for text, reply in zip(args.prompt, answer(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)):
        print(f"> {text}\n{reply}\n")
    return 0
