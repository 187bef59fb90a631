"""A run's adapter/ at its end (rank 0): the standard PEFT adapter and the tokenizer; a mixture-of-experts run with LoRA
on its experts writes the adapter as trained (experts split) to adapter-as-trained/ and, in adapter/, what `finetune
export` writes from it: the form plain PEFT (and vLLM, llama.cpp) loads. PEFT skips per-expert tensors it has no module
for without a word, so a per-expert adapter/ loaded into a stock model without its experts' LoRA."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from finetune.errors import FinetuneError
from finetune.files import AS_TRAINED, _replace_dir
from finetune.outputs.adapter_files import ADAPTER_CONFIG, save_adapter
from finetune.outputs.export import export_adapter
from finetune.outputs.export_source import Source


def save_run_adapter(peft_config, key_map: dict[str, str], state: dict[str, torch.Tensor], out_dir: Path, tokenizer,
                     recipe) -> None:
    """The run's adapter (rank 0, before the last barrier): the standard PEFT adapter and the tokenizer in adapter/; with
    LoRA on split experts (a causal LM, no DoRA), in AS_TRAINED/, and adapter/ is written by `finish_run_adapter` after
    the barrier (the old one removed first: a run killed in between reads as unfinished, and resume=auto rewrites
    both)."""
    target = out_dir / (AS_TRAINED if _peft_form_differs(peft_config, key_map) else "adapter")
    if target.name == AS_TRAINED:
        shutil.rmtree(out_dir / "adapter", ignore_errors=True)
    save_adapter(peft_config, key_map, state, target, tokenizer=tokenizer, recipe=recipe)
    if target.name == "adapter" and any(".experts." in key for key in key_map.values()):
        why = "DoRA on experts" if peft_config.use_dora else "a reward model's experts"
        print(f"[finetune] note: adapter/ holds the experts' LoRA per expert (plain PEFT has no form for {why}; "
              "finetune export, generate and model.adapter read it)", flush=True)


def _peft_form_differs(peft_config, key_map: dict[str, str]) -> bool:
    """LoRA on split experts of a causal LM: plain PEFT loads another form (export_experts.for_runtimes). It has none
    for DoRA there (ParamWrapper refuses it), and export checks a reward model's (SEQ_CLS) experts against an unsplit
    classifier: those stay per expert, as before."""
    task = str(getattr(peft_config, "task_type", "") or "")
    return any(".experts." in key for key in key_map.values()) and not peft_config.use_dora and "SEQ_CLS" not in task


def finish_run_adapter(out_dir: Path, recipe) -> None:
    """Rank 0, after the last barrier (on a large MoE model the export takes minutes, longer than a collective's
    timeout): adapter/ from AS_TRAINED/ as `finetune export` writes it. Should that fail, adapter/ gets the adapter as
    trained, with the reason: the trained run is never lost to its last conversion."""
    trained = out_dir / AS_TRAINED
    if not (trained / ADAPTER_CONFIG).is_file() or (out_dir / "adapter" / ADAPTER_CONFIG).is_file():
        return
    staged = out_dir / ".adapter.peft"
    shutil.rmtree(staged, ignore_errors=True)
    try:
        config = json.loads((trained / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        export_adapter(Source(trained, recipe, config), staged)
    except Exception as exc:  # noqa: BLE001 (any failure: the adapter as trained is kept, and said why)
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(trained, staged)
        why = str(exc) if isinstance(exc, FinetuneError) else f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"[finetune] warning: adapter/ holds the adapter as trained (per expert): the form plain PEFT loads could "
              f"not be written ({why.splitlines()[0] if why else ''}). Plain PEFT skips per-expert tensors; use "
              "finetune export, generate and model.adapter with this run.", flush=True)
    else:
        print(f"[finetune] adapter/: the experts' LoRA in the form plain PEFT loads (what `finetune export` writes; "
              f"adapter/runtimes.json says where else it runs); {AS_TRAINED}/: the adapter as trained (experts split), "
              "read by finetune export, generate and model.adapter", flush=True)
    _replace_dir(staged, out_dir / "adapter")
