"""Recipe YAML from elsewhere (bug bash bb26): a file of a few hundred bytes must not hang finetune or take all memory,
and a value nested thousands of levels deep is one recipe error, not a RecursionError traceback."""

from __future__ import annotations

import time

import pytest

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe import load_recipe, read_yaml

HEAD = "model: {name_or_path: some/model}\ndata: {datasets: [{path: d.jsonl}]}\n"


def alias_bomb(depth: int) -> str:
    """`a0` holds 10 scalars, each `aN` ten aliases of `a(N-1)`: under 700 bytes, 10**(depth+1) values written out."""
    lines = ["extra:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]" for n in range(1, depth + 1)]
    return HEAD + "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once_naming_the_file(tmp_path, capsys):
    """Found by a bug bash: read_yaml's unshared() copied every alias, so a 682-byte recipe of nested aliases
    (`a1: [*a0 x10]`, `a2: [*a1 x10]` ...) built 10**9 objects: `finetune validate` hung past 60 s with > 2 GB and
    growing, before even the unknown-key check. A recipe found online or a received run's recipe.yaml was enough."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(8))
    assert len(path.read_bytes()) < 700
    started = time.perf_counter()
    with pytest.raises(RecipeError) as caught:
        read_yaml(path)
    assert time.perf_counter() - started < 1.0
    message = str(caught.value)
    assert str(path) in message and "alias" in message and "Fix" in message
    assert main(["validate", str(path)]) == 2
    assert "finetune: error:" in capsys.readouterr().err


def test_aliases_within_the_limit_still_read_as_copies(tmp_path):
    """The limit counts values written out: ordinary aliases (a few shared columns or datasets) read as before, each
    a copy of its anchor (an override of one must never change the other)."""
    path = tmp_path / "ok.yaml"
    path.write_text("model: {name_or_path: some/model}\n"
                    "data:\n  datasets:\n    - &first {path: a.jsonl, columns: &cols {instruction: q, output: a}}\n"
                    "    - {path: b.jsonl, columns: *cols}\n    - *first\n")
    raw = read_yaml(path)
    datasets = raw["data"]["datasets"]
    assert datasets[1]["columns"] == datasets[0]["columns"] and datasets[1]["columns"] is not datasets[0]["columns"]
    assert datasets[2] == datasets[0] and datasets[2] is not datasets[0]
    small = tmp_path / "small_bomb.yaml"
    small.write_text(alias_bomb(3))  # 10**4 values: a large recipe, not a bomb
    assert len(read_yaml(small)["extra"]["a3"]) == 10


def test_a_recipe_nested_thousands_of_levels_deep_is_one_recipe_error(tmp_path, capsys):
    """Found by a bug bash: read_yaml caught only yaml.YAMLError; a value nested ~5,000 levels deep made PyYAML's
    composer raise RecursionError, and finetune showed the whole traceback (exit 1, not 2)."""
    path = tmp_path / "deep.yaml"  # 3,000 levels of block lists (`[[[...]]]` says the same, PyYAML scans it slower)
    path.write_text(HEAD + "description:\n" + "".join(" " * level + "- \n" for level in range(3000)))
    with pytest.raises(RecipeError, match="nested too deeply") as caught:
        load_recipe(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "finetune: error:" in err and "nested too deeply" in err and "Traceback" not in err
