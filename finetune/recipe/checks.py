"""Recipe checks that span sections: the training dtypes, what a training objective needs of the data, what
streaming cannot do, what train.keep_best needs.

A leaf: recipe.py calls these from its cross-field validator with the recipe being validated; each raises ValueError
with the keys and the fix, which the schema turns into one paragraph naming the file.
"""

from __future__ import annotations

import math

# The data format each objective trains on, and what to say when the other kind of preference data is given.
OBJECTIVE_FORMATS = {"dpo": ("preference",), "kto": ("unpaired_preference",), "grpo": ("prompt",),
                     "reward": ("preference",)}
FORMAT_HINTS = {
    "dpo": "give rows with prompt/chosen/rejected and set its format: preference",
    "kto": "give rows with prompt/completion/label (label true: desirable, false: undesirable) and set its format: "
           "unpaired_preference (a pair file unpairs into one desirable and one undesirable row per pair)",
    "grpo": "give rows with a `prompt` (text or chat messages) and the columns your reward functions read, and set its "
            "format: prompt",
    "reward": "give rows with prompt/chosen/rejected and set its format: preference",
}
# dpo: keys that also configure train.objective: kto (the reference and dropout are shared).
SHARED_DPO_KEYS = ("reference", "disable_dropout")


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


def check_objective(recipe) -> None:  # a finetune.recipe.Recipe (not imported: recipe.py imports this)
    """Preference data goes with its objective and only with it (pairs: dpo, unpaired: kto); preference rows are not
    packed; the prompt leaves room; the sections set are the objective's."""
    data, dpo, objective = recipe.data, recipe.dpo, recipe.train.objective
    preference_formats = {f for formats in OBJECTIVE_FORMATS.values() for f in formats}
    for key, specs in (("data.datasets", data.datasets), ("data.eval_datasets", data.eval_datasets)):
        for index, spec in enumerate(specs):
            if objective in OBJECTIVE_FORMATS and spec.format not in OBJECTIVE_FORMATS[objective]:
                raise ValueError(
                    f"{key}[{index}] ({spec.path}) has format `{spec.format}`, but train.objective is {objective}, which "
                    f"trains on {OBJECTIVE_FORMATS[objective][0]} rows. Fix: {FORMAT_HINTS[objective]}, or set "
                    f"train.objective: {_objective_of(spec.format)} to train on this data.")
            if objective == "sft" and spec.format in preference_formats:
                raise ValueError(
                    f"{key}[{index}] ({spec.path}) has format `{spec.format}` "
                    f"({'prompt' if spec.format == 'prompt' else 'preference'} data), but train.objective is sft. Fix: "
                    f"set train.objective: {_objective_of(spec.format)} (and its section) to learn from it, or give "
                    "SFT data in another format.")
    if objective == "grpo":
        from finetune.recipe.grpo import check_grpo  # a leaf module beside this one

        check_grpo(recipe)
        _check_sections(recipe)
        return
    if objective == "reward":
        from finetune.recipe.reward import check_reward  # a leaf module beside this one

        check_reward(recipe)
    if objective in OBJECTIVE_FORMATS and data.packing:
        raise ValueError(f"data.packing: preference rows are not packed (responses are scored as whole sequences). "
                         f"Fix: remove data.packing for train.objective: {objective}.")
    if dpo.max_prompt_length is not None and dpo.max_prompt_length >= data.max_length:
        raise ValueError(f"dpo.max_prompt_length ({dpo.max_prompt_length}) leaves no room for a response within "
                         f"data.max_length ({data.max_length}). Fix: lower it, or raise data.max_length.")
    _check_sections(recipe)


def _objective_of(data_format: str) -> str:
    """The objective that trains on `data_format` (pairs: dpo, also reward's)."""
    return next((name for name, formats in OBJECTIVE_FORMATS.items() if data_format in formats), "sft")


def _changed(section) -> list[str]:
    """The keys of a section whose values differ from their defaults (a resolved recipe.yaml lists every key, so what
    was set cannot be told from what was written)."""
    default = type(section)()
    return sorted(name for name in type(section).model_fields if getattr(section, name) != getattr(default, name))


