"""Export a trained adapter: a clean standard PEFT adapter, or (`--merge`) a full bf16 model, verified after writing.

    finetune export runs/x exported-adapter          clean adapter (+ tokenizer), checked against the base's structure
    finetune export runs/x merged --merge            base in full precision + adapter, merged, saved as bf16 safetensors

Source: a run folder (holding adapter/ and recipe.yaml), an adapter folder, a checkpoint folder (checkpoints/step-N),
or a run folder with `--step N` (a kept checkpoint: finetune/outputs/checkpoint_adapter.py writes its adapter first).
The base comes from --base, else the run's (or checkpoint's) recipe (so GGUF bases resolve exactly as in training),
else the adapter's base_model_name_or_path.
Every export is written into a temporary folder and renamed into place (an existing output is never touched), and a
verify step says what it compared: the adapter's keys and shapes against a PeftModel built for the base, and for a
merge the reloaded model's logits against base + adapter on a fixed prompt. Every export also says where the adapter
runs (PEFT, merged transformers, vLLM, llama.cpp; finetune/outputs/runtimes.py), printed and written as runtimes.json and
RUNTIMES.md into the export folder.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from finetune.errors import FinetuneError
from finetune.files import atomic_dir
from finetune.outputs.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from finetune.outputs.export_source import ExportError, Source, open_source, resolve_source  # noqa: F401 (the API)
from finetune.outputs.export_tokenizer import TOKENIZER_FILES, check_tokenizer_loads, load_tokenizer_for
from finetune.outputs.runtimes import adapter_verdicts, write_report

VERIFY_PROMPT = "What is the capital of France? Answer in one word."


def normalize_key(key: str) -> str:
    """A parameter name from any wrapping (FSDP1, checkpointing, compile, in-memory PEFT) -> PEFT's on-disk key."""
    from finetune.parallel import normalize_key as strip_wrappers

    key = strip_wrappers(key)
    key = key.replace(".default.", ".")  # in-memory PEFT names carry the adapter name; files do not
    return key if key.startswith("base_model.model.") else "base_model.model." + key


def check_adapter_weights(adapter_dir: Path) -> None:
    """ExportError (the file named, the way out) unless adapter_model.safetensors is a whole safetensors file: a cut-short
    one was a SafetensorError traceback in export and generate (bb30). Reads the header only: callable before a base
    loads."""
    from finetune.model.lora.saved_adapter import weights_problem
    from finetune.outputs.export_source import damaged_adapter

    if problem := weights_problem(adapter_dir):
        raise ExportError(damaged_adapter(adapter_dir, problem))


def clean_adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors under normalized keys; ExportError when the file is not whole (check_adapter_weights), or
    its tensors are empty, duplicated or not finite."""
    from safetensors.torch import load_file

    check_adapter_weights(adapter_dir)
    raw = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        clean = normalize_key(key)
        if clean in tensors:
            raise ExportError(
                f"{adapter_dir}: keys {key} and another both normalize to {clean}; the adapter file is damaged."
            )
        tensors[clean] = value.contiguous()
    if not tensors or not any("lora_" in key for key in tensors):
        raise ExportError(
            f"{adapter_dir}/{ADAPTER_WEIGHTS}: holds no LoRA tensors ({len(tensors)} tensors). Nothing to export."
        )
    bad = [key for key, value in tensors.items() if not torch.isfinite(value).all()]
    if bad:
        raise ExportError(f"{adapter_dir}: tensor {bad[0]} (and {len(bad) - 1} more) has NaN/inf values; not exported.")
    return tensors


# --------------------------------------------------------------------------------------------------- the base
def base_config(source: Source, base: str | None):
    """The base model's config (no weights): --base, else the run's recipe, else the adapter's base."""
    from transformers import AutoConfig

    from finetune.model import load_config

    if base is None and source.recipe is not None:
        return load_config(source.recipe)
    name = base or source.adapter_config.get("base_model_name_or_path")
    if not name:
        raise ExportError(
            f"{source.adapter_dir}: the adapter names no base model. Fix: pass --base MODEL_FOLDER_OR_HUB_ID."
        )
    from finetune.hub import use_cache_only_if_unreachable
    from finetune.model.sources.hub import is_local, local_problem

    if problem := local_problem(name):
        given = "--base" if base else f"the adapter's base model ({ADAPTER_CONFIG} base_model_name_or_path)"
        raise ExportError(f"{given}: {problem}" + ("" if base else " Or pass --base MODEL_FOLDER_OR_HUB_ID."))
    if not is_local(name):
        use_cache_only_if_unreachable()  # offline: the cache at once, not five retries (~27 s) before the same error
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"--base `{name}`: cannot read its config ({str(exc).splitlines()[0][:200]}). Fix: pass a model "
            "folder (config.json + weights) or a reachable hub id."
        ) from None


