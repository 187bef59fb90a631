"""`finetune generate`: a quick look at what a run learned, from prompts or in an interactive chat.

    finetune generate runs/quickstart --prompt "Write 2023-07-04 as a ledger stamp."
    finetune generate runs/quickstart --prompt "..." --no-adapter     the base alone, for comparison
    finetune generate runs/quickstart                                 interactive chat (/reset, /exit)
    finetune generate runs/quickstart --step 20 --prompt "..."        a kept checkpoint's adapter (finetune checkpoints)
    finetune generate runs/tools --tools tools.json --prompt "..."    tools offered to every prompt of the session

The base is loaded exactly as in training (the run's recipe: 4-bit, GGUF conversion, dtype). A prompt is rendered as
the run's rows rendered theirs in training (data.datasets[0]; finetune/data/prompts.py: dataset_prompt_ids, the code
GRPO's prompts use): alpaca rows' template, the raw text of completion and text rows and of GRPO's text prompts, the
chat template for chat rows (history kept in the interactive chat), each with the dataset's system prompt and tools
where its rows had them; the first line says which. Rows with their own `tools` column (Glaive's, the shipped
recipes/qwen3-8b-tools.yaml) offered each its own: a prompt gets the tools of `--tools FILE` (a JSON list of schemas in
the rows' OpenAI form, or JSON Lines of one a line) through apply_chat_template(tools=...), and without it a line says
that the rows carried tools this prompt lacks. Decoding is greedy and stops at every end token the model lists,
and at the chat template's end of turn where that is text to the tokenizer (ChatML's `<|im_end|>` on a Llama 2 base,
trained as pieces: the answer is cut there), so the same prompt gives the same answer. A reply is read as a chat client
reads it (finetune/data/replies.py): the final answer is printed, without the reasoning (a `<think>` block, harmony's
analysis channel) and without harmony's channel words; the interactive chat keeps the reply in its history as a client
sends it back (the answer as content, the reasoning in its own field). A reward model's adapter (a score head)
generates nothing: refused.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from finetune.data.prompts import dataset_prompt_ids, turn_end_stops
from finetune.data.replies import shown
from finetune.data.templates import row_system, row_tools, template_rendered
from finetune.errors import DataError, FinetuneError
from finetune.outputs.export import (
    ExportError,
    Source,
    clean_adapter_tensors,
    load_tokenizer_for,
    open_source,
    write_clean_adapter,
)
from finetune.recipe import DatasetSpec, Recipe


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


@dataclass(frozen=True)
class PromptStyle:
    """How the run's rows rendered a prompt: the dataset they are copied from (keys in their normal form), the
    recipe's data.system_prompt (the dataset's own wins), whether a prompt is a conversation (the chat template, the
    history kept) or a text alone, what the first line says of it, and the tools of `--tools` (every prompt's, in
    place of the dataset's, as a row's own `tools` column takes the place of them in training)."""

    spec: DatasetSpec
    system_prompt: str | None
    conversation: bool
    said: str
    tools: list[dict] | None = None


def prompt_style(recipe: Recipe | None, tokenizer) -> PromptStyle:
    """The rendering of the run's first dataset (data.datasets[0]); without a recipe, the tokenizer's chat template
    when it has one, else the raw text."""
    if recipe is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
        said = "the tokenizer's chat template (no recipe)" if chat else "raw text (no recipe, no chat template)"
        return PromptStyle(DatasetSpec(path="prompt", format="chat" if chat else "text"), None, chat, said)
    given = recipe.data.datasets[0]
    spec = given.model_copy(update={"columns": {}})  # typed prompts have our keys, not the data's columns
    system = row_system({}, spec, recipe.data.system_prompt)
    conversation, how = template_rendered(spec, tokenizer), ""
    if spec.format == "prompt":  # GRPO: text prompts trained raw, chat prompts through the template
        conversation, how = _chat_prompts(given, tokenizer)
    said = f"data.datasets[0]'s {_rendering(spec.format, conversation, system=bool(system))}{how})"
    others = [index for index, other in enumerate(recipe.data.datasets[1:], start=1)
              if (other.format, other.system_prompt, other.tools) != (given.format, given.system_prompt, given.tools)]
    if others:
        said += f"; data.datasets[{others[0]}] rendered its rows otherwise"
    return PromptStyle(spec, recipe.data.system_prompt, conversation, said)


def _rendering(data_format: str, conversation: bool, *, system: bool) -> str:
    """What the first line says of a rendering: `alpaca rows (the alpaca template, after the system prompt`."""
    kind = {"prompt": "GRPO prompts", "unpaired_preference": "KTO rows", "preference": "preference pairs"}.get(
        data_format, f"{data_format} rows")
    uses_system = conversation or data_format in ("alpaca", "preference", "unpaired_preference")
    how = "the chat template" if conversation else "the alpaca template" if data_format == "alpaca" else "the raw text"
    return f"{kind} ({how}" + (", after the system prompt" if system and uses_system else "")


def _chat_prompts(spec: DatasetSpec, tokenizer) -> tuple[bool, str]:
    """(whether GRPO's prompts were chat messages, a note): read off the dataset's first row; where the data cannot
    be read any more, the chat template when the tokenizer has one."""
    from finetune.data.sources import load_rows

    try:
        rows = load_rows(spec.model_copy(update={"max_rows": 1}))
    except (FinetuneError, OSError, ValueError):
        rows = []
    if rows and isinstance(rows[0], dict):
        return isinstance(rows[0].get(spec.columns.get("prompt", "prompt")), list), ""
    chat = bool(getattr(tokenizer, "chat_template", None))
    return chat, f"; {spec.path} could not be read to tell text prompts from chat ones"


def render(tokenizer, messages: list[dict], system_prompt: str | None = None, *,
           style: PromptStyle | None = None) -> list[int]:
    """Token ids of a conversation ready for the model's answer, rendered as the run's rows (`style`; without one, the
    tokenizer's chat template, else the raw text, and `system_prompt`). A text rendering asks the last message alone."""
    style = style or replace(prompt_style(None, tokenizer), system_prompt=system_prompt)
    prompt = messages if style.conversation else messages[-1]["content"]
    row = {"tools": style.tools} if style.tools else None  # as a row's own `tools` column: the template's `tools`
    return dataset_prompt_ids(prompt, style.spec, tokenizer, style.system_prompt, row=row)


TOOLS_FIX = ("Fix: write the file as a JSON list of function schemas in the OpenAI form a row's `tools` column holds, "
             '[{"type": "function", "function": {"name": "...", "description": "...", "parameters": {...}}}], or as '
             "JSON Lines of one schema a line, or leave --tools out.")


def read_tools_file(path: str) -> list[dict]:
    """The tools of `--tools FILE`: a JSON list of function schemas (OpenAI's form, as the rows' `tools` hold them; a
    bare or flat schema is wrapped as in training, conversations.normalize_tools), or JSON Lines of one schema a line."""
    from finetune.data.conversations import normalize_tools

    where = f"--tools {path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")  # UTF-8 whatever the locale, a BOM dropped
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: the file cannot be read as UTF-8 text ({exc}). {TOOLS_FIX}") from None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        tools = _json_lines(text, where, exc)
    if isinstance(tools, dict):  # one schema alone (or JSON Lines of one line)
        tools = [tools]
    try:
        normal = normalize_tools(tools, where)
    except DataError as exc:
        raise DataError(f"{exc} {TOOLS_FIX}") from None
    if not normal:
        raise DataError(f"{where}: the file holds no tools (an empty list). {TOOLS_FIX}")
    return normal


def _json_lines(text: str, where: str, whole: json.JSONDecodeError) -> list:
    """The schemas of a JSON Lines file; a file that is neither JSON nor JSON Lines is the error of `--tools`."""
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if len(lines) < 2:
        raise DataError(f"{where}: not valid JSON ({whole}). {TOOLS_FIX}")
    tools = []
    for number, line in lines:
        try:
            tools.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: neither one JSON value ({whole}) nor JSON Lines (line {number}: {exc}). "
                            f"{TOOLS_FIX}") from None
    return tools


