"""`finetune generate --tools FILE` offers tools to every prompt of the session, and a run whose rows carried their own
`tools` column says so when no --tools is given.

Found by a bug bash (bb53 #5): a run trained on rows with a per-row `tools` column (Glaive's, as the shipped
recipes/qwen3-8b-tools.yaml) was asked `<|im_start|>user\\nWeather in Paris?<|im_end|>\\n<|im_start|>assistant\\n`,
without the `# Tools` block every training example had, and nothing said so; there was no way to pass tools (only a
dataset-level `tools:` reached the prompt).

In-process and fast: Qwen3's shipped template on the suite's tiny family tokenizer (tests/data/chat_families.py), a run
folder with its recipe and a stand-in adapter; the model load and the decoding are replaced by a recorder of the token
ids `finetune generate` would decode from, compared with apply_chat_template(messages, tools=...,
add_generation_prompt=True).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl, write_recipe
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
from chat_families import ROWS, WEATHER_TOOL, family_tokenizer

from finetune import cli

PROMPT = "Weather in Paris?"
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city now.",
                                               "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("qwen3")  # Qwen3's own template: the tools in its system prompt, under `# Tools`


def run_folder(tmp_path: Path, rows: list[dict], dataset: dict | None = None) -> Path:
    """A finished run as `finetune generate` reads it: recipe.yaml and adapter/ (a stand-in for the weights)."""
    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    write_recipe(run / "recipe.yaml", {"model": {"name_or_path": "unused"},
                                       "data": {"datasets": [{"path": str(data), **(dataset or {"format": "chat"})}],
                                                "max_length": 256}})
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "peft_type": "LORA"}))
    save_file({"stand_in": torch.zeros(1)}, str(run / "adapter" / "adapter_model.safetensors"))  # whole, never read
    return run


@pytest.fixture
def generate(monkeypatch, tokenizer, capsys):
    """`finetune generate RUN ARGS...` -> (exit code, the prompts it decoded from, stdout, stderr); nothing loads.
    Lines given as `chat` are typed into the interactive chat, each answered `ok`."""
    asked: list[list[int]] = []

    def recorded(model, tok, prompts, **_):
        asked.extend(prompts)
        return ["ok"] * len(prompts)

    def replied(model, tok, prompts, **_):
        asked.extend(prompts)
        return [{"role": "assistant", "content": "ok"} for _ in prompts]

    monkeypatch.setattr("finetune.training.evals.generate_batch", recorded)
    monkeypatch.setattr("finetune.training.evals.generate_replies", replied)
    monkeypatch.setattr("finetune.cli.generate.load_for_generation", lambda source, no_adapter: (object(), tokenizer))

    def call(*args: str, chat: tuple[str, ...] = ()) -> tuple[int, list[list[int]], str, str]:
        lines = iter([*chat, "/exit"])
        monkeypatch.setattr("builtins.input", lambda _: next(lines))
        asked.clear()
        code = cli.main(["generate", *args, "--max-new-tokens", "2"])
        captured = capsys.readouterr()
        return code, list(asked), captured.out, captured.err

    return call


def served(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The ids a server asks the model with: apply_chat_template(messages, tools=..., add_generation_prompt=True)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("form", ["json", "jsonl"])
def test_the_tools_of_a_file_reach_every_prompt(tmp_path, generate, tokenizer, form):
    """Before: `--tools` was no option (argparse refused it), and the prompt had no `# Tools` block."""
    run = run_folder(tmp_path, [ROWS["tool_call"]])
    tools = [WEATHER_TOOL, CLOCK_TOOL]
    file = tmp_path / f"tools.{form}"
    file.write_text(json.dumps(tools) if form == "json" else "".join(json.dumps(tool) + "\n" for tool in tools))
    code, asked, out, err = generate(str(run), "--tools", str(file), "--prompt", PROMPT, "--prompt", "And in Rome?")
    assert code == 0, err
    user = [{"role": "user", "content": PROMPT}], [{"role": "user", "content": "And in Rome?"}]
    assert asked == [served(tokenizer, user[0], tools), served(tokenizer, user[1], tools)]
    assert "# Tools" in tokenizer.decode(asked[0]) and '"name": "get_time"' in tokenizer.decode(asked[0])
    assert f"with the 2 tools of {file}" in out and "note:" not in out


def test_the_interactive_chat_offers_the_tools_at_every_turn(tmp_path, generate, tokenizer):
    """Before: the chat had no way to offer tools: every turn was asked without them."""
    run = run_folder(tmp_path, [ROWS["tool_call"]])
    file = tmp_path / "tools.json"
    file.write_text(json.dumps([WEATHER_TOOL]))
    code, asked, out, err = generate(str(run), "--tools", str(file), chat=(PROMPT, "And in Rome?"))
    assert code == 0, err
    first = [{"role": "user", "content": PROMPT}]
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And in Rome?"}]
    assert asked == [served(tokenizer, first, [WEATHER_TOOL]), served(tokenizer, second, [WEATHER_TOOL])]
    assert f"with the 1 tool of {file}" in out and out.count("model> ok") == 2


def test_a_run_whose_rows_carried_tools_says_the_prompt_has_none(tmp_path, generate, tokenizer):
    """Before: the prompt went without tools and nothing said so; now one line says the rows carried tools (the
    first row's count) and names --tools FILE. The prompt itself is unchanged: the tools are not guessed."""
    run = run_folder(tmp_path, [ROWS["tool_call"]])
    code, asked, out, err = generate(str(run), "--prompt", PROMPT)
    assert code == 0, err
    assert asked == [served(tokenizer, [{"role": "user", "content": PROMPT}], None)]
    (note,) = [line for line in out.splitlines() if "note:" in line]
    assert "rows carried their own tools" in note and "1 in the first row" in note and "--tools FILE" in note
    plain = run_folder(tmp_path / "plain", [ROWS["multi_turn"]])
    assert "note:" not in generate(str(plain), "--prompt", PROMPT)[2]  # rows without tools: nothing to say


@pytest.mark.parametrize("content, said", [
    ("[{\"type\": \"function\"", "not valid JSON"),
    ('{"name": "a"}\n{"name": ', "line 2"),
    ('[{"type": "function", "function": {"description": "no name"}}]', "a `name`"),
    ("[]", "holds no tools"),
    (None, "cannot be read"),
], ids=["cut-json", "cut-jsonl", "no-name", "empty", "missing"])
def test_a_bad_tools_file_is_one_paragraph_naming_it(tmp_path, generate, content, said):
    """Before: `--tools` was refused by argparse as an unknown argument, whatever the file."""
    run = run_folder(tmp_path, [ROWS["tool_call"]])
    file = tmp_path / "tools.json"
    if content is not None:
        file.write_text(content)
    code, asked, _, err = generate(str(run), "--tools", str(file), "--prompt", PROMPT)
    assert code == 2 and not asked
    assert f"--tools {file}:" in err and said in err and "Fix: write the file as a JSON list" in err, err
    assert "Traceback" not in err


def test_tools_are_refused_where_a_prompt_has_no_place_for_them(tmp_path, generate):
    """Before: `--tools` was no option; an alpaca run renders no chat template, so tools would be silently dropped."""
    run = run_folder(tmp_path, [{"instruction": "up 2", "output": "yes"}], {"format": "alpaca"})
    file = tmp_path / "tools.json"
    file.write_text(json.dumps([WEATHER_TOOL]))
    code, asked, _, err = generate(str(run), "--tools", str(file), "--prompt", PROMPT)
    assert code == 2 and not asked
    assert f"--tools {file}: the prompts are rendered as data.datasets[0]'s alpaca rows" in err and "Fix:" in err
