"""Plots: a real PNG of sensible size per run and for a comparison; bad folders name themselves; no matplotlib is
one warning at the end of a run (never an error)."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import yaml

from finetune.cli import main as cli_main
from finetune.errors import FinetuneError
from finetune.tracking import plot


def fake_run(folder, *, steps: int = 30, scale: float = 1.0, old_names: bool = False):
    """A run folder's metrics.jsonl in today's names, or in the names runs wrote before (`lr`, per-step `tokens`)."""
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        lr = 2e-4 * min(1.0, step / 5)
        next_lr = 2e-4 * min(1.0, (step + 1) / 5)  # an old `lr` was the next step's rate (read after the scheduler's step)
        lines.append({"step": step, "loss": scale * (3.0 / step**0.5),
                      **({"lr": next_lr, "tokens": 512} if old_names else {"learning_rate": lr, "num_tokens": 512 * step})})
        if step % 10 == 0:
            lines.append({"step": step, "eval_loss": scale * (3.2 / step**0.5)})
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 31, "lo'  # a cut-off last line
    (folder / "metrics.jsonl").write_text(text)
    return folder


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_run_writes_png(tmp_path):
    run = fake_run(tmp_path / "run-a")
    path = plot.plot_run(run)
    assert path == run / "plot.png"
    width, height = png_size(path)
    assert 600 <= width <= 2000 and 400 <= height <= 2000
    assert path.stat().st_size > 10_000  # lines and labels drawn, not an empty canvas


@pytest.mark.parametrize("old_names", [False, True])
def test_read_run_series(tmp_path, old_names):
    """A run of today and one written before the HF/TRL names (`lr`, the next step's rate) give the same learning-rate
    series: each step's own rate (an old run's step 1 has none)."""
    series = plot.read_run(fake_run(tmp_path / "run", old_names=old_names))
    assert len(series["loss"]) == 30 and [s for s, _ in series["eval_loss"]] == [10, 20, 30]
    first = (2, pytest.approx(8e-5)) if old_names else (1, pytest.approx(4e-5))
    assert series["learning_rate"][0] == first and len(series["learning_rate"]) == 30 - old_names


def test_cli_compares_runs(tmp_path, capsys):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", scale=0.8)
    out = tmp_path / "charts" / "compare.png"
    assert cli_main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert png_size(out)[0] >= 600 and str(out) in capsys.readouterr().out
    single = plot.plot_runs([a], tmp_path / "single.png")
    assert out.stat().st_size > single.stat().st_size  # two runs draw more than one


def test_folder_without_metrics_is_named(tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(FinetuneError, match="not-a-run: has no metrics.jsonl"):
        plot.plot_runs([fake_run(tmp_path / "ok"), empty], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing: does not exist" in capsys.readouterr().err


def test_no_matplotlib_is_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.plot_run(fake_run(tmp_path / "run")) is None
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0]
    assert not (tmp_path / "run" / "plot.png").exists()


def test_a_nan_eval_is_valid_json_in_metrics_jsonl_never_best_and_the_loss_axis_names_the_objective(tmp_path):
    """Found by a bug bash of the numbers a run reports: a NaN eval loss was written as a bare NaN (not JSON: JSON.parse
    and jq refuse it; a skipped step's was the string "nan"), min() picked a NaN seen first as the best eval (keep_best,
    the summary's best step), and plot.png labelled DPO, KTO and reward losses "per trained token"."""
    from finetune.outputs.step_folders import best_step
    from finetune.recipe import validate_recipe
    from finetune.tracking import Trackers

    out = tmp_path / "run"
    recipe = validate_recipe({"model": {"name_or_path": "m"}, "data": {"datasets": [{"path": "d.jsonl"}]},
                              "output": {"dir": str(out)}})
    trackers = Trackers(recipe, out, is_main=True, resumed_step=0)
    trackers.write(step=1, loss=2.0, learning_rate=1e-4)
    trackers.write(step=2, eval_loss=float("nan"))
    trackers.close()
    strict = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
              for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert strict[-1] == {"step": 2, "eval_loss": "nan"}
    assert best_step([(2, float("nan")), (4, 5.0), (6, 4.0)], {2, 4, 6}) == 6
    assert best_step([(2, float("nan"))], {2}) is None

    for name, objective in (("dpo", "dpo"), ("sft", None), ("kto", "kto")):
        fake_run(tmp_path / name)
        (tmp_path / name / "recipe.yaml").write_text(yaml.safe_dump({"train": {"objective": objective} if objective else {}}))
    assert plot._loss_label([tmp_path / "dpo"]) == "DPO loss (mean over pairs)"
    assert plot._loss_label([tmp_path / "sft"]) == "loss (per trained token)"
    assert plot._loss_label([tmp_path / "dpo", tmp_path / "kto"]) == "loss (each run's objective)"


def test_a_linked_plot_png_is_replaced_never_written_through(tmp_path):
    """Found by a bug bash (bb26 #2): a run's plot.png that is a symbolic link (a run folder from a tarball, or linked
    into a shared report folder) was written through by savefig: the file it pointed at became the run's plot. The
    image is written beside it and renamed over the link."""
    run = fake_run(tmp_path / "run")
    target = tmp_path / "precious.png"
    target.write_bytes(b"not the run's plot")
    (run / "plot.png").symlink_to(target)
    plot.plot_run(run)
    assert target.read_bytes() == b"not the run's plot"
    assert not (run / "plot.png").is_symlink() and (run / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # no partial file left