def _remote_code(source: Source) -> bool:
    """The run's model.trust_remote_code (said when its recipe was read): a merge of a custom-code base reloads it."""
    return bool(source.recipe is not None and source.recipe.model.trust_remote_code)


def load_full_precision_base(source: Source, base: str | None, *, dtype: torch.dtype = torch.float32):
    """The base with every weight in `dtype` (no 4-bit): what a merge needs so that W + BA is exact."""
    from finetune.model import load_base_model
    from finetune.model.classes import from_pretrained

    if base is None and source.recipe is not None:
        update = {
            "quantization": source.recipe.quantization.model_copy(update={"method": "none"}),
            "model": source.recipe.model.model_copy(update={"dtype": "float32"}),
        }
        model = load_base_model(source.recipe.model_copy(update=update), device=torch.device("cpu"))
        return model.to(dtype)
    name = base or source.adapter_config["base_model_name_or_path"]
    try:
        return from_pretrained(name, dtype=dtype, trust_remote_code=_remote_code(source))
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"base `{name}`: cannot load it ({str(exc).splitlines()[0][:200]}). Fix: pass --base."
        ) from None


# ------------------------------------------------------------------------------------------------- the checks
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def trained_base_config(source: Source):
    """Config of the base the adapter was trained on, when it can be read offline (else None: the shape check remains)."""
    from transformers import AutoConfig

    from finetune.model import load_config

    try:
        if source.recipe is not None:
            return load_config(source.recipe)
        name = source.adapter_config.get("base_model_name_or_path")
        return AutoConfig.from_pretrained(name) if name and Path(name).is_dir() else None
    except (FinetuneError, OSError, ValueError):
        return None


def check_base_matches(source: Source, config, base: str | None, tokenizer=None) -> None:
    """ExportError when --base differs in architecture or vocabulary from the base the adapter was trained on."""
    given = _text_config(config)
    if base is not None:
        trained = trained_base_config(source)
        if trained is not None:
            trained = _text_config(trained)
            diffs = [
                f"{name} {getattr(trained, name, None)} (trained) vs {getattr(given, name, None)} (--base)"
                for name in _ARCH_FIELDS
                if getattr(trained, name, None) != getattr(given, name, None)
            ]
            if diffs:
                raise ExportError(
                    f"--base `{base}`: not the architecture/vocabulary the adapter was trained on ({source.base_name}): "
                    f"{'; '.join(diffs)}. Nothing was written. Fix: omit --base, or pass the base the run used."
                )
    if tokenizer is not None and len(tokenizer) > given.vocab_size:
        raise ExportError(
            f"base {base or source.base_name}: vocabulary of {given.vocab_size} tokens, but the run's tokenizer has "
            f"{len(tokenizer)}: a different vocabulary. Nothing was written. Fix: merge onto the base the run used."
        )


