"""The two tiers of the suite, kept honest: a pytest plugin (registered by conftest.py).

* The fast tier (`make test-fast`, `pytest -m "not slow"`) is in-process. A test without the `slow` mark fails
  - at once, when it starts a launch: torchrun, `accelerate launch`, the DeepSpeed launcher, pip (a wheel build), the
    `finetune` command, or a Python process running a module of the project or of those tools (`-m`) or a script file;
  - after its call, when the processes it started (a `python -c` script, a shell script) used more than
    CHILD_CPU_LIMIT seconds of CPU: a fresh interpreter that imports torch costs that much, a training run far more.
  The message says to mark the test slow. Cheap helper processes stay: `python -c "import time; time.sleep(60)"` as a
  peer that dies, a `-c` script that imports only a light module of finetune, `uname`, `mount`, a shell script that
  stops early, forked `datasets` workers.
* `--durations-record PATH` writes every test's wall and CPU seconds (setup + call + teardown), its tier and the run's
  totals into PATH (`make durations` -> tests/durations.txt), so that a slower suite shows in review.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.precision import cpu_summary

LAUNCHERS = {"torchrun", "accelerate", "deepspeed", "pip", "pip3", "finetune"}
# A Python process is a launch by its command line when it runs a module of the project, a launcher, pip, a build or a
# pytest session (`-m`), or a script file. Its other arguments (paths, often under a folder named after the test) do
# not count; `-c` code is judged by the CPU its process used (CHILD_CPU_LIMIT).
LAUNCH_MODULES = re.compile(r"(finetune|torch|accelerate|deepspeed|pip|build|pytest)(\.|$)")
SHELLS = {"sh", "bash", "dash", "zsh"}
# CPU seconds that the processes a fast-tier test started may use together: `python -c "import torch"` alone takes
# ~1.5-3 s of CPU; the cheap helpers of the fast tier take < 0.5 s.
CHILD_CPU_LIMIT = 1.5
PYTHON_FLAGS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def launch_in(args) -> str | None:
    """The command line, shortened, when `args` (as given to subprocess.Popen) is a launch; else None."""
    if isinstance(args, (str, bytes, os.PathLike)):  # shell=True, or a bare program name
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(arg) for arg in args]
    if not argv or not _is_launch(argv):
        return None
    line = " ".join(argv).replace("\n", " ")
    return line if len(line) <= 160 else line[:157] + "..."


def _is_launch(argv: list[str]) -> bool:
    program = Path(argv[0]).name
    if program in LAUNCHERS:
        return True
    if program in SHELLS:  # `sh -c "python -m ..."` is judged by its first command; a script by its CPU
        if "-c" in argv[1:-1]:
            inner = shlex.split(argv[argv.index("-c") + 1])
            return bool(inner) and _is_launch(inner)
        return False
    if not (program.startswith("python") or argv[0] == sys.executable):
        return False
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "-m":
            return bool(LAUNCH_MODULES.match(next(rest, "")))
        if arg == "-c":
            return False
        if arg in PYTHON_FLAGS_WITH_VALUE:
            next(rest, None)
        elif not arg.startswith("-"):
            return True  # a script file
    return False


class LaunchInFastTier(AssertionError):
    pass


class Tiers:
    """The launch guard and the durations record (one instance per pytest process)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.item: pytest.Item | None = None  # the test being set up, run or torn down
        self.seconds: dict[str, float] = {}  # wall
        self.cpu_seconds: dict[str, float] = {}  # this process's CPU time plus its finished children's
        self.slow: dict[str, bool] = {}
        self.launches: dict[str, int] = {}  # cold process launches each test started (its floor: ~21 CPU-s per 2-rank launch)
        self.warm: dict[str, int] = {}  # warm launches (tests/warm.py: ranks forked from servers that imported already)
        self.failed: set[str] = set()
        self.started = time.time()
        self.children_at_start = 0.0
        self._patch_popen()

    def _patch_popen(self) -> None:
        # _execute_child is where every subprocess.run/check_output/Popen spawns on POSIX: one place to look.
        original = subprocess.Popen._execute_child
        tiers = self

        def execute_child(popen, args, *rest, **kwargs):
            tiers.check(args)
            return original(popen, args, *rest, **kwargs)

        subprocess.Popen._execute_child = execute_child

    def check(self, args) -> None:
        item = self.item
        line = launch_in(args) if item is not None else None
        if line is None:
            return
        import warm

        counts = self.warm if warm.is_warm(args) else self.launches
        counts[item.nodeid] = counts.get(item.nodeid, 0) + 1
        if item.get_closest_marker("slow") is not None:
            return
        raise LaunchInFastTier(
            f"{item.nodeid} is in the fast tier (no `slow` mark) but starts a process launch: {line}\n"
            "The fast tier (`make test-fast`, pytest -m 'not slow') is in-process: mark this test "
            "@pytest.mark.slow (tests/tiers.py says what counts as a launch).")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.item = item
        started = cpu_time()
        self.children_at_start = children_cpu_time()
        try:
            return (yield)
        finally:
            self.item = None
            self.cpu_seconds[item.nodeid] = cpu_time() - started

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        result = yield  # a test that failed has failed; a passing one is checked for the CPU its processes used
        self.check_children(item, children_cpu_time() - self.children_at_start)
        return result

    def check_children(self, item: pytest.Item, seconds: float) -> None:
        if seconds > CHILD_CPU_LIMIT and item.get_closest_marker("slow") is None:
            raise LaunchInFastTier(
                f"{item.nodeid} is in the fast tier (no `slow` mark) but the processes it started used {seconds:.1f} s "
                f"of CPU (the limit: {CHILD_CPU_LIMIT} s). The fast tier (`make test-fast`, pytest -m 'not slow') is "
                "in-process: mark this test @pytest.mark.slow (tests/tiers.py).")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield  # the launches go with the report, so that xdist's controller (which writes the record) has them
        if call.when == "teardown":
            report.user_properties.append(("launches", self.launches.get(item.nodeid, 0)))
            report.user_properties.append(("warm", self.warm.get(item.nodeid, 0)))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        for name, value in report.user_properties:
            if name in ("launches", "warm"):
                getattr(self, name)[report.nodeid] = value
        self.slow[report.nodeid] = "slow" in report.keywords  # also under xdist, where the items run elsewhere
        if report.failed:
            self.failed.add(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = self.config.getoption("durations_record")
        if path and not hasattr(self.config, "workerinput"):  # xdist: only the controller writes
            Path(path).write_text(self.record(session))

    def record(self, session: pytest.Session) -> str:
        wall = time.time() - self.started
        selection = self.config.getoption("markexpr") or "all"
        tiers = {name: [n for n in self.seconds if self.slow.get(n) == (name == "slow")] for name in ("fast", "slow")}
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines = [
            "# Wall and CPU seconds of every test (setup + call + teardown; a session fixture counts in the first test",
            "# that uses it; CPU: the pytest process's threads and the processes it waited for, which moves less with the",
            "# machine's load than wall time does), written by `make durations` (pytest --durations-record,",
            "# tests/tiers.py). Regenerate it in a change that adds or slows tests, so that the growth shows in review.",
            "# `make durations MARK='not slow'` records the fast tier only.",
            (f"# selection: -m {selection!r}; {len(self.seconds)} tests, {wall:.0f} s wall "
             f"({time.strftime('%Y-%m-%d', time.gmtime())}; {cpu_summary()}; load average {load:.1f} at the end)"),
        ]
        for name, ids in tiers.items():
            if ids:
                lines.append(f"# {name} tier: {len(ids)} tests, {sum(self.seconds[n] for n in ids):.0f} s wall, "
                             f"{sum(self.cpu_seconds.get(n, 0.0) for n in ids):.0f} s CPU, "
                             f"{sum(self.launches.get(n, 0) for n in ids)} cold launches, "
                             f"{sum(self.warm.get(n, 0) for n in ids)} warm")
        if self.failed:
            lines.append(f"# failed in this run: {len(self.failed)} (their seconds are up to the failure)")
        lines.append("# cold: the process launches the test started (launchers, pip, `python -m finetune`, scripts), each paying")
        lines.append("# its imports; warm: launches whose ranks were forked from the suite's warm servers (tests/warm.py)")
        lines.append("# tier     wall      cpu  cold  warm  test")
        for nodeid in sorted(self.seconds):
            tier = "slow" if self.slow.get(nodeid) else "fast"
            mark = "  FAILED" if nodeid in self.failed else ""
            cpu = f"{self.cpu_seconds[nodeid]:7.1f}" if nodeid in self.cpu_seconds else "      -"  # xdist: not measured
            lines.append(f"{tier}  {self.seconds[nodeid]:7.1f}  {cpu}  {self.launches.get(nodeid, 0):4d}  "
                         f"{self.warm.get(nodeid, 0):4d}  {nodeid}{mark}")
        return "\n".join(lines) + "\n"


def cpu_time() -> float:
    """CPU seconds of this process and of its children that ended: on a shared machine a test's CPU time moves less
    with the load than its wall time does."""
    return time.process_time() + children_cpu_time()


def children_cpu_time() -> float:
    """CPU seconds of the child processes that ended and were waited for (and of the children they waited for)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-record", metavar="PATH", default=None,
                     help="write every test's wall seconds and tier into PATH (make durations: tests/durations.txt)")
