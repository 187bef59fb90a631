"""The objectives a recipe may name (train.objective), one entry each: the registry every stage reads.

An entry says where the objective's training code is (`module:Class` of its Objective subclass in
training/objectives, imported when a run starts, so the recipe stays a leaf), where its recipe section is (`module:Class`,
read from the recipe key of the objective's name), the data formats it trains on, what it reads of other objectives'
sections, whether a row is a pair of sequences (the planner's activations), which model head it puts in the LM
head's place and whether it adds a mixture-of-experts model's load-balancing loss. The schema builds
train.objective's choices and the Recipe's sections from it; the checks, the planner, the model and the loop ask it,
never `objective == "..."`.

Adding an objective: its module in training/objectives/, its section module in recipe/ (a pydantic model; a
`check_recipe(recipe)` method, if any, raises ValueError for what it needs of the other sections), and one entry here.
tests/training/test_objective_registry.py adds a toy objective that way and trains it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str  # train.objective's value, and its section's recipe key
    objective: str  # "module:Class" of its training.objectives.Objective subclass
    section: str | None = None  # "module:Class" of its recipe section (None: it has none)
    formats: tuple[str, ...] = ()  # the data formats it trains on (empty: SFT's, any format no objective claims)
    format_hint: str = ""  # how to give rows of its format (the fix when other rows are given)
    reads: tuple[tuple[str, tuple[str, ...]], ...] = ()  # other sections' keys it reads: (("dpo", ("reference",)),)
    reads_hint: str = ""  # the fix when other keys of those sections are set
    pairs: bool = False  # a row is two sequences in one forward (chosen and rejected): the planner's activations
    head: str | None = None  # a head in the LM head's place ("score": model/reward_head.py)
    # Why it adds no mixture-of-experts load-balancing loss (train.router_aux_loss_coef); empty: it adds it to its
    # policy's forward, as TRL's trainers do (training/router_aux.py)
    no_router_aux: str = ""


_PAIRS = "give rows with prompt/chosen/rejected and set its format: preference"

OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (
    ObjectiveSpec("sft", "finetune.training.objectives.sft:Supervised"),
    ObjectiveSpec("dpo", "finetune.training.objectives.preference:Preference", "finetune.recipe.preference:PreferenceSection",
                  ("preference",), _PAIRS, pairs=True),
    # A pair file (format: preference) is unpaired as TRL's KTOTrainer unpairs it (data/ported_rows.py)
    ObjectiveSpec("kto", "finetune.training.objectives.kto:KTO", "finetune.recipe.kto:KTOSection",
                  ("unpaired_preference", "preference"),
                  "give rows with prompt/completion/label (label true: desirable, false: undesirable) and set its format: "
                  "unpaired_preference, or give pairs (prompt/chosen/rejected) with format: preference, which finetune "
                  "unpairs as TRL's KTOTrainer does (each pair: one desirable and one undesirable row)",
                  reads=(("dpo", ("reference", "disable_dropout")),),
                  reads_hint="set KTO's loss and beta in the kto: section (kto.loss, kto.beta, kto.desirable_weight, "
                             "kto.undesirable_weight), and remove the rest."),
    ObjectiveSpec("grpo", "finetune.training.objectives.grpo:GRPO", "finetune.recipe.grpo:GRPOSection", ("prompt",),
                  "give rows with a `prompt` (text or chat messages) and the columns your reward functions read, and set "
                  "its format: prompt", reads=(("dpo", ("reference",)),),
                  reads_hint="its loss is set in grpo:; remove these keys."),
    ObjectiveSpec("reward", "finetune.training.objectives.reward:Reward", "finetune.recipe.reward:RewardSection",
                  ("preference",), _PAIRS, pairs=True, head="score",
                  no_router_aux="a reward model's score head sees no router logits, and TRL's RewardTrainer adds no "
                                "load-balancing loss either"),
)}


def spec_of(name: str) -> ObjectiveSpec:
    return OBJECTIVES[name]


def load(target: str):
    """The object a "module:Name" entry names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def sections() -> dict[str, type]:
    """{recipe key: section class} of the objectives that have one, in the registry's order."""
    return {spec.name: load(spec.section) for spec in OBJECTIVES.values() if spec.section}


def claimed_formats() -> set[str]:
    """The data formats some objective other than SFT trains on."""
    return {f for spec in OBJECTIVES.values() for f in spec.formats}


def objective_of(data_format: str) -> str:
    """The first objective that trains on `data_format` (pairs: dpo, also reward's); SFT for the others."""
    return next((spec.name for spec in OBJECTIVES.values() if data_format in spec.formats), "sft")
