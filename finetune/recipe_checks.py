"""Recipe checks that span sections: what a training objective needs of the data, what streaming cannot do, what
train.keep_best needs.

A leaf: recipe.py calls these from its cross-field validator with the recipe being validated; each raises ValueError
with the keys and the fix, which the schema turns into one paragraph naming the file.
"""

from __future__ import annotations


def check_objective(recipe) -> None:  # a finetune.recipe.Recipe (not imported: recipe.py imports this)
    """Preference data goes with train.objective: dpo and only with it; pairs are not packed; the prompt leaves room."""
    data, dpo = recipe.data, recipe.dpo
    for key, specs in (("data.datasets", data.datasets), ("data.eval_datasets", data.eval_datasets)):
        for index, spec in enumerate(specs):
            if recipe.train.objective == "dpo" and spec.format != "preference":
                raise ValueError(
                    f"{key}[{index}] ({spec.path}) has format `{spec.format}`, but train.objective is dpo, which trains "
                    "on preference pairs. Fix: give rows with prompt/chosen/rejected and set its format: preference, or "
                    "set train.objective: sft to fine-tune on this data.")
            if recipe.train.objective == "sft" and spec.format == "preference":
                raise ValueError(
                    f"{key}[{index}] ({spec.path}) has format `preference` (chosen/rejected pairs), but "
                    "train.objective is sft. Fix: set train.objective: dpo (and the dpo: section) to learn from the pairs, "
                    "or give SFT data in another format.")
    if recipe.train.objective == "dpo" and data.packing:
        raise ValueError("data.packing: pairs are not packed (a chosen and a rejected response are scored as whole "
                         "sequences). Fix: remove data.packing for train.objective: dpo.")
    if dpo.max_prompt_length is not None and dpo.max_prompt_length >= data.max_length:
        raise ValueError(f"dpo.max_prompt_length ({dpo.max_prompt_length}) leaves no room for a response within "
                         f"data.max_length ({data.max_length}). Fix: lower it, or raise data.max_length.")


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
