"""Formats and chat templates: a row rendered to (text, trained) segments, tokenized with exact labels."""

from __future__ import annotations

import numpy as np

from finetune.data.examples import IGNORE_INDEX, Example
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

# Field names each format needs, and optional ones (the recipe's `columns` maps them to other column names).
FORMAT_FIELDS = {
    "alpaca": (("instruction", "output"), ("input", "system")),
    "chat": (("messages",), ()),
    "completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
    "preference": (("chosen", "rejected"), ("prompt",)),  # prompt optional: the implicit-prompt form has none
    "unpaired_preference": (("prompt", "completion", "label"), ()),  # TRL's KTO rows; label: desirable or not
    "prompt": (("prompt",), ()),  # GRPO: prompts only; the other columns go to the reward functions
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# ShareGPT-style `conversations` use from/value and these speaker names; everything maps to system/user/assistant.
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "model": "assistant", "bot": "assistant"}


# --------------------------------------------------------------------------------------------------- rendering
def _column(spec: DatasetSpec, name: str, row: dict | None = None) -> str:
    """The data column holding field `name` (chat data may use ShareGPT's `conversations` unmapped)."""
    if name in spec.columns:
        return spec.columns[name]
    if name == "messages" and row is not None and "messages" not in row and "conversations" in row:
        return "conversations"
    return name


def _field(row: dict, spec: DatasetSpec, name: str):
    return row.get(_column(spec, name, row))


def check_row(row: dict, spec: DatasetSpec, where: str) -> None:
    """The row is an object with every field its format needs, and chat turns are well formed (no tokenizer needed)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object with fields, got {type(row).__name__}.")
    required, _ = FORMAT_FIELDS[spec.format]
    missing = [_column(spec, name, row) for name in required if _field(row, spec, name) in (None, "", [])]
    if missing:
        raise DataError(
            f"{where}: missing or empty {', '.join(f'`{m}`' for m in missing)} needed by format `{spec.format}` (row has: "
            f"{', '.join(sorted(row))}). Fix the row, map the columns with data.datasets[].columns, or set data.bad_rows: skip."
        )
    if spec.format == "chat":
        normalize_messages(_field(row, spec, "messages"), spec, where)


def normalize_messages(turns, spec: DatasetSpec, where: str) -> list[dict]:
    """role/content or from/value turns -> [{role, content}] with system/user/assistant roles that alternate."""
    messages = convert_turns(turns, spec, where)
    _check_alternation(messages, where)
    return messages


def convert_turns(turns, spec: DatasetSpec, where: str) -> list[dict]:
    """role/content or from/value turns -> [{role, content}] with system/user/assistant roles (order not checked)."""
    if not isinstance(turns, list):
        raise DataError(f"{where}: chat messages must be a list of turns, got {type(turns).__name__}.")
    role_key, content_key = spec.columns.get("role", "role"), spec.columns.get("content", "content")
    messages = []
    for number, turn in enumerate(turns, start=1):
        if isinstance(turn, dict) and role_key not in turn and "from" in turn and "value" in turn:
            role, content = turn["from"], turn["value"]
        elif isinstance(turn, dict) and role_key in turn and content_key in turn:
            role, content = turn[role_key], turn[content_key]
        elif isinstance(turn, dict) and "role" in turn and "content" in turn:  # already converted
            role, content = turn["role"], turn["content"]
        else:
            raise DataError(f"{where}: message {number} needs `{role_key}` and `{content_key}` (or `from` and `value`), "
                            f"got {turn!r}. Fix the row or map the keys with data.datasets[].columns (role, content).")
        if ROLE_ALIASES.get(str(role).lower()) is None:
            raise DataError(f"{where}: message {number} has role `{role}`; known roles are {', '.join(ROLE_ALIASES)}.")
        messages.append({"role": ROLE_ALIASES[str(role).lower()], "content": "" if content is None else str(content)})
    return messages


def _check_alternation(messages: list[dict], where: str) -> None:
    """System turns only first; then user, assistant, user, ...; at least one assistant turn to train on."""
    expected = "user"
    for number, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "system" and all(m["role"] == "system" for m in messages[:number]):
            continue
        if role != expected:
            raise DataError(
                f"{where}: message {number} has role `{role}` where `{expected}` was expected: after an optional system "
                "message, roles must alternate user, assistant, user, ... Fix the row (merge consecutive turns of one "
                "speaker) or set data.bad_rows: skip."
            )
        expected = "assistant" if role == "user" else "user"
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing would be trained. Add the answer or "
                        "set data.bad_rows: skip.")


def _chat_segments(messages: list[dict], tokenizer, where: str, *, trained_from: int = 0) -> list[tuple[str, bool]]:
    """Segments of a rendered conversation: each assistant turn (content + end-of-turn) from message `trained_from`
    on trained, the rest not (a preference pair scores its responses, not the assistant turns of its prompt)."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = render(messages, False)
    segments, cursor = [], 0
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant" or index < trained_from:
            continue
        start = len(render(messages[:index], True))
        upto = render(messages[: index + 1], False)
        if not full.startswith(upto) or not cursor <= start <= len(upto):
            raise DataError(
                f"{where}: the tokenizer's chat template does not render conversation prefixes as prefixes of the whole, so "
                "assistant turns cannot be located exactly. Use a template without history rewriting."
            )
        end = len(upto.rstrip())  # the end-of-turn token is trained (the model must learn to stop), the newline not
        segments += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def render_segments(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str) -> list[tuple[str, bool]]:
    """Row -> [(text, trained)] for the dataset's format."""
    check_row(row, spec, where)
    eos = tokenizer.eos_token or ""
    system_prompt = spec.system_prompt if spec.system_prompt is not None else system_prompt
    if spec.format == "text":
        return [(str(_field(row, spec, "text")) + eos, True)]
    if spec.format == "completion":
        return [(str(_field(row, spec, "prompt")), False), (str(_field(row, spec, "completion")) + eos, True)]
    if spec.format == "preference":
        return render_pair(row, spec, tokenizer, system_prompt, where)
    if spec.format == "unpaired_preference":
        return render_unpaired(row, spec, tokenizer, system_prompt, where)
    if spec.format == "chat":
        messages = normalize_messages(_field(row, spec, "messages"), spec, where)
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        return _chat_segments(messages, tokenizer, where)
    instruction, extra = str(_field(row, spec, "instruction")), _field(row, spec, "input")
    template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    system = _field(row, spec, "system") or system_prompt
    if system:
        prompt = f"{system}\n\n{prompt}"
    return [(prompt, False), (str(_field(row, spec, "output")) + eos, True)]


