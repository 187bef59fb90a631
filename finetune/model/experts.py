"""Mixture-of-experts layers as real QLoRA: the fused expert tensors of transformers 5 split into one Linear per expert
projection, so bitsandbytes stores every expert weight in 4 bits and PEFT puts a LoRA (with dropout) on each.

transformers 5 keeps a layer's experts as two 3-D parameters (`experts.gate_up_proj`: experts x 2*inter x hidden,
`experts.down_proj`: experts x hidden x inter) and fuses the checkpoint's per-expert tensors into them while loading
(its conversion mapping: `MergeModulelist` stacks the experts, `Concatenate` joins gate and up). bitsandbytes quantizes
`nn.Linear` modules only, so those parameters stayed bf16 (on Mixtral-8x7B ~96% of the weights), and PEFT reaches them
only through `ParamWrapper`, which has no dropout. Here each such module becomes `RoutedExperts`: per expert, one
`nn.Linear` per projection, named as the checkpoint names them (Mixtral `w1`/`w3`/`w2`, Qwen-MoE `gate_proj`/`up_proj`/
`down_proj`: read from transformers' converter for the model, not from a table of ours). Then:
  * transformers' own bnb quantizer turns them into `Linear4bit` like every other projection (NF4, double quant, the
    recipe's quant storage dtype), FSDP shards them like every other 4-bit weight, and a forward dequantizes one
    expert projection at a time (never the whole expert stack in bf16);
  * PEFT's ordinary `lora.Linear4bit` wraps each one: LoRA per expert, dropout working, and adapter keys in the
    per-expert layout that PEFT itself converts for a stock transformers 5 model (and that vLLM reads);
  * the checkpoint's per-expert tensors map one to one onto these weights, after transformers' key renames (sharded
    loading reads one expert tensor at a time, `expert_views`); a checkpoint that stores the fused 3-D tensors is read
    by slicing them per expert.
The router (`gate`) is not an `nn.Linear` in transformers 5: it stays unquantized and, by default, frozen.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from finetune.errors import ModelLoadError

# Where the checkpoint has no per-expert converter (it ships the fused tensors), the per-expert names transformers 4 used.
DEFAULT_NAMES = (("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class ExpertNames:
    """Per-expert projection names: the parts of `gate_up_proj` in the order transformers concatenates them, and
    `down_proj`'s (from the model's conversion mapping: `.experts.*.w1.weight` -> `w1`)."""

    gate_up: tuple[str, ...]
    down: tuple[str, ...]


# ------------------------------------------------------------------------------------------------ the module
class ExpertMLP(nn.Module):
    """One expert: act(gate(x)) * up(x), then down; each projection an `nn.Linear` (a `Linear4bit` once quantized)."""

    def __init__(self, names: ExpertNames, hidden: int, inter: int, act_fn, *, dtype=None):
        super().__init__()
        self.names = names
        for name in names.gate_up:
            self.add_module(name, nn.Linear(hidden, inter, bias=False, dtype=dtype))
        self.add_module(names.down[0], nn.Linear(inter, hidden, bias=False, dtype=dtype))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (getattr(self, name)(x) for name in self.names.gate_up)
        return getattr(self, self.names.down[0])(self.act_fn(gate) * up)


class RoutedExperts(nn.ModuleList):
    """A layer's experts, one module each; same call as transformers' experts (states, top-k index, top-k weights).
    `fused_type` / `fused_config`: transformers' experts class it replaced and its config, so that `fuse_experts` can
    give a merged model back its stock layout (plain Python attributes: no state, nothing for FSDP to see).

    Every expert runs on every step, on the tokens routed to it (possibly none): each rank then uses every parameter
    and joins every collective in the same order whatever its tokens chose. Skipping unrouted experts, as transformers'
    eager loop does, deadlocks FSDP1 (each expert's LoRA is a unit of its own, all-gathered when its forward runs)
    and breaks DDP's gradient reduction (a parameter unused on one rank only).

    One host sync per layer, not one per expert: the (token, slot) pairs are grouped by expert with one stable sort,
    and the host reads only where each expert's group starts (`expert_groups`); each expert then slices its group with
    Python ints. A `torch.where(top_k_index == e)` per expert waits for the GPU every time (its output size is read
    back): 128 experts x 48 layers = 6k stalls per forward on Qwen3-30B-A3B, a step bound by the CPU's launches."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        token_idx, weights, bounds = expert_groups(top_k_index, top_k_weights, len(self))
        for index, expert in enumerate(self):
            rows = token_idx[bounds[index] : bounds[index + 1]]  # a view: no sync, possibly empty
            routed = expert(hidden_states[rows]) * weights[bounds[index] : bounds[index + 1], None]
            final.index_add_(0, rows, routed.to(final.dtype))
        return final


def expert_groups(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tokens and routing weights of every (token, top-k slot) pair grouped by expert, and the group bounds as
    Python ints (expert e's pairs are [bounds[e], bounds[e + 1])): one sort, one search, one device-to-host copy.

    The sort is stable, so within an expert the pairs keep their flat (token, slot) order, which is the order
    `torch.where(top_k_index == e)` gave: the same rows gathered and added in the same order, bitwise the same output.
    The bounds come from `searchsorted` on the sorted expert ids, not `bincount`: CUDA's bincount reads the input's
    min and max back to the host to size its output (two more syncs) and has no deterministic kernel."""
    slots = top_k_index.size(-1)
    flat = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_experts, torch.arange(experts + 1, device=flat.device, dtype=flat.dtype))
    bounds = starts.tolist()  # the layer's one host sync
    return order // slots, top_k_weights.reshape(-1)[order], bounds


# ------------------------------------------------------------------------------------------------ finding them
def fused_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers 5's fused experts modules (3-D `gate_up_proj` and `down_proj` parameters), by name."""
    found = []
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            found.append((name, module))
    return found


def unsupported_layout(module: nn.Module) -> str | None:
    """Why this fused experts module cannot be split into per-expert Linears, or None."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed (in x out)"
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        return "its experts have biases"
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return "its gate and up projections are interleaved, or it has no gate"
    if getattr(module, "has_post_expert_norm", False) or getattr(type(module), "_apply_gate", _default_apply_gate) \
            is not _default_apply_gate:
        return "its experts apply their own gating or a norm"
    return None


def expert_names(model: nn.Module, param_name: str, part: str) -> tuple[str, ...]:
    """The per-expert names transformers' converter for `param_name` (…experts.gate_up_proj / down_proj) reads."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    for converter in get_model_conversion_mapping(model):
        if not isinstance(converter, WeightConverter) or not param_name.endswith(converter.target_patterns[0]):
            continue
        operations = [type(op) for op in converter.operations]
        expected = [MergeModulelist, Concatenate] if part == "gate_up" else [MergeModulelist]
        names = tuple(re.search(r"\*\.(\w+)\.weight$", p).group(1) for p in converter.source_patterns
                      if re.search(r"\*\.(\w+)\.weight$", p))
        if operations == expected and len(names) == len(converter.source_patterns):
            return names
    return DEFAULT_NAMES[0] if part == "gate_up" else DEFAULT_NAMES[1]


def _layout(model: nn.Module, name: str, module: nn.Module) -> ExpertNames:
    reason = unsupported_layout(module)
    if reason is not None:
        raise ModelLoadError(
            f"model: the experts of {type(module).__name__} ({name}) cannot be stored in 4 bits by finetune: {reason}. "
            "Fix: set quantization.method: none (experts in model.dtype), or use a Mixtral- or Qwen-MoE-style model.")
    return ExpertNames(expert_names(model, f"{name}.gate_up_proj", "gate_up"),
                       expert_names(model, f"{name}.down_proj", "down"))


# ------------------------------------------------------------------------------------------------ splitting
def split_experts(model: nn.Module, *, dtype: torch.dtype, quantized: bool = True) -> int:
    """Replace every fused experts module by `RoutedExperts` of plain `nn.Linear`s, on the fused tensors' device.

    On the meta device (the sharded loader's skeleton) the new weights are empty and transformers' bnb quantizer then
    converts them like every Linear. With real tensors (after `from_pretrained`) each expert's weights are copied
    out of the fused tensors (`quantize_split_experts` quantizes them). Returns the number of modules replaced.
    A layout this cannot split is refused when `quantized` (its experts would stay in model.dtype), else left fused."""
    replaced = 0
    for name, module in fused_expert_modules(model):
        if not quantized and unsupported_layout(module) is not None:
            continue
        names = _layout(model, name, module)
        experts, inter2, hidden = module.gate_up_proj.shape
        parts = len(names.gate_up)
        device = module.gate_up_proj.device
        with torch.device(device):
            split = RoutedExperts([ExpertMLP(names, hidden, inter2 // parts, module.act_fn, dtype=dtype)
                                   for _ in range(experts)])
        split.fused_type, split.fused_config = type(module), getattr(module, "config", None)
        if device.type != "meta":
            with torch.no_grad():
                for index, expert in enumerate(split):
                    for part, chunk in zip(names.gate_up, module.gate_up_proj[index].chunk(parts, dim=0), strict=True):
                        getattr(expert, part).weight.copy_(chunk)
                    getattr(expert, names.down[0]).weight.copy_(module.down_proj[index])
        split.requires_grad_(False)
        model.set_submodule(name, split)
        replaced += 1
    return replaced


def quantize_split_experts(model: nn.Module, bnb_config, *, load_dtype: torch.dtype) -> int:
    """Store every expert Linear of a loaded model in 4 bits, one projection at a time, as transformers' own
    `Bnb4bitQuantize` does for the other Linears (and the sharded loader does for these): the packed bytes and quant
    states are the same whichever loader built the model. Returns the number of weights quantized."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    count = 0
    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        for expert in module:
            values = {name: child.weight.detach() for name, child in expert.named_children() if type(child) is nn.Linear}
            replace_with_bnb_linear(expert, quantization_config=bnb_config)
            for name, value in values.items():
                layer = getattr(expert, name)
                value = value.to(dtype=load_dtype)
                layer.weight = bnb.nn.Params4bit(value, requires_grad=False, **layer.weight.__dict__).to(value.device)
                count += 1
    return count


# ------------------------------------------------------------------------------------------------ LoRA on them
def has_routed_experts(model: nn.Module) -> bool:
    return any(isinstance(module, RoutedExperts) for module in model.modules())


@contextmanager
def per_expert_layout():
    """PEFT 0.21 rewrites the LoRA targets of a Mixtral- or Qwen-MoE-type model for transformers 5's fused experts
    (`w1`/`gate_proj`... -> `target_parameters=gate_up_proj`, ParamWrapper, no dropout; `all-linear` -> the router's
    `gate.weight` too), and fuses a loaded adapter's per-expert tensors the same way. Split into `RoutedExperts`, the
    model has transformers 4's per-expert Linears again, so both rewrites would target parameters that no longer
    exist: PEFT is told, inside this block only, that it is not on transformers 5."""
    from peft.tuners import tuners_utils
    from peft.utils import save_and_load

    previous = tuners_utils.is_transformers_ge_v5, save_and_load.is_transformers_ge_v5
    tuners_utils.is_transformers_ge_v5 = save_and_load.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners_utils.is_transformers_ge_v5, save_and_load.is_transformers_ge_v5 = previous


def get_peft_model(model: nn.Module, config, *, train_router: bool = False, **kwargs):
    """PEFT's `get_peft_model`, with the per-expert Linears of `RoutedExperts` targeted as the Linears they are.

    On a MoE model, targets that cannot work are refused first (`check_expert_targets`), before any weight is read
    when the model is a meta skeleton; whatever else PEFT refuses becomes one paragraph naming lora.target_modules.
    `train_router` (lora.train_router): the routers become PEFT's modules_to_save (`trainable_routers`)."""
    from peft import get_peft_model as peft_get_peft_model

    if train_router:
        config.modules_to_save = router_names(model)
    if not has_routed_experts(model):
        return peft_get_peft_model(model, config, **kwargs)
    check_expert_targets(model, config)
    try:
        with per_expert_layout():
            peft_model = peft_get_peft_model(model, config, **kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"lora.target_modules {config.target_modules!r}: PEFT cannot put LoRA there on this "
                             f"mixture-of-experts model ({str(exc).splitlines()[0][:300]}). Fix: use all-linear, or "
                             f"name Linear modules (attention projections, the experts' {_expert_leaf_names(model)}).") from None
    trainable_routers(peft_model)
    return peft_model


def router_names(model: nn.Module) -> list[str]:
    """The routers' module names (`gate`): the leaf module with one weight beside each layer's `RoutedExperts`.
    ModelLoadError when the model has none (lora.train_router on a dense model)."""
    names = sorted({name for parent in model.modules() if any(isinstance(c, RoutedExperts) for c in parent.children())
                    for name, child in parent.named_children() if not isinstance(child, (RoutedExperts, nn.Linear))
                    and not list(child.children()) and isinstance(getattr(child, "weight", None), torch.Tensor)})
    if not names:
        raise ModelLoadError("lora.train_router: true, but this model has no mixture-of-experts router to train. Fix: "
                             "remove lora.train_router (it applies to Mixtral- and Qwen-MoE-style models).")
    return names


def trainable_routers(peft_model: nn.Module) -> int:
    """The trainable copies PEFT made of the routers (modules_to_save): fp32 master weights like the LoRA tensors, and
    their input cast to the weight's dtype, as the router's own `F.linear` needs one dtype (fp32 on a single process
    or DDP; the compute dtype inside FSDP's mixed precision). The frozen original stays in model.dtype."""
    from peft.utils import ModulesToSaveWrapper

    count = 0
    for module in peft_model.modules():
        if not isinstance(module, ModulesToSaveWrapper):
            continue
        for copy in module.modules_to_save.values():
            copy.float().requires_grad_(True)
            copy.register_forward_pre_hook(_input_in_weight_dtype)
            count += 1
    return count


def _input_in_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])


def load_adapter(model: nn.Module, folder: str | Path):
    """`PeftModel.from_pretrained` for a model with `RoutedExperts`: the adapter's expert tensors (under the model's
    names or the checkpoint's, `conversions.model_names`) are loaded one to one into the per-expert LoRA layers, not
    fused for transformers 5's experts as PEFT would. Any key the model has no place for is refused."""
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from finetune.model.conversions import model_names

    if not has_routed_experts(model):
        return PeftModel.from_pretrained(model, str(folder))
    config = PeftConfig.from_pretrained(str(folder))
    config.inference_mode = True
    peft_model = get_peft_model(model, config)
    weights = load_peft_weights(str(folder), device="cpu")
    names = model_names(model, list(weights))
    with per_expert_layout():
        result = set_peft_model_state_dict(peft_model, {names[key]: value for key, value in weights.items()})
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing:
        raise ModelLoadError(f"{folder}: the adapter does not fit this mixture-of-experts model "
                             f"({len(result.unexpected_keys)} unexpected, {len(missing)} missing LoRA tensors, e.g. "
                             f"{(list(result.unexpected_keys) or missing)[0]}). Fix: use the adapter of a run on this base.")
    return peft_model.eval()


def fuse_experts(model: nn.Module) -> int:
    """Give every `RoutedExperts` of a model without 4-bit or LoRA layers (a merged one) transformers' own fused experts
    back, the per-expert weights stacked as transformers stacks them (`split_experts` reversed): `save_pretrained`
    then writes the checkpoint layout and names transformers, vLLM and llama.cpp read. Returns the modules replaced."""
    replaced = 0
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]:
        names = module[0].names
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([getattr(expert, part).weight for part in names.gate_up]) for expert in module])
            down = torch.stack([getattr(expert, names.down[0]).weight for expert in module])
        with torch.device("meta"):
            fused = module.fused_type(module.fused_config)
        fused.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        fused.down_proj = nn.Parameter(down, requires_grad=False)
        model.set_submodule(name, fused)
        replaced += 1
    return replaced


