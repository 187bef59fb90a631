"""The recipe's model settings as transformers takes them: the dtypes and the BitsAndBytesConfig (where the base comes
from, a folder or a hub id, is sources/hub.py).

A leaf of model/: every loader (base.py, loading.py, the quantized cache, `finetune quantize`) reads these.
"""

from __future__ import annotations

import torch

from finetune.recipe import Recipe

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def quantization_config(recipe: Recipe):
    """BitsAndBytesConfig for the recipe, or None for `quantization: none`."""
    q = recipe.quantization
    if q.method == "none":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.method,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(recipe.compute_dtype),
        bnb_4bit_quant_storage=torch_dtype(q.quant_storage or recipe.model.dtype),
    )
