"""How `make test`'s pytest-xdist workers share the suite (registered by conftest.py when xdist is loaded).

Two things `--dist loadfile` alone gets wrong on a 2-core machine:

* A session fixture is built once per worker. The runs that several files share (conftest.py's `shipped_run`,
  `strategy_runs`, `checkpointed_run`, `sft_adapter`: each one or more launches of 2 ranks) were launched again by
  the second worker whenever its files landed there. SHARED_RUNS keeps each set of files on one worker.
* Files were handed out by their number of tests, so a file of few long launches (test_shipped.py) could start last
  and leave one worker alone for its whole length. Here the longest unit goes first (longest-processing-time
  scheduling), each unit's length being its tests' seconds in tests/durations.txt (1 s for a test not in it yet).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

DURATIONS = Path(__file__).resolve().parent / "durations.txt"

# Files that use the same session-scoped runs: one unit of work, so the runs are made once.
SHARED_RUNS = {
    "shipped runs": (  # shipped_run (config x family) and strategy_runs (torchrun of each strategy)
        "tests/parallel/test_shipped.py", "tests/planner/test_planner.py", "tests/parallel/test_experts_parallel.py",
        "tests/parallel/test_distributed.py", "tests/test_quiet.py", "tests/outputs/test_export.py",
        "tests/model/test_experts_gpt_oss.py"),
    "sft adapter": ("tests/training/test_preference.py", "tests/training/test_kto.py"),
    "checkpointed runs": ("tests/outputs/test_checkpoint.py", "tests/outputs/test_export_step.py",
                          "tests/outputs/test_upgraded_runs.py"),
}
UNIT_OF_FILE = {path: unit for unit, paths in SHARED_RUNS.items() for path in paths}


# tests/tiers.py writes `tier wall cpu cold warm nodeid`; older records: `tier wall cpu launches nodeid`, `tier wall cpu
# nodeid`.
RECORD_LINE = re.compile(r"^(fast|slow)\s+([\d.]+)\s+\S+\s+(?:\d+\s+){0,2}(\S.*?)(?:  FAILED)?$")


def recorded_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Each test's wall seconds in the durations record."""
    seconds = {}
    if path.exists():
        for line in path.read_text().splitlines():
            match = RECORD_LINE.match(line)
            if match:
                seconds[match.group(3)] = float(match.group(2))
    return seconds


class _LongestFirst(OrderedDict):
    """The scheduler's queue of units: `popitem(last=False)` hands out the longest one left."""

    def __init__(self, length):
        super().__init__()
        self.length = length

    def popitem(self, last=True):
        unit = max(self, key=lambda name: (self.length(self[name]), name))
        return unit, self.pop(unit)


class SharedRunsScheduling(LoadFileScheduling):
    def __init__(self, config, log=None):
        super().__init__(config, log)
        seconds = recorded_seconds()
        self.workqueue = _LongestFirst(lambda tests: sum(seconds.get(nodeid, 1.0) for nodeid in tests))

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return UNIT_OF_FILE.get(path, path)


class Plugin:
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getoption("dist") == "loadfile":
            return SharedRunsScheduling(config, log)
        return None