def _expert_leaf_names(model: nn.Module) -> str:
    names = next((module[0].names for module in model.modules() if isinstance(module, RoutedExperts) and len(module)), None)
    return "/".join((*names.gate_up, *names.down)) if names else "projections"


def check_expert_targets(model: nn.Module, config) -> None:
    """Refuse LoRA targets a MoE model cannot take, naming the key and the fix: the router (not a Linear in
    transformers 5; it stays frozen), the fused expert names of transformers 5 (`gate_up_proj`), and an adapter
    trained on the fused experts (PEFT's `target_parameters`, ParamWrapper: no dropout, bf16 experts)."""
    if getattr(config, "target_parameters", None):
        raise ModelLoadError(
            f"model.adapter: it puts LoRA on transformers 5's fused expert tensors (target_parameters "
            f"{sorted(config.target_parameters)}), which finetune keeps as one 4-bit Linear per expert. Fix: train a new "
            f"adapter with finetune (target_modules all-linear puts LoRA on every expert's {_expert_leaf_names(model)}).")
    targets = config.target_modules
    if targets is None or isinstance(targets, str):
        return  # all-linear (or a regex) matches Linears only: the experts' projections, never the router
    routers = {name.rsplit(".", 1)[-1] for parent_name, parent in model.named_modules()
               if any(isinstance(child, RoutedExperts) for child in parent.children())
               for name, child in parent.named_children() if not isinstance(child, (RoutedExperts, nn.Linear))}
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in routers:
            raise ModelLoadError(
                f"lora.target_modules: `{target}` is the experts' router, which stays unquantized and takes no LoRA (it "
                "is no Linear in transformers 5). Fix: remove it from lora.target_modules; to train the routers, set "
                "lora.train_router: true (each router trained in full, as PEFT's modules_to_save).")
        if leaf in ("gate_up_proj", "down_proj") and leaf not in leaves:
            raise ModelLoadError(
                f"lora.target_modules: `{target}` is transformers 5's fused expert tensor; finetune keeps one Linear per "
                f"expert projection. Fix: name them as the checkpoint does ({_expert_leaf_names(model)}), or use all-linear.")
