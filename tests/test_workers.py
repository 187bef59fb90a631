"""tests/workers.py: the files that share a launching session fixture are one unit of work, and the longest unit is
handed out first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("xdist")  # the dev extra has it (make install); without it `make test` runs in one process
import workers

TESTS = Path(__file__).resolve().parent
# conftest.py's session fixtures that launch training runs (the tiny models are built in-process, in seconds).
LAUNCHING_SESSION_FIXTURES = ("shipped_run", "strategy_runs", "checkpointed_run", "sft_adapter")


def _users(fixture: str) -> set[str]:
    pattern = re.compile(rf"\b{fixture}\b")
    return {path.relative_to(TESTS.parent).as_posix() for path in TESTS.rglob("test_*.py")
            if path != Path(__file__).resolve() and pattern.search(path.read_text())}


def test_every_file_sharing_a_launched_session_run_is_in_one_unit():
    for fixture in LAUNCHING_SESSION_FIXTURES:
        users = _users(fixture)
        assert len(users) >= 1, fixture
        units = {workers.UNIT_OF_FILE.get(path, path) for path in users}
        assert len(units) == 1, (f"{fixture} is used by {sorted(users)}, which tests/workers.py SHARED_RUNS puts in "
                                 f"{sorted(units)}: a second worker would launch its runs again; add them to one unit")


def test_units_are_files_except_the_shared_ones():
    scheduling = workers.SharedRunsScheduling.__new__(workers.SharedRunsScheduling)
    assert scheduling._split_scope("tests/training/test_kto.py::test_x[a-b]") == "sft adapter"
    assert scheduling._split_scope("tests/test_recipe.py::test_y") == "tests/test_recipe.py"


def test_the_longest_unit_is_handed_out_first():
    seconds = {"a::1": 5.0, "b::1": 30.0, "b::2": 1.0, "c::1": 20.0}
    queue = workers._LongestFirst(lambda tests: sum(seconds.get(t, 1.0) for t in tests))
    queue["a"] = {"a::1": False}
    queue["b"] = {"b::1": False, "b::2": False}
    queue["c"] = {"c::1": False, "c::new": False}
    queue["d"] = {"d::new": False}
    assert [queue.popitem(last=False)[0] for _ in range(4)] == ["b", "c", "a", "d"]


def test_the_durations_record_is_read():
    seconds = workers.recorded_seconds()
    assert len(seconds) > 500 and all(value >= 0 for value in seconds.values())
    assert any(nodeid.startswith("tests/parallel/test_shipped.py::") for nodeid in seconds)
