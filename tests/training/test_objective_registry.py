"""An objective added as the house says (issue 54): its module in training/objectives/, its recipe section, one entry in
finetune/recipe/objectives.py, and nothing else of the package touched. A toy objective (SFT's loss times
`toy.scale`) is added that way to a copy of the package; the copy validates its section, plans it and trains it."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    REPO,
    RUN_PY,
    addition_rows,
    child_env,
    read_metrics,
    recipe_dict,
    run_cmd,
    write_jsonl,
    write_recipe,
)

TOY_OBJECTIVE = '''"""A toy objective: SFT's loss times the recipe's toy.scale."""

from finetune.training.objectives.sft import Supervised


class Scaled(Supervised):
    def loss(self, model, batch, totals, device):
        tensor, logged, sums = super().loss(model, batch, totals, device)
        return tensor * self.recipe.toy.scale, logged * self.recipe.toy.scale, sums
'''
TOY_SECTION = '''"""The recipe's `toy:` section."""

from pydantic import BaseModel, ConfigDict, Field


class ToySection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    scale: float = Field(1.0, gt=0, description="What the SFT loss is multiplied by.")

    def check_recipe(self, recipe):
        if recipe.data.packing:
            raise ValueError("train.objective toy: data.packing is not for toys. Fix: remove data.packing.")
'''
TOY_ENTRY = '    ObjectiveSpec("toy", "finetune.training.objectives.toy:Scaled", "finetune.recipe.toy:ToySection"),\n'

CHECKS = '''
import sys
from finetune.errors import RecipeError
from finetune.recipe import load_recipe
recipe = load_recipe(sys.argv[1])
assert (recipe.train.objective, recipe.toy.scale) == ("toy", 3.0), recipe
for overrides, needle in ((["train.objective=sft"], "toy.scale: set, but train.objective is sft, which does not read "
                           "the toy: section"),
                          (["toy.scal=2"], "toy.scal"), (["data.packing=true"], "data.packing is not for toys"),
                          (["dpo.beta=0.2"], "dpo.beta: set, but train.objective is toy")):
    try:
        load_recipe(sys.argv[1], overrides)
    except RecipeError as exc:
        assert needle in str(exc), (needle, str(exc))
    else:
        raise AssertionError(f"{overrides} was accepted")
print("checks ok")
'''


def _changed_files(original: Path, copy: Path) -> list[str]:
    """The files of `copy` that are new or differ from `original` (recursively, __pycache__ left out)."""
    changed = []

    def walk(cmp: filecmp.dircmp, prefix: str) -> None:
        changed.extend(prefix + name for name in cmp.right_only + cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(filecmp.dircmp(original, copy, ignore=["__pycache__"]), "")
    return sorted(changed)


@pytest.mark.slow  # ~20 s: the copy's checks and plan (cold, two interpreters) and one step each of the toy and of SFT
def test_a_toy_objective_touches_its_module_its_section_and_one_registry_line_and_trains(tiny_llama, tmp_path):
    package = tmp_path / "pkg" / "finetune"
    shutil.copytree(REPO / "finetune", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "training" / "objectives" / "toy.py").write_text(TOY_OBJECTIVE)
    (package / "recipe" / "toy.py").write_text(TOY_SECTION)
    registry = package / "recipe" / "objectives.py"
    text = registry.read_text()
    end = text.index("\n)}\n")  # the registry's closing line
    registry.write_text(text[: end + 1] + TOY_ENTRY + text[end + 1:])
    assert _changed_files(REPO / "finetune", package) == ["recipe/objectives.py", "recipe/toy.py",
                                                           "training/objectives/toy.py"]
    assert len(registry.read_text().splitlines()) == len(text.splitlines()) + 1

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    train = {"max_steps": 1, "save_every": 0}
    toy = write_recipe(tmp_path / "toy.yaml", recipe_dict(tiny_llama, data, tmp_path / "toy", train=train | {
        "objective": "toy"}, toy={"scale": 3.0}))
    sft = write_recipe(tmp_path / "sft.yaml", recipe_dict(tiny_llama, data, tmp_path / "sft", train=train))

    env = child_env(PYTHONPATH=str(package.parent))
    cold = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "timeout": 300}
    checked = subprocess.run([sys.executable, "-c", CHECKS, str(toy)], check=False, **cold)
    assert checked.returncode == 0 and "checks ok" in checked.stdout, checked.stderr[-3000:]
    planned = subprocess.run([sys.executable, "-m", "finetune", "plan", str(toy)], check=False, **cold)
    assert planned.returncode == 0, planned.stderr[-3000:]
    trained = subprocess.run([sys.executable, str(package / "run.py"), str(toy)], check=False, **cold)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "toy" / "adapter" / "adapter_model.safetensors").is_file()

    baseline = run_cmd([sys.executable, str(RUN_PY), str(sft)])  # the repository's package, SFT
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    toy_loss, sft_loss = (read_metrics(tmp_path / name)[0]["loss"] for name in ("toy", "sft"))
    assert toy_loss == pytest.approx(3.0 * sft_loss, rel=1e-5)  # the same first step, before any update
