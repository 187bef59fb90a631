"""Rendered rows -> token ids and labels: each row's text tokenized once, its trained segments' tokens labelled, and
every prompt given the tokens it has when sent alone.

Why the prompt's own tokens. Serving tokenizes the prompt alone (transformers' pipeline, vLLM, `finetune generate`,
GRPO's prompts). A row's text tokenized as one string can differ at the prompt's end: a GPT-2-style pre-tokenizer
(SmolLM2's, StarCoder's) joins the generation prompt's `\\n` with the indentation an answer starts with (`\\n   ` is one
token), and gives a prompt ending in `\\n\\n` two `\\n` tokens where the prompt alone has one `\\n\\n`. The adapter would
then learn to answer after tokens no server sends. So where a token covers characters on both sides of a prompt's end,
or the whitespace run it ends with tokenizes otherwise alone, the row is tokenized in pieces split there (the text
before alone, then the rest), as TRL's preference trainers tokenize a prompt and its answer. The other rows keep the
one-string tokenization (the fast path: one Rust batch call). A prompt's end is where the context before an assistant
turn (or a completion, an alpaca output) stops: the turn's reasoning left untrained by data.reasoning: context is part
of the turn (chat.Reasoning), no prompt ends before its answer. A tokenizer whose normalizer writes `▁` before the
text it encodes (Llama 2's, Mistral v0.1's tokenizer.json) would spell the rest alone with a space the row lacks: such
a row keeps its one-string tokens (their token holding the prompt's last space is trained), as TRL 1.16 does.
"""

from __future__ import annotations

import itertools

import numpy as np

from finetune.data.chat import Opener, Reasoning
from finetune.data.examples import IGNORE_INDEX, Example

_WINDOW = 64  # characters of a whitespace run a prompt ends with that are checked for a different tokenization alone


def _labels(ids: list[int], offsets, segments: list[tuple[str, bool]]) -> list[int]:
    """Label a token with its id when its characters overlap a trained segment, else IGNORE_INDEX.

    Overlap (not "starts inside") so that a token merging the prompt's last space with the answer's first
    characters is trained where the row keeps such a token (module docstring): the answer must be learned.
    """
    lows, highs, position = [], [], 0
    for text, trained in segments:
        if trained:
            lows.append(position)
            highs.append(position + len(text))
        position += len(text)
    if not ids:
        return []
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = spans[:, 0], np.maximum(spans[:, 1], spans[:, 0] + 1)
    index = np.searchsorted(np.asarray(highs, dtype=np.int64), starts, side="right")  # first span ending after start
    valid = index < len(lows)
    trained = valid & (np.asarray(lows + [0], dtype=np.int64)[np.minimum(index, len(lows))] < ends)
    return np.where(trained, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its BOS first when it encodes text, asked of what it produces rather than of its
    `add_bos_token` attribute: Llama 3's tokenizer.json adds <|begin_of_text|> in its post-processor while
    transformers 5 reports add_bos_token False (a base model trained without its attention sink)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos] and plain[:1] != [bos]


def _with_bos(example: Example, bos: int | None) -> Example:
    """`example` with BOS (untrained) first, given the tokenizer adds one (`bos`), unless its text writes it already."""
    if bos is not None and (not example.input_ids or example.input_ids[0] != bos):
        return Example([bos] + example.input_ids, [IGNORE_INDEX] + example.labels)
    return example


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> Example:
    """Tokenize one rendered row (tokenize_many)."""
    return tokenize_many([segments], tokenizer)[0]


def tokenize_many(all_segments: list[list[tuple[str, bool]]], tokenizer, *, chunk: int = 1024, bos: bool = True,
                  own_prompt_rows: list[int] | None = None, late_turns: dict[int, list[int]] | None = None) -> list[Example]:
    """Batch-tokenize many rendered rows: a fast tokenizer encodes a batch on all cores (Rust threads); a row whose
    prompt would not get its own tokens is tokenized in pieces (module docstring). `bos`: the tokenizer's BOS is put
    first where it adds one (adds_bos). False: a continuation, tokenized apart, or a chat template's rendering
    (template_rendered), which writes BOS itself where the model has one. `own_prompt_rows`: given a list, the indices of
    the rows tokenized in pieces are appended to it (`finetune data` and the run's data line count them). `late_turns`:
    given a dict, a row tokenized in pieces whose later turns' prompts hold a cut (their history is then no longer
    the tokens a server sends: serving_splits) gets the prompt ends of those turns under its index."""
    return _tokenize(all_segments, [prompt_ends(segments) for segments in all_segments], tokenizer, chunk=chunk,
                     bos=bos, own_prompt_rows=own_prompt_rows, late_turns=late_turns)


