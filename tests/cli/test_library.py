"""The recipe library: every recipe validates offline, names a real accelerate config, and list/show/copy work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.cli.library import expected_accelerate_config, library_dir, recipe_names, recipe_path, resolve_recipe_path
from finetune.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
EXPECTED = {"quickstart", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b"}


def test_library_has_the_promised_recipes():
    assert library_dir() == REPO / "recipes"
    assert EXPECTED <= set(recipe_names())


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_offline(path: Path):
    recipe = load_recipe(path)  # schema and cross-field checks, no network, no weights
    assert recipe.description.strip() and "\n" not in recipe.description, "a one-line description is required"
    config = expected_accelerate_config(path)
    assert config is not None, f"{path.name}: the first comment lines must name accelerate_configs/<config>.yaml"
    assert (REPO / config).is_file(), f"{path.name} names {config}, which does not exist"
    if path.stem == "quickstart":
        assert recipe.model.gguf_file and recipe.model.name_or_path.startswith("pkg:")
        return
    assert recipe.model.name_or_path.count("/") == 1, "library recipes name a real hub id (org/name)"
    assert recipe.quantization.method == "nf4" and load_recipe(path, dtype_device="gpu").model.dtype == "bfloat16"
    assert all(not Path(spec.path).exists() and "/" in spec.path for spec in recipe.data.datasets), "a public dataset"


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem != "quickstart"], ids=lambda p: p.stem)
def test_recipe_model_architecture_is_stored(path: Path):
    """The planner needs the architecture offline (`finetune plan` on a library recipe downloads nothing): every library
    recipe's model is stored, and it is the model the recipe names."""
    from finetune.model import architectures

    name = load_recipe(path).model.name_or_path
    config = architectures.stored_config(name)
    assert config is not None, f"no stored architecture for {name}: add its config.json to finetune/model/architectures"
    text = config.get_text_config()  # a multimodal checkpoint's language model (Gemma 3 12B/27B); else the config
    assert text.num_hidden_layers > 0 and text.vocab_size > 1000


# The chat templates of the library's models as they ship on the hub, from TRL's stored copies ("original templates",
# trl/chat_templates; trl is a dev dependency). Models without a copy there are not checked here.
SHIPPED_TEMPLATES = {"meta-llama/Llama-3.1-": "llama3_1.jinja", "meta-llama/Llama-3.3-": "llama3_1.jinja",
                     "Qwen/Qwen2.5-": "qwen2_5.jinja", "Qwen/Qwen3-": "qwen3.jinja", "google/gemma-3-": "gemma3.jinja",
                     "openai/gpt-oss-": "gptoss.jinja"}
CHAT_RECIPES = [p for p in RECIPES if p.stem != "quickstart"
                and any(spec.format == "chat" for spec in load_recipe(p).data.datasets)]


@pytest.mark.parametrize("path", CHAT_RECIPES, ids=lambda p: p.stem)
def test_chat_recipe_renders_multi_turn_rows_with_its_model_template(path: Path):
    """The suite's tiny tokenizer is ChatML, so a model template that rewrites earlier turns (Qwen3's drops their
    <think> blocks, gpt-oss ends them otherwise) could pass there and break the real run: render a two-turn row of the
    recipe's dataset with the template the recipe's model ships; both answers are trained, whole, once each.
    (Llama 3.3 ships Llama 3.1's template.)"""
    trl = pytest.importorskip("trl")
    from finetune.cli.tiny import build_tokenizer
    from finetune.data.templates import render_examples

    recipe = load_recipe(path)
    name = next((file for prefix, file in SHIPPED_TEMPLATES.items() if recipe.model.name_or_path.startswith(prefix)), None)
    if name is None:
        pytest.skip(f"no stored chat template for {recipe.model.name_or_path}")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / name).read_text()
    for spec in (spec for spec in recipe.data.datasets if spec.format == "chat"):
        role, content = spec.columns.get("role", "role"), spec.columns.get("content", "content")
        turns = [("user", "What is 2 plus 3?"), ("assistant", "5"), ("user", "And 4 plus 4?"), ("assistant", "8")]
        row = {spec.columns.get("messages", "messages"): [{role: r, content: text} for r, text in turns]}
        trained = [text for example in render_examples(row, spec, tokenizer, recipe.data.system_prompt, "row 1")
                   for text, is_trained in example if is_trained]
        assert len(trained) == 2 and "5" in trained[0] and "8" in trained[1], trained


