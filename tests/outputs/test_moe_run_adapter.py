"""A mixture-of-experts run's adapter at its end (finetune/outputs/run_adapter.py): adapter/ in the form plain PEFT
loads, the adapter as trained in adapter-as-trained/; per expert in adapter/ where plain PEFT has no form (DoRA on
experts, a reward model's experts), with a note; never a run lost to that last conversion. A review of the change
found a MoE reward run and a MoE DoRA run failing at their end with no adapter/ (the export refused or raised)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import RUN_PY, addition_rows, objective_recipe, recipe_dict, run_cmd, write_jsonl, write_recipe

from finetune.files import AS_TRAINED
from finetune.outputs import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def _keys(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as handle:
        return list(handle.keys())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dora", "reward"])
def test_a_moe_run_whose_adapter_plain_peft_cannot_take_finishes_per_expert(case, tiny_mixtral, tmp_path):
    if case == "dora":
        values = recipe_dict(tiny_mixtral, write_jsonl(tmp_path / "rows.jsonl", addition_rows(16)), tmp_path / "run",
                             lora={"dora": True}, train={"max_steps": 2})
    else:
        pairs = [{"prompt": f"What is {i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1} apples."}
                 for i in range(16)]
        values = objective_recipe("reward", "preference", tiny_mixtral, write_jsonl(tmp_path / "pairs.jsonl", pairs),
                                  tmp_path / "run", train={"max_steps": 2})
    result = run_cmd([sys.executable, str(RUN_PY), str(write_recipe(tmp_path / "r.yaml", values))])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    assert not (run / AS_TRAINED).exists() and "adapter/ holds the experts' LoRA per expert" in result.stdout
    assert any(".experts.0." in key for key in _keys(run / "adapter"))


def test_the_old_adapter_goes_first_and_a_failed_conversion_keeps_the_adapter_as_trained(tiny_llama, tmp_path, capsys):
    """A finished MoE run resumed (max_steps raised) and killed during the end's conversion kept the old step's
    adapter/ beside the new adapter-as-trained/: a finished run to every check, a stale adapter to plain PEFT."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from finetune.outputs.run_adapter import finish_run_adapter, save_run_adapter

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / ADAPTER_WEIGHTS).write_bytes(b"step 2's adapter")
    name = "model.layers.0.mlp.experts.0.w1.lora_A.default.weight"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["w1"], task_type="CAUSAL_LM")
    save_run_adapter(config, {name: "base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight"},
                     {name: torch.ones(2, 8)}, run, AutoTokenizer.from_pretrained(tiny_llama), recipe=None)
    assert not (run / "adapter").exists() and (run / AS_TRAINED / ADAPTER_CONFIG).is_file()  # a kill now: unfinished
    finish_run_adapter(run, recipe=None)  # no recipe, no base named: the export fails
    said = capsys.readouterr().out
    assert "warning: adapter/ holds the adapter as trained (per expert)" in said and "FOLDER_OR_HUB_ID" in said
    assert _keys(run / "adapter") == _keys(run / AS_TRAINED)
    assert json.loads((run / "adapter" / ADAPTER_CONFIG).read_text())["r"] == 2


def test_a_full_disk_while_the_tokenizer_is_written_publishes_no_adapter(tiny_llama, tmp_path):
    """The tokenizer was written into adapter/ after it was published: a disk that filled there left weights beside a
    0-byte tokenizer_config.json, a folder every check took for a finished run (found in a bug bash, on a 995 KB tmpfs).
    The full disk is simulated in the tokenizer's save, with the text the tokenizers library raises."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from finetune.errors import CheckpointError
    from finetune.outputs.run_adapter import save_run_adapter

    class FullDisk:
        def __init__(self):
            self.real = AutoTokenizer.from_pretrained(tiny_llama)

        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer_config.json").write_text("")
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002 (the tokenizers library's own)

    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(CheckpointError, match=r"no space left on that filesystem.*and the tokenizer files"):
        save_run_adapter(config, {name: "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"},
                         {name: torch.ones(2, 8)}, tmp_path, FullDisk(), recipe=None)
    assert not (tmp_path / "adapter").exists() and not list(tmp_path.iterdir())
