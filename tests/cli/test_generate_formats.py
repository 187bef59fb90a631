"""`finetune generate` asks a run as its rows were trained: the prompt rendered by the run's data format, system prompt
and tools, and a reward model's adapter refused (it scores, it does not answer).

Found by a bug bash (bb4), each reproduced on the code before this file: every prompt went through the tokenizer's
chat template, so alpaca runs (7 shipped recipes), completion runs and GRPO text prompts were asked in a format they
never trained on; a dataset's own system_prompt (data.datasets[].system_prompt) and tools were dropped; and a reward
model's run printed greedy text from the base with the LoRA and without its score head.

In-process and fast: a run folder with its recipe and a stand-in adapter; the model load and the decoding are replaced
by a recorder of the token ids `finetune generate` would decode from, compared with the training rendering's prompt.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl, write_recipe
from safetensors.torch import save_file

from finetune import cli
from finetune.cli.tiny import build_tokenizer
from finetune.data import IGNORE_INDEX
from finetune.data.tokenize import tokenize_chunk
from finetune.recipe import load_recipe

SYSTEM = "Answer as the ledger does."
TOOL = {"type": "function", "function": {"name": "ledger", "description": "Look up an entry.",
                                         "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # ChatML template, eos <|im_end|>: a chat tokenizer, as the shipped alpaca recipes use


def run_folder(tmp_path: Path, rows: list[dict], dataset: dict, *, objective: str = "sft",
               task_type: str = "CAUSAL_LM", **data_keys) -> Path:
    """A finished run as `finetune generate` reads it: recipe.yaml and adapter/ (a stand-in for the weights)."""
    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    recipe = {"model": {"name_or_path": "unused"}, "train": {"objective": objective},
              "data": {"datasets": [{"path": str(data), **dataset}], "max_length": 128, **data_keys}}
    if objective == "grpo":
        recipe["grpo"] = {"reward_functions": ["finetune.rewards:exact_match"], "num_generations": 2,
                          "max_completion_length": 16}
        recipe["train"]["micro_batch_size"] = 2
    write_recipe(run / "recipe.yaml", recipe)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"task_type": task_type, "peft_type": "LORA"}))
    save_file({"stand_in": torch.zeros(1)}, str(run / "adapter" / "adapter_model.safetensors"))  # whole, never read
    return run


@pytest.fixture
def generate(monkeypatch, tokenizer, capsys):
    """`finetune generate RUN --prompt P` -> (the prompt ids it decoded from, its output); nothing is loaded."""
    asked: list[list[int]] = []

    def recorded(model, tok, prompts, **_):
        asked.extend(prompts)
        return ["ok"] * len(prompts)

    monkeypatch.setattr("finetune.training.evals.generate_batch", recorded)

    def call(run: Path, prompt: str, tok=tokenizer) -> tuple[list[int], str]:
        monkeypatch.setattr("finetune.cli.generate.load_for_generation", lambda source, no_adapter: (object(), tok))
        asked.clear()
        code = cli.main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "2"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return asked[0], captured.out

    return call


def trained_prompt(run: Path, row: dict, tokenizer) -> list[int]:
    """The ids before the first trained token of `row` as the run's data stage tokenizes it."""
    recipe = load_recipe(run / "recipe.yaml")
    result = tokenize_chunk([row], ["line 1"], [], recipe.data.datasets[0], recipe, tokenizer)
    (example,) = result.examples
    return example.input_ids[: next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)]


def test_an_alpaca_run_is_asked_with_the_alpaca_template_and_its_system_prompt(tmp_path, generate, tokenizer):
    """Before: '<|im_start|>user\\nup 2<|im_end|>\\n<|im_start|>assistant\\n' for a run that trained on
    'Answer as the ledger does.\\n\\n### Instruction:\\nup 2\\n\\n### Response:\\n'."""
    row = {"instruction": "up 2", "output": "yes"}
    run = run_folder(tmp_path, [row], {"format": "alpaca", "system_prompt": SYSTEM})
    ids, out = generate(run, "up 2")
    assert ids == trained_prompt(run, row, tokenizer)
    assert tokenizer.decode(ids) == f"{SYSTEM}\n\n### Instruction:\nup 2\n\n### Response:\n"
    assert "alpaca rows (the alpaca template, after the system prompt)" in out


def test_a_completion_run_is_asked_with_the_raw_prompt(tmp_path, generate, tokenizer):
    """Before: the raw prompt wrapped in the chat template as a user turn."""
    row = {"prompt": "Q: up 2\nA:", "completion": " yes sir"}
    run = run_folder(tmp_path, [row], {"format": "completion"})
    ids, out = generate(run, "Q: up 2\nA:")
    assert ids == trained_prompt(run, row, tokenizer) and tokenizer.decode(ids) == "Q: up 2\nA:"
    assert "completion rows (the raw text)" in out