def expected_adapter_shapes(config, adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    """On-disk adapter keys and shapes that PEFT expects for this base config (built on the meta device: no weights),
    mixture-of-experts layers split into per-expert Linears as training split them (finetune/model/experts/)."""
    from peft import PeftConfig

    from finetune.model.experts import get_peft_model
    from finetune.outputs.export_experts import split_meta_model

    peft_config = PeftConfig.from_pretrained(str(adapter_dir))
    peft_config.inference_mode = False
    if peft_config.task_type == "SEQ_CLS":  # a reward model (train.objective reward): the base with its score head
        from peft import get_peft_model as plain_get_peft_model
        from transformers import AutoModelForSequenceClassification

        from finetune.model.support import sequence_classifier_problem

        config = copy.deepcopy(config)
        config.num_labels = 1
        if problem := sequence_classifier_problem(config):  # a reward run made before `finetune train` refused it
            raise ExportError(f"{adapter_dir}: a reward model's adapter that cannot be exported: {problem}. Nothing "
                              "was written.")
        with torch.device("meta"):
            classifier = AutoModelForSequenceClassification.from_config(config)
            peft_model = plain_get_peft_model(classifier, peft_config)
        return _adapter_shapes(peft_model)
    model = split_meta_model(config)
    with torch.device("meta"):
        peft_model = get_peft_model(model, peft_config)
    return _adapter_shapes(peft_model)


def _adapter_shapes(peft_model) -> dict[str, tuple[int, ...]]:
    """The adapter's on-disk keys and shapes: LoRA and modules_to_save, and the base weight of a LoRA-targeted
    `lm_head` or `embed_tokens`, which PEFT's own save adds (save_embedding_layers "auto") but a run's adapter never
    holds (only trainable tensors are saved): check_adapter_fits takes it as optional (EMBEDDING_BASE)."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, save_embedding_layers="auto")
    return {key: tuple(value.shape) for key, value in state.items()}


EMBEDDING_BASE = ".base_layer.weight"  # the optional keys: an embedding's base weight saved beside its LoRA


def check_adapter_fits(tensors: dict[str, torch.Tensor], config, source: Source, base: str | None) -> str:
    """ExportError unless the adapter's keys and shapes are exactly those of a PeftModel for the base; returns a summary."""
    expected = expected_adapter_shapes(config, source.adapter_dir)
    missing = sorted(key for key in set(expected) - set(tensors) if not key.endswith(EMBEDDING_BASE))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{k} {tuple(tensors[k].shape)} vs {expected[k]}"
        for k in expected
        if k in tensors and tuple(tensors[k].shape) != expected[k]
    ]
    if missing or unexpected or wrong:
        detail = "; ".join(
            part
            for part in (
                f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
                f"{len(unexpected)} not in the base (e.g. {unexpected[0]})" if unexpected else "",
                f"{len(wrong)} of another shape (e.g. {wrong[0]})" if wrong else "",
            )
            if part
        )
        raise ExportError(
            f"{source.adapter_dir}: the adapter does not fit base {base or source.base_name} "
            f"({_text_config(config).model_type}): {detail}. Nothing was written. Fix: use the base the run was trained on "
            "(omit --base), or export from the right run."
        )
    return f"{len(tensors)} tensors: keys and shapes equal to a PeftModel built for the base ({_text_config(config).model_type})"


def check_out_free(out: Path) -> None:
    """ExportError unless `out` is free: nothing there, not even a symbolic link to nothing (exists() is False for one,
    and the final rename onto it failed with a traceback after all the work)."""
    import os

    if os.path.lexists(out):
        link = f" (a symbolic link to {os.readlink(out)})" if out.is_symlink() else ""
        raise ExportError(
            f"{out}: already exists{link}; nothing was overwritten. Fix: choose a new output folder or remove it."
        )


