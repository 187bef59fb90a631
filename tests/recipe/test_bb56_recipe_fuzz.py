"""Bug bash bb56 (fuzzing the recipe): a misspelled finetune key blamed on HF's Trainer, YAML booleans taken as
numbers, a recipe from a pipe "not found", and an empty recipe said in Python's type names. In this process, on the
recipe loader itself (finetune/recipe/)."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
from conftest import write_recipe

from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe, validate_recipe
from finetune.recipe.names import MANAGED, MANAGED_PREFIXES, MEANS, NO_COUNTERPART
from finetune.recipe.text import field_names, leading_comments, read_yaml, schema_at, section_keys, suggest

BASE = {"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]}}
LEAVE_IT_OUT = "finetune makes itself"


def refusal(raw: dict) -> str:
    with pytest.raises(RecipeError) as caught:
        validate_recipe(raw)
    return str(caught.value)


def with_key(section: str, key: str, value) -> dict:
    return {**BASE, section: {**BASE.get(section, {}), key: value}}


# ------------------------------------------------------------------------- F1: typos of our eval_/save_/fsdp_ keys
@pytest.mark.parametrize("section,typo,key", [
    ("data", "eval_max_row", "eval_max_rows"), ("data", "eval_maxx_rows", "eval_max_rows"),
    ("data", "eval_fracton", "eval_fraction"), ("data", "eval_datasetz", "eval_datasets"),
    ("train", "eval_evry", "eval_every"), ("train", "save_evry", "save_every"), ("train", "log_evry", "log_every"),
    ("train", "save_everry", "save_every"), ("train", "wandb_projet", "wandb_project"),
    ("train", "mlflow_experimnt", "mlflow_experiment"), ("train", "mlflow_tracking_ur", "mlflow_tracking_uri"),
    ("parallel", "fsdp_verison", "fsdp_version"), ("parallel", "fsdp_versions", "fsdp_version"),
    ("grpo", "vllm_gpu_memory_utilisation", "vllm_gpu_memory_utilization"),
    ("grpo", "vllm_server_timout", "vllm_server_timeout")])
def test_a_typo_of_our_own_key_is_told_that_key_not_to_leave_it_out(section, typo, key):
    """Found by a bug bash: `data.eval_max_row` (and every typo of a key starting eval_, save_, log_, fsdp_, wandb_,
    mlflow_, vllm_) was "a setting of HF's Trainer or TRL's trainers that finetune makes itself ...; leave it out": a
    user who followed it lost the setting. The near spelling of our key is asked before the name families."""
    said = refusal(with_key(section, typo, 3))
    assert f"{section}.{typo}: unknown key. Did you mean `{key}`?" in said, said
    assert LEAVE_IT_OUT not in said, said


def test_a_typo_of_another_sections_key_is_told_where_that_key_is():
    """`train.eval_fracton`: data.eval_fraction misspelled in the wrong section, was "leave it out" too."""
    said = refusal(with_key("train", "eval_fracton", 0.1))
    assert "Did you mean `data.eval_fraction` (another section's key: move it there)?" in said, said
    assert LEAVE_IT_OUT not in refusal(with_key("parallel", "eval_max_row", 3))


@pytest.mark.parametrize("section", ["train", "parallel"])
def test_hf_and_trl_names_of_those_families_keep_their_answers(section):
    """The real names still get their mapping (or why there is none), never a guess: eval_steps is not eval_every
    misspelled but HF's name of it, and hub_strategy is not parallel.strategy (named now: no counterpart)."""
    answers = {"eval_steps": "is `train.eval_every` here", "save_steps": "is `train.save_every` here",
               "logging_steps": "is `train.log_every` here", "fsdp_config": "is `parallel.strategy` here",
               "save_total_limit": "is `train.keep_last` here", "eval_strategy": "has no counterpart here",
               "hub_strategy": "has no counterpart here", "hub_revision": "has no counterpart here",
               "vllm_importance_sampling_cap": "is `grpo.vllm_importance_sampling_clip_max` here",
               "eval_accumulation_steps": LEAVE_IT_OUT, "logging_dir": LEAVE_IT_OUT, "save_safetensors": LEAVE_IT_OUT,
               "fsdp_min_num_params": LEAVE_IT_OUT, "ddp_backend": LEAVE_IT_OUT}
    said = refusal({**BASE, section: dict.fromkeys(answers, 1)}).splitlines()
    for name, answer in answers.items():
        (line,) = [line for line in said if line.startswith(f"  {section}.{name}: unknown key.")]
        assert answer in line and "Did you mean" not in line, line


