"""`model.attn_implementation: auto`: sdpa where the model's class supports it, else eager, decided from the class
transformers would build for the config (its `_supports_sdpa`), before any weight loads.

Why not leave it to transformers: an explicit `sdpa` on a class without it (gpt-oss) is an error, not a fallback, and
the planner and the packing check need to know which attention a run computes. Flash attention is never chosen by
`auto` (it needs the flash-attn package and a CUDA device); name it explicitly where it applies.
"""

from __future__ import annotations

import sys

from finetune.distributed import print0
from finetune.model.classes import causal_lm_class
from finetune.recipe import Recipe, announcing


def supported_attention(config) -> tuple[str, str]:
    """(implementation, why) for `auto`: sdpa where the class supports it, else eager."""
    cls = causal_lm_class(config)
    if cls is None:
        return "sdpa", "the model class is not one transformers maps for this config (remote code): its default"
    if getattr(cls, "_supports_sdpa", False):
        return "sdpa", f"{cls.__name__} supports torch's scaled_dot_product_attention"
    return "eager", f"{cls.__name__} does not support sdpa in this transformers"


def attention_for(recipe: Recipe, config) -> str:
    """The implementation a run of `recipe` on `config` computes with (auto resolved without touching the recipe)."""
    explicit = recipe.model.attn_implementation
    return supported_attention(config)[0] if explicit == "auto" else explicit


def resolve_attention(recipe: Recipe, config) -> str:
    """model.attn_implementation: auto becomes the implementation for this model, once, on the recipe (as model.dtype:
    auto does at validation), with one line saying which and why; an explicit value is kept as it is."""
    if recipe.model.attn_implementation != "auto":
        return recipe.model.attn_implementation
    implementation, why = supported_attention(config)
    recipe.model.attn_implementation = implementation
    if announcing():  # `finetune train`'s pre-flight is muted: the launched rank 0 says it, once
        # stderr, as the dtype line: `plan --json` and `plan --library-table` keep stdout for what they print
        print0(f"[finetune] model.attn_implementation: auto -> {implementation} ({why})", file=sys.stderr)
    return implementation
