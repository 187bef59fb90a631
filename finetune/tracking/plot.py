"""Charts of runs from their metrics.jsonl: loss (train and eval), the GRPO reward when logged, and learning rate
against steps.

    finetune plot runs/a                  -> runs/a/plot.png
    finetune plot runs/a runs/b --out x.png   (runs compared on one chart; default compare.png)

At the end of a run, run.py calls `plot_run(out_dir)`, which writes `<out_dir>/plot.png` and never fails the
finished run: on any plotting problem it prints one warning line, and without matplotlib (an optional extra:
`pip install 'finetune[plot]'`) one line per process. matplotlib draws with its headless Agg canvas (no display on
training machines).

A plot is regenerated output, but `--out` may name a user's own image: `finetune plot` replaces a run's plot.png
(the default) and any image it wrote itself (PNG, PDF, SVG, EPS and PS carry CREATOR in their metadata), and says so;
any other existing file is refused (nothing overwritten), as the other writing verbs refuse an existing destination.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.files import destination_problem
from finetune.tracking.metrics_file import read_records

INSTALL_PLOT = "pip install 'finetune[plot]'"
_said_missing = False  # the missing-matplotlib warning is said once per process (quickstart --dpo runs twice)
CREATOR = "finetune plot"  # the image's Creator metadata: an image finetune wrote, which `finetune plot` may replace
_MARKED = ("png", "pdf", "svg", "eps", "ps")  # the formats whose metadata matplotlib writes (and it is searchable)


def read_run(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Series of a run folder: train loss, eval loss, learning rate and (GRPO) reward as (step, value) lists."""
    folder = Path(run_dir)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        what = "does not exist" if not folder.exists() else "has no metrics.jsonl"
        raise FinetuneError(f"{folder}: {what}; `finetune plot` takes run folders (output.dir of a run), "
                            "which hold metrics.jsonl.")
    series: dict[str, list[tuple[int, float]]] = {"loss": [], "eval_loss": [], "learning_rate": [], "reward": []}
    for record in read_records(path):  # old runs' `lr` read as learning_rate
        for key, points in series.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "step" in record:
                points.append((int(record["step"]), float(value)))
    if not series["loss"] and not series["eval_loss"]:
        raise FinetuneError(f"{folder}: metrics.jsonl holds no loss yet (no logged step); nothing to plot.")
    return series


_LOSS_LABELS = {"sft": "loss (per trained token)", "dpo": "DPO loss (mean over pairs)", "kto": "KTO loss (mean over rows)",
                "reward": "reward-model loss (mean over pairs)", "grpo": "GRPO loss"}


def _loss_label(folders: list[Path]) -> str:
    """The loss axis's label, by the runs' train.objective (their recipe.yaml): DPO, KTO and reward losses are means
    over pairs or rows, not per trained token (the label said so for every run)."""
    import yaml

    objectives = set()
    for folder in folders:
        try:
            text = (folder / "recipe.yaml").read_text(encoding="utf-8")  # as a run writes it, whatever the locale
            objectives.add(((yaml.safe_load(text) or {}).get("train") or {}).get("objective", "sft"))
        except (OSError, ValueError, yaml.YAMLError, AttributeError):  # (ValueError: a UnicodeDecodeError)
            objectives.add(None)
    if len(objectives) == 1 and (only := objectives.pop()) in _LOSS_LABELS:
        return _LOSS_LABELS[only]
    return "loss (each run's objective)"


def _figure(**options):
    """A matplotlib Figure drawn by the Agg canvas; ImportError when matplotlib is not installed.

    Not pyplot: its global state and backend machinery cost ~0.3 s more at the end of every run, for nothing here.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**options)
    FigureCanvasAgg(figure)
    return figure


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """One PNG: loss (train solid, eval dashed with markers) above, the GRPO reward (runs that log one) in the middle,
    learning rate below, one colour per run."""
    runs = [(Path(d), read_run(d)) for d in run_dirs]  # every folder checked before drawing anything
    rewarded = any(series["reward"] for _, series in runs)
    figure = _figure(figsize=(9, 9 if rewarded else 7))
    if rewarded:
        loss_axes, reward_axes, lr_axes = figure.subplots(3, 1, sharex=True, height_ratios=[3, 2, 1.3])
        reward_axes.set_ylabel("reward (mean)")
        reward_axes.grid(alpha=0.3)
    else:
        loss_axes, lr_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1.3])
    for index, (folder, series) in enumerate(runs):
        color = f"C{index % 10}"
        name = folder.resolve().name
        if series["loss"]:
            loss_axes.plot(*zip(*series["loss"]), color=color, linewidth=1.4, label=f"{name} train")
        if series["eval_loss"]:
            loss_axes.plot(*zip(*series["eval_loss"]), color=color, linestyle="--", marker="o", label=f"{name} eval")
        if series["learning_rate"]:
            lr_axes.plot(*zip(*series["learning_rate"]), color=color, label=name)
        if series["reward"]:
            reward_axes.plot(*zip(*series["reward"]), color=color, linewidth=1.4, label=name)
    loss_axes.set_ylabel(_loss_label([folder for folder, _ in runs]))
    loss_axes.set_title("training runs" if len(runs) > 1 else runs[0][0].resolve().name)
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(fontsize=8)
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("optimizer step")
    lr_axes.grid(alpha=0.3)
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    marked = out.suffix.lower().lstrip(".") in _MARKED
    partial = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")  # (the suffix names the format)
    with warnings.catch_warnings():
        # A run named in CJK or with an emoji (its folder is the title and the legend) is drawn with boxes for the
        # characters the font lacks, and matplotlib warned once per character and drawing: 6 UserWarnings in the
        # log of a run that went well. The boxes stay; the numbers are what the chart is for.
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from (current )?font", category=UserWarning)
        figure.tight_layout()
        try:  # written beside it and renamed over it: a link there is replaced, never written through (bb26)
            figure.savefig(partial, dpi=110, **({"metadata": {"Creator": CREATOR}} if marked else {}))
            os.replace(partial, out)
        finally:  # (a read-only folder refuses the unlink too, EROFS: missing_ok covers ENOENT only; bb46)
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    return out


def written_by_finetune(path: Path) -> bool:
    """The image's metadata names CREATOR: written by `finetune plot` or a run's plot.png (the metadata sits near the
    start of a PNG, SVG or EPS and at the end of a PDF: those parts are read, not the whole file)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - (1 << 16)))
            tail = handle.read()
    except OSError:
        return False
    return CREATOR.encode() in head or CREATOR.encode() in tail