# ------------------------------------------------------------------------------------------------- the writes
def write_clean_adapter(folder: Path, tensors: dict[str, torch.Tensor], source: Source, base: str | None, *,
                        config_update: dict | None = None) -> None:
    """A standard PEFT adapter folder (+ the run's tokenizer files), read back and compared."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = dict(source.adapter_config, inference_mode=True, **(config_update or {}))
    if base is not None:
        config["base_model_name_or_path"] = base
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (source.adapter_dir / name).is_file():
            shutil.copy2(source.adapter_dir / name, folder / name)
    written = load_file(str(folder / ADAPTER_WEIGHTS))
    if written.keys() != tensors.keys() or any(not torch.equal(written[k], v) for k, v in tensors.items()):
        raise RuntimeError(f"{folder}: the adapter read back differs from what was written")


def _checked_tensors(source: Source, config, base: str | None, tokenizer=None) -> tuple[dict, dict, str, str]:
    """(tensors under the model's names, the written form's tensors and config update, the fit summary, a note).

    A mixture-of-experts adapter is checked in the layout training used and written as export_experts.py says."""
    from finetune.outputs import export_experts

    tensors = clean_adapter_tensors(source.adapter_dir)
    check_base_matches(source, config, base, tokenizer)
    try:
        moe = export_experts.is_moe(config)  # builds the base on the meta device
    except ValueError as exc:  # transformers' AutoModelForCausalLM knows no model of this config class: a traceback
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"base {base or source.base_name}: transformers builds no causal language model from its "
                          f"config ({reason}). Nothing was written. Fix: pass --base with the base the run trained on "
                          "(a folder or hub id that AutoModelForCausalLM loads).") from None
    if not moe:
        return tensors, (tensors, {}), check_adapter_fits(tensors, config, source, base), ""
    tensors = export_experts.in_model_names(tensors, config)
    fits = check_adapter_fits(tensors, config, source, base)
    if why := export_experts.peft_loads_no_form(tensors, config):
        raise ExportError(why)
    written, update = export_experts.for_runtimes(tensors, config, source.adapter_config)
    return tensors, (written, update), fits, export_experts.note(source.adapter_config, update)


def export_adapter(source: Source, out: Path, *, base: str | None = None) -> str:
    """Clean standard adapter into `out`; returns the verify line."""
    check_out_free(out)
    check_tokenizer_loads(source)  # the files copied beside the adapter: a folder whose tokenizer fails is no export
    config = base_config(source, base)
    _, (written, update), fits, note = _checked_tensors(source, config, base)
    with atomic_dir(out, replace=False) as tmp:
        write_clean_adapter(tmp, written, source, base, config_update=update)
        runtimes = write_report(tmp, adapter_verdicts(tmp, config, merged=False), merged=False)
    return f"verify: adapter read back bit-identical; {fits}.\n{note}{runtimes}"


def prompt_ids(tokenizer) -> torch.Tensor:
    """The fixed verify prompt, rendered with the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": VERIFY_PROMPT}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = VERIFY_PROMPT
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids, use_cache=False).logits.float()


def compare_logits(name: str, got: torch.Tensor, reference: torch.Tensor) -> dict:
    """Max abs difference, its size relative to the logits' range, and top-1 agreement over the prompt positions."""
    diff = (got - reference).abs().max().item()
    scale = reference.abs().max().item()
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"compared": name, "max_abs_diff": diff, "relative": diff / max(scale, 1e-6), "top1_agreement": agree}


