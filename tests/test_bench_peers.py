"""benchmarks/bench_peers.py and its DPO / GRPO harnesses (bench_peers_dpo.py, bench_peers_grpo.py): what they measure
around finetune's loop, their ratio tables and their command lines, in-process (no benchmark run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import recipe_dict

from finetune import data, distributed, model, training
from finetune.recipe import validate_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/ is a script folder, not a package

import bench_peers
import bench_peers_dpo
import bench_peers_grpo


def test_phase_readings_come_from_the_calls_the_loop_makes(tiny_llama, alpaca_file, tmp_path):
    """Found by a bug bash: the phase table's "after training" and "after the final eval" were 0 MB in every run: the
    harness wrapped training.loop.evaluate, which the loop no longer calls (it calls evaluate_figures). Now the loop
    itself runs under the harness's hooks, and every phase is read; the hooks are gone afterwards."""
    recipe = validate_recipe(recipe_dict(tiny_llama, alpaca_file, tmp_path / "out", train={
        "max_steps": 2, "eval_every": 0, "save_every": 0, "gradient_checkpointing": False},
        eval={"generation_rows": 0}))
    distributed.init_distributed()
    tokenizer = model.load_tokenizer(recipe)
    train_examples, eval_examples, _ = data.build_examples(recipe, tokenizer)
    peft_model = model.build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=False)
    originals = (training.loop.evaluate_figures, training.loop.optimizer_step, data.BatchStream.__iter__)
    tokens, phases = [], {}
    (tmp_path / "out").mkdir()
    with bench_peers.measured_run(tokens, phases):
        training.train(peft_model, recipe, train_examples, eval_examples, pad_id=tokenizer.pad_token_id,
                       out_dir=tmp_path / "out")
    assert set(phases) == {"before_eval", "after_eval", "before_checkpoint", "after_checkpoint"}
    assert all(value > 0 for value in phases.values())
    assert phases["before_eval"] <= phases["after_eval"] <= phases["after_checkpoint"]  # a high-water mark
    assert len(tokens) >= 2 and all(count > 0 for count in tokens)
    assert (training.loop.evaluate_figures, training.loop.optimizer_step, data.BatchStream.__iter__) == originals


def summarized(runs: list[tuple[str, str, float, float]]) -> list[dict]:
    """Saved runs as `--json` writes them: (runner, mode, tokens/s, peak RSS MB)."""
    return [{"runner": runner, "mode": mode, "procs": 1, "strategy": "single", "median_tokens_per_s": speed,
             "tokens_per_s": speed, "peak_rss_mb": rss, "eval_loss": 1.0, "other_cpu": 0.0, "phases": {}}
            for runner, mode, speed, rss in runs]


def test_ratios_without_an_ours_row_are_not_available():
    """Found by a bug bash: with no `ours` row in a mode, every "vs ours" ratio was the row against itself (1.00x)."""
    lines = bench_peers.table(summarized([("trl", "unpacked", 100, 800), ("peft", "unpacked", 150, 600),
                                          ("ours", "packed", 200, 400), ("trl", "packed", 100, 800)])).splitlines()
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[-3:-1] for line in lines[2:]}
    assert [cell.strip() for cell in rows["trl", "unpacked"]] == ["n/a", "n/a"]
    assert [cell.strip() for cell in rows["peft", "unpacked"]] == ["n/a", "n/a"]
    assert [cell.strip() for cell in rows["trl", "packed"]] == ["0.50x", "2.00x"]


def test_phase_table_shows_a_phase_not_seen_as_a_dash():
    """Found by a bug bash: a phase that was never read printed as 0 MB, a figure; now `-`."""
    runs = summarized([("ours", "unpacked", 100, 800)])
    runs[0]["phases"] = {"before_checkpoint": 500.0, "after_checkpoint": 544.0}
    assert bench_peers.phase_table(runs).splitlines()[-1] == "| ours | unpacked | - | - | 544 |"


@pytest.mark.parametrize("argv, complaint", [
    (["--only", "ours,tlr"], "--only: unknown 'tlr'"),
    (["--only", "TRL"], "--only: unknown 'TRL'"),
    (["--modes", "unpack"], "--modes: unknown 'unpack'"),
    (["--modes", "pack,packed"], "--modes: unknown 'pack'"),
    (["--only", ","], "--only: no name given"),
])
def test_sft_harness_refuses_unknown_names_before_running(argv, complaint, monkeypatch, capsys):
    """Found by a bug bash: a typo in --only was skipped silently, and one in --modes ran unpacked under its own
    label (`--modes pack`). Now refused, with the names to choose from, before any input is written."""
    monkeypatch.setattr(bench_peers, "write_inputs", lambda *a, **k: pytest.fail("ran despite a bad name"))
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", *argv])
    with pytest.raises(SystemExit) as stop:
        bench_peers.main()
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert complaint in error and "choose from" in error


@pytest.mark.parametrize("argv, complaint", [
    (["--only", "TRL"], "--only: unknown 'TRL'; choose from ours, ours-precomputed, trl"),
    (["--only", "ours-precomputd"], "--only: unknown 'ours-precomputd'"),
    (["--steps", "1"], "--steps must be at least 3"),
])
def test_dpo_harness_refuses_unknown_names_and_too_few_steps(argv, complaint, monkeypatch, capsys):
    """Found by a bug bash: `--dpo --only TRL` (or a typo such as ours-precomputd) ran finetune's own DPO under that
    label, and `--steps 1` crashed in the tokens/s after the whole run. Now refused before anything runs; the worker
    refuses an unknown name too."""
    monkeypatch.setattr(bench_peers_dpo, "write_inputs", lambda *a, **k: pytest.fail("ran despite a bad argument"))
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--dpo", *argv])
    with pytest.raises(SystemExit) as stop:
        bench_peers.main()
    assert stop.value.code == 2 and complaint in capsys.readouterr().err
    monkeypatch.setattr(bench_peers_dpo, "worker_ours", lambda *a: pytest.fail("ours ran for 'TRL'"))
    with pytest.raises(SystemExit):
        bench_peers_dpo.worker_main(["--worker", "TRL", "--recipe", "r.yaml", "--out", "o"])


def test_dpo_table_without_ours_says_not_available():
    """Found by a bug bash: without an `ours` run the DPO table's "vs ours" columns read 0.00."""
    results = [{"runner": "trl", "tokens_per_s": 100.0, "peak_rss_mb": 800.0, "first_loss": 0.6931,
                "reward_accuracy": 0.5, "other_cpu": 0.0}]
    row = bench_peers_dpo.table(results).splitlines()[-1]
    assert row.split(")", 1)[1].split()[:3] == ["n/a", "800", "n/a"], row


def test_grpo_harness_refuses_an_unknown_runner(monkeypatch, capsys):
    """Found by a bug bash (the same family): `--grpo --only` took any name and failed in the worker, after the SFT
    run that starts the comparison."""
    monkeypatch.setattr(bench_peers_grpo, "write_inputs", lambda *a, **k: pytest.fail("ran despite a bad name"))
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--grpo", "--only", "ours,TRL"])
    with pytest.raises(SystemExit) as stop:
        bench_peers.main()
    assert stop.value.code == 2 and "--only: unknown 'TRL'" in capsys.readouterr().err
