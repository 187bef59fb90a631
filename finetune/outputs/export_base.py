"""The base a merge is made on (export.py: export_merged): never a 4-bit checkpoint, and an LM head of its own where
the adapter puts LoRA on a head tied to the input embeddings.

  * A merge adds each LoRA's B @ A to the base weight it adapts, in full precision. A run on a pre-quantized 4-bit
    checkpoint (`finetune quantize`) has no such weights to load: transformers would load the folder 4-bit and fail
    on the fp32 request with a load report and a traceback. The merge goes onto the 16-bit folder the checkpoint was
    quantized from, where the folder records it (quantized_from.json) and it is still there, else it is refused in one
    paragraph that asks for --base.
  * With tied embeddings (config `tie_word_embeddings`, no lm_head.weight in the checkpoint) the LM head and the input
    embeddings are one tensor. Merging LoRA into the head would change the embeddings too, and a reload would tie the
    merged head back onto the (unmerged) embeddings. The head is untied first (its own copy of the weight, the
    config's tie switched off), so the merged model is base + adapter and saves its head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.outputs.export_source import ExportError, Source


def merge_base(source: Source, base: str | None) -> tuple[str | None, str]:
    """(the --base to merge onto, a note for the report): `base` unchanged unless the base would be a 4-bit checkpoint
    folder; then the 16-bit folder it records, or ExportError."""
    from finetune.model.quantization.prequantized import is_prequantized, quantized_from

    name = base or _trained_base_name(source)
    folder = Path(name).expanduser() if name else None
    if folder is None or not folder.is_dir() or not is_prequantized(folder):
        return base, ""
    recorded = quantized_from(folder)
    usable = bool(recorded) and Path(recorded).is_dir() and not is_prequantized(Path(recorded))
    if base is None and usable:
        return recorded, (f"note: the run's base {folder} is a 4-bit checkpoint written by `finetune quantize` from "
                          f"{recorded}: merged onto that 16-bit base (pass --base to choose another).\n")
    if usable:
        where, fix = f" It was quantized from {recorded}.", f"pass --base {recorded}"
    else:
        where = (f" It records that it was quantized from {recorded}, which is not a 16-bit model folder now."
                 if recorded else "")
        fix = "pass --base FOLDER, the 16-bit base the checkpoint was quantized from"
    given = "--base" if base else "the run's base"
    raise ExportError(
        f"{given} {folder} is a 4-bit checkpoint (config.json has a bitsandbytes quantization_config). A merge adds each "
        f"LoRA update to the 16-bit weights, and a 4-bit checkpoint has none to load.{where} Nothing was written. Fix: "
        f"{fix} (or export without --merge: the adapter runs on the 4-bit checkpoint as it is).")


def _trained_base_name(source: Source) -> str | None:
    if source.recipe is not None:
        return None if source.recipe.model.gguf_file else source.recipe.model.name_or_path
    return source.adapter_config.get("base_model_name_or_path")


def untie_adapted_head(model, adapter_config: dict) -> str:
    """Give the LM head its own weight when it is tied to the input embeddings and the adapter targets either of them
    (module docstring); returns the report's note when it untied them, else "". `model` holds real weights (before
    the adapter is loaded)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return ""
    targets = adapter_config.get("target_modules") or []
    names = {name for name, module in model.named_modules() if module is head or module is embeddings}
    if isinstance(targets, str) or not any(name == t or name.endswith("." + t) for name in names for t in targets):
        return ""
    head.weight = torch.nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, _text_config(model.config))}.values():
        config.tie_word_embeddings = False
    return ("note: the base ties its LM head to the input embeddings and the adapter has LoRA there: the merged model "
            "has a head of its own (tie_word_embeddings false), so the embeddings stay the base's.\n")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
