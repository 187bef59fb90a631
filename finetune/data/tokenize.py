"""A chunk of rows rendered, tokenized and length-limited: the work the cache builder spreads over data.num_proc.

Every row gets the same treatment whatever chunk or process it lands in, so the tokens do not depend on num_proc.
Problems are returned, never raised, from here (a worker process would lose the message's type); the builder
raises the first one when the recipe says to.

Length policy (data.overlong):
- truncate (default): a row longer than max_length keeps its first max_length tokens; a row whose answer lies
  wholly past max_length then has nothing to learn and is dropped and counted (the data line names the first few).
  Under data.reasoning: context a turn's reasoning opener (`<think>\n`) is trained but is no answer: a row cut
  inside its reasoning keeps nothing to learn (templates.answer_starts).
- drop: every row longer than max_length is dropped and counted.
- error: truncate, but a row left with nothing to learn stops the run, naming it (the strictness of v1-v3).
- split (format text only, recipe/data.py): a row longer than max_length becomes consecutive max_length pieces, each
  an example, so no token is thrown away; a piece's first token is no target, as any example's. The pieces after the
  first get no BOS (run_clm's group_texts and TRL's `wrapped` packing add none): a BOS marks a document's start, and
  the model never meets one in the middle of a text at inference. A last piece of one token (nothing to predict) is
  left out.
Truncation counts the tokens it cut (`cut_tokens`, of `tokens_before_cut`: the kept examples' tokens before it), so
the data line can say how much of the data a run never sees.
A row with no trained token at all (an empty answer; a text row of one token: an example's first token is never a
target) is a malformed row: data.bad_rows decides.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data.chat import prefill_misses
from finetune.data.conversations import closing_tag_reads, renders_tools
from finetune.data.examples import IGNORE_INDEX, Example
from finetune.data.folders import folder_files, saved_folder
from finetune.data.pairs import pair_examples, prompted_answer_starts, tokenize_prompted
from finetune.data.ported_rows import checked_spec, pair_row, pair_spec, unpaired
from finetune.data.readers import CHUNK_CHARS, BlankLine, data_suffix
from finetune.data.template_facts import chat_template_text
from finetune.data.templates import (
    FORMAT_FIELDS,
    _column,
    _field,
    _render_or_reason,
    answer_starts,
    arrow_null_rows,
    template_rendered,
    tokenize_many,
)
from finetune.data.tokens import serving_splits
from finetune.distributed import print0
from finetune.errors import DataError
from finetune.recipe import DatasetSpec, Recipe

_NO_EOS_NOTED: weakref.WeakSet = weakref.WeakSet()  # tokenizers without an EOS whose note was printed
KEPT_REASONS = 20  # skipped rows whose reasons are kept (every skip is counted)
NAMED_DROPS = 5  # rows dropped for length that the data line names
# The fields whose value may be a list of chat turns (whose keys data.datasets[].columns role/content/reasoning name).
TURN_LISTS = {"chat": ("messages",), "preference": ("prompt", "chosen", "rejected"),
              "unpaired_preference": ("prompt", "completion", "chosen", "rejected"), "prompt": ("prompt",)}
# A row error's advice to skip such rows (`, or set data.bad_rows: skip [to skip ... with a count]`), said to no one
# when rows are skipped already: dropped from the reasons kept under data.bad_rows: skip.
_SKIP_ADVICE = re.compile(r",? or set data\.bad_rows: skip(?: to skip [^.]*)?(?=\.)| \(data\.bad_rows: skip\)")


@dataclass
class ChunkResult:
    """What one chunk of rows became: its examples, its counts, why rows were skipped or dropped."""

    examples: list[Example] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"rows": 0, "skipped": 0, "truncated": 0, "dropped": 0,
                                                  "prompt_truncated": 0, "response_truncated": 0,
                                                  "closing_tag_rows": 0, "cut_tokens": 0, "tokens_before_cut": 0,
                                                  "split_rows": 0, "split_pieces": 0, "blank_lines": 0,
                                                  "own_prompt_rows": 0, "served_turns": 0, "prefill_rows": 0, "arrow_null_rows": 0,
                                                  "template_kwargs_rows": 0, "unpaired_pairs": 0})
    reasons: list[str] = field(default_factory=list)  # skipped rows (malformed, or bad_rows: error's first problem)
    dropped_rows: list[str] = field(default_factory=list)  # where the first rows dropped for length were
    fatal: str | None = None  # a problem that ends the build (raised by the builder)
    arrays: dict | None = None  # the examples as the store's arrays (store.chunk_arrays), made by the cache builder
    origins: list[str] = field(default_factory=list)  # each example's row, by its place (`row 7`, `line 7`)
    # the first row whose answer was read as reasoning closed by a `</think>` line (conversations._INLINE_THINK)
    first_closing_tag_row: str | None = None
    # the first row tokenized in pieces so that its prompt keeps its own tokens (tokens.tokenize_many), and the first
    # whose assistant turn is trained after less than the generation prompt (chat.prefill_misses)
    first_own_prompt_row: str | None = None
    first_prefill_row: str | None = None
    first_arrow_null_row: str | None = None  # the first row whose tools lost Arrow's null keys (templates.arrow_cleaned)
    first_template_kwargs_row: str | None = None  # the first row with its own chat_template_kwargs, and them
    first_unpaired_pair: str | None = None  # the first pair unpaired into two KTO rows (ported_rows.unpaired)


def parse_lines(lines: list[str], places: list[str], path: str, *, bad_rows: str) -> tuple[list, list[str], list[str]]:
    """JSON Lines text -> rows (and their places); an unparsable line is a reason (skipped or, by bad_rows, fatal)."""
    rows, kept, broken = [], [], []
    for line, place in zip(lines, places):
        try:  # without its newline: a line cut short is "Expecting value" where it stops, not at column 1 of nothing
            rows.append(json.loads(line.rstrip("\r\n")))
            kept.append(place)
        except json.JSONDecodeError as exc:
            broken.append(f"{path}: {place} is not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}). Fix or delete that "
                          "line" + (", or set data.bad_rows: skip to skip broken rows with a count." if bad_rows == "error"
                                    else "."))
            if bad_rows == "error":
                break
    return rows, kept, broken


def check_dataset(rows: list, spec: DatasetSpec, tokenizer, source: str, *, whole: bool = True) -> None:
    """Problems of a whole dataset that skipping rows cannot fix: a column absent everywhere, no chat template.
    `rows`: the dataset's first rows; `whole`: they are all of it (a mapped optional column none has is then refused,
    else warned about: a later row may have it)."""
    check_end_tokens(spec, tokenizer, source)
    check_sample_by(spec, source)
    whole = whole and len(rows) <= 1000
    dict_rows = [row for row in rows[:1000] if isinstance(row, dict)]
    spec = checked_spec(spec, dict_rows)  # a pair file under kto: a pair's fields (ported_rows)
    required, _ = FORMAT_FIELDS[spec.format]
    for name in required:
        if dict_rows and all(_column(spec, name, row) not in row for row in dict_rows):
            columns = sorted({key for row in dict_rows for key in row})
            _other_preference_kind(spec, columns, source)
            mapped = f" (mapped from `{name}`)" if name in spec.columns else ""
            raise DataError(
                f"{source}: column `{_column(spec, name, dict_rows[0])}`{mapped}, needed by format `{spec.format}`, does "
                f"not exist (columns: {', '.join(columns)}). Map it with data.datasets[].columns, e.g. "
                f"columns: {{{name}: {columns[0] if columns else 'COLUMN'}}}, or pick the right format."
            )
    check_mapped_columns(dict_rows, spec, source, whole=whole)
    if spec.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{source}: chat data needs a tokenizer with a chat template, and this tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has none (a base model's). Fix: set "
            "model.chat_template (e.g. chatml, or the instruct model's family: qwen3, llama-3.1, ...), use a chat "
            "model's tokenizer (model.tokenizer), or the alpaca/completion formats."
        )
    if spec.format in ("chat", "preference", "unpaired_preference", "prompt"):
        _check_tools(dict_rows, spec, tokenizer, source)


def check_sample_by(spec: DatasetSpec, source: str) -> None:
    """data.datasets[].sample_by is for .txt files (a folder of them): on other data it would be ignored."""
    if spec.sample_by is None:
        return
    path = Path(spec.path).expanduser()
    files = folder_files(path, spec) if path.is_dir() and not saved_folder(path) else []
    if any(data_suffix(file) == ".txt" for file in files):
        return
    what = ("a folder whose data files are not .txt (a .txt file beside data files of another type is not read)"
            if files else "not a folder of .txt files")
    raise DataError(f"{source}: data.datasets[].sample_by: {spec.sample_by} says how a .txt file is cut into rows, and "
                    f"this dataset is {what}, so it would be ignored. Fix: remove sample_by, or point the path at a "
                    "folder of .txt files (for whole documents in other files, give one document per row: JSON Lines "
                    'with a `text` field).')


def check_end_tokens(spec: DatasetSpec, tokenizer, source: str) -> None:
    """A tokenizer with neither a pad nor an EOS token is refused here, before any weight loads: batches are padded
    with its pad token (model.load_tokenizer takes the EOS where it has none), so the run stopped at its first batch
    (`torch.full(..., None)`). One with a pad but no EOS trains text-like rows (text, completion, alpaca; preference
    and KTO rows without a chat template) without an end token: said once per tokenizer."""
    if tokenizer.eos_token is not None or spec.format == "prompt":
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if tokenizer.pad_token_id is None:
        raise DataError(
            f"{source}: the tokenizer ({name}) has neither a pad token nor an EOS token, so no batch can be padded "
            "(finetune pads with the pad token, else with the EOS) and no row can end with an end token: training "
            "would stop at its first batch. Fix: give the tokenizer its tokens (in its tokenizer_config.json, "
            "`eos_token`: the token that ends the model's answers, the one its config.json's eos_token_id names, and "
            'a `pad_token`, e.g. "<|endoftext|>"; tokens of its vocabulary), or set model.tokenizer to a tokenizer '
            "that has them (the model's instruct or base tokenizer).")
    if template_rendered(spec, tokenizer) or tokenizer in _NO_EOS_NOTED:
        return
    _NO_EOS_NOTED.add(tokenizer)
    print0(f"[finetune] note: {source}: the tokenizer ({name}) has no EOS token, so its `{spec.format}` rows train "
           "without an end token and the model does not learn to stop (generation runs to its token limit). Fix: "
           "set `eos_token` in its tokenizer_config.json (the token its config.json's eos_token_id names), or set "
           "model.tokenizer to a tokenizer that has one.")


def check_mapped_columns(rows: list[dict], spec: DatasetSpec, source: str, *, whole: bool = True) -> None:
    """Every column data.datasets[].columns names is in the data (the keys of the rows; for role, content and
    reasoning, of their turns): a mapping to a column no row has (a typo) would leave an optional field out of every
    row without a word (alpaca rows trained without their `input`, chat rows without their tools). `whole`: `rows`
    are all the rows (refused); else the first ones only, and a later row may have it (a warning)."""
    columns = sorted({str(key) for row in rows for key in row})
    turns = [turn for row in rows for name in TURN_LISTS.get(spec.format, ()) if isinstance(_field(row, spec, name), list)
             for turn in _field(row, spec, name) if isinstance(turn, dict)]
    turn_keys = sorted({str(key) for turn in turns for key in turn})
    for name, column in spec.columns.items():
        inside_turns = name in ("role", "content", "reasoning")
        have, what = (turn_keys, "message has that key") if inside_turns else (columns, "row has that column")
        if not rows or (inside_turns and not turns) or column in have:
            continue
        if not whole:
            print(f"[finetune] warning: {source}: data.datasets[].columns maps `{name}` to `{column}`, and none of the "
                  f"first {len(rows)} rows has that {'key' if inside_turns else 'column'}: the rows without it are read "
                  f"without their `{name}` (if the name is a typo, every row is).", flush=True)
            continue
        raise DataError(
            f"{source}: data.datasets[].columns maps `{name}` to `{column}`, but no {what} (the first {len(rows)} rows' "
            f"{'message keys' if inside_turns else 'columns'}: {', '.join(have) or 'none'}), so every row would be "
            f"read without its `{name}`. Fix: map `{name}` to the {'key' if inside_turns else 'column'} that holds it "
            f"(columns: {{{name}: ...}}), or remove the mapping.")


def _check_tools(rows: list[dict], spec: DatasetSpec, tokenizer, source: str) -> None:
    """Tools offered to a template that never renders them: refused before tokenizing (the rows would train a model
    that never saw its tools)."""
    column = _column(spec, "tools")
    offered = spec.tools is not None or any(row.get(column) not in (None, "", []) for row in rows)
    template = chat_template_text(tokenizer, tools=offered)
    if template and offered and not renders_tools(template):
        raise DataError(
            f"{source}: the rows offer tools (`{column}`{' and data.datasets[].tools' if spec.tools else ''}), but the "
            "chat template does not render `tools` (DeepSeek-R1 distills' does not), so the model would never see "
            "them. Fix: set model.chat_template to one that does (qwen2.5, qwen3, qwen3.5, llama-3.1, gpt-oss, "
            "glm-4.5, or a .jinja file), or leave the tools out.")


def _other_preference_kind(spec: DatasetSpec, columns: list[str], source: str) -> None:
    """Unpaired rows given as pairs: say which kind the rows are (pairs given as unpaired preference data are unpaired,
    as TRL's KTOTrainer unpairs them: ported_rows)."""
    if spec.format == "preference" and {"completion", "label"} <= set(columns):
        raise DataError(
            f"{source}: the rows have `completion` and `label` (unpaired preference data, TRL's KTO format), but "
            "format `preference` (train.objective: dpo) needs `chosen` and `rejected` answers per row. Fix: set its "
            "format: unpaired_preference and train.objective: kto, or give prompt/chosen/rejected pairs.")


def tokenize_chunk(rows: list, places: list[str], broken: list[str], spec: DatasetSpec, recipe: Recipe,
                   tokenizer) -> ChunkResult:
    """Render, tokenize and length-limit one chunk of rows (`broken`: reasons of rows that could not even be read)."""
    data, result = recipe.data, ChunkResult()
    blank = [isinstance(row, BlankLine) for row in rows]  # a .txt file's blank lines: no rows, counted apart
    if any(blank):
        rows, places = [row for row, no in zip(rows, blank) if not no], [pl for pl, no in zip(places, blank) if not no]
    result.counts["blank_lines"] = sum(blank)
    result.counts["rows"] = len(rows) + len(broken)
    result.reasons += broken
    rendered = []
    for row, place in zip(rows, places):
        read_before, missed_before, nulls_before = closing_tag_reads(), prefill_misses(), arrow_null_rows()
        rendered.append(_render_or_reason(row, pair_spec(spec) if pair_row(spec, row) else spec, tokenizer,
                                          data.system_prompt, f"{spec.path} {place}", reasoning=data.reasoning))
        if prefill_misses() > missed_before and not isinstance(rendered[-1], str):
            result.counts["prefill_rows"] += 1
            result.first_prefill_row = result.first_prefill_row or f"{spec.path} {place}"
        if isinstance(row, dict) and row.get("chat_template_kwargs") and not isinstance(rendered[-1], str):
            result.counts["template_kwargs_rows"] += 1
            result.first_template_kwargs_row = result.first_template_kwargs_row or \
                f"{spec.path} {place}: {row['chat_template_kwargs']}"
        if arrow_null_rows() > nulls_before and not isinstance(rendered[-1], str):
            result.counts["arrow_null_rows"] += 1
            result.first_arrow_null_row = result.first_arrow_null_row or f"{spec.path} {place}"
        if closing_tag_reads() > read_before and not isinstance(rendered[-1], str):  # kept, and rewritten so
            result.counts["closing_tag_rows"] += 1
            result.first_closing_tag_row = result.first_closing_tag_row or f"{spec.path} {place}"
    result.reasons += [item for item in rendered if isinstance(item, str)]
    kept = [(item, place) for item, place in zip(rendered, places) if not isinstance(item, str)]
    bos = not template_rendered(spec, tokenizer)  # a chat template writes BOS itself where the model has one
    if spec.format == "preference":
        _pairs(kept, spec, recipe, tokenizer, result, bos=bos)
    elif spec.format == "unpaired_preference":
        _unpaired_rows(kept, spec, data, tokenizer, result, bos=bos)
    else:  # a row may give several examples (a conversation whose template rewrites history: data/chat.py)
        flat = [(segments, place) for examples, place in kept for segments in examples]
        own_places: list[str] = []
        for group in _text_groups(flat):  # a long conversation's examples are its history again and again: held a
            # group at a time, each group's overlong examples dropped before the next (bb45: 8 agent rows, 8.1 GB)
            all_segments, own, late = [segments for segments, _ in group], [], {}
            tokenized = tokenize_many(all_segments, tokenizer, bos=bos, own_prompt_rows=own, late_turns=late)
            own_places += [group[i][1] for i in own]
            if late:
                group, tokenized = _served_turns(group, tokenized, late, tokenizer, bos=bos)
                all_segments = [segments for segments, _ in group]
                result.counts["served_turns"] += sum(len(ends) for ends in late.values())
            for example, answer, (_, place) in zip(tokenized, answer_starts(all_segments, tokenizer, bos=bos), group):
                _length_policy(example, spec, place, data, result, answer=answer)
        _count_own_prompts(result, spec, own_places)
    result.counts["skipped"] += len(result.reasons)
    if result.reasons and data.bad_rows == "error" and result.fatal is None:
        result.fatal = result.reasons[0]
    result.reasons = result.reasons[:KEPT_REASONS]
    if data.bad_rows == "skip":
        result.reasons = [_SKIP_ADVICE.sub("", reason) for reason in result.reasons]
    return result


def _unpaired_rows(kept: list, spec: DatasetSpec, data, tokenizer, result: ChunkResult, *, bos: bool) -> None:
    """KTO rows ((segments, label) each): the length policy of SFT rows (TRL's keep_start). A pair file's rows are
    unpaired first, as TRL's KTOTrainer unpairs them (ported_rows.unpaired), and counted."""
    kept, pairs = unpaired(kept)
    result.counts["unpaired_pairs"] += len(pairs)
    result.first_unpaired_pair = f"{spec.path} {pairs[0]}" if pairs else None
    all_segments = [segments for (segments, _), _ in kept]
    tokenized = tokenize_prompted(all_segments, tokenizer, bos=bos)
    answers = prompted_answer_starts(all_segments, tokenizer, bos=bos)
    for example, answer, ((_, desirable), place) in zip(tokenized, answers, kept):
        example.desirable = desirable
        _length_policy(example, spec, place, data, result, answer=answer)


def _served_turns(group: list, tokenized: list[Example], late: dict[int, list[int]], tokenizer, *,
                  bos: bool) -> tuple[list, list[Example]]:
    """The group's examples with each one whose later turns' prompts hold a piece's cut replaced by
    tokens.serving_splits (one per such turn, and one of the turns before), tokenized again: every trained turn
    after the prompt a server sends."""
    splits = {index: serving_splits(group[index][0], ends) for index, ends in late.items()}
    again = iter(tokenize_many([part for index in sorted(splits) for part in splits[index]], tokenizer, bos=bos))
    items, examples = [], []
    for index, (item, example) in enumerate(zip(group, tokenized)):
        parts = splits.get(index)
        items += [(part, item[1]) for part in parts] if parts else [item]
        examples += [next(again) for _ in parts] if parts else [example]
    return items, examples


def _count_own_prompts(result: ChunkResult, spec: DatasetSpec, own_places: list[str]) -> None:
    """The rows tokenized in pieces (tokens.tokenize_many), counted once each (a conversation may give several
    examples), the first named."""
    own_places = list(dict.fromkeys(own_places))
    result.counts["own_prompt_rows"] += len(own_places)
    if own_places and result.first_own_prompt_row is None:
        result.first_own_prompt_row = f"{spec.path} {own_places[0]}"


def _text_groups(flat: list, chars: int = CHUNK_CHARS) -> list[list]:
    """The rendered examples in order, in groups of at most `chars` characters of text (at least one example)."""
    groups, size = [[]], 0
    for item in flat:
        length = sum(len(text) for text, _ in item[0])
        if groups[-1] and size + length > chars:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += length
    return groups if groups[0] else []


def _length_policy(example: Example, spec: DatasetSpec, place: str, data, result: ChunkResult, *,
                   answer: int | None = None) -> None:
    """Keep, truncate, split or drop one tokenized example of the row at `place` by data.overlong (module docstring).
    `answer`: the token its answer starts at, where that is not its first trained token (answer_starts)."""
    where = f"{spec.path} {place}"
    overlong = len(example.input_ids) > data.max_length
    if overlong and data.overlong == "drop":
        _dropped(result, where)
        return
    # The first target: a trained label past the first token, which nothing predicts (examples.Example.num_trained).
    # Counting index 0 kept a text row of one token (`<|im_end|>` alone), which trains steps of loss 0 (bb34).
    target = next((i for i, label in enumerate(example.labels) if i and label != IGNORE_INDEX), None)
    first = answer if answer is not None and target is not None else target
    if first is not None and first < data.max_length:
        if overlong and data.overlong == "split":
            _split(example, data.max_length, place, result)
            return
        result.counts["tokens_before_cut"] += len(example.input_ids)
        if overlong:
            result.counts["truncated"] += 1
            result.counts["cut_tokens"] += len(example.input_ids) - data.max_length
            trained = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
            example = _cut(example, data.max_length, trained)
        result.examples.append(example)
        result.origins.append(place)
        return
    if first is None:  # nothing trained even before truncation: a malformed row (empty answer)
        result.reasons.append(f"{where}: no trained token: the answer is empty after rendering, or the row is a "
                              "single token (an end token alone), and a row's first token is never a target (nothing "
                              "precedes it). Fix: give the row its text or remove it, or set data.bad_rows: skip to "
                              "skip such rows with a count.")
    elif data.overlong == "error":
        result.fatal = result.fatal or (
            f"{where}: the answer starts at token {first} of max_length {data.max_length}, so truncation leaves nothing "
            "to learn from this row. Fix: raise data.max_length, or leave data.overlong at its default (truncate), "
            "which drops such rows with a count.")
    else:
        _dropped(result, where)


def _split(example: Example, max_length: int, place: str, result: ChunkResult) -> None:
    """data.overlong: split: the example as consecutive max_length pieces, each an example of its own (no BOS added:
    module docstring); a piece without a target (a last piece of one token) is left out."""
    result.counts["split_rows"] += 1
    result.counts["tokens_before_cut"] += len(example.input_ids)
    for start in range(0, len(example.input_ids), max_length):
        piece = Example(example.input_ids[start:start + max_length], example.labels[start:start + max_length])
        if piece.num_trained:
            result.counts["split_pieces"] += 1
            result.examples.append(piece)
            result.origins.append(place)


def _cut(example: Example, max_length: int, completion: int) -> Example:
    """The example's first max_length tokens (TRL's keep_start). A KTO row also keeps the completion tokens the cut
    removed, as many as a mismatched row can hold after a prompt of one token (Example.completion_tail): TRL builds
    the KL row from its partner's whole completion (`completion`: where it starts) and cuts only that row."""
    kept = Example(example.input_ids[:max_length], example.labels[:max_length], desirable=example.desirable)
    end = min(len(example.input_ids), completion + max_length - 1)
    if example.desirable is not None and end > max_length:
        kept.completion_tail = Example(example.input_ids[max_length:end], example.labels[max_length:end])
    return kept


def _dropped(result: ChunkResult, where: str) -> None:
    """Count a dropped example; name its row once (a conversation can give several examples: data/chat.py)."""
    result.counts["dropped"] += 1
    if len(result.dropped_rows) < NAMED_DROPS and where not in result.dropped_rows:
        result.dropped_rows.append(where)


def _pairs(kept: list, spec: DatasetSpec, recipe: Recipe, tokenizer, result: ChunkResult, *, bos: bool) -> None:
    before, unanswered = len(result.reasons), []
    result.examples = pair_examples([item for item, _ in kept], [f"{spec.path} {place}" for _, place in kept],
                                    tokenizer, recipe, result.counts, result.reasons, unanswered, bos=bos)
    for where in unanswered:
        if recipe.data.overlong == "error":
            result.fatal = result.fatal or (
                f"{where}: a response's answer starts past data.max_length {recipe.data.max_length}, after its "
                "untrained reasoning (data.reasoning: context), so truncation leaves nothing to learn from this pair "
                "(its reasoning opener alone would be scored). Fix: raise data.max_length, or leave data.overlong at "
                "its default (truncate), which drops such pairs with a count.")
        else:
            _dropped(result, where)
    if len(result.reasons) > before and recipe.data.bad_rows == "error":
        result.fatal = f"{result.reasons[before]} Fix the row or set data.bad_rows: skip to skip such pairs with a count."


def merge_counts(total: dict, result: ChunkResult) -> None:
    """Add a chunk's counts, reasons and named drops to the dataset's totals."""
    for name, value in result.counts.items():
        total[name] = total.get(name, 0) + value
    total["skipped_reasons"] = (total.get("skipped_reasons", []) + result.reasons)[:KEPT_REASONS]
    total["dropped_rows"] = (total.get("dropped_rows", []) + result.dropped_rows)[:NAMED_DROPS]
    total["first_closing_tag_row"] = total.get("first_closing_tag_row") or result.first_closing_tag_row
    total["first_own_prompt_row"] = total.get("first_own_prompt_row") or result.first_own_prompt_row
    total["first_prefill_row"] = total.get("first_prefill_row") or result.first_prefill_row
    total["first_arrow_null_row"] = total.get("first_arrow_null_row") or result.first_arrow_null_row
    total["first_template_kwargs_row"] = total.get("first_template_kwargs_row") or result.first_template_kwargs_row
    total["first_unpaired_pair"] = total.get("first_unpaired_pair") or result.first_unpaired_pair
