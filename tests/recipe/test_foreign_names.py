"""Keys of the tools people port from (axolotl, LLaMA-Factory, TRL / HF TrainingArguments, Unsloth) get the key they
mean, or why finetune has none, from `finetune validate` (finetune/recipe/names.py, foreign_names.py), and
docs/migrating.md's tables are exactly those answers: every row is checked here against the CLI, in this process."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
from conftest import write_recipe

from finetune.cli.command import main
from finetune.recipe import Recipe, foreign_names, validate_recipe
from finetune.recipe.names import MANAGED_REASON
from finetune.recipe.objectives import OBJECTIVES
from finetune.recipe.text import section_keys
from finetune.training.loop import lr_lambda

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
BASE = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]}}
ENTRY = "data.datasets.0."


def validate(tmp_path: Path, capsys, recipe: dict, *overrides: str) -> str:
    """`finetune validate` of `recipe` (with overrides), which must refuse it: its stderr."""
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    assert main(["validate", str(path), *overrides]) == 2
    return capsys.readouterr().err


def answer_line(err: str, key: str) -> str:
    """The answer to `key` (a dotted path as the error names it) in a recipe's list of problems."""
    (line,) = [line for line in err.splitlines() if line.startswith(f"  {key}: unknown key. ")]
    return line.removeprefix(f"  {key}: unknown key. ")


def table_cell(answer: str) -> str:
    """An answer as docs/migrating.md's tables write it: what follows "`name` is", or "no counterpart: why"."""
    found = re.fullmatch(r"`[^`]*` (.*)\.", answer, re.DOTALL)
    assert found, answer
    rest = found.group(1)
    if MANAGED_REASON in rest:
        return "set by finetune itself, or of no use here: leave it out"
    if rest.startswith("has no counterpart here: "):
        return "no counterpart: " + rest.removeprefix("has no counterpart here: ")
    rest = rest.removeprefix("is ")
    moved = " here: move it to that section"
    return rest.replace(moved, "", 1) if moved in rest else rest.replace(" here", "", 1)


def doc_tables() -> dict[str, list[tuple[str, str]]]:
    """docs/migrating.md's tables: {first header cell: [(key cell, finetune cell), ...]}."""
    tables: dict[str, list[tuple[str, str]]] = {}
    header = None
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells[0]
            tables[header] = []
        elif not set(cells[0]) <= set("- "):
            assert len(cells) == 2 and cells[0].startswith("`") and cells[0].endswith("`"), line
            tables[header].append((cells[0][1:-1], cells[1]))
    return tables


TABLES = doc_tables() if DOC.is_file() else {}


@pytest.mark.parametrize("table", sorted(TABLES) or ["(docs/migrating.md is missing)"],
                         ids=lambda header: re.sub(r"\W+", "-", header).strip("-"))
def test_each_row_of_the_migration_guide_is_what_validate_answers(table, tmp_path, capsys):
    """Found by a bug bash: docs had no migration table for any tool, and README's "a name from ... axolotl gets the
    key it means" was false for everyday keys. Each row (`key` or `key: value`, a dataset entry's in the entry
    tables) is given to `finetune validate` as an override; the row says exactly what it answers."""
    assert TABLES, "docs/migrating.md is missing"
    path = write_recipe(tmp_path / "recipe.yaml", BASE)
    wrong = []
    for key, cell in TABLES[table]:
        name, given, value = key.partition(": ")
        override = (ENTRY if "entry" in table else "") + name + (f"={value}" if given else ".x=1")  # .x: no value
        assert main(["validate", str(path), override]) == 2, override
        said = re.search(r"is not a recipe key\. (.*) \(keys under [^)]*\)$", capsys.readouterr().err.strip())
        if said is None or table_cell(said.group(1)) != cell:
            wrong.append(f"{key}:\n  doc: {cell}\n  validate: {said.group(1) if said else None}")
    assert not wrong, "\n".join(wrong)


def test_every_name_of_the_tools_tables_has_its_row():
    """The answers and the guide come from one table: a name added to foreign_names.py without its row (or a row
    of a name the code does not know) fails here."""
    rows = {table: {key.partition(": ")[0] for key, _ in rows} for table, rows in TABLES.items()}
    tool = {"axolotl": set(foreign_names.AXOLOTL_MEANS) | set(foreign_names.AXOLOTL_NO_COUNTERPART),
            "LLaMA-Factory": set(foreign_names.LLAMA_FACTORY_MEANS) | set(foreign_names.LLAMA_FACTORY_NO_COUNTERPART),
            "Unsloth": set(foreign_names.UNSLOTH_MEANS) | set(foreign_names.UNSLOTH_NO_COUNTERPART)}
    missing = {name: names - set().union(*(keys for table, keys in rows.items() if table.startswith(name)
                                           and "entry" not in table)) for name, names in tool.items()}
    entries = set(foreign_names.ENTRY_COLUMNS) | set(foreign_names.ENTRY_MEANS) | set(foreign_names.ENTRY_NO_COUNTERPART)
    missing["entries"] = entries - set().union(*(keys for table, keys in rows.items() if "entry" in table))
    missing["by value"] = set(foreign_names.VALUE_ANSWERS) - set().union(*rows.values())
    assert not any(missing.values()), missing


