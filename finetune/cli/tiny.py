"""Tiny models and tokenizers built locally, for tests, the offline smoke quickstart and benchmarks.

No download: the tokenizer is a byte-level BPE trained in a second on a small built-in corpus, with ChatML
special tokens and a ChatML chat template; the model is random-init from a config of a real architecture
family (llama, qwen2, mistral, gemma, qwen3; mixtral, qwen3_moe, gpt_oss and llama4_text with experts), saved with `save_pretrained` so it
loads like any hub model. The folder must be new or empty: one that holds anything (a real model at a mistyped path)
is replaced only with `force` (`finetune tiny-model OUT --force`), whole, never written into.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from finetune.errors import FinetuneError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Instruction: add the two numbers. Input: 12 and 30. Response: 42",
    "What is the capital of France? The capital of France is Paris.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
    "Reverse the word: hello -> olleh. Reverse the word: model -> ledom.",
    "### Instruction:\n### Input:\n### Response:\n user assistant system",
]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML specials, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


_FAMILY_KWARGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    # Mixture of experts: 4 experts, 2 routed per token (each expert as wide as the dense families' MLP).
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2},
    # gpt-oss: biased, interleaved experts (finetune/model/experts/families/gpt_oss.py); sliding and full layers.
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    # Llama 4 as Scout has it (every layer MoE, one routed expert and a shared one, fused experts stored (in, out));
    # interleave_moe_layer_step=2 gives Maverick's (MoE every other layer, dense MLPs between).
    "llama4_text": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1},
}


def model_folder_problem(out_dir: Path, *, force: bool) -> str | None:
    """Why a tiny model may not be saved at `out_dir` (None when it may): a file or a link there, a folder that holds
    anything (without `force`; with it, one this command runs in), or a path that cannot be made."""
    from finetune.files import destination_problem

    verb = "finetune tiny-model"
    if not os.path.lexists(out_dir):
        problem = destination_problem(out_dir)
        return f"{verb}: {problem}; nothing was written. Fix: choose another folder." if problem else None
    if out_dir.is_symlink() or not out_dir.is_dir():
        what = f"a symbolic link (to {os.readlink(out_dir)})" if out_dir.is_symlink() else "a file"
        return (f"{verb}: {out_dir} is {what}, not a folder; nothing was written. Fix: choose a new folder for the "
                "model (it writes config.json, the weights and the tokenizer files there).")
    entries = sorted(path.name for path in out_dir.iterdir())
    if entries and not force:
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        return (f"{verb}: {out_dir} already exists and holds {shown}; nothing was written (a random-init model would "
                "overwrite its config.json and weights). Fix: choose a new folder, or add --force to replace this "
                "one (everything in it is removed).")
    if entries and Path.cwd().resolve().is_relative_to(out_dir.resolve()):
        return (f"{verb}: {out_dir} is the current folder or holds it; --force would remove the folder this command "
                "runs in. Nothing was written. Fix: choose another folder, or run from outside it.")
    return None


@contextlib.contextmanager
def model_folder(out_dir: str | Path, *, force: bool = False) -> Iterator[Path]:
    """The folder to save a tiny model into: `out_dir` itself when new or empty; with `force`, a temporary folder that
    then replaces a non-empty `out_dir` whole (no mix of an old sharded model's files with the new ones).
    FinetuneError (before anything is built) when model_folder_problem says so."""
    from finetune.files import atomic_dir

    out_dir = Path(out_dir)
    if problem := model_folder_problem(out_dir, force=force):
        raise FinetuneError(problem)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        with atomic_dir(out_dir, replace=True) as tmp:
            yield tmp
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        yield out_dir


def build_tiny_model(out_dir: str | Path, *, family: str = "llama", hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                     tie_word_embeddings: bool = False, max_shard_size: str | None = None,
                     intermediate_size: int | None = None, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                     llama4: dict | None = None, force: bool = False):
    """Save a random-init causal LM of `family` plus the tokenizer into `out_dir` (new or empty; `force`: replaced);
    return the path.

    `max_shard_size` (e.g. "100KB") writes a sharded checkpoint with an index file, as large models ship.
    `intermediate_size` (default 2 x hidden) and the head counts give odd shapes (FSDP2 chunk boundaries inside a
    quantization block, uneven chunks). `llama4`: Llama4TextConfig fields for family llama4_text (Maverick's
    {"interleave_moe_layer_step": 2})."""
    from transformers import AutoConfig

    if family not in _FAMILY_KWARGS:
        raise ValueError(f"family must be one of {sorted(_FAMILY_KWARGS)}, got {family!r}")
    out_dir = Path(out_dir)
    if problem := model_folder_problem(out_dir, force=force):  # before the seconds of building
        raise FinetuneError(problem)
    if problem := size_problem(family, hidden_size=hidden_size, num_layers=num_layers, heads=num_attention_heads,
                               intermediate_size=intermediate_size or hidden_size * 2):
        raise FinetuneError(problem)
    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=_context_length(AutoConfig.for_model(family, **_FAMILY_KWARGS[family])),
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **_FAMILY_KWARGS[family],
        **({"moe_intermediate_size": hidden_size * 2} if family == "qwen3_moe" else {}),
        **({"intermediate_size_mlp": hidden_size * 2, **(llama4 or {})} if family == "llama4_text" else {}),
    )
    return _save(config, tokenizer, out_dir, seed=seed, max_shard_size=max_shard_size, force=force)


def size_problem(family: str, *, hidden_size: int, num_layers: int, heads: int, intermediate_size: int) -> str | None:
    """Why a tiny model of these sizes cannot be built here (None when it can): a hidden size that its attention heads
    do not split into even widths (transformers refused 65 with a traceback; RoPE rotates pairs), or a model larger
    than this machine's memory (--hidden-size 100000000 asked torch for 181 GB and ended in a traceback, bb56)."""
    if hidden_size % (2 * heads):
        fits = max(2 * heads, hidden_size // (2 * heads) * 2 * heads)
        return (f"finetune tiny-model: --hidden-size {hidden_size} is not a multiple of {2 * heads}: the model's "
                f"{heads} attention heads split the hidden size into equal widths, each even (rotary position "
                f"embeddings turn pairs of values). Fix: --hidden-size {fits} or {fits + 2 * heads} (default 64).")
    experts = _FAMILY_KWARGS[family].get("num_local_experts") or _FAMILY_KWARGS[family].get("num_experts") or 1
    layer = 4 * hidden_size**2 + 3 * hidden_size * intermediate_size * experts  # attention, MLP (each expert's)
    parameters = num_layers * layer + 2 * 512 * hidden_size  # and the 512-token embeddings and head
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    if memory and 4 * parameters > memory // 2:  # float32 weights, with room for saving them
        return (f"finetune tiny-model: a model {hidden_size} wide (--hidden-size) of {num_layers} layers (--layers) is "
                f"about {parameters:.2g} parameters, {4 * parameters / 2**30:,.1f} GiB in float32: more than half of "
                f"this machine's {memory / 2**30:,.1f} GiB of memory, and not tiny (tests and smoke runs use 64 wide, "
                "2 layers). Fix: a smaller --hidden-size or --layers.")
    return None


def _context_length(defaults) -> int:
    """1,024 positions, or where the family stretches RoPE with YaRN (gpt-oss: factor 32 over 4,096 positions) the
    length that stretch implies: transformers warns on every load of a config whose max_position_embeddings is not
    original x factor ("The explicitly set RoPE scaling factor ... does not match"), as 1,024 did (bug bash: on every
    command on a tiny gpt_oss)."""
    rope = getattr(defaults, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn" and rope.get("original_max_position_embeddings"):
        return int(rope["original_max_position_embeddings"] * rope.get("factor", 1.0))
    return 1024


def _save(config, tokenizer, out_dir: Path, *, seed: int, max_shard_size: str | None = None, force: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # A multimodal config is saved as its hub checkpoint is (the whole image-text model): transformers maps Gemma 3's to
    # the multimodal class as a causal LM too, but Llama 4's to the text-only Llama4ForCausalLM.
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText as AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with model_folder(out_dir, force=force) as folder:
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        tokenizer.save_pretrained(folder)
    return out_dir


# Stored config keys that describe the published checkpoint, not the architecture. quantization_config: how the
# hub stores the weights (gpt-oss: MXFP4 experts); the tiny model is saved unquantized (the MXFP4 read is
# tests/model/test_experts_gpt_oss.py's).
_PROVENANCE_KEYS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
                    "quantization_config")


def tiny_config_like(name_or_path: str, *, vocab_size: int, eos_token_id: int, pad_token_id: int, hidden_size: int = 64,
                     num_layers: int = 2):
    """The stored architecture of `name_or_path` (finetune/model/architectures) scaled down, its kind kept.

    Same model_type (so the same decoder-layer class, norms, activation, rope scaling, soft-capping, sliding window,
    bias and tied-embedding settings); only the sizes shrink: `num_layers` layers, `hidden_size` wide, 4 heads of 16,
    4 experts with 2 per token where the model has experts,
    grouped-query attention kept as such (2 key/value heads) where the original has it. Token ids follow the tiny
    tokenizer. None when no architecture is stored for the name.
    """
    from transformers import AutoConfig

    from finetune.model.architectures import stored_config_dict

    fields = stored_config_dict(name_or_path)
    if fields is None:
        return None
    fields = {key: value for key, value in fields.items() if key not in _PROVENANCE_KEYS}
    sizes = {"vocab_size": vocab_size, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
             "hidden_size": hidden_size, "num_layers": num_layers}
    if isinstance(fields.get("text_config"), dict):  # multimodal (Gemma 3 12B/27B): the language model nested
        return _tiny_multimodal(fields, **sizes)
    fields = _tiny_text_fields(fields, **sizes)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _tiny_text_fields(fields: dict, *, vocab_size: int, eos_token_id: int, pad_token_id: int, hidden_size: int,
                      num_layers: int) -> dict:
    """A language model's stored fields with the sizes shrunk (see tiny_config_like)."""
    fields = dict(fields)
    stored_layers = fields.get("num_hidden_layers")
    heads = fields.get("num_attention_heads") or 4
    grouped = (fields.get("num_key_value_heads") or heads) < heads
    fields.update(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2 if grouped else 4, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, bos_token_id=None,
    )
    if "head_dim" in fields:  # an explicit head size (Gemma, SmolLM2): keep it explicit
        fields["head_dim"] = hidden_size // 4
    for experts_key in ("num_local_experts", "num_experts"):  # mixture of experts: 4 experts, 2 per token
        if fields.get(experts_key):
            fields.update({experts_key: 4, "num_experts_per_tok": min(2, fields.get("num_experts_per_tok") or 2)})
    for key in ("moe_intermediate_size", "intermediate_size_mlp"):  # experts' width; Llama 4's dense MLP layers
        if fields.get(key):
            fields[key] = hidden_size * 2
    for key, value in list(fields.items()):  # per-layer lists (gpt-oss's layer_types): the first num_layers
        if isinstance(value, list) and len(value) == stored_layers:
            fields[key] = value[:num_layers]
    if fields.get("max_window_layers"):  # Qwen2: layers past this use the sliding window (when enabled)
        fields["max_window_layers"] = min(fields["max_window_layers"], num_layers)
    return fields


def _tiny_multimodal(fields: dict, *, vocab_size: int, **sizes):
    """A multimodal stored config scaled down: its text config as a language model's, a one-layer vision tower of
    28-pixel images in 14-pixel patches, 4 image tokens. The image token ids sit past the tokenizer's (the text
    vocabulary grows by 4 for them), so no text token is ever taken for an image token."""
    from transformers import AutoConfig

    # head_dim explicit even where the hub config leaves it to the class default (gemma-3-12b-it: 256)
    text = {key: value for key, value in fields["text_config"].items() if key not in _PROVENANCE_KEYS}
    text = _tiny_text_fields(dict(text, head_dim=None), vocab_size=vocab_size + 4, **sizes)
    vision = {key: value for key, value in (fields.get("vision_config") or {}).items() if key not in _PROVENANCE_KEYS}
    vision.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    for key in ("projector_input_dim", "projector_output_dim", "vision_output_dim"):  # Llama 4's vision adapter
        if key in vision:
            vision[key] = 32
    fields = dict(fields, text_config=text, vision_config=vision, eos_token_id=sizes["eos_token_id"],
                  pad_token_id=sizes["pad_token_id"], mm_tokens_per_image=4)
    for offset, key in enumerate(("boi_token_index", "eoi_token_index", "image_token_index"), start=1):
        if key in fields:
            fields[key] = vocab_size + offset
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_tiny_model_like(name_or_path: str, out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2,
                          seed: int = 0, force: bool = False) -> Path:
    """Save a random-init, scaled-down model of `name_or_path`'s stored architecture plus the tiny tokenizer."""
    if problem := model_folder_problem(Path(out_dir), force=force):
        raise FinetuneError(problem)
    tokenizer = build_tokenizer()
    config = tiny_config_like(name_or_path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, hidden_size=hidden_size, num_layers=num_layers)
    if config is None:
        from finetune.model.architectures import stored_names

        raise ValueError(f"no stored architecture for {name_or_path!r}; stored: {', '.join(stored_names())}")
    return _save(config, tokenizer, Path(out_dir), seed=seed, force=force)
