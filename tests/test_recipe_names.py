"""The names users bring from HF's TrainingArguments, TRL's configs, PEFT's LoraConfig and axolotl map to the recipe
key they mean (finetune/recipe/names.py), checked against the installed libraries: a field they add, or a recipe key
that moves, fails here. A spelling guess only for a typo: it never points to a key of another meaning."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe, recipe_to_yaml, validate_recipe
from finetune.recipe.names import MANAGED, MANAGED_PREFIXES, MEANS, NO_COUNTERPART
from finetune.recipe.text import schema_at, section_keys

BASE = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]}}


def installed_fields() -> dict[str, set[str]]:
    from peft import LoraConfig
    from transformers import TrainingArguments

    fields = {"TrainingArguments": {f.name for f in dataclasses.fields(TrainingArguments)},
              "LoraConfig": {f.name for f in dataclasses.fields(LoraConfig)}}
    trl = pytest.importorskip("trl")
    for name in ("SFTConfig", "DPOConfig", "KTOConfig", "GRPOConfig"):
        fields[name] = {f.name for f in dataclasses.fields(getattr(trl, name))}
    return fields


def test_every_installed_field_is_known():
    """Each field is a recipe key of some section, a name mapped to one, one with a reason for having none, or a
    setting finetune makes itself: a new field of a new release fails here until it is placed."""
    ours = {key for keys in section_keys(Recipe).values() for key in keys}
    unplaced = {cls: sorted(name for name in names if name not in ours and name not in MEANS and name not in
                            NO_COUNTERPART and name not in MANAGED and not name.startswith(MANAGED_PREFIXES))
                for cls, names in installed_fields().items()}
    assert not any(unplaced.values()), unplaced


def test_every_mapped_key_is_a_recipe_key():
    for name, target in MEANS.items():
        key = re.split(r"[;: ]", target, maxsplit=1)[0].replace("[]", "")
        path = tuple(key.split("."))
        parent = schema_at(Recipe, path[:-1])
        assert parent is not None and path[-1] in parent.model_fields, f"{name} -> {target}: no key `{key}`"
        assert name not in NO_COUNTERPART and name not in MANAGED, name


def test_the_trl_fields_the_preference_docs_name_are_trls():
    """docs/preference.md's TRL column names fields of the installed TRL's configs, and names.py maps no TRL name TRL
    lacks: `dpo.max_prompt_length` was said to be DPOConfig.max_prompt_length, which TRL 1.16 does not have (its DPO
    keeps the start of prompt + response), so a ported config was told the keys correspond."""
    import trl
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    classes = {"DPOConfig": trl.DPOConfig, "KTOConfig": trl.KTOConfig, "CPOConfig": CPOConfig,
               "ORPOConfig": ORPOConfig, "GRPOConfig": trl.GRPOConfig, "SFTConfig": trl.SFTConfig}
    text = (Path(__file__).resolve().parent.parent / "docs" / "preference.md").read_text()
    named = set(re.findall(r"\b([A-Z][A-Za-z]*Config)\.([a-z_]+)", text))
    assert named and not [f"{cls}.{name}" for cls, name in sorted(named)
                          if name not in {f.name for f in dataclasses.fields(classes[cls])}]
    assert not any("max_prompt_length" in fields for fields in installed_fields().values())
    assert "max_prompt_length" not in MEANS


HF_RECIPE = {"per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum",
             "num_train_epochs": "train.num_epochs", "lr_scheduler_type": "train.lr_schedule",
             "logging_steps": "train.log_every", "save_steps": "train.save_every", "eval_steps": "train.eval_every",
             "save_total_limit": "train.keep_last", "resume_from_checkpoint": "train.resume",
             "optim": "train.optimizer", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "bf16": "model.dtype",
             "max_seq_length": "data.max_length", "output_dir": "output.dir"}


def test_a_recipe_written_with_hf_names_gets_the_key_each_one_means():
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "train": {name: 1 for name in HF_RECIPE}})
    lines = str(caught.value).splitlines()
    assert lines[0].endswith(f"{len(HF_RECIPE)} problems in the recipe:")
    for name, key in HF_RECIPE.items():
        (line,) = [line for line in lines if line.startswith(f"  train.{name}:")]
        assert f"`{name}` is `{key}" in line, line


@pytest.mark.parametrize("name,wrong", [("gradient_accumulation_steps", "gradient_checkpointing"),
                                        ("resume_from_checkpoint", "gradient_checkpointing"),
                                        ("save_steps", "max_steps"), ("logging_steps", "max_steps"),
                                        ("lora_r", "log_every"), ("warmup_ratio", "warmup_steps")])
def test_the_suggestion_never_points_to_a_key_of_another_meaning(name, wrong):
    """The five that pointed the wrong way (issue 52), and warmup_ratio, which is built now."""
    try:
        validate_recipe({**BASE, "train": {name: 0.1}})
        assert name == "warmup_ratio"
    except RecipeError as exc:
        assert f"`{wrong}`" not in str(exc), str(exc)


def test_typos_still_get_the_nearest_key_and_misplaced_keys_their_section():
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "train": {"learning_rat": 1e-4, "max_length": 512}, "lora": {"learning_rate": 1e-4}})
    text = str(caught.value)
    assert "train.learning_rat: unknown key. Did you mean `learning_rate`?" in text
    assert "train.max_length: unknown key. `max_length` is `data.max_length` here: move it to that section." in text
    assert "lora.learning_rate: unknown key. `learning_rate` is `train.learning_rate` here" in text


def test_names_without_a_counterpart_say_why():
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "train": {"neftune_noise_alpha": 5, "assistant_only_loss": True,
                                           "dataloader_num_workers": 4}})
    text = str(caught.value)
    assert "`neftune_noise_alpha` has no counterpart here: NEFTune embedding noise is not built." in text
    assert "`assistant_only_loss` has no counterpart here: chat rows always train the assistant turns only" in text
    assert "`dataloader_num_workers` is a setting of HF's Trainer" in text


def test_peft_ways_to_train_embeddings_point_to_lora_on_them():
    """Found by a bug bash: lora.modules_to_save / trainable_token_indices were called HF Trainer or TRL settings
    that "have no use here"; they are PEFT LoraConfig's, and LoRA on the embeddings (target_modules) is the way here."""
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "lora": {"modules_to_save": ["embed_tokens"], "trainable_token_indices": [5]}})
    text = str(caught.value)
    assert "HF's Trainer" not in text and text.count("PEFT LoraConfig's") == 2
    assert "lora.target_modules (`[..., embed_tokens, lm_head]`" in text and "lora.target_modules `[..., embed_tokens]`" in text