def test_no_answer_of_the_tools_tables_is_hidden_by_a_key_of_the_same_name():
    """A tool's name that is also a recipe key somewhere was answered "`strict` is `parallel.strict` here: move it"
    before its own entry was read: such a name is a false friend (its own answer first) or answered by its value."""
    keys = {key for keys in section_keys(Recipe).values() for key in keys}
    tables = [foreign_names.AXOLOTL_MEANS, foreign_names.AXOLOTL_NO_COUNTERPART, foreign_names.LLAMA_FACTORY_MEANS,
              foreign_names.LLAMA_FACTORY_NO_COUNTERPART, foreign_names.UNSLOTH_MEANS,
              foreign_names.UNSLOTH_NO_COUNTERPART]
    hidden = {name for table in tables for name in table if name in keys} - foreign_names.FALSE_FRIENDS
    assert not hidden, hidden
    names = [name for table in tables for name in table]
    assert len(names) == len(set(names)), "a name in two tables"


def test_the_speaker_table_the_answers_name_is_the_readers():
    from finetune.data.conversations import ROLE_ALIASES

    said = {role: set(speakers.split(", ")) for role, _, speakers in
            (part.partition(": ") for part in foreign_names.ROLE_NAMES.split("; "))}
    read = {role: {speaker for speaker, meant in ROLE_ALIASES.items() if meant == role} for role in said}
    assert said == read and set(ROLE_ALIASES) == set().union(*said.values())


# ------------------------------------------------------------------------------------------------- bug bash bb51 #3
def test_trls_loss_type_is_the_loss_key_that_takes_its_value(tmp_path, capsys):
    """Found by a bug bash: a DPO recipe's `loss_type: sigmoid` (TRL's DPOConfig) was told "`loss_type` is
    `grpo.loss_type` here: move it", and the moved key was refused (sigmoid is no GRPO loss)."""
    answers = {}
    for value in ("sigmoid", "dapo", "apo_zero_unpaired", "robust"):
        err = validate(tmp_path, capsys, {**BASE, "train": {"objective": "dpo"}, "loss_type": value})
        answers[value] = answer_line(err, "loss_type")
    assert answers["sigmoid"] == "`loss_type: sigmoid` is `dpo.loss: sigmoid` here (train.objective: dpo)."
    assert answers["dapo"] == "`loss_type: dapo` is `grpo.loss_type: dapo` here (train.objective: grpo)."
    assert answers["apo_zero_unpaired"].startswith("`loss_type: apo_zero_unpaired` is `kto.loss: apo_zero_unpaired`")
    # none takes it: every objective's loss key, each with what it takes (read from the schema)
    for section, key in (("dpo", "loss"), ("kto", "loss"), ("grpo", "loss_type")):
        values = typing.get_args(Recipe.model_fields[section].annotation.model_fields[key].annotation)
        assert f"`{section}.{key}` for train.objective {section} ({', '.join(values[:-1])} or {values[-1]})" in \
            answers["robust"], answers["robust"]
    assert answers["robust"].endswith("`robust` is none of them.")
    # in a section of its own, `loss_type` is that section's loss, and a value of another objective says so
    err = validate(tmp_path, capsys, {**BASE, "kto": {"loss_type": "ipo"}})
    assert answer_line(err, "kto.loss_type") == ("`loss_type` is `kto.loss` here. It takes kto or apo_zero_unpaired, "
                                                 "not `ipo`: `loss_type: ipo` is `dpo.loss: ipo` here "
                                                 "(train.objective: dpo).")


# ------------------------------------------------------------------------------------------------- bug bash bb51 #4
def test_axolotls_strict_is_not_parallel_strict(tmp_path, capsys):
    """Found by a bug bash: axolotl's `strict: false` (in almost every axolotl config) was told "`strict` is
    `parallel.strict` here: move it", a setting of another meaning (refuse a strategy that will not fit)."""
    err = validate(tmp_path, capsys, {**BASE, "strict": False, "train": {"strict": True}})
    for key in ("strict", "train.strict"):
        line = answer_line(err, key)
        assert line.startswith("`strict` has no counterpart here: a recipe is always checked whole") and \
            "move it" not in line, line