# ------------------------------------------------------------------------------------------- preference pairs
def _pair_parts(row: dict, spec: DatasetSpec, where: str) -> tuple[list[dict] | str | None, object, object]:
    """(prompt, chosen, rejected) of a pair row. The implicit-prompt form (chosen and rejected whole conversations,
    as UltraFeedback-binarized ships them) becomes its shared opening turns and the two answers."""
    prompt, chosen, rejected = (_field(row, spec, name) for name in ("prompt", "chosen", "rejected"))
    if isinstance(chosen, list) and isinstance(rejected, list) and convert_turns(chosen, spec, where)[0]["role"] != "assistant":
        chosen_turns, rejected_turns = normalize_messages(chosen, spec, where), normalize_messages(rejected, spec, where)
        shared = 0
        while shared < min(len(chosen_turns), len(rejected_turns)) - 1 and chosen_turns[shared] == rejected_turns[shared]:
            shared += 1
        return chosen_turns[:shared], chosen_turns[shared:], rejected_turns[shared:]
    return prompt, chosen, rejected


def render_pair(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None,
                where: str) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """A preference row -> (chosen segments, rejected segments), the same prompt untrained in both, the responses trained.

    Text prompts go through the tokenizer's chat template as a user turn when it has one, else stay raw text (a
    base model); message-list prompts must end with a user turn, and the responses are assistant turn(s).
    """
    prompt, chosen, rejected = _pair_parts(row, spec, where)
    if chosen == rejected:
        raise DataError(f"{where}: `chosen` and `rejected` are identical, so the pair says nothing. Fix the row or set "
                        "data.bad_rows: skip to skip such pairs with a count.")
    chosen_segments, rejected_segments = _answered(prompt, (("chosen", chosen), ("rejected", rejected)), spec,
                                                   tokenizer, system_prompt, where)
    return chosen_segments, rejected_segments


def render_unpaired(row: dict, spec: DatasetSpec, tokenizer, system_prompt: str | None,
                    where: str) -> tuple[list[tuple[str, bool]], bool]:
    """An unpaired preference row (TRL's KTO format: prompt, completion, label) -> (segments, desirable): the prompt
    untrained, the completion trained, rendered as a pair's response is (render_pair)."""
    label = _field(row, spec, "label")
    if not isinstance(label, (bool, np.bool_)):
        raise DataError(f"{where}: `{_column(spec, 'label')}` must be true (a desirable completion) or false (an "
                        f"undesirable one), got {label!r}. Fix the row (JSON true/false, not a number or a string) or "
                        "set data.bad_rows: skip.")
    prompt, completion = _field(row, spec, "prompt"), _field(row, spec, "completion")
    (segments,) = _answered(prompt, (("completion", completion),), spec, tokenizer, system_prompt, where)
    return segments, bool(label)


