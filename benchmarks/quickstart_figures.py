"""The README's quickstart figures, from the runs that produce them: `finetune quickstart`, `--dpo` and `--grpo`.

    python benchmarks/quickstart_figures.py [--only sft|dpo|grpo] [--out DIR]      (make quickstart-figures)

Each command runs as a user runs it (`python -m finetune quickstart ...`, the shipped recipe unchanged, its own
process, the machine's GGUF cache: the first run ever converts the GGUF file, ~25 s, which is counted in its wall time);
its printed report is read back and the figures are printed in the README's words, with the machine they come from.
Nothing is written outside --out (default: a temporary folder, removed afterwards).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import group_run

# The lines of the quickstart's reports (finetune/cli/quickstart.py: report, dpo_report) that hold the figures.
SFT_SCORES = re.compile(r"exact match on (\d+) held-out prompts: before (\d+)% \((\d+)/\d+\) -> after (\d+)% \((\d+)/\d+\)")
DPO_SCORES = re.compile(r"exact match on (\d+) held-out prompts: after SFT (\d+)% -> after DPO (\d+)%")
GRPO_SCORES = re.compile(r"exact match on (\d+) held-out prompts: after SFT (\d+)% \((\d+)/\d+\) -> after GRPO (\d+)% "
                         r"\((\d+)/\d+\)")
DPO_PAIRS = re.compile(r"held-out pairs: reward accuracy (\d+)%, margin ([-+.\d]+), eval loss ([.\d]+)")


def machine() -> str:
    """`2 cores, Intel(R) Xeon(R) Processor, AMX, torch 2.13.0, load average 3.1 at the start`: what the wall time needs."""
    import torch

    from finetune.precision import cpu_summary

    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    return f"{cpu_summary()}, torch {torch.__version__}{load}"


def run_quickstart(args: list[str], log: Path) -> tuple[str, float]:
    """(printed output, wall seconds) of `python -m finetune quickstart ARGS`; exits with its log's tail if it fails."""
    start = time.perf_counter()
    with open(log, "w") as handle:
        code = group_run.run([sys.executable, "-m", "finetune", "quickstart", *args], cwd=REPO, stdout=handle,
                             stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    text = log.read_text()
    if code != 0:
        raise SystemExit(f"`finetune quickstart {' '.join(args)}` failed (exit {code}); the end of {log}:\n{text[-3000:]}")
    return text, wall


def sft_figures(root: Path) -> str:
    import yaml

    from finetune.cli.quickstart import quickstart_recipe

    steps = yaml.safe_load(quickstart_recipe().read_text())["train"]["max_steps"]  # the shipped recipe's
    text, wall = run_quickstart(["--out", str(root / "quickstart"), "output.overwrite=true"], root / "quickstart.log")
    found = SFT_SCORES.search(text)
    if not found:
        raise SystemExit(f"the quickstart's report has no before/after line:\n{text[-2000:]}")
    prompts, before, _, after, _ = found.groups()
    return (f"`finetune quickstart`: exact match on {prompts} held-out prompts went from {before}% to {after}% in "
            f"{steps} steps, {wall:.0f} s wall time\n    (its report: {found.group(0)})")


def dpo_figures(root: Path) -> str:
    from finetune.cli.quickstart import SFT_STEPS

    text, wall = run_quickstart(["--dpo", "--out", str(root / "quickstart-dpo"), "output.overwrite=true"],
                                root / "quickstart-dpo.log")
    scores, pairs = DPO_SCORES.search(text), DPO_PAIRS.search(text)
    if not scores:
        raise SystemExit(f"the DPO quickstart's report has no exact-match line:\n{text[-2000:]}")
    _, after_sft, after_dpo = scores.groups()
    line = (f"`finetune quickstart --dpo`: a {SFT_STEPS}-step SFT answers {after_sft}% of the held-out prompts exactly, "
            f"DPO from its adapter {after_dpo}%, {wall:.0f} s wall time\n    (its report: {scores.group(0)}")
    if pairs:
        line += f"; held-out pairs: reward accuracy {pairs.group(1)}%, eval loss {pairs.group(3)}"
    return line + ")"


def grpo_figures(root: Path) -> str:
    from finetune.cli.quickstart import SFT_STEPS

    text, wall = run_quickstart(["--grpo", "--out", str(root / "quickstart-grpo"), "output.overwrite=true"],
                                root / "quickstart-grpo.log")
    scores = GRPO_SCORES.search(text)
    if not scores:
        raise SystemExit(f"the GRPO quickstart's report has no exact-match line:\n{text[-2000:]}")
    prompts, after_sft, _, after_grpo, _ = scores.groups()
    return (f"`finetune quickstart --grpo`: a {SFT_STEPS}-step SFT answers {after_sft}% of {prompts} held-out prompts "
            f"exactly, GRPO from its adapter {after_grpo}%, {wall:.0f} s wall time\n    (its report: {scores.group(0)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["sft", "dpo", "grpo"], help="one of the three runs")
    parser.add_argument("--out", type=Path, help="keep the run folders and logs here (default: a temporary folder)")
    args = parser.parse_args()
    group_run.stop_on_sigterm()  # a timeout's SIGTERM ends the running quickstart too, and removes the temporary folder
    print(f"[quickstart-figures] machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="quickstart-figures-") as scratch:
        root = (args.out or Path(scratch)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        lines = []
        for name, figures in (("sft", sft_figures), ("dpo", dpo_figures), ("grpo", grpo_figures)):
            if args.only in (None, name):
                lines.append(figures(root))
                print(f"[quickstart-figures] {lines[-1]}", flush=True)
    print("\nThe README's figures, as measured now:")
    print("\n".join(f"  {line}" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
