"""A recipe as a user writes and overrides it (bug bash bb9): YAML aliases, empty sections, override values taken as
written, values YAML types into something else, infinite numbers, file encodings, list items and short forms, and the
path values a recipe does not expand or read from its own folder."""

from __future__ import annotations

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe, parse_override

BASE = {"model": {"name_or_path": "some/model"}, "data": {"datasets": [{"path": "data.jsonl"}]}}


def write(tmp_path, recipe: dict | str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def refusal(path, overrides=()) -> str:
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, list(overrides))
    return str(caught.value)


# ------------------------------------------------------------------------------------------------- 1. aliases
def test_an_override_of_an_aliased_item_changes_that_item_only(tmp_path):
    """Found by a bug bash: PyYAML builds an anchor and its aliases as one dict, so
    `data.datasets[1].columns.output=response` also changed datasets[0] (`columns: &cols` ... `columns: *cols`): the
    run trained a.jsonl on the wrong column without a word; `data.datasets[0].max_rows=10` also cut eval_datasets[0]."""
    path = write(tmp_path, """
model: {name_or_path: some/model}
data:
  datasets:
    - &first {path: a.jsonl, columns: &cols {instruction: question, output: answer}}
    - {path: b.jsonl, columns: *cols}
  eval_datasets: [*first]
""")
    recipe = load_recipe(path, ["data.datasets[1].columns.output=response", "data.datasets[0].max_rows=10"])
    assert recipe.data.datasets[0].columns == {"instruction": "question", "output": "answer"}
    assert recipe.data.datasets[1].columns == {"instruction": "question", "output": "response"}
    assert recipe.data.datasets[0].max_rows == 10 and recipe.data.eval_datasets[0].max_rows is None
    assert load_recipe(path).data.datasets[1].columns["output"] == "answer"  # the aliases still read as written


def test_an_alias_inside_itself_is_refused(tmp_path):
    """An alias that holds its own anchor has no end; it is named (the copy that keeps aliases apart must not loop)."""
    text = refusal(write(tmp_path, "model: {name_or_path: x}\ndata: {datasets: &a [*a]}\n"))
    assert "r.yaml: a YAML alias refers to a mapping or list that holds it" in text


# ----------------------------------------------------------------------------------------- 2. empty sections
def test_an_empty_section_takes_its_defaults_like_leaving_it_out(tmp_path):
    """Found by a bug bash: a `quantization:` header whose keys are all commented out read as `quantization: none`,
    so the base trained in full precision (QLoRA turned into plain LoRA) without a word; an empty `lora:` was refused."""
    path = write(tmp_path, """
model: {name_or_path: some/model}
quantization:
  # method: nf4
  # double_quant: true
lora:
  # r: 8
data: {datasets: [{path: data.jsonl}]}
""")
    recipe = load_recipe(path)
    assert recipe.quantization.method == "nf4" and recipe.quantization.double_quant
    assert recipe.lora.r == 16
    assert load_recipe(write(tmp_path, {**BASE, "quantization": "none"}, "n.yaml")).quantization.method == "none"


@pytest.mark.parametrize("override", ["quantization=null", "quantization=", "quantization=~"], ids=["null", "empty", "tilde"])
def test_a_null_quantization_override_is_refused_with_the_way_to_turn_it_off(tmp_path, override):
    """Found by a bug bash: `quantization=null` (or empty) meant no quantization, silently; as an empty section now
    means nf4, it is refused, naming `quantization.method=none`, rather than silently meaning either."""
    text = refusal(write(tmp_path, BASE), [override])
    assert "`quantization` is a section, and null does not switch a section off" in text
    assert "`quantization.method=none`" in text
    assert load_recipe(write(tmp_path, BASE), ["quantization=none"]).quantization.method == "none"


