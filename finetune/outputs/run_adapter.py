"""A run's adapter/ at its end (rank 0): the standard PEFT adapter and the tokenizer; a mixture-of-experts run with LoRA
on its experts writes the adapter as trained (experts split) to adapter-as-trained/ and, in adapter/, what `finetune
export` writes from it: the form plain PEFT (and vLLM, llama.cpp) loads. PEFT skips per-expert tensors it has no module
for without a word, so a per-expert adapter/ loaded into a stock model without its experts' LoRA."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from finetune.files import AS_TRAINED
from finetune.outputs.adapter_files import ADAPTER_CONFIG, save_adapter
from finetune.outputs.export import export_adapter
from finetune.outputs.export_source import Source


def save_run_adapter(peft_config, key_map: dict[str, str], state: dict[str, torch.Tensor], out_dir: Path, tokenizer,
                     recipe) -> None:
    """The run's adapter/ (rank 0): the standard PEFT adapter and the tokenizer. With LoRA on split experts, the adapter
    as trained goes to AS_TRAINED/ and adapter/ gets what `finetune export` writes from it, said in one line."""
    experts = any(".experts." in key for key in key_map.values())
    target = out_dir / (AS_TRAINED if experts else "adapter")
    save_adapter(peft_config, key_map, state, target)
    tokenizer.save_pretrained(target)
    if not experts:
        return
    staged = out_dir / ".adapter.peft"
    shutil.rmtree(staged, ignore_errors=True)
    export_adapter(Source(target, recipe, json.loads((target / ADAPTER_CONFIG).read_text())), staged)
    shutil.rmtree(out_dir / "adapter", ignore_errors=True)
    staged.rename(out_dir / "adapter")
    print(f"[finetune] adapter/: the experts' LoRA in the form plain PEFT loads (what `finetune export` writes); "
          f"{AS_TRAINED}/: the adapter as trained (experts split), read by finetune export, generate and model.adapter",
          flush=True)

