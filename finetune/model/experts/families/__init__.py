"""The expert layouts finetune can split into per-expert Linears: one module per family, registered here by name.

A family module holds (see concatenated.py): `MODELS` (the models it covers, for messages), `why_not(module)` (None
when this family takes a fused experts module, else why not), `names(model, name, module)` (the per-expert
`ExpertNames`, as the checkpoint names them), `sizes(module, names)` (experts, hidden, intermediate), `new_expert(module,
names, hidden, inter, dtype=)` (one expert's module), `ROUTED` (the `RoutedExperts` class, called as transformers calls
the fused module), `copy_in(split, module)` (the fused weights into the per-expert Linears), `fused_tensors(split)` (the
reverse, for export: the fused module's parameters by name) and `fused_config(module)` (what rebuilds the fused module),
`TRANSPOSED` (the stored fused tensors are (in, out): the loader reads an expert's part as columns, transposed),
`STORED_IN_OUT` (the fused parameters are experts x in x out: how an exported fused-expert LoRA is oriented);
optionally `expert_views(index, name, split)` (how the checkpoint's tensors are read per expert, where they are no row
blocks of a stored 3-D tensor; gpt_oss.py). A new family is one new module and one line below.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from finetune.model.experts.families import concatenated, gpt_oss, llama4, own_gating

# Llama 4 first: its experts module looks concatenated (no flag says it is transposed), its class says otherwise.
FAMILIES: dict[str, ModuleType] = {"llama4": llama4, "concatenated": concatenated, "gpt_oss": gpt_oss,
                                   "own_gating": own_gating}


def family_for(module: nn.Module) -> tuple[str | None, list[str]]:
    """The name of the family that takes this fused experts module (the first in `FAMILIES`), or None and every
    family's reason for refusing it."""
    reasons = []
    for name, family in FAMILIES.items():
        reason = family.why_not(module)
        if reason is None:
            return name, []
        reasons.append(reason)
    return None, reasons


def covered_models() -> str:
    """The models the registered families cover, for error messages."""
    return "; ".join(family.MODELS for family in FAMILIES.values())