def _answered(prompt, answers: tuple[tuple[str, object], ...], spec: DatasetSpec, tokenizer, system_prompt: str | None,
              where: str) -> list[list[tuple[str, bool]]]:
    """Segments of each (name, answer) to the same prompt, the answers trained.

    Text prompts go through the tokenizer's chat template as a user turn when it has one, else stay raw text (a
    base model); message-list prompts must end with a user turn, and the answers are assistant turn(s).
    """
    chat = isinstance(prompt, list) or any(isinstance(a, list) for _, a in answers) or \
        bool(getattr(tokenizer, "chat_template", None))
    if not chat:
        if prompt in (None, ""):
            raise DataError(f"{where}: `{_column(spec, 'prompt')}` is missing: a text response needs the prompt it "
                            "answers. Add it, map it with data.datasets[].columns, or give whole conversations.")
        eos = tokenizer.eos_token or ""
        return [[(str(prompt), False), (str(answer) + eos, True)] for _, answer in answers]
    turns = [{"role": "user", "content": str(prompt)}] if isinstance(prompt, str) and prompt else \
        convert_turns(prompt or [], spec, where)
    if not turns or turns[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt of a conversational row must end with a user turn (it ends with "
                        f"{turns[-1]['role'] if turns else 'nothing'}), so that the answers answer it. Fix the "
                        "row or set data.bad_rows: skip.")
    system = system_prompt if system_prompt and turns[0]["role"] != "system" else None
    turns = ([{"role": "system", "content": system}] if system else []) + turns
    sequences = []
    for name, answer in answers:
        reply = [{"role": "assistant", "content": str(answer)}] if not isinstance(answer, list) else \
            convert_turns(answer, spec, where)
        messages = normalize_messages(turns + reply, spec, f"{where} ({name})")
        if messages[len(turns)]["role"] != "assistant" or not any(m["content"].strip() for m in messages[len(turns):]):
            raise DataError(f"{where}: `{name}` must be a non-empty assistant answer. Fix the row or set data.bad_rows: skip.")
        sequences.append(_chat_segments(messages, tokenizer, where, trained_from=len(turns)))
    return sequences


# -------------------------------------------------------------------------------------------------- tokenizing
def _labels(ids: list[int], offsets, segments: list[tuple[str, bool]]) -> list[int]:
    """Label a token with its id when its characters overlap a trained segment, else IGNORE_INDEX.

    Overlap (not "starts inside") so that a token merging the prompt's last space with the answer's first
    characters is trained: the answer must be learned even when the tokenizer glues it to the prompt.
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


def _with_bos(example: Example, tokenizer) -> Example:
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not example.input_ids or example.input_ids[0] != bos):
        return Example([bos] + example.input_ids, [IGNORE_INDEX] + example.labels)
    return example


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> Example:
    """Tokenize the joined text once; label the tokens that overlap a trained segment."""
    return tokenize_many([segments], tokenizer)[0]


def tokenize_many(all_segments: list[list[tuple[str, bool]]], tokenizer, *, chunk: int = 1024) -> list[Example]:
    """Batch-tokenize many rendered rows: a fast tokenizer encodes a batch on all cores (Rust threads)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    examples = []
    for first in range(0, len(all_segments), chunk):
        part = all_segments[first : first + chunk]
        texts = ["".join(text for text, _ in segments) for segments in part]
        if backend is not None:  # straight to the Rust tokenizer: skips transformers' per-row Python conversion
            for segments, encoding in zip(part, backend.encode_batch(texts, add_special_tokens=False)):
                examples.append(_with_bos(Example(encoding.ids, _labels_from_encoding(encoding, segments)), tokenizer))
            continue
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for segments, ids, offsets in zip(part, encoded["input_ids"], encoded["offset_mapping"]):
            examples.append(_with_bos(Example(list(ids), _labels(list(ids), offsets, segments)), tokenizer))
    return examples


def _labels_from_encoding(encoding, segments: list[tuple[str, bool]]) -> list[int]:
    """`_labels` in O(trained spans): the tokens holding a span's first and last characters bound its tokens."""
    ids, labels, position = encoding.ids, [IGNORE_INDEX] * len(encoding.ids), 0
    for text, trained in segments:
        if trained and text:
            first, last = encoding.char_to_token(position), encoding.char_to_token(position + len(text) - 1)
            if first is None or last is None:  # a character no token covers (a normalizer dropped it): the slow way
                return _labels(ids, encoding.offsets, segments)
            labels[first : last + 1] = ids[first : last + 1]
        position += len(text)
    return labels


def _render_rows(rows: list, places: list[str], spec: DatasetSpec, tokenizer, system_prompt: str | None,
                 workers: int) -> list:
    """Render every row to segments, or to the DataError message that rejects it (in worker processes if asked)."""
    source = spec.path
    jobs = [(row, f"{source} {place}") for row, place in zip(rows, places)]
    if workers > 1 and len(jobs) >= 2000:
        import multiprocessing

        global _WORKER_CONTEXT
        _WORKER_CONTEXT = (spec, tokenizer, system_prompt)  # inherited by the forked workers, not pickled per row
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_render_in_worker, jobs, chunksize=256)
    return [_render_or_reason(row, spec, tokenizer, system_prompt, where) for row, where in jobs]


_WORKER_CONTEXT: tuple | None = None


def _render_in_worker(job: tuple) -> list | str:
    spec, tokenizer, system_prompt = _WORKER_CONTEXT
    return _render_or_reason(job[0], spec, tokenizer, system_prompt, job[1])


def _render_or_reason(row, spec: DatasetSpec, tokenizer, system_prompt: str | None, where: str) -> list | str:
    try:
        return render_segments(row, spec, tokenizer, system_prompt, where)
    except DataError as exc:
        return str(exc)