def test_no_installed_field_of_a_name_family_is_guessed_as_one_of_our_keys():
    """Every field of TrainingArguments, TRL's configs and LoraConfig that the tables leave to a family of names
    (MANAGED_PREFIXES) still gets "leave it out" in every section: a field a new release adds that is one spelling
    away from our key (as hub_strategy from parallel.strategy) fails here until names.py says what it is."""
    pytest.importorskip("trl")
    import trl
    from peft import LoraConfig
    from transformers import TrainingArguments

    ours = {key for keys in section_keys(Recipe).values() for key in keys}
    names = {field.name for cls in (TrainingArguments, LoraConfig, trl.SFTConfig, trl.DPOConfig, trl.KTOConfig,
                                    trl.GRPOConfig) for field in dataclasses.fields(cls)}
    family = sorted(name for name in names if name.startswith(MANAGED_PREFIXES) and name not in ours
                    and name not in MEANS and name not in NO_COUNTERPART and name not in MANAGED)
    assert len(family) > 30
    guessed = [f"{section}.{name}: {hint}" for section in ("train", "data", "parallel", "grpo", "model", "lora")
               for name in family
               if LEAVE_IT_OUT not in (hint := suggest(name, field_names(schema_at(Recipe, (section,))), root=Recipe,
                                                       section=section))]
    assert guessed == []


# ------------------------------------------------------------------------------- F6: YAML booleans at number keys
def _every_key() -> list[tuple[str, str]]:
    return [(section, key) for section, keys in section_keys(Recipe).items() if "[]" not in section for key in keys]


def test_no_key_of_any_section_takes_a_yaml_boolean_as_a_number():
    """Found by a bug bash: `lora.r: yes` trained rank 1 and `train.max_steps: true` one step: pydantic's lax mode reads
    true as 1, false as 0, and YAML reads yes/no, on/off as booleans. Every key of every section (those of train:,
    data:, the objectives', defined in their own modules) either takes a boolean as a boolean or refuses it at the
    key; none holds a number made of one."""
    silent = []
    for section, key in [*_every_key(), ("data.datasets.0", "weight"), ("data.datasets.0", "max_rows")]:
        for value in (True, False):
            raw = {**BASE, "data": {"datasets": [{"path": "d.jsonl"}]}}
            if section == "data.datasets.0":
                raw["data"]["datasets"][0][key] = value
            else:
                raw[section] = {**raw.get(section, {}), key: value}
            try:
                recipe = validate_recipe(raw)
            except RecipeError as exc:
                said = str(exc)
                if f"{section}.{key}: expected a number, but YAML read the value as {str(value).lower()}" in said:
                    assert f"Fix: write the number, e.g. `{key}: " in said, said
                continue
            node = recipe
            for part in [*section.split("."), key]:
                node = node[int(part)] if part.isdigit() else getattr(node, part)
            if not isinstance(node, bool) and node is not None and not isinstance(node, str):
                silent.append(f"{section}.{key}: {value} -> {node!r}")
    assert silent == []


def test_booleans_are_refused_at_their_key_from_a_file_and_an_override(tmp_path):
    """The fuzzer's cases: `r: yes` in a file, `train.grad_accum=true` on the command line; listed with the recipe's
    other problems at once. Boolean keys, `quantized_cache: off` and `scale_rewards: true` still read their booleans."""
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: x}\ndata: {datasets: [{path: d.jsonl}]}\nlora: {r: yes, rslora: yes}\n"
                    "train: {keep_last: on, max_grad_norm: false, lerning_rate: 1}\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, ["train.grad_accum=true"])
    said = str(caught.value)
    assert "5 problems in the recipe" in said, said
    for key, value in (("lora.r", "true"), ("train.keep_last", "true"), ("train.max_grad_norm", "false"),
                       ("train.grad_accum", "true")):
        assert f"  {key}: expected a number, but YAML read the value as {value}" in said, said
    assert "`max_grad_norm: 1.0` (or null, for none)" in said and "Did you mean `learning_rate`?" in said
    fine = validate_recipe({**BASE, "lora": {"rslora": True}, "model": {"name_or_path": "x", "quantized_cache": False},
                            "grpo": {"scale_rewards": True}, "train": {"gradient_checkpointing": False}})
    assert fine.lora.rslora is True and fine.model.quantized_cache == "off" and fine.grpo.scale_rewards == "group"


