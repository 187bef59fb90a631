"""The recipe schema: closed, typed, every problem at once, overrides through the same validation."""

from __future__ import annotations

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe, parse_override, recipe_to_yaml, validate_recipe

BASE = {
    "model": {"name_or_path": "some/model"},
    "data": {"datasets": [{"path": "data.jsonl"}]},
}


def write(tmp_path, recipe: dict | str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def test_minimal_recipe_gets_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_NATIVE_BF16", "1")  # model.dtype: auto on a CPU with native bf16 (tests/test_precision.py)
    recipe = load_recipe(write(tmp_path, BASE))
    assert recipe.quantization.method == "nf4" and recipe.quantization.double_quant
    assert recipe.lora.target_modules == "all-linear"
    assert recipe.model.trust_remote_code is False
    assert recipe.compute_dtype == "bfloat16"


def test_stable_contract_keys_exist():
    # Outside scripts rely on these exact paths.
    for section, key in [("model", "name_or_path"), ("output", "dir"), ("train", "max_steps"), ("train", "seed"),
                         ("train", "learning_rate")]:
        assert key in Recipe.model_fields[section].annotation.model_fields


def test_unknown_key_suggests_nearest(tmp_path):
    raw = {**BASE, "train": {"learnig_rate": 1e-4}}
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, raw))
    text = str(err.value)
    assert "r.yaml" in text and "train.learnig_rate: unknown key" in text and "`learning_rate`" in text


def test_unknown_section_suggests_nearest(tmp_path):
    with pytest.raises(RecipeError, match="trian: unknown key. Did you mean `train`"):
        load_recipe(write(tmp_path, {**BASE, "trian": {}}))


def test_all_problems_listed_at_once(tmp_path):
    raw = {**BASE, "train": {"max_steps": -1, "learning_rate": "fast"}, "lora": {"r": 0}}
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, raw))
    text = str(err.value)
    assert "3 problems" in text
    assert "train.max_steps" in text and "train.learning_rate" in text and "lora.r" in text


def test_missing_required_section(tmp_path):
    with pytest.raises(RecipeError, match="data: required key is missing"):
        load_recipe(write(tmp_path, {"model": {"name_or_path": "x"}}))


def test_missing_file_and_yaml_syntax(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match=r"r.yaml: line \d+, column \d+: YAML syntax error"):
        load_recipe(write(tmp_path, "model:\n  name_or_path: [unclosed\n"))
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(write(tmp_path, "- just\n- a list\n"))


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, BASE)
    recipe = load_recipe(path, ["train.max_steps=7", "output.dir=/runs/x", "lora.target_modules=[q_proj, v_proj]"])
    assert recipe.train.max_steps == 7 and recipe.output.dir == "/runs/x"
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(RecipeError, match="`train.max_step` is not a recipe key. Did you mean `max_steps`"):
        load_recipe(path, ["train.max_step=7"])
    with pytest.raises(RecipeError, match="train.max_steps"):
        load_recipe(path, ["train.max_steps=many"])
    with pytest.raises(RecipeError, match="expected KEY.PATH=VALUE"):
        load_recipe(path, ["train.max_steps"])
    assert load_recipe(path, ["train.learning_rate=1e-4"]).train.learning_rate == 1e-4  # YAML 1.1 string, coerced
    recipe = load_recipe(path, ["data.datasets.0.format=chat"])
    assert recipe.data.datasets[0].format == "chat"
    # the bracket form users write (it was "`data.datasets[0]` is not a recipe key. Did you mean `datasets`?")
    assert load_recipe(path, ["data.datasets[0].format=chat"]).data.datasets[0].format == "chat"
    with pytest.raises(RecipeError, match=r"`3` is not an index of the list \(it has 1 items: 0 to 0, or -1 for the "):
        load_recipe(path, ["data.datasets[3].format=chat"])
    # the last item as Python writes it (it was "`data.datasets[-1]` is not a recipe key")
    assert load_recipe(path, ["data.datasets[-1].format=chat"]).data.datasets[0].format == "chat"
    assert load_recipe(path, ["data.datasets.-1.weight=2"]).data.datasets[0].weight == 2
    with pytest.raises(RecipeError, match=r"`-2` is not an index of the list"):
        load_recipe(path, ["data.datasets[-2].format=chat"])


def test_parse_override_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=") == (["a", "b"], None)


