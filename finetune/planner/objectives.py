"""What a preference objective adds to a plan: the starting adapter's copy, and the forwards it runs (a note)."""

from __future__ import annotations


def swaps_reference(recipe) -> bool:
    """The reference pass swaps the starting adapter's values in: a copy of them is kept (planner part dpo_reference_copy)."""
    if recipe.train.objective == "kto":
        return bool(recipe.model.adapter)
    return (recipe.train.objective == "dpo" and bool(recipe.model.adapter) and recipe.dpo.reference == "adapter_off"
            and recipe.dpo.loss in ("sigmoid", "ipo", "hinge"))


def preference_note(recipe) -> str:
    """What a preference objective runs per micro-batch, as a line of the plan."""
    dpo = recipe.dpo
    if recipe.train.objective == "kto":
        start = " (base + model.adapter: its values swapped in)" if recipe.model.adapter else ""
        return (f"kto: 1 sequence per row; no-grad forwards of the mismatched (KL) rows and the reference per "
                f"micro-batch{start}")
    if dpo.loss not in ("sigmoid", "ipo", "hinge"):
        return f"dpo ({dpo.loss}): 2 sequences per pair in one forward, no reference pass"
    if dpo.reference == "precomputed":
        return "dpo: 2 sequences per pair; reference log-probs precomputed before step 1 (16 bytes per pair of CPU RAM)"
    start = " (base + model.adapter: its values swapped in)" if recipe.model.adapter else ""
    return f"dpo: 2 sequences per pair; one no-grad reference forward per micro-batch{start}"
