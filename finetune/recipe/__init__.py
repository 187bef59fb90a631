"""The recipe: a leaf below every stage (anything may import it; it imports only other leaves).

    schema.py  the closed, typed schema (pydantic): the sections, load_recipe / validate_recipe, recipe_to_yaml
    train.py   the train: section (the objective, steps or epochs, batch, optimizer and schedule, cadences, resume)
    data.py    the data: section (datasets, lengths, the held-out split, packing, streaming)
    text.py    reading recipe text: the YAML file (encoding, one document, aliases as copies), errors as one
               paragraph, "did you mean"
    overrides.py  key.path=value from the command line: the key checked, the value taken as written
    paths.py   path values as written: $VARIABLES (not expanded), relative paths beside the recipe but not here
    checks.py  checks spanning sections: what an objective needs of the data, what streaming cannot do, warmup
    objectives.py  the registry of train.objective: each objective's training class, section, data formats
    one module per objective's section, beside its checks: preference.py (dpo:, TRL's DPOConfig names), kto.py
               (kto:), grpo.py (grpo:, TRL's GRPOConfig names, and what a GRPO recipe needs of the other sections),
               reward_imports.py (grpo.reward_functions' modules, imported afresh where the file changed),
               reward.py (reward:, TRL's RewardConfig names)
    names.py   the names of HF's, TRL's, PEFT's and axolotl's settings -> the recipe key each means, or why none
    router_aux.py  train.router_aux_loss_coef against the model's config: the coefficient, or why none applies
"""

from finetune.recipe.checks import steps_for_epochs
from finetune.recipe.data import DataSection, DatasetSpec
from finetune.recipe.grpo import GRPOSection
from finetune.recipe.kto import KTOSection
from finetune.recipe.overrides import parse_override
from finetune.recipe.preference import PreferenceSection
from finetune.recipe.reward import RewardSection
from finetune.recipe.schema import (
    DType,
    EvalSection,
    LoraSection,
    ModelSection,
    OutputSection,
    ParallelSection,
    QuantizationSection,
    Recipe,
    TrainSection,
    announcements_muted,
    announcing,
    load_recipe,
    recipe_to_yaml,
    validate_recipe,
)
from finetune.recipe.text import read_yaml

__all__ = ["DType", "DataSection", "DatasetSpec", "EvalSection", "GRPOSection", "KTOSection", "LoraSection", "ModelSection",
           "OutputSection", "ParallelSection", "PreferenceSection", "QuantizationSection", "Recipe", "RewardSection", "TrainSection",
           "announcements_muted", "announcing", "load_recipe", "parse_override", "read_yaml", "recipe_to_yaml", "steps_for_epochs",
           "validate_recipe"]
