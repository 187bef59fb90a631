"""Recipe checks that span sections: the training dtypes, what a training objective needs of the data (and the
generation eval of its eval rows), what streaming cannot do, what train.keep_best needs.

A leaf: recipe.py calls these from its cross-field validator with the recipe being validated; each raises ValueError
with the keys and the fix, which the schema turns into one paragraph naming the file.
"""

from __future__ import annotations

import math
from pathlib import Path

from finetune.recipe.objectives import OBJECTIVES, claimed_formats, objective_of, spec_of


def check_dtypes(recipe) -> None:
    """No fp16 training (no loss scaler), and the 4-bit storage dtype is model.dtype (what FSDP shards)."""
    q = recipe.quantization
    for key, value in (("model.dtype", recipe.model.dtype), ("quantization.compute_dtype", q.compute_dtype)):
        if value == "float16":
            # The loop has no loss scaler: small LoRA gradients underflow to zero in fp16, with no error.
            raise ValueError(
                f"{key}: float16 is not supported for training: without loss scaling the LoRA gradients underflow "
                "silently. Fix: bfloat16 (GPUs from Ampere on, and CPUs), or float32 on GPUs without bf16 "
                "(V100, T4); with an accelerate config, set its mixed_precision to bf16 or no to match."
            )
    if q.method != "none":
        storage = q.quant_storage or recipe.model.dtype
        if storage != recipe.model.dtype:
            raise ValueError(
                f"quantization.quant_storage ({storage}) must equal model.dtype ({recipe.model.dtype}): FSDP shards the "
                "packed 4-bit weights as ordinary tensors of that dtype and mixed precision would cast them otherwise. "
                f"Fix: remove quantization.quant_storage or set it to {recipe.model.dtype}."
            )
    elif q.compute_dtype is not None and q.compute_dtype != recipe.model.dtype:
        raise ValueError(
            f"quantization.compute_dtype: {q.compute_dtype} is the dtype of the 4-bit matmuls, and quantization.method: "
            f"none quantizes nothing: the base and the LoRA compute in model.dtype ({recipe.model.dtype}). Fix: set "
            f"model.dtype: {q.compute_dtype} to compute in it, or remove quantization.compute_dtype.")


def check_flash_attention(recipe, device_type: str) -> None:
    """model.attn_implementation: flash_attention_2 computes on CUDA GPUs in bf16 / fp16 only (transformers otherwise
    tries to fetch a kernel from the Hub, then stops with a traceback after the data is tokenized). `device_type`: the
    device the run trains on ("cuda" when planning for GPUs)."""
    if device_type != "cuda":
        raise ValueError(
            "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only, and this machine trains on the CPU. "
            "Fix: set model.attn_implementation: auto (sdpa where the model supports it, else eager).")
    if recipe.model.dtype == "float32":
        raise ValueError(
            "model.attn_implementation: flash_attention_2 computes in bfloat16 or float16 only, and model.dtype is "
            "float32. Fix: set model.dtype: bfloat16, or model.attn_implementation: auto.")


def check_checkpointing(recipe) -> None:
    """parallel.activation_checkpointing, where set, decides in every strategy (the loader reads it); written beside a
    train.gradient_checkpointing that says the opposite, which of the two the user meant is not known."""
    parallel, train = recipe.parallel.activation_checkpointing, recipe.train.gradient_checkpointing
    if parallel is not None and parallel != train and "gradient_checkpointing" in recipe.train.model_fields_set:
        raise ValueError(
            f"train.gradient_checkpointing: {str(train).lower()} and parallel.activation_checkpointing: "
            f"{str(parallel).lower()} disagree (they are one setting: parallel's is FSDP's name for it, and decides "
            "where set). Fix: set one of them.")


def checkpointing(recipe) -> bool:
    """Whether the run recomputes activations: parallel.activation_checkpointing where set, else
    train.gradient_checkpointing (the loader's, through parallel/plan.py, and the architecture check's)."""
    parallel = recipe.parallel.activation_checkpointing
    return recipe.train.gradient_checkpointing if parallel is None else parallel