def export_merged(source: Source, out: Path, *, base: str | None = None) -> str:
    """Base in fp32 + adapter, merged, saved as bf16 safetensors + tokenizer; reloaded with plain transformers and compared.

    Two checks, each against what its step can change (nothing is written unless both pass):
      * the merge: the merged fp32 model against base + adapter (PEFT's forward): equal up to fp32 arithmetic;
      * the save: the folder reloaded by plain transformers against the merged model rounded to bf16 in memory: the
        same weights and config, so the same logits up to fp32 arithmetic.
    How far bf16 rounding moves the logits from base + adapter is reported, not judged: it is the storage format's
    doing, not the merge's, and on a bf16 base it is a few percent of the logit range (each merged weight W + BA is
    rounded again; SmolLM2-135M after 16 steps: 2.6%, top-1 98%). It once refused correct merges.
    """
    import tempfile

    from finetune.model.classes import from_pretrained
    from finetune.model.experts import fuse_experts, load_adapter
    from finetune.outputs.export_base import merge_base, untie_adapted_head

    check_out_free(out)
    if json.loads((source.adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("task_type") == "SEQ_CLS":
        raise ExportError(f"{source.adapter_dir}: a reward model's adapter (train.objective reward: LoRA plus its score "
                          "head) is not merged here: the merged model would be a sequence classifier, which finetune "
                          "does not verify. Nothing was written. Fix: export without --merge and load it with "
                          "AutoModelForSequenceClassification.from_pretrained(base, num_labels=1) + "
                          "PeftModel.from_pretrained (or merge_and_unload() there).")
    base, base_note = merge_base(source, base)  # a 4-bit checkpoint: the 16-bit folder it was quantized from
    config = base_config(source, base)
    tokenizer = load_tokenizer_for(source, base)
    tensors, (written, update), fits, note = _checked_tensors(source, config, base, tokenizer)
    model = load_full_precision_base(source, base)
    note = base_note + untie_adapted_head(model, source.adapter_config) + note  # LoRA on a tied head: on it alone
    ids = prompt_ids(tokenizer)
    base_logits = _logits(model, ids)
    with tempfile.TemporaryDirectory() as adapter_tmp, atomic_dir(out, replace=False) as tmp:
        # Merged as trained (MoE: per expert, finetune's loader); judged as written (MoE: possibly PEFT's fused form).
        trained_form, written_form = Path(adapter_tmp) / "trained", Path(adapter_tmp) / "written"
        write_clean_adapter(trained_form, tensors, source, base)
        write_clean_adapter(written_form, written, source, base, config_update=update)
        peft_model = load_adapter(model, trained_form)  # PeftModel.from_pretrained; MoE experts loaded per expert
        reference = _logits(peft_model, ids)
        merged = peft_model.merge_and_unload()
        in_memory = compare_logits("merged fp32 model vs base + adapter", _logits(merged, ids), reference)
        _require_close(in_memory, relative=1e-4)
        fuse_experts(merged)  # MoE: transformers' own experts layout back, so the folder loads with plain transformers
        _cast_parameters(merged, torch.bfloat16)
        merged.config.dtype = torch.bfloat16
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        rounded = _logits(_cast_parameters(merged, torch.float32), ids)  # the bf16 weights, exactly, computed in fp32
        reloaded = _logits(from_pretrained(tmp, dtype=torch.float32, trust_remote_code=_remote_code(source)), ids)
        saved = compare_logits("saved model (reloaded) vs the merged model in bf16", reloaded, rounded)
        _require_close(saved, relative=1e-4)
        storage = compare_logits("bf16 storage vs base + adapter", reloaded, reference)
        effect = (reference - base_logits).abs().max().item()
        runtimes = write_report(tmp, adapter_verdicts(written_form, config, merged=True), merged=True)
    return note + (
        f"verify: {fits}; prompt {VERIFY_PROMPT!r} ({ids.shape[1]} tokens): "
        f"{_describe(in_memory)}; {_describe(saved)}; {_describe(storage)} (rounding, reported only); the adapter "
        f"itself moves the logits by up to {effect:.3g}.\n"
        f"{runtimes}"
    )


@torch.no_grad()
def _cast_parameters(model, dtype: torch.dtype):
    """Parameters only: buffers such as rotary `inv_freq` stay fp32, as a reload recomputes them (`model.to` would
    round them to bf16 too and move every position's angle)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def _describe(result: dict) -> str:
    return (
        f"{result['compared']}: max abs logit diff {result['max_abs_diff']:.3g} "
        f"({result['relative']:.2%} of the logit range), top-1 agreement {result['top1_agreement']:.0%}"
    )


def _require_close(result: dict, *, relative: float) -> None:
    if result["relative"] > relative or result["top1_agreement"] < 0.9:
        raise ExportError(
            f"export verification failed, nothing was written: {_describe(result)} (allowed: {relative:.2%} "
            "of the range, 90% top-1 agreement). Report this with the run's recipe."
        )