# ------------------------------------------------------------------------------ 3. override values as written
def test_override_values_are_taken_as_written(tmp_path):
    """Found by a bug bash: override values were YAML 1.1 scalars: `Be brief #no lists` lost `#no lists` (a YAML
    comment), a newline was folded into a space, `train.seed=0042` was octal 34 and `train.max_steps=010` was 8."""
    path = write(tmp_path, BASE)
    recipe = load_recipe(path, ["data.system_prompt=Be brief #no lists", "train.seed=0042", "train.max_steps=010",
                                "data.datasets[0].system_prompt=line1\nline2"])
    assert recipe.data.system_prompt == "Be brief #no lists"
    assert recipe.data.datasets[0].system_prompt == "line1\nline2"
    assert (recipe.train.seed, recipe.train.max_steps) == (42, 10)
    # what YAML reads well still does: numbers, null, booleans, lists and mappings, quoted text
    recipe = load_recipe(path, ["train.learning_rate=1e-4", "train.max_grad_norm=null", "data.packing=true",
                                "lora.target_modules=[q_proj, v_proj]", "data.datasets[0].columns={output: answer}",
                                "data.system_prompt='null'", "train.run_name=\"a\\tb\""])
    assert (recipe.train.learning_rate, recipe.train.max_grad_norm, recipe.data.packing) == (1e-4, None, True)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.data.datasets[0].columns == {"output": "answer"}
    assert (recipe.data.system_prompt, recipe.train.run_name) == ("null", "a\tb")
    assert "(got '5 # five')" in refusal(path, ["train.max_steps=5 # five"])  # a number's comment is not dropped


# ------------------------------------------------------------------------- 8. values YAML types into another
@pytest.mark.parametrize("override,key,value", [
    ("data.system_prompt=Answer format: JSON", "system_prompt", "Answer format: JSON"),
    ('data.system_prompt=Reply in JSON {"a": 1}', "system_prompt", 'Reply in JSON {"a": 1}'),
    ("data.system_prompt=[bracket] note", "system_prompt", "[bracket] note"),
    ("train.run_name=12:30", "run_name", "12:30"),
    ("train.run_name=yes", "run_name", "yes"),
    ("model.revision=1234567", "revision", "1234567"),
    ("train.run_name=2024-01-01", "run_name", "2024-01-01"),
    ("data.system_prompt={% if tools %}Use the tools.{% endif %}", "system_prompt", "{% if tools %}Use the tools.{% endif %}"),
], ids=["colon", "braces", "bracket", "base60", "yes", "digits", "date", "jinja"])
def test_a_key_that_takes_text_takes_the_override_as_written(tmp_path, override, key, value):
    """Found by a bug bash: these were refused with `Input should be a valid string` (a mapping, 750 for 12:30, True,
    a number, a date) or `the value is not valid YAML`, with no hint to quote them. Text keys take the text as typed."""
    recipe = load_recipe(write(tmp_path, BASE), [override])
    section = {"system_prompt": recipe.data, "run_name": recipe.train, "revision": recipe.model, "dir": recipe.output}[key]
    assert getattr(section, key) == value


def test_a_chat_template_given_as_text_on_the_command_line_is_taken_as_written():
    """Found by a bug bash: `model.chat_template={% for ... %}` (template text, which the schema allows) was refused:
    `the value is not valid YAML (found character '%' that cannot start any token)`. (Compiling the template, which
    validation does, imports transformers: the value is checked as read here.)"""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parse_override(f"model.chat_template={template}", root=Recipe) == (["model", "chat_template"], template)
    assert parse_override("model.chat_template='chatml'", root=Recipe) == (["model", "chat_template"], "chatml")