def with_tools(style: PromptStyle, tokenizer, tools: list[dict], path: str) -> PromptStyle:
    """The style with `--tools` in every prompt, where a prompt has a place for them: the chat template, one that
    renders its `tools` (DeepSeek-R1 distills' does not)."""
    from finetune.data.conversations import renders_tools
    from finetune.data.template_facts import chat_template_text

    if not style.conversation:
        raise DataError(f"--tools {path}: the prompts are rendered as {style.said}, with no chat template, so they "
                        "have no place for tools and the model was never trained with any. Fix: leave --tools out "
                        "(tools reach a prompt through a chat template: chat rows, or GRPO's chat prompts).")
    if not renders_tools(chat_template_text(tokenizer, tools=True)):
        raise DataError(f"--tools {path}: the tokenizer's chat template does not render `tools`, so the model would "
                        "never see them. Fix: leave --tools out, or train with a model.chat_template that renders "
                        "them.")
    return replace(style, tools=tools, said=f"{style.said}, with the {len(tools)} tool{'s' * (len(tools) > 1)} of {path}")


def rows_tools_note(recipe: Recipe | None, style: PromptStyle) -> str | None:
    """The line said when the run's rows offered their own tools (a `tools` column, read off data.datasets[0]'s first
    row) and the prompts have no --tools: a bug bash (bb53 #5) found such a run asked without any, silently."""
    if recipe is None or style.tools or not style.conversation:
        return None
    from finetune.data.sources import load_rows

    given = recipe.data.datasets[0]
    try:
        rows = load_rows(given.model_copy(update={"max_rows": 1}))
        own = row_tools(rows[0], given.model_copy(update={"tools": None}), "row 1") if rows else None
    except (FinetuneError, OSError, ValueError, AttributeError, TypeError):
        return None  # the data cannot be read any more (or its first row is not a row): nothing to say of it
    if not own:
        return None
    has = "only data.datasets[0].tools" if given.tools else "none"
    return (f"[finetune] note: the run's rows carried their own tools (a `tools` column: {len(own)} in the first "
            f"row); these prompts have {has}, so the model is asked outside what it trained on. Pass --tools FILE (a "
            "JSON list of the tool schemas) to offer them.")


