"""Bug bash bb64 #2: `finetune plan` judged another strategy than the one that runs.

Plan looked at parallel.strategy alone, not at the accelerate config the recipe names in its leading comment (the
launch `finetune validate`, `finetune data` and `finetune train` take), nor at its process count. Each test failed on
the code before its fix. In-process through `finetune.cli.main` (stored model configs: no download).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import write_recipe

from finetune import cli
from finetune.cli.plan import cli_plan

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _plan_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _plan_text(capsys, *argv: str) -> list[str]:
    assert cli.main(["plan", *argv]) == 0
    return capsys.readouterr().out.strip().splitlines()


@pytest.fixture
def configs(tmp_path, monkeypatch) -> Path:
    """A folder with the shipped fsdp1.yaml and fsdp2.yaml in accelerate_configs/, the current folder (a recipe's
    comment names its config by that path, as from a checkout)."""
    (tmp_path / "accelerate_configs").mkdir()
    for name in ("fsdp1", "fsdp2"):
        (tmp_path / "accelerate_configs" / f"{name}.yaml").write_text((REPO / "accelerate_configs" / f"{name}.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _named_recipe(folder: Path, config: str) -> Path:
    """A stored-config recipe whose leading comment names accelerate_configs/CONFIG.yaml with 2 processes."""
    raw = {"model": {"name_or_path": LLAMA_8B}, "data": {"datasets": [{"path": "x.jsonl"}], "max_length": 1024}}
    recipe = write_recipe(folder / f"{config}-recipe.yaml", raw)
    recipe.write_text(f"# accelerate config: accelerate_configs/{config}.yaml with num_processes: 2\n" + recipe.read_text())
    return recipe


def test_plan_judges_the_strategy_of_the_launch_the_recipe_names(capsys):
    """Found by a bug bash: gemma-3-27b names fsdp2.yaml with 2 processes, and validate says "FSDP2 over 2 processes",
    while `plan gemma-3-27b --gpus 2` said "DDP on 2 GPU(s) fits, 20.0 GiB" (--json: strategy ddp), though the FSDP
    row the run takes is 14.9 GiB. The other rows stay listed, and the planner's own choice is said beside."""
    payload = _plan_json(capsys, "gemma-3-27b", "--gpus", "2")
    assert (payload["strategy"], payload["fits"]) == ("fsdp", True)
    launch = payload["launch"]
    assert launch["config"].endswith("accelerate_configs/fsdp2.yaml") and launch["processes"] == 2
    assert launch["parallel"].startswith("FSDP2 over 2 processes (full shard)") and launch["note"] is None
    assert launch["verdict"]["estimate"] == "fsdp" and payload["chosen"] == "ddp"  # auto's, kept as an alternative
    assert {"ddp", "fsdp", "fsdp_grad_op", "fsdp_offload", "zero3"} <= {e["strategy"] for e in payload["estimates"]}
    assert launch["verdict"]["summary"].startswith("the run as launched: FSDP full shard on 2 GPU(s) fits, 14.9 GiB")


def test_plan_without_gpus_plans_the_process_count_of_the_recipes_launch(capsys):
    """Found by a bug bash: plain `finetune plan llama-3.1-70b` planned 1 GPU while the recipe's launch (validate's,
    train's) is fsdp2.yaml with 8 processes. Without --gpus (the parser's None) the launch's count is planned."""
    args = argparse.Namespace(recipe="llama-3.1-70b", overrides=[], gpus=None, gpu_memory="80GB", nodes=None,
                              cpu_memory=None, read_bandwidth=None, json=True)
    assert cli_plan(args) == 0
    payload = json.loads(capsys.readouterr().out)
    launch = payload["launch"]
    assert (launch["processes"], launch["gpus_per_node"], launch["nodes"]) == (8, 8, 1)
    assert payload["strategy"] == "fsdp" and payload["fits"] and launch["verdict"]["summary"].startswith(
        "the run as launched: FSDP full shard on 8 GPU(s) fits")