def serving_splits(segments: list[tuple[str, bool]], late: list[int]) -> list[list[tuple[str, bool]]]:
    """A conversation's example tokenized in pieces, as examples whose every trained turn gets the prompt a server
    sends. Cut at the end of its first prompt, the example's text gives that turn its prompt's own tokens, but a later
    turn's history then holds the cut, where serving tokenizes the whole history as one string (SmolLM2: an earlier
    answer's indentation `\n   ` became `\n`, `   `; bb55). So the turns whose prompts end at `late` (tokenize_many's
    late_turns) get an example each, their history untrained, and the example keeps the turns before them."""
    def upto(end: int, keep_trained: bool) -> list[tuple[str, bool]]:
        taken, position = [], 0
        for text, flag in segments:
            if position >= end and _context(flag):  # the turn after `end` is whole: its trained run has ended
                break
            taken.append((text, flag if keep_trained or position >= end else False))
            position += len(text)
        return taken

    first, cut, position = [], late[0], 0
    for text, flag in segments:  # the turns before the first late one: up to the context run that precedes it
        if position >= cut:
            break
        first.append((text, flag))
        position += len(text)
    while first and _context(first[-1][1]):
        first.pop()
    return ([first] if any(flag for _, flag in first) else []) + [upto(end, keep_trained=False) for end in late]


def own_prompt_note(rows: int, first: str) -> str:
    """The note for the rows tokenize_many tokenized in pieces (`first`: where the first is)."""
    many = rows > 1
    return (f"{rows} row{'s' if many else ''} (the first: {first}) {'were' if many else 'was'} tokenized in pieces at "
            "the end of a prompt: as one string, a token would have joined the prompt's last characters to the "
            "answer's first (a GPT-2-style tokenizer joins a generation prompt's `\\n` with the indentation an answer "
            "starts with), or split the whitespace the prompt ends with otherwise than the prompt alone, a prompt no "
            "server sends. The prompt keeps the tokens it has alone and the answer is tokenized after it, as serving "
            "tokenizes it; nothing to fix")


def served_turns_note(turns: int, first: str) -> str:
    """The note for the later turns serving_splits gave an example of their own."""
    many = turns > 1
    return (f"{turns} later turn{'s' if many else ''} of the conversations tokenized in pieces (the first: {first}) "
            f"{'were' if many else 'was'} given an example of {'their' if many else 'its'} own: the cut that gives an "
            "earlier turn its prompt's own tokens lies in the history of the later ones, which a server tokenizes as "
            "one string; each turn trains after the prompt a server sends. More examples, the same turns trained; "
            "nothing to fix")


def prompt_ends(segments: list[tuple[str, bool]]) -> list[int]:
    """Where in a row's text a prompt ends: after each context segment that a trained one (or a turn's untrained
    reasoning, chat.Reasoning) follows. Not inside a turn: its answer after its untrained reasoning is the model's."""
    ends, position = [], 0
    for (text, flag), (_, after) in itertools.pairwise(segments):
        position += len(text)
        if position and _context(flag) and not _context(after):
            ends.append(position)
    return ends


def _context(flag) -> bool:
    return not flag and not isinstance(flag, Reasoning)


