"""Mixture-of-experts adapters at export: checked and merged in the layout training used, written in the layout other
runtimes read.

Training splits transformers 5's fused experts into one Linear per expert projection (finetune/model/experts/), so the
run's adapter holds one LoRA per expert projection under the model's names (`mlp.experts.3.w1`). At export:
  * the checks and the merge build the base as training built it (experts split), so every key matches one to one;
  * where PEFT converts per-expert LoRA onto transformers 5's fused experts itself (Mixtral, Qwen3-MoE, OLMoE:
    its conversion table, and no shared or dense MLP whose names its config rewrite would move), the written adapter
    names its per-expert tensors as the base checkpoint names them (transformers' renames reversed, as its
    `save_pretrained` writes the base: Mixtral's `block_sparse_moe.experts.3.w1`), which is what vLLM's and
    llama.cpp's model definitions use; elsewhere (gpt-oss, Llama 4, DeepSeek-V3, GLM-4.5, Qwen2-MoE, ...) it holds
    the same LoRA, exactly, on the fused expert parameters (`target_parameters`, export_fused.py), which plain PEFT
    loads as written;
  * its adapter_config.json says `lora_dropout: 0` when it carries expert LoRA: PEFT loads expert LoRA on transformers 5
    through `ParamWrapper`, which refuses any other dropout, and dropout does nothing at inference. The dropout the run
    trained with stays in the run's adapter-as-trained/ and recipe.yaml (and a run that starts from this adapter with
    model.adapter takes lora.dropout from its recipe, as always);
  * a merged model gets transformers' fused experts back before it is saved (`fuse_experts`), so it loads with plain
    `AutoModelForCausalLM.from_pretrained` and saves the checkpoint's per-expert tensors.
"""

from __future__ import annotations

import torch
from torch import nn


def split_meta_model(config, *, trust_remote_code: bool | None = None) -> nn.Module:
    """The base on the meta device (no weights, any size), its experts split as training split them.

    `trust_remote_code`: the run's model.trust_remote_code. None: what the config says of itself, True when its own
    class is the model folder's code (it was loaded with the opt-in, `remote_code_config`), else False. Never asked
    on stdin: transformers would prompt, then fail with a traceback, when its model code is the folder's own."""
    from finetune.model.classes import from_config
    from finetune.model.experts import split_experts

    trusted = remote_code_config(config) if trust_remote_code is None else trust_remote_code
    with torch.device("meta"):
        try:
            model = from_config(config, trust_remote_code=trusted)
        except ValueError as exc:
            if "custom code" not in str(exc):
                raise
            from finetune.errors import ModelLoadError

            raise ModelLoadError(
                f"the base model ({getattr(config, '_name_or_path', '') or config.model_type}) is built by its own code "
                "(auto_map in config.json), which finetune runs only with the opt-in. Fix: set model.trust_remote_code: "
                "true in the run's recipe.yaml (only if you trust that code).") from None
    split_experts(model, dtype=torch.float32, quantized=False)  # a no-op on a model without fused experts
    return model


def remote_code_config(config) -> bool:
    """The config's class is the model folder's own code (transformers loaded it with trust_remote_code: true): the
    model of that folder is built by its code too, with the same opt-in."""
    return type(config).__module__.startswith("transformers_modules")


def is_moe(config, *, trust_remote_code: bool | None = None) -> bool:
    from finetune.model.experts import has_routed_experts

    return has_routed_experts(split_meta_model(config, trust_remote_code=trust_remote_code))


def in_model_names(tensors: dict[str, torch.Tensor], config, *, trust_remote_code: bool | None = None
                   ) -> dict[str, torch.Tensor]:
    """Adapter tensors under the model's names (an adapter exported by finetune names them as the checkpoint does)."""
    from finetune.model.sources.conversions import model_names

    names = model_names(split_meta_model(config, trust_remote_code=trust_remote_code), list(tensors))
    return {names[key]: value for key, value in tensors.items()}


def for_runtimes(tensors: dict[str, torch.Tensor], config, adapter_config: dict, *,
                 trust_remote_code: bool | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(the written MoE adapter's tensors, adapter_config.json updates): per-expert tensors under the checkpoint's
    names where PEFT converts them onto transformers 5's fused experts itself, else PEFT's fused-expert form
    (export_fused.py), which it loads as written."""
    from finetune.model.sources.conversions import checkpoint_names
    from finetune.outputs.export_fused import fused_adapter

    on_experts = any(".experts." in key for key in tensors)
    dropout = {"lora_dropout": 0.0} if on_experts else {}
    fused = (fused_adapter(tensors, split_meta_model(config, trust_remote_code=trust_remote_code), config,
                           adapter_config) if on_experts else None)
    if fused is not None:
        return fused[0], {**fused[1], **dropout}
    # LoRA only: a trained router (lora.train_router, PEFT's modules_to_save) stays under the model's name, which PEFT
    # maps onto its copy without converting it (vLLM and llama.cpp refuse modules_to_save whatever its name).
    names = checkpoint_names(split_meta_model(config, trust_remote_code=trust_remote_code),
                             [key for key in tensors if ".lora_" in key])
    renamed = {names.get(key, key): value for key, value in tensors.items()}
    if len(renamed) != len(tensors):
        raise RuntimeError("two adapter tensors map onto one checkpoint name")
    return renamed, dropout


PEFT_FUSED_EXPERTS = (0, 20)  # measured: 0.18 and 0.19 fail the fused-expert load check; 0.20 and 0.21 pass


def peft_loads_no_form(tensors: dict[str, torch.Tensor], config) -> str | None:
    """Why the installed PEFT loads no form of this adapter's LoRA on transformers 5's fused experts (None where it
    does, or the adapter has none): before 0.19 it converts no per-expert names, and before 0.20 its `ParamWrapper`
    reads a fused expert parameter's LoRA the other way round (loading what export_fused.py writes fails on every
    shape)."""
    from importlib.metadata import version

    installed = version("peft")
    if not any(".experts." in key for key in tensors) or tuple(
            int(part) for part in installed.split(".")[:2]) >= PEFT_FUSED_EXPERTS:
        return None
    return (f"this adapter holds LoRA on the routed experts of a {config.model_type} model, and the installed PEFT "
            f"{installed} loads no form of it onto transformers 5's fused experts (before 0.19 it converts no per-expert "
            "names; before 0.20 it reads a fused expert parameter's LoRA in other shapes). Fix: pip install -U "
            "'peft>=0.20' and export again. The run's adapter as trained (adapter-as-trained/, or adapter/ with a note) "
            "is untouched, and finetune generate and model.adapter read it as it is.")


def note(source_config: dict, update: dict) -> str:
    """What the export changed in the adapter's config, and why (printed with the verify line)."""
    lines = ""
    if "lora_dropout" in update and source_config.get("lora_dropout"):
        lines += (f"note: adapter_config.json says lora_dropout 0 (trained with {source_config['lora_dropout']}): PEFT "
                  "loads LoRA on transformers 5's fused experts only without dropout, and dropout does nothing at "
                  "inference.\n")
    if update.get("target_parameters"):
        lines += ("note: the experts' LoRA is written on transformers 5's fused expert parameters (target_parameters, "
                  "each expert's own LoRA exactly; gate and up as one block-diagonal LoRA of their summed rank), the "
                  "form plain PEFT loads for this model. PEFT warns on load that the rank_pattern/alpha_pattern keys "
                  "match no module: its check looks at modules, not at parameters; the ranks are applied (the PEFT "
                  "verdict below loaded every tensor at its shape).\n")
    return lines