# ------------------------------------------------------------------------------------ F7: a recipe from a pipe
def _recipe_text(tmp_path: Path) -> str:
    return ("# accelerate config: accelerate_configs/single_gpu.yaml\n# The data file is written by hand.\n"
            + write_recipe(tmp_path / "r.yaml", {**BASE, "train": {"max_steps": 7}}).read_text())


def test_a_recipe_from_a_pipe_is_read_and_its_comments_too(tmp_path):
    """Found by a bug bash: `finetune validate <(cat r.yaml)` and `cat r.yaml | finetune validate /dev/stdin` said
    "/dev/fd/63: recipe file not found": read_yaml asked Path.is_file(), false for a pipe. A pipe is read once; its
    leading comments (the launch the recipe names), read again, come from the same bytes."""
    text = _recipe_text(tmp_path)
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    try:
        path = f"/dev/fd/{read}"
        assert load_recipe(path).train.max_steps == 7
        assert leading_comments(path)[0] == "# accelerate config: accelerate_configs/single_gpu.yaml"
        assert read_yaml(path)["train"] == {"max_steps": 7}
    finally:
        os.close(read)


def test_a_piped_recipes_named_launch_is_read_and_refused_for_its_processes(tmp_path, capsys):
    """Found by the last session's note: named_launch asked Path.is_file(), false for a pipe, so `finetune train
    <(cat r.yaml)` whose comment names fsdp2.yaml with num_processes: 2 ran one process in silence; the launch it names
    is read from the pipe's kept bytes, and refused as a launch of processes that would each read the pipe again."""
    from finetune import cli
    from finetune.cli.library import named_launch

    text = ("# accelerate config: accelerate_configs/fsdp2.yaml with num_processes: 2\n"
            + write_recipe(tmp_path / "r.yaml", {**BASE, "train": {"max_steps": 7}}).read_text())
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    try:
        path = f"/dev/fd/{read}"
        launch = named_launch(path)
        assert launch is not None and (launch.config, launch.num_processes) == ("accelerate_configs/fsdp2.yaml", 2)
        assert cli.main(["train", path]) == 2
        said = capsys.readouterr().err
        assert "not a regular file (a pipe" in said and "`# accelerate config:` comment" in said, said
    finally:
        os.close(read)

def test_a_fifo_is_read_even_where_its_name_is_a_library_recipes(tmp_path, monkeypatch):
    """A FIFO (mkfifo) was "not found" too; one named `quickstart` in the folder the command runs in was the library's
    quickstart (resolve_recipe_path asked is_file as well)."""
    from finetune.recipe_library import resolve_recipe_path

    fifo = tmp_path / "quickstart"
    os.mkfifo(fifo)
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe_path("quickstart") == "quickstart"
    text = _recipe_text(tmp_path)
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    assert load_recipe("quickstart").train.max_steps == 7
    writer.join(5)


# ----------------------------------------------------------------------------------------- F9: empty recipes
def test_an_empty_recipe_is_said_as_such(tmp_path):
    """Found by a bug bash: an empty recipe file was "a recipe must be a YAML mapping ..., got NoneType" (a Python
    type's name, where "the file is empty" was the answer)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(RecipeError, match=r"empty.yaml: the file is empty: a recipe is a YAML mapping"):
        read_yaml(empty)
    empty.write_text("# model: {name_or_path: x}\n")
    with pytest.raises(RecipeError, match=r"the file holds only comments"):
        read_yaml(empty)
    empty.write_text("[model, data]\n")
    with pytest.raises(RecipeError, match=r"got a list\.$"):
        read_yaml(empty)


def test_an_empty_recipe_argument_is_said_as_such():
    """Found by a bug bash: `finetune validate ''` said "`.`: recipe file not found (it is a folder)"."""
    with pytest.raises(RecipeError, match=r"^the recipe argument is empty \(''\)"):
        load_recipe("")