def test_a_value_yaml_types_in_the_file_is_named_with_how_it_was_read_and_to_quote_it(tmp_path):
    """Found by a bug bash: `output.dir: 2024-01-01` said `(got datetime.date(2024, 1, 1))`, `run_name: 12:30`
    `(got 750)`, and a mapping where text goes said only `Input should be a valid string`."""
    text = refusal(write(tmp_path, """
model: {name_or_path: some/model, revision: 1234567}
data: {datasets: [{path: data.jsonl, system_prompt: {Answer format: JSON}}]}
train: {run_name: 12:30}
output: {dir: 2024-01-01}
"""))
    assert "output.dir: expected text, but YAML read the value as a date (2024-01-01). Fix: put the text in quotes" in text
    assert "`dir: '2024-01-01'`" in text
    assert "train.run_name: expected text, but YAML read the value as the number 750" in text
    assert "data.datasets.0.system_prompt: expected text, but YAML read the value as a mapping ({'Answer format': 'JSON'})" in text
    assert "model.revision: expected text, but YAML read the value as the number 1234567" in text
    broken = refusal(write(tmp_path, "model: {name_or_path: x}\ndata:\n  system_prompt: [bracket] note\n", "b.yaml"))
    assert "YAML syntax error" in broken and "goes in quotes: `key: '...'`" in broken


# ---------------------------------------------------------------------------------------- 5. infinite numbers
@pytest.mark.parametrize("overrides,key", [
    (["data.datasets[0].weight=1e999"], "data.datasets.0.weight"), (["data.datasets[0].weight=.inf"], "data.datasets.0.weight"),
    (["train.num_epochs=.inf", "train.max_steps=null"], "train.num_epochs"),
    (["train.learning_rate=.inf"], "train.learning_rate"), (["lora.alpha=1e999"], "lora.alpha"),
    (["dpo.beta=.inf"], "dpo.beta"), (["train.max_grad_norm=.nan"], "train.max_grad_norm"),
], ids=["weight-1e999", "weight-inf", "num_epochs", "learning_rate", "lora-alpha", "dpo-beta", "nan"])
def test_infinite_numbers_are_refused_at_their_key(tmp_path, overrides, key):
    """Found by a bug bash: a weight or num_epochs of 1e999 / .inf stopped with `OverflowError: cannot convert float
    infinity to integer` (a traceback), and `train.learning_rate=.inf` passed validate, the run then stopping on NaN."""
    text = refusal(write(tmp_path, BASE), overrides)
    assert f"{key}: Input should be a finite number" in text


# ------------------------------------------------------------------------------------------- 6. file encoding
def test_a_recipe_not_in_utf8_is_named_with_the_fix_and_unicode_files_are_read(tmp_path):
    """Found by a bug bash: a Latin-1 recipe (`café`) or one saved by Notepad as "Unicode" (UTF-16 with a BOM) gave a
    UnicodeDecodeError traceback naming neither the file nor the line."""
    text = "description: café\n" + yaml.safe_dump(BASE)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes(text.encode("latin-1"))
    problem = refusal(latin)
    assert problem.startswith(f"{latin}: line 1: the file is not UTF-8 text (byte 0xe9")
    assert "Fix: save it as UTF-8" in problem
    for name, data in (("utf16.yaml", text.encode("utf-16")), ("bom.yaml", text.encode("utf-8-sig"))):
        (tmp_path / name).write_bytes(data)
        assert load_recipe(tmp_path / name).description == "café"
    (tmp_path / "no_bom.yaml").write_bytes(text.encode("utf-16-le"))
    assert "NUL bytes: UTF-16 without a byte-order mark?" in refusal(tmp_path / "no_bom.yaml")


# ---------------------------------------------------------------------------------- 9. lists and short forms
def test_an_item_of_a_list_the_recipe_does_not_set_says_to_set_the_whole_list(tmp_path):
    """Found by a bug bash: `data.eval_datasets[0].path=x` on a recipe without eval_datasets said the key was not a
    recipe key; `lora.target_modules[0]=q_proj` on the default showed pydantic's union branches
    (`lora.target_modules.list[str]: ...`); `quantization.method=nf4` on `quantization: none` did not name the fix."""
    path = write(tmp_path, BASE)
    text = refusal(path, ["data.eval_datasets[0].path=data.jsonl"])
    assert ("data.eval_datasets has no item 0 (the recipe does not set data.eval_datasets). Fix: set the whole list: "
            "`data.eval_datasets=[{path: data.jsonl}]`.") in text
    text = refusal(path, ["lora.target_modules[0]=q_proj"])
    assert "its default is `all-linear`" in text and "`lora.target_modules=[q_proj]`" in text
    assert "list[str]" not in text
    text = refusal(write(tmp_path, {**BASE, "lora": {"target_modules": "all-linear"}}, "a.yaml"), ["lora.target_modules[0]=q_proj"])
    assert "lora.target_modules is `all-linear` here, not a list" in text
    text = refusal(write(tmp_path, {**BASE, "quantization": "none"}, "q.yaml"), ["quantization.method=nf4"])
    assert "Fix: set the section whole: `quantization={method: nf4}`" in text
    assert "set the whole list: `data.datasets=[...]`" in refusal(path, ["data.datasets[3].path=x"])


