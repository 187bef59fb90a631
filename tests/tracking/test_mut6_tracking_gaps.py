"""Mutation testing round 6 (bb72): gaps in finetune/tracking/runs.py (`finetune runs`) and plot.py (`finetune plot`).
Oracles: MLflow's own client (the runs and start times it stores), the PNG's own header, and the files on disk."""

from __future__ import annotations

import json
import struct
import time

import pytest

from finetune.cli import main


# ---------------------------------------------------------------------------------------------- finetune runs
def mlflow_folder(folder, runs: list[tuple[str, int, float]]) -> str:
    """A run folder whose own mlflow.db holds `runs` (name, start time in ms, final loss), created in that order."""
    from mlflow.tracking import MlflowClient

    folder.mkdir(parents=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("finetune", artifact_location=(folder / "mlartifacts").as_uri())
    for name, start_ms, loss in runs:
        run = client.create_run(experiment, run_name=name, start_time=start_ms)
        client.log_metric(run.info.run_id, "loss", loss, step=1)
        client.set_terminated(run.info.run_id)
    return uri


def listed(capsys, *args) -> tuple[int, str]:
    pytest.importorskip("mlflow")
    code = main(["runs", *map(str, args)])
    return code, capsys.readouterr().out


def test_runs_are_listed_oldest_first_with_the_start_time_mlflow_stored(tmp_path, capsys):
    """The docstring's promise (one row per run, oldest first) and the `started` column, against the start time
    MLflow's client reports for each run (milliseconds since the epoch)."""
    from mlflow.tracking import MlflowClient

    newer, older = 1_790_000_000_000, 1_700_000_000_000  # created newest first: the order must come from the times
    uri = mlflow_folder(tmp_path / "run", [("newer", newer, 1.5), ("older", older, 2.5)])
    code, out = listed(capsys, tmp_path / "run")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("finetune ")]
    assert [line.split()[1] for line in lines] == ["older", "newer"], out
    for line in lines:
        run = MlflowClient(tracking_uri=uri).get_run(line.split()[-1])
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.info.start_time / 1000))
        assert started in line and started.startswith(("2023", "2026")), (line, started)
    assert f"mlflow ui --backend-store-uri {uri}" in out  # one store: how to open it in the UI


def test_a_folder_of_run_folders_lists_every_run_folders_store(tmp_path, capsys):
    """`finetune runs runs/` reads every run folder inside (the module's docstring), not the first one."""
    for name in ("a", "b", "c"):
        mlflow_folder(tmp_path / "runs" / name, [(f"run-{name}", 1_700_000_000_000, 1.0)])
    code, out = listed(capsys, tmp_path / "runs")
    assert code == 0
    for name in ("a", "b", "c"):
        assert f"sqlite:///{tmp_path / 'runs' / name / 'mlflow.db'}: 1 run" in out and f"run-{name}" in out, out


def test_a_folder_whose_stores_all_cannot_be_read_exits_2(tmp_path, capsys):
    """Several run folders, none of whose stores can be read (trackers.json names a database in a folder that is
    gone): nothing is listed, and a script must not read that as success."""
    for name in ("a", "b"):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        gone = tmp_path / "gone" / name / "mlflow.db"
        (folder / "trackers.json").write_text(json.dumps({"mlflow_uri": f"sqlite:///{gone}", "mlflow": "x"}))
    pytest.importorskip("mlflow")
    assert main(["runs", str(tmp_path / "runs")]) == 2
    captured = capsys.readouterr()
    assert captured.out.count("cannot be read") == 2 and "none of the MLflow stores" in captured.err


# ---------------------------------------------------------------------------------------------- finetune plot
def metrics(folder, *, reward: bool = False, eval_only: bool = False, steps: int = 10):
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "learning_rate": 1e-4}
        if not eval_only:
            record["loss"] = 2.0 / step * (1 + (step * 7919 % 997) / 997)  # noisy: a PDF that does not compress away
        if reward:
            record["reward"] = step / 10
        lines.append(record)
        if step % 5 == 0:
            lines.append({"step": step, "eval_loss": 2.2 / step})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])[1]


def test_a_comparison_with_one_grpo_run_has_the_reward_panel(tmp_path, capsys):
    """The reward is drawn for the runs that log one (plot.py's docstring), also beside runs that do not: the chart
    of a GRPO run and an SFT run is as tall as the GRPO run's own (three panels), not the SFT run's (two)."""
    pytest.importorskip("matplotlib")
    grpo, sft = metrics(tmp_path / "grpo", reward=True), metrics(tmp_path / "sft")
    assert main(["plot", str(grpo)]) == 0 and main(["plot", str(sft)]) == 0
    assert main(["plot", str(grpo), str(sft), "--out", str(tmp_path / "both.png")]) == 0
    assert png_height(grpo / "plot.png") > png_height(sft / "plot.png")
    assert png_height(tmp_path / "both.png") == png_height(grpo / "plot.png")


def test_a_pdf_that_finetune_plot_wrote_is_replaced(tmp_path, capsys):
    """PDF carries its Creator mark in the document information at the end of the file: a PDF `finetune plot` wrote
    is replaced on the next call (the docstring: PNG, PDF, SVG, EPS and PS), not refused as a user's own, also when
    it is larger than the 64 KiB read from its start (a long run's curves)."""
    pytest.importorskip("matplotlib")
    runs = [str(metrics(tmp_path / f"run{i}", steps=60_000)) for i in range(3)]
    out = tmp_path / "loss.pdf"
    assert main(["plot", *runs, "--out", str(out)]) == 0
    capsys.readouterr()
    assert out.stat().st_size > 2 * 65536 and b"finetune plot" not in out.read_bytes()[:65536]
    assert main(["plot", *runs, "--out", str(out)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == f"plot written to {out} (it replaces the plot written there before)"


def test_plotting_several_runs_without_out_writes_compare_png_here_not_into_a_run(tmp_path, monkeypatch, capsys):
    """`finetune plot runs/a runs/b` writes compare.png in the current folder (docstring, --help); the first run's
    plot.png is its own chart and stays as it was."""
    pytest.importorskip("matplotlib")
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    (a / "plot.png").write_bytes(b"a's own chart")
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b)]) == 0
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert (a / "plot.png").read_bytes() == b"a's own chart"


def test_a_run_that_logged_only_eval_losses_is_plotted(tmp_path, capsys):
    """read_run refuses a metrics.jsonl with no loss at all; eval losses alone are a chart (plot.py: `no loss yet`
    means neither a train nor an eval loss)."""
    pytest.importorskip("matplotlib")
    run = metrics(tmp_path / "run", eval_only=True)
    assert main(["plot", str(run)]) == 0
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