def test_quantization_short_form_and_storage_rule(tmp_path):
    recipe = load_recipe(write(tmp_path, {**BASE, "quantization": "none"}))
    assert recipe.quantization.method == "none"
    bad = {**BASE, "model": {"name_or_path": "x", "dtype": "bfloat16"}, "quantization": {"quant_storage": "float32"}}
    with pytest.raises(RecipeError, match="quant_storage .* must equal model.dtype"):
        load_recipe(write(tmp_path, bad))


def test_resolved_recipe_round_trips():
    recipe = validate_recipe(BASE)
    again = validate_recipe(yaml.safe_load(recipe_to_yaml(recipe)))
    assert again == recipe


def test_warmup_longer_than_the_run_is_clamped_with_a_note(tmp_path, capsys):
    """A smoke run of a long recipe (`train.max_steps=3` on 30 warmup steps) works: warmup over the run, said once."""
    path = write(tmp_path, {**BASE, "train": {"warmup_steps": 30, "max_steps": 100}})
    assert load_recipe(path).train.warmup_steps == 30
    capsys.readouterr()
    recipe = load_recipe(path, ["train.max_steps=3"])
    assert recipe.train.warmup_steps == 2 and recipe.train.max_steps == 3
    assert "train.warmup_steps (30) is not below train.max_steps (3): warming up over 2 steps instead" in capsys.readouterr().err
    assert load_recipe(path, ["train.max_steps=1"]).train.warmup_steps == 0
    assert yaml.safe_load(recipe_to_yaml(recipe))["train"]["warmup_steps"] == 2  # the resolved recipe says what ran


def test_a_recipes_warmup_steps_give_way_to_a_ratio_and_hfs_no_clipping_is_taken(tmp_path):
    """Found by a bug bash: on a recipe with warmup_steps, `train.warmup_ratio=0.1` was refused with a fix that unset
    the ratio just asked for, and `train.warmup_steps=null` was "not a valid integer" (max_steps=null unsets); HF's
    `max_grad_norm: 0` (no clipping) was refused as "should be greater than 0"."""
    path = write(tmp_path, {**BASE, "train": {"warmup_steps": 30, "max_steps": 100}})
    with pytest.raises(RecipeError, match=r"`train.warmup_steps=0` \(or `=null`\) keeps the ratio"):
        load_recipe(path, ["train.warmup_ratio=0.1"])
    for unset in ("train.warmup_steps=null", "train.warmup_steps=0"):
        recipe = load_recipe(path, ["train.warmup_ratio=0.1", unset])
        assert (recipe.train.warmup_steps, recipe.train.warmup_ratio) == (10, None)  # ceil(0.1 x 100), resolved
    assert load_recipe(path, ["train.max_grad_norm=0"]).train.max_grad_norm is None
    with pytest.raises(RecipeError, match="train.max_grad_norm: Input should be greater than 0"):
        load_recipe(path, ["train.max_grad_norm=-1"])

def test_data_parallel_is_refused_with_the_ddp_command(tmp_path):
    path = write(tmp_path, {**BASE, "parallel": {"strategy": "dp"}})
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    text = str(err.value)
    for reason in ("GIL", "GPU 0", "replicated to every GPU again on every step", "cannot span machines"):
        assert reason in text
    assert f"`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N finetune/run.py {path}`" in text
    assert text.count("\n") == 1  # the file line, then one paragraph
    with pytest.raises(RecipeError, match="`data_parallel` \\(torch.nn.DataParallel\\) is not supported"):
        load_recipe(path, ["parallel.strategy=data_parallel"])