# ------------------------------------------------------------------------------------------ 12. smaller items
def test_a_file_of_several_yaml_documents_is_named_as_such(tmp_path):
    """Found by a bug bash: the error was half of PyYAML's sentence, `YAML syntax error: but found another document`."""
    text = refusal(write(tmp_path, "model: {name_or_path: x}\ndata: {datasets: [{path: d.jsonl}]}\n---\nlora: {r: 8}\n"))
    assert "r.yaml: line 3, column 1: YAML syntax error: a second YAML document starts here" in text
    assert "Fix: remove that `---` line" in text


def test_a_relative_model_beside_the_recipe_but_not_here_is_named(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: run from another folder, `model.name_or_path: tiny` (a folder next to the recipe) gave only
    a hub error, never saying that relative paths are read from the working folder, as the data error does."""
    (tmp_path / "project" / "tiny").mkdir(parents=True)
    path = write(tmp_path / "project", {**BASE, "model": {"name_or_path": "tiny"}})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv("RANK", raising=False)
    load_recipe(path)
    err = capsys.readouterr().err
    assert (f"warning: model.name_or_path `tiny` does not exist in the working folder {tmp_path / 'elsewhere'}, where "
            f"relative paths are read from, but does beside the recipe ({tmp_path / 'project' / 'tiny'})") in err
    monkeypatch.chdir(tmp_path / "project")
    load_recipe(path)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("value,meant", [("$HOME/runs", "/home/me/runs"), ("${HOME}/runs", "/home/me/runs"),
                                         ("runs/$USER_NAME", "runs/me")], ids=["home", "braced", "inside"])
def test_an_environment_variable_in_a_path_is_refused(tmp_path, monkeypatch, value, meant):
    """Found by a bug bash: `output.dir: $HOME/runs` made a folder literally named `$HOME` in the working folder
    (`output: /work/bb9/$HOME/runs is usable`): a recipe does not expand environment variables."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/me")
    monkeypatch.setenv("USER_NAME", "me")
    text = refusal(write(tmp_path, {**BASE, "output": {"dir": value}}))
    assert f"output.dir `{value}` (here that is `{meant}`)" in text
    assert "environment variables are not expanded in a recipe" in text
    assert "environment variables" in refusal(write(tmp_path, BASE, "b.yaml"), [f"data.datasets[0].path={value}/d.jsonl"])
    assert not (tmp_path / "$HOME").exists()


def test_a_moved_run_folders_own_recipe_names_where_it_would_write(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: `finetune train MOVED/recipe.yaml train.resume=auto` started a new run at step 1 in the old
    folder its recipe.yaml names, not the moved run it sits in, without a word. Reading a run folder's recipe.yaml whose
    output.dir is elsewhere now says so, with the fix (output.dir=the folder)."""
    import yaml

    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    (moved / "recipe.yaml").write_text(yaml.safe_dump({**BASE, "output": {"dir": str(tmp_path / "old")}}),
                                       encoding="utf-8")
    monkeypatch.chdir(moved)
    monkeypatch.delenv("RANK", raising=False)
    load_recipe(moved / "recipe.yaml")
    err = capsys.readouterr().err
    assert f"is the recipe.yaml of the run folder {moved}, but its output.dir names {tmp_path / 'old'}" in err, err
    assert f"pass output.dir={moved}" in err
    load_recipe(moved / "recipe.yaml", [f"output.dir={moved}"])
    assert "warning" not in capsys.readouterr().err