def _check_sections(recipe) -> None:
    """A dpo: key that KTO does not read, or a kto: section without train.objective: kto, is a mistake to name."""
    objective = recipe.train.objective
    if objective != "reward" and _changed(recipe.reward):
        raise ValueError(f"reward.{', reward.'.join(_changed(recipe.reward))}: set, but train.objective is {objective}, "
                         "which does not read the reward: section. Fix: set train.objective: reward, or remove it.")
    if objective == "reward":
        unread = _changed(recipe.dpo) + [f"kto.{k}" for k in _changed(recipe.kto)] + \
            [f"grpo.{k}" for k in _changed(recipe.grpo)]
        if unread:
            raise ValueError(f"{', '.join(k if '.' in k else f'dpo.{k}' for k in unread)}: train.objective reward reads "
                             "none of the dpo:, kto: or grpo: sections (its loss is TRL's RewardTrainer's, with no "
                             "reference). Fix: remove these keys.")
        return
    if objective != "grpo" and _changed(recipe.grpo):
        raise ValueError(f"grpo.{', grpo.'.join(_changed(recipe.grpo))}: set, but train.objective is {objective}, which "
                         "does not read the grpo: section. Fix: set train.objective: grpo, or remove the grpo: section.")
    if objective == "grpo" and _changed(recipe.kto):
        raise ValueError(f"kto.{', kto.'.join(_changed(recipe.kto))}: set, but train.objective is grpo, which does not "
                         "read the kto: section. Fix: remove the kto: section.")
    if objective == "grpo":
        unread = [name for name in _changed(recipe.dpo) if name != "reference"]
        if unread:
            raise ValueError(f"dpo.{', dpo.'.join(unread)}: train.objective grpo does not read the dpo: section (its "
                             "loss is set in grpo:). Fix: remove these keys.")
        return
    if objective != "kto" and _changed(recipe.kto):
        raise ValueError(f"kto.{', kto.'.join(_changed(recipe.kto))}: set, but train.objective is {objective}, which does "
                         "not read the kto: section. Fix: set train.objective: kto, or remove the kto: section.")
    if objective == "kto":
        unread = [name for name in _changed(recipe.dpo) if name not in SHARED_DPO_KEYS]
        if unread:
            raise ValueError(f"dpo.{', dpo.'.join(unread)}: train.objective kto reads only dpo.reference and "
                             "dpo.disable_dropout from the dpo: section. Fix: set KTO's loss and beta in the kto: section "
                             "(kto.loss, kto.beta, kto.desirable_weight, kto.undesirable_weight), and remove the rest.")
        if recipe.dpo.reference == "precomputed":
            raise ValueError("dpo.reference: precomputed is not supported with train.objective: kto: KTO's KL term "
                             "scores each prompt with another row's completion, which changes with the shuffle. Fix: "
                             "dpo.reference: adapter_off (the default).")


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
            "is given by one of them. Fix: remove one (on the command line `train.warmup_ratio=null`).")


def clamped_warmup(train) -> str | None:  # a finetune.recipe.TrainSection
    """train.warmup_ratio becomes warmup_steps once max_steps is known (HF's rounding up; the ratio is set to null, so
    the resolved recipe says the steps). Then a short run of a long recipe (`train.max_steps=3` on a recipe with 30
    warmup steps, a smoke run) is a normal request: warm up over the run instead of refusing it, and say so (the
    note returned)."""
    if train.warmup_ratio is not None:
        steps, train.warmup_ratio = math.ceil(round(train.warmup_ratio * train.max_steps, 6)), None
        train.warmup_steps = steps  # after the ratio is unset: each assignment is validated (one of the two)
    if train.warmup_steps >= train.max_steps and train.warmup_steps > 0:
        asked, clamped = train.warmup_steps, train.max_steps - 1
        train.warmup_steps = clamped
        return (f"train.warmup_steps ({asked}) is not below train.max_steps ({train.max_steps}): warming up over "
                f"{clamped} step{'s' if clamped != 1 else ''} instead.")
    return None


def steps_for_epochs(num_epochs: float, steps_per_epoch: int) -> int:
    """train.max_steps for train.num_epochs: ceil(num_epochs x steps_per_epoch), so a fraction of an epoch is a step."""
    # round(): 0.1 x 30 is 3.0000000000000004 in floats, which is 3 steps, not 4.
    return math.ceil(round(num_epochs * steps_per_epoch, 6))