def check_objective(recipe) -> None:  # a finetune.recipe.Recipe (not imported: recipe.py imports this)
    """The data goes with its objective (recipe/objectives.py: the formats each trains on; the others are SFT's); the
    objective's section checks what it needs of the others; preference rows are not packed; the sections set are the
    objective's; a load-balancing weight only where the objective adds that loss."""
    data, objective = recipe.data, recipe.train.objective
    spec = spec_of(objective)
    claimed = claimed_formats()
    for key, specs in (("data.datasets", data.datasets), ("data.eval_datasets", data.eval_datasets)):
        for index, dataset in enumerate(specs):
            if spec.formats and dataset.format not in spec.formats:
                raise ValueError(
                    f"{key}[{index}] ({dataset.path}) has format `{dataset.format}`, but train.objective is {objective}, "
                    f"which trains on {spec.formats[0]} rows. Fix: {spec.format_hint}, or set "
                    f"train.objective: {objective_of(dataset.format)} to train on this data.")
            if not spec.formats and dataset.format in claimed:
                raise ValueError(
                    f"{key}[{index}] ({dataset.path}) has format `{dataset.format}` "
                    f"({'prompt' if dataset.format == 'prompt' else 'preference'} data), but train.objective is "
                    f"{objective}. Fix: set train.objective: {objective_of(dataset.format)} (and its section) to learn "
                    "from it, or give SFT data in another format.")
    section = getattr(recipe, objective) if spec.section else None
    if hasattr(section, "check_recipe"):
        section.check_recipe(recipe)
    if spec.formats and data.packing:
        raise ValueError(f"data.packing: preference rows are not packed (responses are scored as whole sequences). "
                         f"Fix: remove data.packing for train.objective: {objective}.")
    _check_sections(recipe)
    check_generation_eval(recipe)
    if recipe.train.router_aux_loss_coef and spec.no_router_aux:
        raise ValueError(f"train.router_aux_loss_coef ({recipe.train.router_aux_loss_coef:g}) with train.objective "
                         f"{objective}: {spec.no_router_aux}, so there is nothing to weight. Fix: remove "
                         "train.router_aux_loss_coef.")


def check_generation_eval(recipe) -> None:  # a finetune.recipe.Recipe
    """eval.generation_rows asks held-out prompts and scores the answers against the rows' own: it needs eval rows
    (data.eval_fraction or data.eval_datasets), and rows that hold a prompt (text rows train every token, so they ask
    nothing). A fraction that rounds to no row is known only once the rows are counted: the run says so then."""
    data, rows = recipe.data, recipe.eval.generation_rows
    if not rows:
        return
    if data.eval_fraction == 0 and not data.eval_datasets:
        raise ValueError(f"eval.generation_rows ({rows}): there are no eval rows to ask (data.eval_fraction is 0 and "
                         "data.eval_datasets is empty), so the run would have no generation eval. Fix: set "
                         "data.eval_fraction (e.g. 0.05) or data.eval_datasets, or remove eval.generation_rows.")
    asked = [*data.eval_datasets, *(data.datasets if data.eval_fraction else [])]  # where the eval rows come from
    if all(dataset.format == "text" for dataset in asked):
        raise ValueError(f"eval.generation_rows ({rows}): the eval rows are text rows (format: text), which train every "
                         "token, so there is no prompt to answer and no reference answer to score. Fix: remove "
                         "eval.generation_rows (the eval loss measures text rows), or give eval rows with prompts "
                         "(data.eval_datasets of completion, alpaca or chat rows).")


def _changed(section) -> list[str]:
    """The keys of a section whose values differ from their defaults (a resolved recipe.yaml lists every key, so what
    was set cannot be told from what was written)."""
    default = type(section)()
    return sorted(name for name in type(section).model_fields if getattr(section, name) != getattr(default, name))


def _check_sections(recipe) -> None:
    """Every key set in another objective's section is one the objective reads (KTO: dpo.reference and
    dpo.disable_dropout; GRPO: dpo.reference), or a mistake to name."""
    objective = recipe.train.objective
    spec = spec_of(objective)
    reads = dict(spec.reads)
    for other in OBJECTIVES.values():
        if not other.section or other.name == objective:
            continue
        changed = _changed(getattr(recipe, other.name))
        if other.name not in reads and changed:
            raise ValueError(f"{other.name}.{f', {other.name}.'.join(changed)}: set, but train.objective is {objective}, "
                             f"which does not read the {other.name}: section. Fix: set train.objective: {other.name}, or "
                             f"remove the {other.name}: section.")
        unread = [name for name in changed if name not in reads.get(other.name, ())]
        if unread:
            read = " and ".join(f"{other.name}.{name}" for name in reads[other.name])
            raise ValueError(f"{other.name}.{f', {other.name}.'.join(unread)}: train.objective {objective} reads only "
                             f"{read} from the {other.name}: section. Fix: {spec.reads_hint}")