def test_a_value_the_same_named_key_cannot_take_is_named(tmp_path, capsys):
    """A key of another section is named with what it takes when the value given is not that (axolotl's
    `gradient_checkpointing: offload`), and `adapter: qlora` (axolotl's kind of adapter) is not model.adapter."""
    err = validate(tmp_path, capsys, {**BASE, "gradient_checkpointing": "offload", "adapter": "qlora",
                                      "beta": 0.1, "disable_dropout": True})
    assert answer_line(err, "gradient_checkpointing") == ("`gradient_checkpointing` is `train.gradient_checkpointing` "
                                                          "here: move it to that section (it takes true or false, not "
                                                          "`offload`).")
    assert answer_line(err, "adapter").startswith("`adapter: qlora` has no counterpart here: every run trains a LoRA")
    assert answer_line(err, "beta") == ("`beta` is `dpo.beta` (train.objective dpo) or `kto.beta` (train.objective kto) "
                                        "or `grpo.beta` (train.objective grpo) here: move it to that section.")
    assert "`dpo.disable_dropout` (train.objective dpo or kto)" in answer_line(err, "disable_dropout")


# ------------------------------------------------------------------------------------------------- bug bash bb51 #5
AXOLOTL_ENTRY = {"path": "d.jsonl", "type": "chat_template", "field_messages": "conversations",
                 "message_property_mappings": {"role": "from", "content": "value"}, "roles": {"user": ["human"]},
                 "roles_to_train": ["assistant"], "train_on_eos": "turn", "ds_type": "json", "data_files": "d.jsonl"}


def test_axolotls_dataset_entry_keys_are_answered_in_the_entry(tmp_path, capsys):
    """Found by a bug bash: an axolotl `datasets:` entry's keys (`type`, `field_messages`,
    `message_property_mappings`, `roles_to_train`, ...) got only "Valid keys here: path, format, ...": dataset
    entries' keys were never looked up."""
    err = validate(tmp_path, capsys, {**BASE, "data": {"datasets": [AXOLOTL_ENTRY], "eval_datasets": [
        {"path": "e.jsonl", "data_files": "e.jsonl", "type": "completion"}]}})
    assert "Valid keys here" not in err, err
    said = {key: answer_line(err, f"data.datasets.0.{key}") for key in AXOLOTL_ENTRY if key != "path"}
    assert said["type"].startswith("`type: chat_template` is `format: chat` here")
    assert said["field_messages"] == "`field_messages: conversations` is `columns: {messages: conversations}` here."
    assert said["message_property_mappings"].startswith("`message_property_mappings` is `columns: {role: from, "
                                                        "content: value}` here")
    assert said["data_files"].startswith("`data_files` is `data.datasets[].path` here")
    for key in ("roles", "roles_to_train", "train_on_eos", "ds_type"):
        assert said[key].startswith(f"`{key}` has no counterpart here: "), said[key]
    assert answer_line(err, "data.eval_datasets.0.data_files").startswith("`data_files` is `data.eval_datasets[].path`")
    assert answer_line(err, "data.eval_datasets.0.type").startswith("`type: completion` is `format: text` here")


AXOLOTL_TOP = ("lora_model_dir", "dataset_processes", "chat_template_jinja", "max_prompt_len", "rl_beta", "dpo_beta",
               "pad_to_sequence_len", "lora_fan_in_fan_out", "group_by_length", "early_stopping_patience",
               "eot_tokens", "shuffle_merged_datasets", "xformers_attention", "peft_use_rslora")


def test_axolotls_top_level_keys_and_rl(tmp_path, capsys):
    """Found by a bug bash: these axolotl keys got only "Valid keys here", and `rl: orpo` was answered "(sft, dpo,
    kto or grpo)": no `reward`, and not that ORPO is `dpo.loss: orpo` here."""
    err = validate(tmp_path, capsys, {**BASE, **dict.fromkeys(AXOLOTL_TOP, 1), "rl": "orpo"})
    assert "Valid keys here" not in err and "Did you mean" not in err, err
    assert answer_line(err, "lora_model_dir") == "`lora_model_dir` is `model.adapter` here (the adapter folder to start from)."
    assert answer_line(err, "peft_use_rslora") == "`peft_use_rslora` is `lora.rslora` here."
    assert answer_line(err, "rl") == "`rl: orpo` is `train.objective: dpo` with `dpo.loss: orpo` here."
    err = validate(tmp_path, capsys, {**BASE, "rl": 1})  # no value to go by: the objectives, from the registry
    assert answer_line(err, "rl") == f"`rl` is `train.objective` here ({', '.join(list(OBJECTIVES)[:-1])} or " \
                                     f"{list(OBJECTIVES)[-1]})."
    assert "reward" in OBJECTIVES