def test_a_chat_run_is_asked_with_its_datasets_system_prompt_and_tools(tmp_path, generate, tokenizer):
    """Before: no system turn (only data.system_prompt was read, never data.datasets[].system_prompt) and no tools."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% if tools %}TOOLS:{{ tools | length }}\n{% endif %}"
                               + tokenizer.chat_template)  # a template that renders the tools it is given
    row = {"messages": [{"role": "user", "content": "up 3"}, {"role": "assistant", "content": "yes"}]}
    run = run_folder(tmp_path, [row], {"format": "chat", "system_prompt": SYSTEM, "tools": [TOOL]})
    ids, out = generate(run, "up 3", tokenizer)
    text = tokenizer.decode(ids)
    assert text.startswith("TOOLS:1\n") and f"<|im_start|>system\n{SYSTEM}<|im_end|>" in text, text
    assert text.endswith("<|im_start|>user\nup 3<|im_end|>\n<|im_start|>assistant\n")
    assert ids == trained_prompt(run, row, tokenizer)
    assert "chat rows (the chat template, after the system prompt)" in out


@pytest.mark.parametrize("chat", [False, True], ids=["text-prompts", "chat-prompts"])
def test_a_grpo_run_is_asked_as_its_prompts_were_rendered(tmp_path, generate, tokenizer, chat):
    """Before: text prompts (trained raw, as TRL) went through the chat template too."""
    from finetune.data.prompts import prompt_examples

    prompt = [{"role": "user", "content": "up 4"}] if chat else "Q: up 4\nA:"
    run = run_folder(tmp_path, [{"prompt": prompt, "answer": "yes"}], {"format": "prompt"}, objective="grpo",
                     eval_fraction=0)
    ids, out = generate(run, "up 4" if chat else "Q: up 4\nA:")
    (trained, *_), _, _ = prompt_examples(load_recipe(run / "recipe.yaml"), tokenizer)
    assert ids == trained.input_ids
    assert ("GRPO prompts (the chat template)" if chat else "GRPO prompts (the raw text)") in out


def test_a_reward_models_run_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    """Before: 'se over 42Y', greedy text from the base + LoRA without the score head, as if the run had learned it."""
    monkeypatch.setattr("finetune.cli.generate.load_for_generation",
                        lambda *a, **k: pytest.fail("a reward model's adapter was loaded to generate"))
    row = {"prompt": "q 1", "chosen": "a", "rejected": "b"}
    run = run_folder(tmp_path, [row], {"format": "preference"}, objective="reward", task_type="SEQ_CLS")
    assert cli.main(["generate", str(run), "--prompt", "q 1"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "a reward model's adapter" in said and "generates no text" in said and "docs/reward.md" in said
    assert "Traceback" not in said


def test_generate_takes_the_base_where_the_runs_recipe_no_longer_finds_it(tmp_path):
    """Found by a bug bash: once a run's base folder moved, `finetune generate RUN` failed on the old path in the run's
    recipe.yaml and had no --base (export has one; the recipe.yaml is not to be edited: manifests check it)."""
    from finetune.cli.command import build_parser
    from finetune.cli.generate import on_base
    from finetune.outputs.export_source import Source
    from finetune.recipe import validate_recipe

    args = build_parser().parse_args(["generate", "runs/x", "--base", "/new/base", "--prompt", "hi"])
    assert args.base == "/new/base"
    recipe = validate_recipe({"model": {"name_or_path": "/old/base"}, "data": {"datasets": [{"path": "d.jsonl"}]}})
    moved = on_base(Source(tmp_path, recipe, {"base_model_name_or_path": "/old/base"}), "/new/base")
    assert moved.base_name == "/new/base" and moved.recipe.data == recipe.data
    bare = on_base(Source(tmp_path, None, {"base_model_name_or_path": "/old/base"}), "/new/base")
    assert bare.base_name == "/new/base"
    assert on_base(bare, None) is bare


def test_export_names_a_local_base_by_its_absolute_path(tmp_path, monkeypatch):
    """Found by a bug bash: `export --base ./rel` wrote `./rel` into the exported adapter_config.json, which then did
    not load from any other folder. A local folder is named by its absolute path; a hub id stays as written."""
    from finetune.cli.export import local_base

    (tmp_path / "rel").mkdir()
    monkeypatch.chdir(tmp_path)
    assert local_base("./rel") == str(tmp_path / "rel")
    assert local_base("someorg/somemodel") == "someorg/somemodel" and local_base(None) is None