def check_streaming(recipe) -> None:  # a finetune.recipe.Recipe
    """What a stream (data.streaming) cannot do, all named at once: it reads each dataset once per pass, in order, and
    never holds the whole data."""
    if not recipe.data.streaming:
        return
    problems = []
    weighted = [f"data.datasets[{index}].weight ({spec.weight})" for index, spec in enumerate(recipe.data.datasets)
                if spec.weight != 1.0]
    if weighted:
        problems.append(f"{', '.join(weighted)}: a weight repeats or subsamples a whole dataset, and a stream reads "
                        "each dataset once per pass, in order. Fix: remove the weight (repeat rows in the file "
                        "instead), or set data.streaming: false.")
    if recipe.train.objective == "dpo" and recipe.dpo.reference == "precomputed" and recipe.dpo.loss in (
            "sigmoid", "ipo", "hinge"):
        problems.append("dpo.reference: precomputed computes every pair's reference log-probs before step 1, and a "
                        "stream never holds every pair. Fix: dpo.reference: adapter_off (the default), or "
                        "data.streaming: false.")
    if recipe.train.objective == "kto":
        problems.append("train.objective: kto pairs each prompt with another completion of its optimizer step for the "
                        "KL term, which the shuffled rows provide and a stream does not (yet). Fix: data.streaming: "
                        "false.")
    if recipe.train.num_epochs is not None:  # a stream has no length
        problems.append("train.num_epochs: a stream's length is unknown, so epochs cannot be turned into steps. Fix: "
                        "set train.max_steps instead, or data.streaming: false.")
    if problems:
        raise ValueError("data.streaming: " + " ".join(problems))


def check_keep_best(recipe) -> None:  # a finetune.recipe.Recipe
    """train.keep_best compares checkpoints by their eval loss: every checkpoint must have one, so the run needs eval
    data and an eval at every step it saves at."""
    t, data = recipe.train, recipe.data
    if not t.keep_best:
        return
    problems = []
    if not data.eval_datasets and data.eval_fraction == 0:
        problems.append("there is no eval data (data.eval_fraction is 0 and data.eval_datasets is empty). Fix: set "
                        "data.eval_fraction (e.g. 0.05) or data.eval_datasets.")
    if t.eval_every == 0 or t.save_every == 0 or t.save_every % t.eval_every:
        problems.append(f"checkpoints are written every train.save_every ({t.save_every}) steps and evaluations run "
                        f"every train.eval_every ({t.eval_every}) steps (0: only at the end), so some checkpoints would "
                        "have no eval loss. Fix: set train.eval_every to train.save_every or a divisor of it.")
    if problems:
        raise ValueError("train.keep_best: " + " ".join(problems))


def eval_every_note(recipe, eval_examples: int) -> str | None:  # a finetune.recipe.Recipe
    """The run's note for train.eval_every > 0 with no eval examples, where nothing would evaluate: said, not refused
    (docs/recipes.md: a quick variation of a library recipe, such as `data.eval_fraction=0` on one that evaluates every
    200 steps, runs; train.keep_best, which needs the evals, is refused instead: check_keep_best). Bug bash bb58 #5:
    it was silently ignored. A fraction that rounds to no row is known only once the rows are counted."""
    t, data = recipe.train, recipe.data
    if not t.eval_every or eval_examples:
        return None
    if t.objective == "grpo":
        why, fix = ("train.objective grpo holds out no rows and evaluates nothing: each step's rewards are its measure, "
                    "docs/grpo.md"), "remove train.eval_every"
    elif data.eval_fraction == 0 and not data.eval_datasets:
        why = "data.eval_fraction is 0 and data.eval_datasets is empty"
        fix = "set data.eval_fraction (e.g. 0.05) or data.eval_datasets, or remove train.eval_every"
    else:
        files = ", and its data.eval_datasets hold no rows" if data.eval_datasets else ""
        why = f"data.eval_fraction {data.eval_fraction:g} of the rows rounds to none{files}"
        fix = "raise data.eval_fraction, give data.eval_datasets, or remove train.eval_every"
    return (f"train.eval_every is {t.eval_every}, but the run has no eval examples ({why}), so no evaluation runs. "
            f"To evaluate: {fix}.")


