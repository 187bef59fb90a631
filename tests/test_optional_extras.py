"""matplotlib (plot.png, `finetune plot`) and gguf (GGUF model sources) are optional extras: without them a run still
finishes and the features that need them say in one line what to install.

The missing packages are simulated in this process (`sys.modules[name] = None` makes `import name` raise
ImportError, as on a machine without the package); .ci/wheel_smoke.sh runs the tiny quickstart in a venv that really
lacks them.
"""

from __future__ import annotations

import json
import sys
import tomllib

from conftest import REPO, recipe_dict, write_recipe

from finetune.cli import main
from finetune.tracking import plot


def metrics_run(folder):
    folder.mkdir(parents=True)
    lines = [{"step": step, "loss": 3.0 / step, "lr": 1e-4} for step in range(1, 6)] + [{"step": 5, "eval_loss": 0.9}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_pyproject_declares_matplotlib_and_gguf_as_extras_only():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = {requirement.split(">")[0].split("=")[0].split("<")[0].strip() for requirement in pyproject["project"]["dependencies"]}
    assert not {"matplotlib", "gguf"} & names
    extras = pyproject["project"]["optional-dependencies"]
    assert extras["plot"] == ["matplotlib>=3.8"] and extras["gguf"] == ["gguf>=0.10"]
    for extra in ("dev", "all"):  # `make install` ([dev]) keeps both: the quickstart's model is a GGUF file
        assert {"matplotlib>=3.8", "gguf>=0.10"} <= set(extras[extra])
    assert pyproject["build-system"]["requires"] == ["setuptools>=77"]  # SPDX `license = "Apache-2.0"` needs 77


def test_a_run_without_matplotlib_warns_once_and_writes_no_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # simulated: matplotlib not installed
    monkeypatch.setattr(plot, "_said_missing", False)
    first, second = metrics_run(tmp_path / "a"), metrics_run(tmp_path / "b")
    assert plot.plot_run(first) is None and plot.plot_run(second) is None  # two runs in one process (quickstart --dpo)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "pip install 'finetune[plot]'" in lines[0] and "warning" in lines[0], lines
    assert not (first / "plot.png").exists() and not (second / "plot.png").exists()


def test_a_resumed_run_without_matplotlib_says_its_plot_is_from_before(tmp_path, monkeypatch, capsys):
    """Found by a bug bash (the wheel): a run resumed where matplotlib is missing said "no plot.png" while the run
    folder kept the first attempt's plot.png (steps 1-2 of 4), which looked current. It is named as stale (and kept)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # simulated: matplotlib not installed
    monkeypatch.setattr(plot, "_said_missing", False)
    run = metrics_run(tmp_path / "a")
    (run / "plot.png").write_bytes(b"an earlier attempt's chart")
    assert plot.plot_run(run) is None
    err = capsys.readouterr().err
    assert "plot.png was not updated and shows the run before this" in err and "no plot.png" not in err, err
    assert (run / "plot.png").read_bytes() == b"an earlier attempt's chart"


def test_finetune_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # simulated: matplotlib not installed
    assert main(["plot", str(metrics_run(tmp_path / "run"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "pip install 'finetune[plot]'" in err, err


def test_a_gguf_source_without_gguf_says_what_to_install(tmp_path, alpaca_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # simulated: gguf not installed
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))  # nothing converted yet
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.gguf").write_bytes(b"GGUF")  # never read: the package check comes first
    values = recipe_dict(tmp_path / "model", alpaca_file, tmp_path / "run", model={"gguf_file": "m.gguf"})
    assert main(["validate", str(write_recipe(tmp_path / "r.yaml", values))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model.gguf_file `m.gguf`" in err and "pip install 'finetune[gguf]'" in err, err
    assert err.count("\n") == 1