def check_plot_out(out: Path, *, run_plot: bool) -> bool:
    """FinetuneError unless `out` may be written; True when it replaces an image there. `run_plot`: the default
    `<run>/plot.png`, the run's own file, always replaced. Before: a folder named x.png or a path under a file were
    tracebacks, and any existing file was overwritten without a word."""
    if not os.path.lexists(out):
        if (problem := destination_problem(out)) and run_plot:  # no --out given: the run folder's own plot.png
            raise FinetuneError(_unwritable(out, OSError(problem), given=False))
        if problem:
            raise FinetuneError(f"--out {out}: {problem}. Nothing was written. Fix: choose another --out path.")
        return False
    if out.is_dir() or not out.exists():
        what = "a folder" if out.is_dir() else f"a symbolic link to {os.readlink(out)}, which does not exist"
        raise FinetuneError(f"--out {out}: is {what}, not an image file. Nothing was written. Fix: choose another "
                            "--out path, e.g. --out loss.png.")
    if run_plot or written_by_finetune(out) or out.suffix.lower().lstrip(".") not in _MARKED:
        return True  # (a format that carries no mark, JPEG or WebP: replaced, and said, as finetune cannot tell)
    raise FinetuneError(f"--out {out}: already exists and its metadata does not name {CREATOR!r} (another program's "
                        "image, or one a finetune before 2026-12-06 wrote); nothing was overwritten. Fix: choose "
                        "another --out path, or remove it first.")


def plot_run(out_dir: str | Path) -> Path | None:
    """`<out_dir>/plot.png` at the end of a run; a warning instead of an error, whatever goes wrong. None, without a
    word, for a run that logged no step in `out_dir` (a resume whose checkpoint is of train.max_steps, into another
    folder, trains none: its warning leaked `finetune plot`'s error text, bb38)."""
    global _said_missing
    try:
        return plot_runs([out_dir], Path(out_dir) / "plot.png")
    except FinetuneError:  # read_run's: no metrics.jsonl, or no loss in it (no step logged here): nothing to draw
        return None
    except ImportError:
        if _said_missing:
            return None
        _said_missing = True
        reason = f"matplotlib is not installed, it is optional: {INSTALL_PLOT}"
    except Exception as exc:  # noqa: BLE001 - the run is finished and saved; a chart must not fail it
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    old = Path(out_dir) / "plot.png"
    what = (f"{old} was not updated and shows the run before this ({reason})" if old.is_file()  # a resumed run's
            else f"no plot.png ({reason})")
    print(f"[finetune] warning: {what}; metrics.jsonl has the numbers.", file=sys.stderr, flush=True)
    return None


def cli_plot(args) -> int:
    """`finetune plot RUN_DIR [RUN_DIR ...] [--out PNG]`."""
    runs = list(args.runs)
    out = Path(args.out or (Path(runs[0]) / "plot.png" if len(runs) == 1 else "compare.png")).expanduser()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise FinetuneError(f"`finetune plot` needs matplotlib, which is optional. Fix: {INSTALL_PLOT}.") from None
    formats = FigureCanvasBase.get_supported_filetypes()  # what savefig writes (its own error is a traceback)
    if Path(out).suffix.lower().lstrip(".") not in formats:
        raise FinetuneError(f"--out {out}: not an image file name matplotlib writes. Fix: end it with one of "
                            f"{', '.join('.' + name for name in sorted(formats))}, e.g. --out loss.png.")
    replaces = check_plot_out(out, run_plot=not args.out and len(runs) == 1)
    try:
        path = plot_runs(runs, out)
    except ImportError:
        raise FinetuneError(f"`finetune plot` needs matplotlib, which is optional. Fix: {INSTALL_PLOT}.") from None
    except OSError as exc:  # a read-only run folder (a mount, another user's): a double traceback before (bb46)
        raise FinetuneError(_unwritable(out, exc, given=bool(args.out))) from None
    print(f"plot written to {path}" + (" (it replaces the plot written there before)" if replaces else ""))
    return 0


def _unwritable(out: Path, exc: OSError, *, given: bool) -> str:
    """The one paragraph for a plot that could not be written: the folder, the system's reason, and where else to
    write it (`--out`)."""
    reason = exc.strerror or str(exc)  # (the system's, or destination_problem's sentence)
    if given:
        return (f"--out {out}: the plot could not be written there ({reason}). Nothing was written. Fix: choose "
                "another --out path in a folder you can write, e.g. --out /tmp/plot.png.")
    return (f"{out.parent}: the plot could not be written into this run folder as {out.name} ({reason}: a read-only "
            "folder, e.g. a read-only mount or another user's run). Nothing was written and the run is unchanged. "
            f"Fix: write it elsewhere with --out, e.g. `finetune plot {out.parent} --out /tmp/plot.png`.")
