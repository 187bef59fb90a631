"""The chat file of bench_data.py's scale mode (benchmarks/data_scale.py): N rows of 1-3 user/assistant turns of
20-300 words each, seeded (the same bytes on every machine), with about as many SmolLM2 tokens per row as issue 38's
file (median ~930): sentences of common English words with a tail of rarer made-up words, numbers and punctuation."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import time
from pathlib import Path

COMMON_WORDS = (  # noqa: SIM905 (a list literal of 170 words reads worse)
    "the of and to a in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were their one all we can her has there been if more when will would who so no she other its may these about "
    "than into some could them only time new two then do any my our first should like now over such what most also "
    "made after very well where between many through years must before each how being those because while both same "
    "under work life people world system state data model training memory process rank value table file number result "
    "example answer question small large long short early later often never always again simple general different "
    "important possible available second third using given following several within without against during another "
    "around however therefore although together already usually quickly carefully directly especially"
).split()
SYLLABLES = (  # noqa: SIM905
    "ka ro mi tu ne sa li vo pe da gri stan tor mel qui zen bra ful ment tion ex pro con dis ter ing er al ous ble "
    "ver sin cha pho gen ist"
).split()


def _sentence_pool(rng: random.Random, count: int) -> list[list[str]]:
    """Sentences of 5-18 words: common words by a Zipf-like law, 15% rare made-up words, some numbers and commas."""
    rare = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(2000)]
    weights = list(itertools.accumulate(1.0 / (rank + 3) for rank in range(len(COMMON_WORDS))))
    pool = []
    for _ in range(count):
        length = rng.randint(5, 18)
        words = rng.choices(COMMON_WORDS, cum_weights=weights, k=length)
        for index in range(length):
            if rng.random() < 0.15:
                words[index] = rng.choice(rare)
        if length > 8 and rng.random() < 0.5:
            words[rng.randint(2, length - 3)] += ","
        if rng.random() < 0.15:
            words[rng.randint(1, length - 1)] = str(rng.randint(2, 2026))
        words[0] = words[0].capitalize()
        words[-1] += "."
        pool.append(words)
    return pool


def write_chat_file(path: Path, rows: int, *, seed: int = 0) -> dict:
    """A chat JSONL of `rows` rows, 1-3 user/assistant turns of 20-300 words each; the same bytes for the same seed.

    Fast at 200k rows (~700 MB): a message is a run of consecutive sentences of a 20k-sentence pool, starting at a
    random sentence and cut at the drawn word count, and rows are written with string formatting (the text holds only
    letters, digits, spaces, commas and periods, so it needs no JSON escaping).
    """
    started = time.perf_counter()
    rng = random.Random(seed)
    pool = _sentence_pool(rng, 20000)
    texts = [" ".join(words) for words in pool]
    texts += texts  # a run starting near the end continues from the start
    words_before = [0, *itertools.accumulate(len(words) for words in pool + pool)]
    messages = 0
    with open(path, "w") as out:
        for _ in range(rows):
            turns = []
            for _ in range(rng.randint(1, 3)):
                for role in ("user", "assistant"):
                    text = _run_of_words(rng, texts, words_before, len(pool))
                    turns.append(f'{{"role": "{role}", "content": "{text}"}}')
            messages += len(turns)
            out.write(f'{{"messages": [{", ".join(turns)}]}}\n')
    seconds = time.perf_counter() - started
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as written:
        for block in iter(lambda: written.read(1 << 24), b""):
            digest.update(block)
    return {"rows": rows, "messages": messages, "bytes": path.stat().st_size, "seed": seed,
            "blake2b": digest.hexdigest(), "seconds": round(seconds, 2)}


def _run_of_words(rng: random.Random, texts: list[str], words_before: list[int], pool_size: int) -> str:
    first, wanted = rng.randrange(pool_size), rng.randint(20, 300)
    end = bisect.bisect_right(words_before, words_before[first] + wanted) - 1  # whole sentences that fit
    short = words_before[first] + wanted - words_before[end]  # words still missing, taken from the next sentence
    run = " ".join(texts[first:end])
    if short:
        run = (run + " " if run else "") + " ".join(texts[end].split(" ")[:short])
    return run
