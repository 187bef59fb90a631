"""The adapters attached to the base: PEFT's LoraConfig from the recipe's lora: section (or model.adapter's own,
adapter.py), the targets checked before any weight loads, and `attach_lora`: the PeftModel with every LoRA initialized
from its seed (init.py), or every trainable tensor from model.adapter, and, with lora.fused, the fused forward
(fused.py). Experts get LoRA per expert projection through the experts family interface (model/experts/lora.py:
get_peft_model)."""

from __future__ import annotations

from torch import nn

from finetune.errors import ModelLoadError
from finetune.model.lora.adapter import adapter_start, adapter_targets_problem, check_adapter
from finetune.model.lora.init import init_lora_weights
from finetune.recipe import Recipe

__all__ = ["adapter_start", "attach_lora", "check_adapter", "check_target_modules", "embedding_targets", "lora_config",
           "target_modules_problem"]


def lora_config(recipe: Recipe, model: nn.Module | None = None):
    """The LoRA layout: the recipe's lora section, or model.adapter's own (r, alpha, targets) with the recipe's dropout.
    With `model` (the base LoRA goes on) and the recipe's own section: LoRA kept off sparse-attention indexers
    (`indexer_linears`).

    init_lora_weights is finetune's own init, PEFT's default (true), also for model.adapter: the run starts from the
    adapter's tensors (`init_lora_weights` in init.py), and the adapter it writes is W + BA on the base as its
    checkpoint holds it. An adapter's own init written back (`pissa`, `olora`) made PEFT rewrite the base into a
    residual when it loaded the run's adapter: a model finetune never trained (check_adapter refuses those inits)."""
    from peft import LoraConfig

    lora = recipe.lora
    if recipe.model.adapter:
        config = LoraConfig.from_pretrained(str(check_adapter(recipe)))
        config.lora_dropout, config.inference_mode = lora.dropout, False
        config.init_lora_weights = True
        config.eva_config = config.corda_config = config.lora_ga_config = None  # (PEFT warns of them beside true)
        config.loftq_config = {}
        return config
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        bias=lora.bias,
        task_type="CAUSAL_LM",
    )
    if model is not None and (excluded := indexer_linears(model)):
        config.exclude_modules = excluded
    return config


def indexer_linears(model: nn.Module) -> list[str]:
    """The Linear layers inside a sparse-attention indexer (DeepSeek-V3.2's and V4's, GLM-5's `glm_moe_dsa`, HY-V4's,
    and the models built on them: a transformers module whose class name ends in `Indexer`), by full name.

    An indexer scores the keys and returns the indices of the top-k each query attends to: integers, through which no
    gradient flows, so LoRA on its projections never trains (B stays 0; measured on tiny deepseek_v32 / deepseek_v4 /
    glm_moe_dsa / hy_v4 with all-linear: exactly the LoRA under `*Indexer` got no gradient). Left out, the adapter
    holds no dead weights, and DDP needs no search for unused parameters at every step for them (the probe step of
    parallel/wrapping.py found them). DeepSeek trains its indexer with a separate KL loss that finetune does not run."""
    return sorted({f"{name}.{sub_name}" for name, module in model.named_modules()
                   if type(module).__name__.endswith("Indexer") and type(module).__module__.startswith("transformers.")
                   for sub_name, sub in module.named_modules() if isinstance(sub, nn.Linear)})


def _takes_lora(module: nn.Module) -> bool:
    """A layer PEFT's LoRA wraps (its dispatchers: Linear, bitsandbytes' Linear4bit/8bit among them, embeddings,
    convolutions, transformers' Conv1D, multi-head attention); a block that holds such layers is none."""
    layers = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
    return isinstance(module, layers) or type(module).__name__ == "Conv1D"