def answer(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int) -> list[str]:
    """The final answer to each prompt (a reply's reasoning and harmony's channel words are not the answer)."""
    from finetune.training.evals import generate_batch

    return [text.strip() for text in generate_batch(model, tokenizer, prompts, max_new_tokens=max_new_tokens)]


def chat(model, tokenizer, *, style: PromptStyle, max_new_tokens: int) -> None:
    """Read a line, answer it (with the conversation so far when the run's rows were conversations); `/reset`
    forgets, `/exit` or an empty line quits."""
    from finetune.training.evals import generate_replies

    history: list[dict] = []
    alone = "" if style.conversation else " (each line is asked alone: the run's rows are not conversations)"
    print(f"[finetune] chat: type a message; /reset starts over, /exit (or an empty line) quits{alone}.")
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
        # The reply as a client sends it back (data/replies.py): the final answer as content, the reasoning apart
        # (the template puts it in its own field, or drops it from the history as training's rows had it).
        (reply,) = generate_replies(model, tokenizer, [render(tokenizer, history, style=style)],
                                    max_new_tokens=max_new_tokens)
        history = history + [reply] if style.conversation else []
        print(f"model> {shown(reply)}")


def refuse_reward_model(source: Source) -> None:
    """A reward model's adapter (train.objective reward) is LoRA plus a score head on a sequence classifier: it scores,
    it does not answer. The base as a causal LM with that LoRA and no head would print text no training made."""
    if source.adapter_config.get("task_type") == "SEQ_CLS":
        raise ExportError(
            f"{source.origin}: a reward model's adapter (train.objective reward: LoRA plus a `score` head) scores a "
            "prompt and its response with one number; it generates no text, and the base with this LoRA but without "
            "its head would answer as no trained model does. Nothing was generated. Fix: score text with the adapter "
            "on AutoModelForSequenceClassification, as docs/reward.md shows (The adapter), or pass --no-adapter to "
            "see the base model alone.")


def on_base(source, base: str | None):
    """The source with `base` as its base model (`--base`: the run's base folder moved since; bug bash: generate had
    no way to name it, and a run's or checkpoint's recipe.yaml is not to be edited)."""
    if base is None:
        return source
    import dataclasses

    if source.recipe is not None:
        model = source.recipe.model.model_copy(update={"name_or_path": str(base), "gguf_file": None})
        return dataclasses.replace(source, recipe=source.recipe.model_copy(update={"model": model}))
    return dataclasses.replace(source, adapter_config={**source.adapter_config, "base_model_name_or_path": str(base)})


def cli_generate(args: argparse.Namespace) -> int:
    """`finetune generate SOURCE [--step N] [--base B] [--tools FILE] [--prompt P ...] [--max-new-tokens N]
    [--no-adapter]`."""
    base, tools_file = getattr(args, "base", None), getattr(args, "tools", None)
    tools = read_tools_file(tools_file) if tools_file else None  # a bad file named before anything loads
    with open_source(args.source, step=getattr(args, "step", None), base=base) as source:
        source = on_base(source, base)
        if not args.no_adapter:
            refuse_reward_model(source)
            from finetune.outputs.export import check_adapter_weights

            check_adapter_weights(source.adapter_dir)  # a cut-short file named before the base loads, not after (bb30)
        model, tokenizer = load_for_generation(source, no_adapter=args.no_adapter)
    style = prompt_style(source.recipe, tokenizer)
    style = with_tools(style, tokenizer, tools, tools_file) if tools else style
    what = "base model alone" if args.no_adapter else f"base + adapter {source.origin}"
    stops = turn_end_stops(tokenizer)
    until = f", ending at the template's `{stops[0]}` written as text" if stops else ""
    print(f"[finetune] generating with the {what} (greedy, up to {args.max_new_tokens} new tokens{until}); prompts "
          f"rendered as {style.said}")
    if note := rows_tools_note(source.recipe, style):
        print(note)
    if not args.prompt:
        chat(model, tokenizer, style=style, max_new_tokens=args.max_new_tokens)
        return 0
    prompts = [render(tokenizer, [{"role": "user", "content": text}], style=style) for text in args.prompt]
    for text, reply in zip(args.prompt, answer(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)):
        print(f"> {text}\n{reply}\n")
    return 0
