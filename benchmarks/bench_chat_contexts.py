"""What training every assistant turn in its inference context costs in tokens, per chat template.

finetune trains a conversation as one example where the template renders earlier turns as it renders a last turn
(ChatML, Llama 3.1, Qwen2.5) and as one example per context where it does not (Qwen3 and Qwen3.5 with reasoning or
plain turns, gpt-oss, DeepSeek-R1 with reasoning, GLM with reasoning): data/chat.py. The baseline is one example per
conversation, TRL's way with its training templates (every turn rendered as a last turn, history included), measured
here as the tokens of the whole conversation rendered once by TRL's training template of the family (the shipped
template where TRL has none: Llama 3.1). Rows: generated conversations of 1-4 turns, half with
reasoning, answers and reasoning of realistic lengths (40-120 and 80-400 words). Tokens: the tiny byte-level
tokenizers of the suite with each family's special tokens (ratios, not absolute counts, carry to real tokenizers).

    python benchmarks/bench_chat_contexts.py [--rows 300]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data"))

WORDS = ("the model reads each turn and writes an answer that follows from the question and from what came "  # noqa: SIM905
         "before it in the conversation so the context matters").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "."


def conversation(rng: random.Random) -> dict:
    messages, reasoning = [], rng.random() < 0.5
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": sentence(rng, 10, 40)})
        turn = {"role": "assistant", "content": sentence(rng, 40, 120)}
        if reasoning:
            turn["reasoning_content"] = sentence(rng, 80, 400)
        messages.append(turn)
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    from chat_families import FAMILIES, family_tokenizer, trl_template

    from finetune.chat_templates import named_templates
    from finetune.data.conversations import convert_turns, template_messages
    from finetune.data.templates import render_examples, tokenize_many
    from finetune.recipe import DatasetSpec

    rng = random.Random(0)
    rows = [conversation(rng) for _ in range(args.rows)]
    spec = DatasetSpec(path="generated", format="chat")
    print(f"{args.rows} conversations of 1-4 turns, half with reasoning\n")
    print(f"{'template':<12} {'examples/row':>12} {'tokens, TRL (one per row)':>26} {'tokens, per context':>20} "
          f"{'ratio':>6} {'rows/s':>7}")
    for family in FAMILIES:
        template = named_templates()["deepseek-r1"] if family == "deepseek-r1" else None
        tokenizer = family_tokenizer(family, template=template)
        started = time.perf_counter()
        examples = [example for row in rows for example in render_examples(row, spec, tokenizer, None, "row")]
        rate = args.rows / (time.perf_counter() - started)
        ours = tokenize_many(examples, tokenizer)
        training = trl_template(FAMILIES[family][1]) if FAMILIES[family][1] else tokenizer.chat_template
        whole = [tokenizer.apply_chat_template(template_messages(convert_turns(row["messages"], spec, "row"), training),
                                               chat_template=training, tokenize=False) for row in rows]
        baseline = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in whole)
        tokens = sum(len(example.input_ids) for example in ours)
        print(f"{family:<12} {len(examples) / args.rows:>12.2f} {baseline:>26,} {tokens:>20,} "
              f"{tokens / baseline:>6.2f} {rate:>7.0f}")
    print("\nratio: finetune's tokens / TRL's (the compute of an epoch, roughly); rows/s: rendering and locating the "
          "turns, one process.")


if __name__ == "__main__":
    main()
