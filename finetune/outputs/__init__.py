"""Outputs: what a run writes and what comes out of it, each written atomically (nothing the user had is lost).

    run_folder.py     claim_output_dir (one run per folder, a lock), begin_outputs, output_dir_problem, rank stats
    step_folders.py   the checkpoints a run folder holds, each checked against its manifest, with its eval loss;
                      resume_source; the checkpoint of `--step N`; the best eval of a run
    resume_checks.py  check_resume: whether a checkpoint can continue this run (recipe key by key, strategy, step,
                      rows), before any weight loads; refused or noted
    checkpoint.py     save_checkpoint (DCP of the LoRA tensors + optimizer, RNG, trainer state)
    checkpoint_load.py  load_checkpoint: a resume reads one back (resharded to this run's world size and strategy)
    base_record.py    the base a checkpoint was trained on (base.json: its files' content samples and sizes), compared
                      on resume (replaced in place: noted; another size: refused before loading)
    checkpoint_adapter.py  the PEFT adapter of a checkpoint (`finetune export RUN OUT --step N`),
                      read_trainable_tensors (a checkpoint's LoRA tensors whole, in one process)
    adapter_files.py  adapter_key_map, save_adapter: the standard PEFT adapter
    run_adapter.py    save_run_adapter: a run's adapter/ (a MoE run: the form PEFT loads, and adapter-as-trained/)
    export.py         `finetune export`: a clean adapter, or a merged model verified after writing
    export_base.py    the base an export loads: the run's own, `--base`, or the 16-bit folder a 4-bit one came from
    export_source.py  what an export starts from: a run, an adapter, a checkpoint folder or a run's `--step N`
    export_tokenizer.py  the tokenizer an export or generate reads beside an adapter, checked to load (a cut-short
                      tokenizer.json named, never exported)
    trained_template.py  the chat template each checkpoint was trained with (chat_template.json), for `--step N`
    export_experts.py mixture-of-experts adapters at export: checked as trained (experts split), written as runtimes read
    runtimes.py       where an exported adapter runs (PEFT, merged transformers, vLLM, llama.cpp)
    publish.py        push_to_hub: the exported folder uploaded to the Hugging Face Hub
"""

from finetune.outputs.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AS_TRAINED,
    adapter_key_map,
    as_trained,
    save_adapter,
)
from finetune.outputs.resume_checks import check_resume, resume_changes
from finetune.outputs.run_folder import (
    LOCK_FILE,
    begin_outputs,
    claim_output_dir,
    current_rss_bytes,
    output_dir_problem,
    write_rank_stats,
)
from finetune.outputs.step_folders import newest_kept, report_best_eval, resume_source

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AS_TRAINED",
    "LOCK_FILE",
    "adapter_key_map",
    "as_trained",
    "begin_outputs",
    "check_resume",
    "claim_output_dir",
    "current_rss_bytes",
    "newest_kept",
    "output_dir_problem",
    "report_best_eval",
    "resume_changes",
    "resume_source",
    "save_adapter",
    "write_rank_stats",
]


def save_run_adapter(*args, **kwargs) -> None:
    """run_adapter.save_run_adapter, imported when a run ends (it brings the export's modules)."""
    from finetune.outputs.run_adapter import save_run_adapter as save

    save(*args, **kwargs)


def finish_run_adapter(*args, **kwargs) -> None:
    """run_adapter.finish_run_adapter, imported when a run ends."""
    from finetune.outputs.run_adapter import finish_run_adapter as finish

    finish(*args, **kwargs)