def target_modules_problem(model: nn.Module, target_modules) -> str | None:
    """Which names of a lora.target_modules list match no module of `model` (PEFT's rule: the whole name or its last
    parts), or a module that takes no LoRA (an attention block, a norm, a Linear only of a sparse-attention indexer:
    `indexer_linears`), with the Linear names the model has; None when each names LoRA layers. PEFT itself fails only
    when no name matches, with a traceback: a misspelled name beside good ones is dropped without a word, and training
    has fewer LoRAs; a block or a norm ends in PEFT's traceback."""
    if target_modules == "all-linear" or target_modules is None:
        return None
    from types import SimpleNamespace

    from finetune.model.experts.lora import check_expert_targets, has_routed_experts

    if has_routed_experts(model):  # a router or transformers 5's fused expert name: its own message, with the fix
        try:
            check_expert_targets(model, SimpleNamespace(target_modules=list(target_modules), target_parameters=None))
        except ModelLoadError as exc:
            return str(exc)
    indexers = set(indexer_linears(model))
    named = {t: [(n, m) for n, m in model.named_modules() if n == t or n.endswith("." + t)] for t in target_modules}
    matched = {t: [m for _, m in found] for t, found in named.items()}
    missing = [t for t, modules in matched.items() if not modules]
    on_indexers = [t for t, found in named.items() if found and all(n in indexers for n, _ in found)]
    blocks = {t: sorted({type(m).__name__ for m in modules if not _takes_lora(m)}) for t, modules in matched.items()}
    blocks = {t: kinds for t, kinds in blocks.items() if kinds}
    if not missing and not blocks and not on_indexers:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and module is not model.get_output_embeddings()
                     and name not in indexers})
    said = []
    if missing:
        said.append(f"{', '.join(f'`{t}`' for t in missing)} match{'es' if len(missing) == 1 else ''} no module of "
                    f"this model, so {'it' if len(missing) == 1 else 'they'} would get no LoRA")
    if on_indexers:
        said.append(f"{', '.join(f'`{t}`' for t in on_indexers)} name only Linear layers of the sparse-attention "
                    "indexer, which take no LoRA: its output is top-k indices, so no gradient reaches them")
    if blocks:
        listed = ", ".join(f"`{t}` ({'/'.join(kinds)})" for t, kinds in blocks.items())
        said.append(f"{listed} name"
                    f"{'s' if len(blocks) == 1 else ''} modules that take no LoRA: PEFT puts LoRA on Linear layers "
                    "(and embeddings, convolutions), not on the blocks that hold them nor on norms")
    return (f"lora.target_modules: {'; '.join(said)}. Its Linear layers: {', '.join(linear)}. Fix: "
            f"{'fix the names' if missing else 'name the Linear layers'}, or use `all-linear`.")


def embedding_targets(recipe: Recipe, model: nn.Module) -> list[str]:
    """The embedding layers (nn.Embedding) of `model` that the run puts LoRA on: lora.target_modules, or with
    model.adapter the adapter's own targets, by PEFT's rule. PEFT keeps an embedding's LoRA in ParameterDicts
    (`lora_embedding_A/B`), not in Linear modules as every other layer's. `model` may be on the meta device."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = lora_config(recipe)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and check_target_module_exists(config, name)]


def check_target_modules(recipe: Recipe, model: nn.Module) -> None:
    """RecipeError with `target_modules_problem`'s paragraph (the one `finetune validate` prints) when lora.target_modules
    names a module `model` lacks or one that takes no LoRA, and with model.adapter when the list selects other modules
    than the adapter's own targets (`adapter_targets_problem`). `model` may be on the meta device: only its module names
    and types are read."""
    from finetune.errors import RecipeError

    targets = recipe.lora.target_modules
    if problem := target_modules_problem(model, targets) or adapter_targets_problem(recipe, model):
        raise RecipeError(problem)


def attach_lora(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Wrap the base in a PeftModel; only LoRA parameters (and lora.bias's biases, trained routers) require grad
    afterwards. LoRA starts from `init_lora_weights`: its seed, or every trainable tensor from model.adapter."""
    from finetune.model.experts.lora import get_peft_model

    check_target_modules(recipe, model)  # (the loaders said it before any weight loaded: model/loading.py)
    peft_model = get_peft_model(model, lora_config(recipe, model), train_router=recipe.lora.train_router)
    init_lora_weights(peft_model, recipe.train.seed, start=adapter_start(recipe, model))
    if recipe.lora.fused:
        from finetune.model.lora.fused import use_fused_lora

        use_fused_lora(peft_model)  # falls back to PEFT's forward per call where it does not apply (lora_fused.py)
    return peft_model
