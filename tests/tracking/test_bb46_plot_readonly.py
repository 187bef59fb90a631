"""`finetune plot RUN` on a read-only run folder: one paragraph naming the folder and `--out`, no traceback (bb46)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from matplotlib.figure import Figure

from finetune.cli import main as cli_main
from finetune.tracking import plot


def test_plot_of_a_read_only_run_folder_is_one_paragraph_naming_out(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: `finetune plot RUN` on a read-only run folder (a read-only mount, or another user's run)
    ended in a double traceback: savefig raised EROFS, and the cleanup's `partial.unlink(missing_ok=True)` raised it
    again (missing_ok covers ENOENT only). The suite runs as root, which chmod does not stop, so the read-only folder
    is simulated: the one write into the run folder (savefig) and the unlink there raise EROFS, as a read-only mount
    does. `--out` elsewhere still works."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "learning_rate": 1e-4}) + "\n"
                                               for s in range(1, 6)))
    save, unlink = Figure.savefig, Path.unlink

    def read_only(path: Path):
        if Path(path).parent == run:
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def savefig(self, fname, *args, **kwargs):
        read_only(fname)
        return save(self, fname, *args, **kwargs)

    def path_unlink(self, missing_ok=False):
        read_only(self)
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Figure, "savefig", savefig)
    monkeypatch.setattr(Path, "unlink", path_unlink)
    assert cli_main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Read-only file system" in err and f"{run}:" in err
    assert f"finetune plot {run} --out" in err and len([line for line in err.splitlines() if line.strip()]) == 1
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    checked = plot.destination_problem
    monkeypatch.setattr(plot, "destination_problem", lambda path: f"{run} is not writable by this user")
    assert cli_main(["plot", str(run)]) == 2  # (no plot.png yet: found before drawing; it said `--out`, not given)
    assert f"{run}: the plot could not be written into this run folder" in capsys.readouterr().err
    monkeypatch.setattr(plot, "destination_problem", checked)
    out = tmp_path / "elsewhere" / "p.png"
    assert cli_main(["plot", str(run), "--out", str(out)]) == 0 and out.stat().st_size > 10_000
    capsys.readouterr()
    assert cli_main(["plot", str(run), "--out", str(run / "x.png")]) == 2  # a given --out there: named as such
    err = capsys.readouterr().err
    assert f"--out {run / 'x.png'}: the plot could not be written" in err and "Traceback" not in err