@pytest.mark.parametrize("section, key", [("model", "dtype"), ("quantization", "compute_dtype")])
def test_fp16_training_is_refused_with_the_reason(section, key):
    """No loss scaling in the loop: fp16 LoRA gradients would underflow silently."""
    raw = {"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "a.jsonl"}]}}
    raw.setdefault(section, {})[key] = "float16"
    with pytest.raises(RecipeError, match=rf"{section}.{key}: float16 is not supported for training.*Fix: bfloat16"):
        validate_recipe(raw, source="r.yaml")


def test_local_paths_are_kept_absolute_so_the_run_names_the_files_it_trained(tmp_path, monkeypatch):
    """Relative local paths were kept as written: the run's recipe.yaml and adapter_config.json said `tiny` and
    `data/train.jsonl`, so `finetune generate` / `export` / a resume from another folder took the model for a hub id
    or read that folder's own data/train.jsonl. Now each that exists from here is made absolute when the recipe loads;
    hub ids, template names and paths not found stay as written."""
    monkeypatch.chdir(tmp_path)
    for folder in ("tiny", "data", "sft/adapter", "rm"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    (tmp_path / "data" / "tools.json").write_text("[]")
    (tmp_path / "rm" / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}')
    (tmp_path / "chatml").write_text("{{ messages }}")  # a file named as a template: the named template wins
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    raw = {"model": {"name_or_path": "tiny", "adapter": "sft/adapter", "chat_template": "t.jinja"},
           "train": {"objective": "grpo", "micro_batch_size": 8},
           "data": {"max_length": 1024, "datasets": [{"path": "data/train.jsonl", "format": "prompt", "tools": "data/tools.json"},
                                 {"path": "openai/gsm8k", "format": "prompt"}],
                    "eval_datasets": [{"path": "data/missing.jsonl", "format": "prompt"}]},
           "grpo": {"reward_functions": ["finetune.rewards:contains_answer"], "reward_models": ["rm"]}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    recipe = load_recipe(path)
    assert recipe.model.name_or_path == str(tmp_path / "tiny") and recipe.model.adapter == str(tmp_path / "sft/adapter")
    assert recipe.model.chat_template == str(tmp_path / "t.jinja")
    assert [spec.path for spec in recipe.data.datasets] == [str(tmp_path / "data/train.jsonl"), "openai/gsm8k"]
    assert recipe.data.datasets[0].tools == str(tmp_path / "data/tools.json")
    assert recipe.data.eval_datasets[0].path == "data/missing.jsonl"  # not found: as written, its check names it
    assert recipe.grpo.reward_models == [str(tmp_path / "rm")]
    raw["model"]["chat_template"] = "chatml"
    path.write_text(yaml.safe_dump(raw))
    assert load_recipe(path).model.chat_template == "chatml"


def test_a_tilde_path_is_expanded_for_the_libraries_and_the_saved_recipe(tmp_path, monkeypatch):
    """Found by a bug bash (bb25 #3): `model.name_or_path: ~/tiny` (or model.tokenizer) was checked with ~ expanded
    but passed on as written, so transformers took `~/tiny` for a hub id and the run was refused ("check that ~/tiny
    is a saved transformers folder"), and a `~/t.jsonl` data path stayed `~` in the run's recipe.yaml (a resume under
    another HOME read another file)."""
    home = tmp_path / "home"
    (home / "tiny").mkdir(parents=True)
    (home / "t.jsonl").write_text('{"prompt": "q", "completion": "a"}\n')
    monkeypatch.setenv("HOME", str(home))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "~/tiny", "tokenizer": "~/tiny"},
                                    "data": {"datasets": [{"path": "~/t.jsonl"}, {"path": "~/missing.jsonl"}]}}))
    recipe = load_recipe(path)
    assert recipe.model.name_or_path == recipe.model.tokenizer == str(home / "tiny")
    assert [spec.path for spec in recipe.data.datasets] == [str(home / "t.jsonl"), "~/missing.jsonl"]


def test_output_dir_is_kept_absolute_before_it_exists(tmp_path, monkeypatch):
    """A review of the paths fix: output.dir stayed relative, so `finetune train runs/rel/recipe.yaml
    train.resume=auto` from another folder started a new run there, without a word. It is absolute from the start."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                                    "output": {"dir": "runs/rel"}}))
    assert load_recipe(path).output.dir == str(tmp_path / "runs/rel") and not (tmp_path / "runs").exists()


def test_load_recipe_takes_a_library_name_as_the_command_line_does(tmp_path, monkeypatch):
    """Found by a bug bash (the wheel, from Python): load_recipe("llama-3.1-8b") said "recipe file not found" and
    pointed at recipes/..., a path a wheel user does not have, where `finetune validate llama-3.1-8b` works."""
    from finetune.recipe_library import recipe_path

    monkeypatch.chdir(tmp_path)  # no recipes/ folder here
    recipe = load_recipe("llama-3.1-8b")
    assert recipe == load_recipe(recipe_path("llama-3.1-8b"))
    assert recipe.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("seed", [2**64, 2**64 - 1, -1])
def test_a_seed_torch_cannot_take_with_its_offsets_is_refused(seed):
    """Found by a bug bash (determinism): train.seed 2**64 was a traceback in validate; 2**64-1 trained a whole epoch
    and crashed at the next epoch's shuffle (seed + epoch), with nothing saved; rank 1 crashed at seed + rank."""
    with pytest.raises(RecipeError, match="train.seed"):
        validate_recipe({**BASE, "train": {"seed": seed}})
    assert validate_recipe({**BASE, "train": {"seed": 2**63 - 1}}).train.seed == 2**63 - 1