# ------------------------------------------------------------------------------------------------- bug bash bb51 #6
LLAMA_FACTORY = {"model_name_or_path": "x", "stage": "sft", "finetuning_type": "lora", "lora_rank": 8,
                 "lora_target": "all", "quantization_bit": 4, "dataset": "my_chat", "dataset_dir": "data",
                 "template": "qwen3", "cutoff_len": 128, "train_on_prompt": False, "mask_history": False,
                 "pref_beta": 0.1, "pref_loss": "sigmoid", "max_samples": 100, "preprocessing_num_workers": 2,
                 "plot_loss": True, "quantization_method": "bnb"}


def test_llama_factory_keys_get_the_key_they_mean(tmp_path, capsys):
    """Found by a bug bash: LLaMA-Factory's keys got "Valid keys here"; `quantization_bit: 4` was told "Did you mean
    `quantization`?" (a section, which takes no 4), and `dataset: my_chat` (a dataset's name) "is the `data:`
    section here"."""
    err = validate(tmp_path, capsys, {**BASE, **LLAMA_FACTORY})
    assert "Valid keys here" not in err and "Did you mean" not in err, err
    said = {key: answer_line(err, key) for key in LLAMA_FACTORY}
    assert said["quantization_bit"] == ("`quantization_bit: 4` is `quantization.method: nf4` here (the default; fp4 "
                                        "is the other 4-bit type).")
    assert said["dataset"].startswith("`dataset: my_chat` is `data.datasets[].path` here") and "section" not in \
        said["dataset"]
    assert said["lora_target"] == "`lora_target: all` is `lora.target_modules: all-linear` here."
    assert said["pref_loss"] == "`pref_loss: sigmoid` is `dpo.loss: sigmoid` here (train.objective: dpo)."
    assert said["stage"] == "`stage: sft` is `train.objective: sft` here."
    assert said["model_name_or_path"] == "`model_name_or_path` is `model.name_or_path` here."
    err = validate(tmp_path, capsys, {**BASE, "dataset": {"datasets": []}})  # a mapping: the data: section
    assert answer_line(err, "dataset") == "`dataset` is the `data:` section here."


# ------------------------------------------------------------------------------------------------- bug bash bb51 #7
def test_hf_schedule_names_say_finetunes_floor(tmp_path, capsys):
    """Found by a bug bash: `lr_scheduler_type: linear` was answered "`train.lr_schedule` here (cosine, linear or
    constant)", as if equal, but finetune decays to train.min_lr_ratio (0.1 by default) and HF to 0."""
    floor = Recipe.model_fields["train"].annotation.model_fields["min_lr_ratio"].default
    err = validate(tmp_path, capsys, {**BASE, "lr_scheduler_type": "linear", "lr_scheduler": "cosine"})
    for key, value in (("lr_scheduler_type", "linear"), ("lr_scheduler", "cosine")):
        assert answer_line(err, key) == (
            f"`{key}: {value}` is `train.lr_schedule: {value}` here (it decays to train.min_lr_ratio of the peak, "
            f"default {floor}; HF's and axolotl's decay to 0: set train.min_lr_ratio: 0 for theirs).")


# transformers' get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup after the warmup (step s of T,
# w warmup steps): their lr_lambda, which decays to 0
HF_AFTER_WARMUP = {"linear": lambda s, w, t: max(0.0, (t - s) / (t - w)),
                   "cosine": lambda s, w, t: max(0.0, 0.5 * (1 + math.cos(math.pi * (s - w) / (t - w))))}


@pytest.mark.parametrize("schedule", sorted(HF_AFTER_WARMUP))
def test_the_schedule_is_hfs_after_the_warmup_only_with_min_lr_ratio_0(schedule):
    """finetune/training/loop.py's lr_lambda said "after the warmup the two are the same"; with the default
    min_lr_ratio (0.1) they are not, with 0 they are (what the answers above and docs/migrating.md tell)."""
    for ratio, same in ((0.0, True), (None, False)):
        train = {"max_steps": 10, "warmup_steps": 2, "lr_schedule": schedule,
                 **({"min_lr_ratio": ratio} if ratio is not None else {})}
        ours = lr_lambda(validate_recipe({**BASE, "train": train}))
        after = [(ours(step), HF_AFTER_WARMUP[schedule](step, 2, 10)) for step in range(2, 10)]
        assert all(abs(a - b) < 1e-12 for a, b in after) is same, after


def test_foreign_names_answer_through_a_recipe_file_as_through_overrides(tmp_path, capsys):
    """The file path (pydantic's errors) and the override path give one answer: the value comes with the key both
    ways (the guide's rows are checked as overrides)."""
    err = validate(tmp_path, capsys, {**BASE, "loss_type": "dapo", "data": {"datasets": [
        {"path": "d.jsonl", "type": "alpaca"}]}})
    assert answer_line(err, "loss_type") == "`loss_type: dapo` is `grpo.loss_type: dapo` here (train.objective: grpo)."
    assert answer_line(err, "data.datasets.0.type").startswith("`type: alpaca` is `format: alpaca` here")