def _tokenize(all_segments: list[list[tuple[str, bool]]], all_ends: list[list[int]], tokenizer, *, chunk: int,
              bos: bool, own_prompt_rows: list[int] | None, late_turns: dict[int, list[int]] | None = None) -> list[Example]:
    """tokenize_many with each row's prompt ends given (answer_starts gives the ends of the rows it re-labels)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    examples, bos_id = [], tokenizer.bos_token_id if bos and all_segments and adds_bos(tokenizer) else None
    for first in range(0, len(all_segments), chunk):
        part = all_segments[first : first + chunk]
        texts = ["".join(text for text, _ in segments) for segments in part]
        if backend is None:  # a tokenizer without a Rust backend: the one-string tokenization, labelled by offsets
            encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            examples += [_with_bos(Example(list(ids), _labels(list(ids), offsets, segments)), bos_id)
                         for segments, ids, offsets in zip(part, encoded["input_ids"], encoded["offset_mapping"])]
            continue
        # straight to the Rust tokenizer: skips transformers' per-row Python conversion
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        rows = [Example(encoding.ids, _labels_from_encoding(encoding, segments))
                for segments, encoding in zip(part, encodings)]
        suspects = _suspect_ends(texts, encodings, all_ends[first : first + chunk], backend)
        pieced = _in_pieces({index: _pieces(part[index], ends) for index, ends in suspects.items()},
                            {index: encodings[index].ids for index in suspects}, tokenizer) if suspects else {}
        for index in sorted(pieced):
            rows[index] = pieced[index]
            if own_prompt_rows is not None:
                own_prompt_rows.append(first + index)
            late = [end for end in all_ends[first + index] if end > suspects[index][0]]
            if late_turns is not None and late:
                late_turns[first + index] = late
        examples += [_with_bos(row, bos_id) for row in rows]
    return examples


def _suspect_ends(texts: list[str], encodings, all_ends: list[list[int]], backend) -> dict[int, list[int]]:
    """Row -> the prompt ends whose tokens may differ from the prompt's own: a token covers characters on both sides
    (`\\n   `), or the prompt ends with a whitespace run of two or more characters that tokenizes otherwise when
    nothing follows it (GPT-2's pre-tokenizer gives `\\n\\n` + `yes` the tokens `\\n`, `\\n`, `yes`, and `\\n\\n` alone
    one token). The run is tokenized alone from the token it starts in, all such runs in one batch call."""
    suspects: dict[int, list[int]] = {}
    windows: list[tuple[int, int, str, list[int]]] = []
    for index, (text, encoding, ends) in enumerate(zip(texts, encodings, all_ends)):
        for end in ends:
            after = encoding.char_to_token(end)  # the token holding the first character after the prompt
            if after is None:  # a character no token covers (a normalizer dropped it): left as it is
                continue
            if encoding.token_to_chars(after)[0] < end:
                suspects.setdefault(index, []).append(end)
            elif end >= 2 and text[end - 2 : end].isspace():
                run = end - 2
                while run > max(end - _WINDOW, 0) and text[run - 1].isspace():
                    run -= 1
                opening = encoding.char_to_token(run)
                if opening is not None:
                    start = encoding.token_to_chars(opening)[0]
                    windows.append((index, end, text[start:end], encoding.ids[opening:after]))
    if windows:
        alone = backend.encode_batch([text for _, _, text, _ in windows], add_special_tokens=False)
        for (index, end, _, ids), encoding in zip(windows, alone):
            if encoding.ids != ids:
                suspects.setdefault(index, []).append(end)
    return {index: sorted(ends) for index, ends in suspects.items()}


def _pieces(segments: list[tuple[str, bool]], ends: list[int]) -> list[list[tuple[str, bool]]]:
    """A row's segments cut at `ends` (prompt ends: each at a segment's start)."""
    pieces, current, position, cuts = [], [], 0, iter(ends)
    cut = next(cuts, None)
    for text, flag in segments:
        if cut is not None and position == cut:
            pieces.append(current)
            current, cut = [], next(cuts, None)
        current.append((text, flag))
        position += len(text)
    return pieces + [current]


def _in_pieces(rows: dict[int, list], joint: dict[int, list[int]], tokenizer) -> dict[int, Example]:
    """Each row (its pieces) tokenized piece by piece, every piece of every row in one batch call; a row is left
    out where that changes nothing or does not spell its text (a normalizer that writes `▁` before each piece:
    module docstring)."""
    texts = ["".join(text for text, _ in piece) for pieces in rows.values() for piece in pieces]
    encodings = iter(tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    found = {}
    for index, pieces in rows.items():
        ids, labels = [], []
        for piece, encoding in zip(pieces, encodings):
            ids += encoding.ids
            labels += _labels_from_encoding(encoding, piece)
        if ids != joint[index] and _spelled(ids, tokenizer) == _spelled(joint[index], tokenizer):
            found[index] = Example(ids, labels)
    return found


def _spelled(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def answer_starts(all_segments: list[list[tuple[str, bool]]], tokenizer, *, bos: bool = True) -> list[int | None]:
    """The token each rendered example's answer starts at where it has a reasoning opener (chat.Opener: under
    data.reasoning: context a turn trains its `<think>\n` before its untrained reasoning), else None (its first
    trained token is its answer's). A row cut before that token has nothing to learn: the opener alone is no answer.
    Found by tokenizing those examples again with the openers untrained, split at the same prompt ends (the same
    text in the same pieces: the same tokens)."""
    opened = [i for i, segments in enumerate(all_segments) if any(isinstance(flag, Opener) for _, flag in segments)]
    bare = _tokenize([[(text, bool(flag) and not isinstance(flag, Opener)) for text, flag in all_segments[i]]
                      for i in opened], [prompt_ends(all_segments[i]) for i in opened], tokenizer, chunk=1024,
                     bos=bos, own_prompt_rows=None)
    starts: list[int | None] = [None] * len(all_segments)
    for i, example in zip(opened, bare):
        starts[i] = next((k for k, label in enumerate(example.labels) if label != IGNORE_INDEX), None)
    return starts


def _labels_from_encoding(encoding, segments: list[tuple[str, bool]]) -> list[int]:
    """`_labels` in O(trained spans): the tokens holding a span's first and last characters bound its tokens.

    char_to_token gives the *first* token of a character; one written as several tokens (an emoji or most CJK in
    byte-level BPE, a combining accent, any byte-fallback character) has the others after it, covering the same
    character, and they are trained too (before, a span ending in `🙂` trained its first byte only)."""
    ids, labels, position = encoding.ids, [IGNORE_INDEX] * len(encoding.ids), 0
    for text, trained in segments:
        if trained and text:
            end = position + len(text)
            first, last = encoding.char_to_token(position), encoding.char_to_token(end - 1)
            if first is None or last is None:  # a character no token covers (a normalizer dropped it): the slow way
                return _labels(ids, encoding.offsets, segments)
            while last + 1 < len(ids) and (span := encoding.token_to_chars(last + 1)) is not None and span[0] < end:
                last += 1  # the next token starts inside the span: the rest of its last character (or of the span)
            labels[first : last + 1] = ids[first : last + 1]
        position += len(text)
    return labels