# ------------------------------------------------------------------------------------------------- warmup_ratio
def test_warmup_ratio_is_hfs_share_of_the_run_rounded_up(tmp_path):
    recipe = validate_recipe({**BASE, "train": {"max_steps": 95, "warmup_ratio": 0.1}})
    assert (recipe.train.warmup_steps, recipe.train.warmup_ratio) == (10, None)  # ceil(9.5), as HF rounds
    (tmp_path / "resolved.yaml").write_text(recipe_to_yaml(recipe))
    assert load_recipe(tmp_path / "resolved.yaml").train.warmup_steps == 10  # the resolved recipe reloads alike
    epochs = validate_recipe({**BASE, "train": {"num_epochs": 2, "warmup_ratio": 0.05}})
    assert epochs.train.warmup_ratio == 0.05  # the run's length is not known yet
    epochs.resolve_num_epochs(50, launch="1 process")
    assert (epochs.train.max_steps, epochs.train.warmup_steps, epochs.train.warmup_ratio) == (100, 5, None)
    with pytest.raises(RecipeError, match="warmup_steps .3. and warmup_ratio .0.1. are both set"):
        validate_recipe({**BASE, "train": {"warmup_steps": 3, "warmup_ratio": 0.1}})
    with pytest.raises(RecipeError, match="train.warmup_ratio"):
        validate_recipe({**BASE, "train": {"warmup_ratio": 1.5}})


# ------------------------------------------------------------------------------------------------- bug bash bb9
@pytest.mark.parametrize("section,key", [("dpo", "dpo.loss"), ("kto", "kto.loss")])
def test_trls_loss_type_points_to_the_sections_loss(section, key):
    """Found by a bug bash: `dpo.loss_type` / `kto.loss_type` / `reward.loss_type` were told to move to
    `grpo.loss_type`, a GRPO setting a DPO run never reads (the recipe then refused for setting the grpo section)."""
    with pytest.raises(RecipeError) as caught:
        load_recipe_overrides([f"{section}.loss_type=ipo"])
    assert f"`loss_type` is `{key}` here." in str(caught.value) and "grpo" not in str(caught.value)
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "reward": {"loss_type": "sigmoid"}})
    assert "`reward.loss_type` has no counterpart here: a reward model trains with TRL RewardTrainer's" in str(caught.value)
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "dpo": {"temperature": 0.5}})
    assert "`temperature` is `grpo.temperature` here, a setting of train.objective grpo; the dpo: section has no " \
           "such key." in str(caught.value)


@pytest.mark.parametrize("loss,objective", [("orpo", "dpo"), ("simpo", "dpo"), ("ipo", "dpo"), ("apo_zero_unpaired", "kto")])
def test_a_loss_named_as_the_objective_gets_the_objective_and_its_loss(loss, objective):
    """Found by a bug bash: `train.objective=orpo` got only pydantic's list of objectives, not that ORPO is
    `dpo.loss: orpo` here."""
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, "train": {"objective": loss}})
    assert f"Fix: train.objective: {objective} and {objective}.loss: {loss}" in str(caught.value)


@pytest.mark.parametrize("name,section", [("training", "train"), ("dataset", "data"), ("peft", "lora"),
                                          ("LORA", "lora"), ("TRAIN", "train"), ("evaluation", "eval")])
def test_a_mistyped_section_gets_the_section(name, section):
    """Found by a bug bash: top-level typos got no suggestion (`training.`, `dataset.`, `peft.`, `LORA.`: difflib's
    cutoff 0.8, case-sensitive), only the list of sections."""
    with pytest.raises(RecipeError) as caught:
        validate_recipe({**BASE, name: {}})
    text = str(caught.value)
    assert f"`{name}` is the `{section}:` section here." in text or f"Did you mean `{section}`?" in text, text
    with pytest.raises(RecipeError, match=f"`{name}` is not a recipe key.*`{section}"):
        load_recipe_overrides([f"{name}.x=1"])


def load_recipe_overrides(overrides: list[str]):
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.yaml"
        path.write_text(yaml.safe_dump(BASE))
        return load_recipe(path, overrides)