def test_gpus_against_the_launchs_count_plans_the_gpus_and_says_so(configs, capsys):
    """--gpus 4 for a recipe whose launch names 2 processes: planned on 4 (the user asked), as `finetune train
    --num-processes 4` runs it (the recipe's config at 4 processes), with a note naming the recipe's own count."""
    recipe = str(_named_recipe(configs, "fsdp2"))
    lines = _plan_text(capsys, recipe, "--gpus", "4")
    assert ("note: --gpus 4 plans 4 processes, as asked; the recipe's launch names 2 (accelerate_configs/fsdp2.yaml "
            "with num_processes: 2)") in "\n".join(lines)
    assert lines[-1].startswith("the run as launched: FSDP full shard on 4 GPU(s) fits"), lines[-2:]
    assert lines[-2].startswith("the planner's choice") and "DDP on 4 GPU(s) fits" in lines[-2], lines[-2:]
    assert "launch: 4 processes, as given, with the config the recipe names (accelerate_configs/fsdp2.yaml" in lines[-5]
    two = _plan_text(capsys, recipe, "--gpus", "2")  # the launch's own count: as the recipe names it, no note
    assert "launch: 2 processes, as the recipe names it (accelerate_configs/fsdp2.yaml with num_processes: 2)" in two
    assert not any(line.startswith("note:") for line in two), two
    one = _plan_json(capsys, recipe, "--gpus", "1")  # one process runs in this process: single
    assert one["strategy"] == "single" and "the recipe's launch names 2" in one["launch"]["note"]


def test_a_shard_grad_op_config_is_planned_as_shard_grad_op(configs, capsys):
    """Found by a bug bash: an FSDP config with fsdp_reshard_after_forward: false (shard-grad-op, which the shipped
    config's own comment offers) was planned as DDP under auto and as a full shard under parallel.strategy: fsdp.
    The shipped fsdp2.yaml with that one line changed; an FSDP1 config's rows are FSDP1's."""
    shipped = (REPO / "accelerate_configs" / "fsdp2.yaml").read_text()
    assert "  fsdp_reshard_after_forward: true " in shipped
    (configs / "accelerate_configs" / "grad_op.yaml").write_text(
        shipped.replace("  fsdp_reshard_after_forward: true ", "  fsdp_reshard_after_forward: false "))
    recipe = _named_recipe(configs, "grad_op")
    for strategy in ("auto", "fsdp"):
        payload = _plan_json(capsys, str(recipe), f"parallel.strategy={strategy}", "--gpus", "2")
        assert payload["launch"]["parallel"].startswith("FSDP2 over 2 processes (shard-grad-op)"), payload["launch"]
        assert (payload["strategy"], payload["launch"]["verdict"]["estimate"]) == ("fsdp", "fsdp_grad_op")
    rows = {}
    for name in ("fsdp1", "fsdp2"):
        payload = _plan_json(capsys, str(_named_recipe(configs, name)), "--gpus", "2")
        assert payload["launch"]["parallel"].startswith(f"FSDP{name[-1]} over 2 processes"), payload["launch"]
        rows[name] = next(e for e in payload["estimates"] if e["strategy"] == "fsdp")["reads"]["rank_bytes"]
    assert rows["fsdp1"] > 1.5 * rows["fsdp2"]  # FSDP1 reads whole units; FSDP2 each rank its own shard


def test_a_recipe_strategy_its_launch_refuses_is_said(configs, capsys):
    """parallel.strategy=ddp under the recipe's FSDP launch: validate and train refuse it, and plan said nothing of
    it. The refusal is said; the recipe's own strategy is still judged by its row."""
    recipe = str(_named_recipe(configs, "fsdp2"))
    payload = _plan_json(capsys, recipe, "parallel.strategy=ddp", "--gpus", "2")
    assert "parallel.strategy is `ddp` but the accelerate config is an FSDP config" in payload["launch"]["refused"]
    assert payload["recipe_strategy"]["estimate"] == "ddp" and payload["strategy"] == "ddp"
    lines = _plan_text(capsys, recipe, "parallel.strategy=ddp", "--gpus", "2")
    assert any(line.startswith("this launch is refused, as `finetune validate` and `finetune train` refuse it")
               for line in lines), lines
