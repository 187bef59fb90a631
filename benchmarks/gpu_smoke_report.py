"""The GPU smoke's verdict (benchmarks/gpu_smoke.py): a check per line (PASS and FAIL checked, SKIP with the reason
this machine could not check it), the counts and exit code, the JSON (written in every case) and the table."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_smoke_device import Cuda

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Check:
    """One line of the verdict: PASS and FAIL are checked, SKIP says why this machine could not check it."""

    name: str
    verdict: str
    detail: str
    figures: dict = field(default_factory=dict)


def verdict(ok: bool) -> str:
    return PASS if ok else FAIL


def summary(checks: list[Check]) -> dict[str, int]:
    return {"passed": sum(c.verdict == PASS for c in checks), "failed": sum(c.verdict == FAIL for c in checks),
            "skipped": sum(c.verdict == SKIP for c in checks)}


def exit_code(checks: list[Check]) -> int:
    """0 when no check failed (skips allowed: they are listed), else 1."""
    return 1 if any(c.verdict == FAIL for c in checks) else 0


def write_report(path: Path, about: dict, runs: dict, checks: list[Check], started: float) -> None:
    report = {**about, "seconds": round(time.monotonic() - started, 1),
              # A failed run keeps its stderr's end: on a lent GPU there may be no second try to see it.
              "runs": {k: {key: v for key, v in r.items() if key != "stdout" and (key != "stderr" or not r["ok"])}
                       for k, r in runs.items()},
              "checks": [{"check": c.name, "verdict": c.verdict, "detail": c.detail, **c.figures} for c in checks],
              "summary": summary(checks)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def print_table(path: Path, about: dict, runs: dict, checks: list[Check], device: Cuda) -> None:
    print(f"\nGPU smoke on {about['device']} (torch {about['torch']}, CUDA {about['cuda'] or '-'}); JSON: {path}")
    print(f"{'run':<15} {'tokens/s':>9} {device.peak_label:>9} {'reserved':>9}  losses (first -> last)")
    for name, run in runs.items():
        if run["ok"] and run["losses"]:
            reserved = "-" if run["reserved_mib"] is None else f"{run['reserved_mib']:.0f}"
            print(f"{name:<15} {run['tokens_per_s'] or 0:>9.0f} {run['peak_mib']:>9.0f} {reserved:>9}  "
                  f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}")
        else:
            print(f"{name:<15} {run['reason'][-100:] if run['reason'] else 'no losses logged'}")
    if device.dry_run:
        print("* dry run: CPU-side figures stand in for the GPU's (peak RSS; each check's detail names its stand-in)")
    for check in checks:
        print(f"{check.verdict}  {check.name}: {check.detail}")
    counts = summary(checks)
    print(f"gpu-smoke: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
          + (" (dry run on the CPU)" if device.dry_run else ""))