def test_list_shows_every_recipe_with_its_purpose(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for path in RECIPES:
        assert path.stem in out
        assert load_recipe(path).description in out


def test_show_prints_the_file(capsys):
    assert main(["recipes", "show", "quickstart"]) == 0
    assert capsys.readouterr().out == (REPO / "recipes" / "quickstart.yaml").read_text()


def test_unknown_name_exits_2_and_lists_known(capsys):
    assert main(["recipes", "show", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert "no-such-recipe" in err and "quickstart" in err


def test_copy_to_file_and_folder_never_overwrites(tmp_path, capsys):
    """The copy is the recipe but for its comments, which name the copy (they named recipes/NAME.yaml and
    accelerate_configs/X.yaml, which exist in the repository, not beside a copy from an installed package)."""
    source = (REPO / "recipes" / "mistral-7b.yaml").read_text()
    assert main(["recipes", "copy", "mistral-7b", str(tmp_path / "mine.yaml")]) == 0
    copied = (tmp_path / "mine.yaml").read_text()
    assert yaml.safe_load(copied) == yaml.safe_load(source) and "recipes/mistral-7b.yaml" in source
    assert "recipes/mistral-7b.yaml" not in copied and f"# Launch: finetune train {tmp_path / 'mine.yaml'} " in copied
    assert main(["recipes", "copy", "mistral-7b", str(tmp_path)]) == 0
    assert yaml.safe_load((tmp_path / "mistral-7b.yaml").read_text()) == yaml.safe_load(source)
    dpo = tmp_path / "dpo.yaml"
    assert main(["recipes", "copy", "llama-3.1-70b-2x24gb-dpo", str(dpo)]) == 0
    said = dpo.read_text()
    assert f"# Launch: finetune train {dpo} --accelerate-config fsdp2\n" in said and "#     or:" not in said
    assert "# accelerate config: accelerate_configs/fsdp2.yaml" in said  # what validate reads, kept
    assert f"`finetune plan {dpo} --gpus 2" in said
    (tmp_path / "mine.yaml").write_text("edited")
    assert main(["recipes", "copy", "quickstart", str(tmp_path / "mine.yaml")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "mine.yaml").read_text() == "edited"


def test_names_resolve_to_library_files():
    assert recipe_path("quickstart") == REPO / "recipes" / "quickstart.yaml"
    assert recipe_path("quickstart.yaml") == REPO / "recipes" / "quickstart.yaml"
    assert recipe_path("nope") is None
    assert resolve_recipe_path("qwen2.5-7b") == str(REPO / "recipes" / "qwen2.5-7b.yaml")


def test_accelerate_configs_resolve_by_name(capsys):
    from finetune.cli.library import accelerate_config_names, resolve_accelerate_config

    assert set(accelerate_config_names()) == {p.stem for p in (REPO / "accelerate_configs").glob("*.yaml")}
    assert resolve_accelerate_config("fsdp2") == str(REPO / "accelerate_configs" / "fsdp2.yaml")
    assert resolve_accelerate_config("ddp.yaml") == str(REPO / "accelerate_configs" / "ddp.yaml")
    # The README's checkout path still works from any folder: the library config of that name.
    assert resolve_accelerate_config("accelerate_configs/ddp.yaml").endswith("accelerate_configs/ddp.yaml")
    assert main(["validate", "quickstart", "--accelerate-config", "fsdp3"]) == 2
    err = capsys.readouterr().err
    assert "fsdp3" in err and "fsdp2" in err and "Traceback" not in err


def test_no_stage_imports_the_cli():
    """The CLI sits on top: a module below it importing it closes an import circle (planner -> cli -> run ...).
    tests/test_architecture.py checks the rest of the house rules."""
    import ast

    offenders = []
    for path in sorted((REPO / "finetune").rglob("*.py")):
        if path.relative_to(REPO / "finetune").parts[0] in ("cli", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "finetune":
                names = [f"finetune.{alias.name}" for alias in node.names]
            if "finetune.cli" in names:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
