"""Where an exported adapter runs: plain PEFT, merged transformers, vLLM, llama.cpp's convert_lora_to_gguf.py.

Each runtime's rules are taken from its own source (cited per rule below and in docs/recipes.md); an adapter a runtime
would refuse, or load with a wrong scale, is flagged with the reason and, where there is one, the fix. PEFT is checked
by loading the written adapter into a PeftModel built for the base (on the meta device: no base weights needed).

    status  valid       loads and computes what training computed
            needs       loads once the runtime is started with a flag (the flag is in the reason)
            unverified  not run by finetune (what to check is in the reason): LoRA on mixture-of-experts experts in
                        vLLM and llama.cpp (per expert: their sources say they load it; fused: llama.cpp's may not)
            invalid     refused, or loaded with a wrong result
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPORT_JSON = "runtimes.json"
REPORT_TEXT = "RUNTIMES.md"

# vllm/config/lora.py: `MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]`, `max_lora_rank = 16`.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_MAX_RANK = 16
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass
class Verdict:
    runtime: str
    status: str  # valid | needs | invalid
    reasons: list[str] = field(default_factory=list)

    def line(self) -> str:
        detail = "; ".join(self.reasons)
        return f"{self.runtime}: {self.status.upper()}" + (f" - {detail}" if detail else "")


def lora_modules(tensor_names: list[str]) -> list[str]:
    """Module paths that carry LoRA A/B matrices (`model.layers.0.self_attn.q_proj`)."""
    found = {name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for name in tensor_names if ".lora_" in name}
    return sorted(found)


def _patterns(config: dict) -> tuple[dict, dict]:
    return config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}


def vllm_verdict(config: dict, tensor_names: list[str]) -> Verdict:
    """vLLM's rules: vllm/lora/peft_helper.py (PEFTHelper._validate_features, validate_legal, __post_init__) and
    vllm/lora/utils.py (get_supported_lora_modules: every linear layer, plus the model's embedding_modules)."""
    reasons, status = [], "valid"
    rank_pattern, alpha_pattern = _patterns(config)
    if config.get("use_dora"):
        status, reasons = "invalid", [*reasons, "DoRA: vLLM refuses it (`vLLM does not yet support DoRA.`)"]
    if config.get("modules_to_save"):
        status = "invalid"
        reasons.append(f"modules_to_save {config['modules_to_save']}: vLLM refuses it (`vLLM only supports "
                       "modules_to_save being None.`)")
    if rank_pattern or alpha_pattern:
        status = "invalid"
        reasons.append("rank_pattern/alpha_pattern: vLLM reads one r and one lora_alpha and scales every module by "
                       "lora_alpha/r (PEFTHelper drops the patterns), so the listed modules get the wrong scale")
    ranks = [config.get("r", 0), *rank_pattern.values()]
    rank = max(int(r) for r in ranks)
    if rank > VLLM_RANKS[-1]:
        status = "invalid"
        reasons.append(f"rank {rank} > {VLLM_RANKS[-1]}, the largest max_lora_rank vLLM accepts")
    elif rank > VLLM_DEFAULT_MAX_RANK:
        flag = next(r for r in VLLM_RANKS if r >= rank)
        status = "needs" if status == "valid" else status
        reasons.append(f"rank {rank} > vLLM's default max_lora_rank {VLLM_DEFAULT_MAX_RANK}: start vLLM with "
                       f"--max-lora-rank {flag}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):  # (vLLM 0.32: --enable-lora-bias is gone)
        status = "invalid"
        reasons.append("adapter bias (lora.bias / lora_bias): vLLM refuses it (`Adapter bias is not supported.`); "
                       "train with lora.bias: none to serve the adapter with vLLM")
    outside = [m for m in lora_modules(tensor_names) if m.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens")]
    if outside:
        status = "needs" if status == "valid" else status
        reasons.append(f"LoRA on {', '.join(sorted({m.rsplit('.', 1)[-1] for m in outside}))}: vLLM takes it only where "
                       "the model class lists it in embedding_modules (varies by model and version); check before serving")
    if config.get("use_rslora") and status != "invalid":
        reasons.append("rsLoRA: vLLM scales by lora_alpha/sqrt(r), as PEFT does")
    if status == "valid" and not reasons:
        reasons.append(f"LoRA on linear layers only, rank {rank} <= {VLLM_DEFAULT_MAX_RANK}")
    return Verdict("vLLM (LoRA adapter, enable_lora=True)", status, reasons)


def llama_cpp_verdict(config: dict, tensor_names: list[str], *, tied_embeddings: bool) -> Verdict:
    """llama.cpp's rules: convert_lora_to_gguf.py (reads lparams["lora_alpha"]; takes .lora_A.weight / .lora_B.weight
    and lora_embedding_A/B, skips .base_layer.weight, keeps norm weights, exits on any other tensor), src/llama-adapter.cpp
    (skips `_norm.weight` tensors on load, refuses a LoRA tensor the base GGUF lacks) and src/llama-adapter.h (get_scale:
    adapter_scale * alpha / rank, rank from the tensor, one alpha per file). Checked against the converter itself by
    tests/outputs/test_llama_cpp_converter.py."""
    reasons, status = [], "valid"
    if "lora_alpha" not in config:
        status = "invalid"
        reasons.append("adapter_config.json has no lora_alpha, which the converter reads (KeyError)")
    if config.get("use_dora"):
        status = "invalid"
        reasons.append("DoRA: its lora_magnitude_vector tensors are not lora_A/lora_B; the converter stops "
                       "(`Unexpected name ...: Not a lora_A or lora_B tensor`)")
    taken = {name: _converter_takes(name) for name in tensor_names}
    stops = [n for n, how in taken.items() if how == "stops" and "lora_magnitude_vector" not in n]
    norms = [n for n, how in taken.items() if how == "norm"]
    saved = config.get("modules_to_save")
    if stops:
        status = "invalid"
        embeddings = any(n.endswith((".embed_tokens.weight", ".lm_head.weight")) for n in stops)
        reasons.append(f"{len(stops)} tensor(s) not named .lora_A.weight/.lora_B.weight (e.g. {stops[0]})"
                       + (f", full weights of modules_to_save {saved}" if saved else "")
                       + "; the converter stops on them (`Not a lora_A or lora_B tensor`"
                       + ("; `Embeddings is present in the adapter`)" if embeddings else ")"))
    if norms:
        status = "invalid"
        reasons.append(f"{len(norms)} norm weight(s) in the adapter (e.g. {norms[0]}"
                       + (f", modules_to_save {saved}" if saved else "") + "): the converter keeps them, but llama.cpp "
                       "skips `_norm.weight` tensors when it loads an adapter (`TODO: add support for norm vector`), so "
                       "it runs with the base's norms, not the trained ones")
    if tied_embeddings and any(m.endswith("lm_head") for m in lora_modules(tensor_names)):
        status = "invalid"
        reasons.append("LoRA on lm_head of a base with tied embeddings: the converter writes output.weight.lora_a/b, "
                       "but the base's GGUF has no output.weight (it reuses token_embd), so llama.cpp refuses the "
                       "adapter (`LoRA tensor 'output.weight' does not exist in base model`)")
    rank_pattern, alpha_pattern = _patterns(config)
    if config.get("use_rslora"):
        status = "invalid"
        r, alpha = config.get("r", 1), config.get("lora_alpha", 1)
        reasons.append(f"rsLoRA: llama.cpp scales by alpha/rank, not alpha/sqrt(rank), so the update is {r ** 0.5:g}x too "
                       f"small. Fix: convert a copy whose adapter_config.json says lora_alpha {alpha * r ** 0.5:g} "
                       f"(alpha*sqrt(r)), or load it with --lora-scaled FILE {r ** 0.5:g}")
    if alpha_pattern:
        status = "invalid"
        reasons.append(f"alpha_pattern {alpha_pattern}: a GGUF adapter has one alpha, so those modules get the wrong "
                       "scale")
    if rank_pattern and status == "valid":
        reasons.append("rank_pattern: fine, llama.cpp reads each module's rank from its tensors")
    if status == "valid" and not reasons:
        reasons.append("lora_A/lora_B tensors only, lora_alpha set, plain alpha/r scaling")
    return Verdict("llama.cpp (convert_lora_to_gguf.py -> GGUF adapter)", status, reasons)


def _converter_takes(name: str) -> str:
    """What convert_lora_to_gguf.py does with one adapter tensor (its get_tensors): `lora` (an A/B half), `skip`
    (a targeted layer's base weight), `norm` (kept as a norm vector: mergekit-extract-lora writes those) or `stops`."""
    if ".lora_A.weight" in name or ".lora_B.weight" in name or ".lora_embedding_" in name:
        return "lora"
    if ".base_layer.weight" in name:
        return "skip"
    return "norm" if "_layernorm" in name or ".norm" in name else "stops"


def check_peft_load(folder: Path, base_config) -> Verdict:
    """Load the written adapter with PEFT's own loader into a PeftModel of the base and compare every tensor.

    The base is built on the meta device (no weights, any size); the adapter tensors are assigned from the file, so
    what PEFT loaded can be compared with what was written, and missing or unexpected keys are PEFT's own findings."""
    from peft import PeftConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict

    from finetune.model.classes import from_config

    name = "PEFT (PeftModel.from_pretrained)"
    written = load_peft_weights(str(folder), device="cpu")
    peft_config = PeftConfig.from_pretrained(str(folder))
    if peft_config.task_type == "SEQ_CLS":  # a reward model: the base as a sequence classifier with one label
        from transformers import AutoModelForSequenceClassification

        base_config = copy.deepcopy(base_config)
        base_config.num_labels = 1
    build = AutoModelForSequenceClassification.from_config if peft_config.task_type == "SEQ_CLS" else from_config
    with torch.device("meta"):
        model = build(base_config)
    peft_model = get_peft_model(model, peft_config, low_cpu_mem_usage=True)
    expected = _as_peft_converts(peft_model, written)
    _materialize_adapter(peft_model, {**written, **expected})
    result = set_peft_model_state_dict(peft_model, written)
    unexpected = list(result.unexpected_keys)
    missing = [key for key in result.missing_keys if "lora_" in key or "modules_to_save" in key]
    loaded = get_peft_model_state_dict(peft_model)
    differ = [key for key, value in expected.items()
              if key not in loaded or loaded[key].is_meta or not torch.equal(loaded[key], value)]
    if unexpected or missing or differ:
        example = (unexpected or missing or differ)[0]
        reason = (f"PEFT's loader: {len(unexpected)} unexpected, {len(missing)} missing, {len(differ)} different "
                  f"tensor(s) (e.g. {example})")
        return Verdict(name, "invalid", [reason])
    reason = f"PEFT's loader took all {len(written)} tensors into a PeftModel of the base, each equal to the file"
    if expected is not written:
        reason += f" once PEFT fused the per-expert tensors for transformers 5's experts ({len(written)} -> {len(expected)})"
    elif peft_config.target_parameters:
        reason += " (LoRA on transformers 5's fused expert parameters: target_parameters)"
    return Verdict(name, "valid", [reason])


def _as_peft_converts(peft_model, written: dict) -> dict:
    """The file's tensors as PEFT holds them after loading: unchanged, except on a model whose layers transformers 5
    fused (MoE experts), where PEFT's loader fuses an adapter's per-expert tensors the same way first."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # PEFT < 0.19 loads an adapter's tensors as written (no fusing; a fused-expert base then differs)
        return written
    converted = convert_peft_adapter_state_dict_for_transformers(peft_model, peft_model.peft_config["default"], written)
    return written if converted.keys() == written.keys() else converted


def _materialize_adapter(peft_model, tensors: dict) -> None:
    """Give the adapter's own tensors (LoRA, DoRA magnitudes, modules_to_save copies with their buffers, base layers
    saved with the adapter) real CPU storage, each in the dtype the file holds it in; the rest of the base stays on the
    meta device. A router copy's buffer (DeepSeek-V3's `e_score_correction_bias`) left on the meta device would read as
    different, and so would the file's fp32 router (lora.train_router trains it in fp32) rounded into a copy of a bf16
    base's router: the check is whether PEFT puts each tensor of the file in its place, not the base's precision."""
    from peft.utils import get_peft_model_state_dict

    state = peft_model.state_dict(keep_vars=True)  # the model's own tensors: their file keys, by identity
    file_keys = {id(tensor): key for key, tensor in get_peft_model_state_dict(peft_model, state_dict=state).items()}
    named = [*peft_model.named_parameters(remove_duplicate=False), *peft_model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:  # remove_duplicate=False: a tied lm_head is a duplicate
        key = file_keys.get(id(tensor), name)
        if not tensor.is_meta or not ("lora_" in name or "modules_to_save" in name or key in tensors):
            continue
        dtype = tensors[key].dtype if key in tensors else tensor.dtype
        parent_name, _, leaf = name.rpartition(".")
        parent = peft_model.get_submodule(parent_name)
        if isinstance(tensor, torch.nn.Parameter):
            setattr(parent, leaf, torch.nn.Parameter(torch.zeros(tensor.shape, dtype=dtype), requires_grad=False))
        else:
            parent._buffers[leaf] = torch.zeros(tensor.shape, dtype=dtype)  # keeps it persistent or not, as it was


def expert_lora_verdicts(vllm: Verdict, llama_cpp: Verdict, tensor_names: list[str], *, fused: bool = False) -> None:
    """LoRA on MoE experts: per-expert tensors named as the base checkpoint names them (finetune/outputs/
    export_experts.py), marked unverified from what vLLM's and llama.cpp's sources say, as neither was run here; or
    PEFT's LoRA on the fused expert parameters (`fused`: target_parameters, export_fused.py), which stock vLLM refuses."""
    experts = [m for m in lora_modules(tensor_names) if ".experts." in f"{m}."]
    if not experts:
        return
    if fused:
        _fused_expert_verdicts(vllm, llama_cpp, len(experts))
        return
    if vllm.status != "invalid":
        vllm.status = "unverified"
        vllm.reasons.append(
            f"LoRA on {len(experts)} MoE expert projections: vLLM applies LoRA to fused MoE layers from v0.11.2 on "
            "(FusedMoEWithLoRA, vllm-project/vllm#21229) and its loader takes per-expert tensors named `.experts.<i>.` "
            "(vllm/lora/lora_model.py); older versions refuse adapters with expert weights. Not run by finetune: serve "
            "it with vLLM >= 0.11.2 on a model class with LoRA support and compare an answer with `finetune generate`")
    if llama_cpp.status != "invalid":
        llama_cpp.status = "unverified"
        llama_cpp.reasons.append(
            f"LoRA on {len(experts)} MoE expert projections: convert_lora_to_gguf.py stacks per-expert A/B tensors as "
            "the model converter stacks the base's experts (LoraTorchTensor handles torch.stack) and llama.cpp applies "
            "LoRA to expert tensors (build_lora_mm_id in build_moe_ffn). Not run by finetune: convert it against the "
            "base's GGUF and compare an answer with `finetune generate`")


def _fused_expert_verdicts(vllm: Verdict, llama_cpp: Verdict, modules: int) -> None:
    """The fused-expert form (what plain PEFT loads for this model): vLLM reads a `target_parameters` expert LoRA
    with the wrong orientation and stops on a shape mismatch (vllm-project/vllm#52194, #52198: fixes proposed, not
    in a release finetune knows of); llama.cpp's converter maps per-expert tensor names, which this file has none of."""
    vllm.status = "invalid"
    vllm.reasons.append(
        f"LoRA on {modules} fused MoE expert parameters (PEFT's target_parameters form, the one plain PEFT loads for "
        "this model): stock vLLM reads it transposed and stops on a shape mismatch (vllm-project/vllm#52198). Fix: "
        "serve a merged model (finetune export --merge)")
    if llama_cpp.status != "invalid":
        llama_cpp.status = "unverified"
        llama_cpp.reasons.append(
            f"LoRA on {modules} fused MoE expert parameters (PEFT's target_parameters form): convert_lora_to_gguf.py "
            "names tensors through the base model's converter, which has no name for `experts.lora_A`; not run by "
            "finetune and expected to stop. Fix: convert a merged model (finetune export --merge)")


def adapter_verdicts(folder: Path, base_config, *, merged: bool) -> list[Verdict]:
    """Every runtime's verdict on the adapter in `folder` (for --merge: the adapter that was merged)."""
    from safetensors import safe_open

    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    text_config = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    tied = bool(getattr(text_config, "tie_word_embeddings", getattr(base_config, "tie_word_embeddings", False)))
    verdicts = [check_peft_load(folder, base_config)]
    if merged:
        verdicts.append(Verdict("transformers (merged model, no PEFT)", "valid",
                                ["reloaded with AutoModelForCausalLM and its logits compared with base + adapter"]))
    vllm, llama_cpp = vllm_verdict(config, names), llama_cpp_verdict(config, names, tied_embeddings=tied)
    if not merged:  # merged, the experts are plain weights again: no LoRA on them left for a runtime to apply
        expert_lora_verdicts(vllm, llama_cpp, names, fused=bool(config.get("target_parameters")))
    return [*verdicts, vllm, llama_cpp]


def write_report(out: Path, verdicts: list[Verdict], *, merged: bool) -> str:
    """runtimes.json and RUNTIMES.md into the export folder; returns the text that is printed."""
    subject = "the adapter merged into this model" if merged else "this adapter"
    lines = [f"Where {subject} runs (checked by finetune export against each runtime's rules):", ""]
    lines += [f"- {verdict.line()}" for verdict in verdicts]
    text = "\n".join(lines)
    (out / REPORT_JSON).write_text(json.dumps([asdict(v) for v in verdicts], indent=2) + "\n", encoding="utf-8")
    (out / REPORT_TEXT).write_text(text + "\n", encoding="utf-8")
    return text