def output_in_data_problem(recipe) -> str | None:  # a finetune.recipe.Recipe
    """output.dir inside a dataset's folder (a folder of data files is read whole): the run's metrics.jsonl and
    recipe.yaml would be read as rows by the next launch, and its files mixed into the user's data. Asked of a run
    about to write (and by validate), not of a recipe read back from a run folder: runs already there stay readable."""
    out = Path(recipe.output.dir).expanduser().resolve()
    for key, specs in (("data.datasets", recipe.data.datasets), ("data.eval_datasets", recipe.data.eval_datasets)):
        for index, spec in enumerate(specs):
            folder = Path(spec.path).expanduser()
            if folder.is_dir() and out.is_relative_to(folder.resolve()):
                return (f"output.dir {recipe.output.dir} is inside {key}[{index}]'s folder {spec.path}, which is read "
                        "whole as data: the run's own files (metrics.jsonl, recipe.yaml) would be read as rows by the "
                        "next launch. Nothing was changed. Fix: choose an output.dir outside the data folder.")
    return None


def check_one_of_each(train) -> None:  # a finetune.recipe.TrainSection
    """A run's length is max_steps or num_epochs, its warmup warmup_steps or warmup_ratio: never both of a pair."""
    if train.num_epochs is not None and "max_steps" in train.model_fields_set:
        raise ValueError(
            f"max_steps ({train.max_steps}) and num_epochs ({train.num_epochs:g}) are both set; a run's length is "
            "given by one of them. Fix: remove train.max_steps or train.num_epochs from the recipe; on the command "
            "line `train.max_steps=null` (or `train.num_epochs=null`) unsets the recipe's.")
    if train.warmup_ratio is not None and train.warmup_steps > 0:
        raise ValueError(
            f"warmup_steps ({train.warmup_steps}) and warmup_ratio ({train.warmup_ratio:g}) are both set; the warmup "
            "is given by one of them. Fix: remove one from the recipe; on the command line `train.warmup_steps=0` (or "
            "`=null`) keeps the ratio, `train.warmup_ratio=null` keeps the steps.")


def clamped_warmup(train) -> str | None:  # a finetune.recipe.TrainSection
    """train.warmup_ratio becomes warmup_steps once max_steps is known (HF's rounding up; the ratio is set to null, so
    the resolved recipe says the steps). Then a short run of a long recipe (`train.max_steps=3` on a recipe with 30
    warmup steps, a smoke run) is a normal request: warm up over the run instead of refusing it, and say so (the
    note returned)."""
    ratio = train.warmup_ratio
    if ratio is not None:
        steps, train.warmup_ratio = math.ceil(round(ratio * train.max_steps, 6)), None
        train.warmup_steps = steps  # after the ratio is unset: each assignment is validated (one of the two)
        train._warmup_ratio = ratio
    if train.warmup_steps >= train.max_steps and train.warmup_steps > 0:
        asked, clamped = train.warmup_steps, train.max_steps - 1
        train.warmup_steps = clamped
        # the key the recipe set (bug bash bb58 #6: a ratio's clamp was said as a warmup_steps the recipe never set)
        key = (f"train.warmup_ratio {ratio:g} (= {asked} warmup steps, rounded up)" if ratio is not None
               else f"train.warmup_steps ({asked})")
        return (f"{key} is not below train.max_steps ({train.max_steps}): warming up over "
                f"{clamped} step{'s' if clamped != 1 else ''} instead.")
    return None


def steps_for_epochs(num_epochs: float, steps_per_epoch: int) -> int:
    """train.max_steps for train.num_epochs: ceil(num_epochs x steps_per_epoch), so a fraction of an epoch is a step,
    and at least 1 (a whole epoch holds one: checked_steps_per_epoch)."""
    # round(): 0.1 x 30 is 3.0000000000000004 in floats, which is 3 steps, not 4. max(1): below 5e-7 of a step the
    # rounding gave 0 steps, which train.max_steps (> 0) refused with a pydantic traceback at the run's start while
    # `finetune validate` passed (bug bash bb58 #3).
    return max(1, math.ceil(round(num_epochs * steps_per_epoch, 6)))


def steps_per_rows(recipe) -> int:  # a finetune.recipe.Recipe
    """The optimizer steps that train on each step's rows: GRPO's grpo.num_iterations (a cycle samples once and trains
    that many steps on the completions; TRL's RepeatSampler repeats each prompt batch as often, so an epoch has that
    many times the steps); 1 for every other objective. Steps per epoch are data.steps_per_epoch(..., iterations=this),
    in the run, `finetune data` and `finetune validate` alike."""
    return recipe.grpo.num_iterations if recipe.train.objective == "grpo" else 1
