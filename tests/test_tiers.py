"""The fast tier's launch guard and the durations record (tests/tiers.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tiers

PY = sys.executable


@pytest.mark.parametrize("args", [
    [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "finetune/run.py", "r.yaml"],
    [PY, "-m", "accelerate.commands.launch", "--num_processes", "2", "run.py"],
    [PY, "/repo/finetune/run.py", "r.yaml"],
    [PY, "-m", "finetune", "quickstart", "--tiny"],
    [PY, "-m", "pip", "wheel", "-q", "--no-deps", "."],
    ["torchrun", "--nproc_per_node=2", "x.py"],
    ["/usr/bin/accelerate", "launch", "x.py"],
    [PY, "-u", "/tmp/tool/convert_lora_to_gguf.py", "--base", "tiny"],
    [PY, "-m", "pytest", "-q", "tests/x.py"],
    ["sh", "-c", "python -m finetune train r.yaml"],
    "python -m finetune train r.yaml",  # shell=True
])
def test_a_launch_is_recognised(args):
    assert tiers.launch_in(args) is not None


@pytest.mark.parametrize("args", [
    [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],  # a peer that is killed
    ["uname", "-p"],
    ["nvidia-smi", "-L"],
    ["mount", "-t", "tmpfs", "tmpfs", "/tmp/pytest-of-root/test_finetune_x0/disk"],  # not Python: its path is no launch
    ["git", "status"],
    [PY, "-c", "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_CREAT)", "/tmp/run/.finetune.lock"],
    [PY, "-m", "json.tool", "/tmp/finetune/metrics.json"],
    # Judged by the CPU they use instead (test_a_fast_tier_test_whose_processes_use_cpu_fails):
    [PY, "-c", "import sys\nfrom finetune.errors import exit_process\nexit_process(3)"],
    ["bash", "benchmarks/gpu_smoke.sh"],
])
def test_a_cheap_helper_process_is_not_a_launch_by_its_command_line(args):
    assert tiers.launch_in(args) is None


def test_a_fast_tier_test_cannot_launch_and_a_slow_one_can(request, tmp_path):
    script = tmp_path / "noop.py"  # a script file is a launch by the rule; this one takes milliseconds
    script.write_text("import sys; sys.exit(7)\n")
    with pytest.raises(tiers.LaunchInFastTier, match="mark this test @pytest.mark.slow"):
        subprocess.run([PY, str(script)], check=False)
    request.node.add_marker(pytest.mark.slow)  # the guard asks at the moment of the launch
    assert subprocess.run([PY, str(script)], check=False).returncode == 7


def test_a_fast_tier_test_whose_processes_use_cpu_fails(pytestconfig, request):
    plugin = pytestconfig.pluginmanager.get_plugin("finetune-tiers")
    plugin.check_children(request.node, tiers.CHILD_CPU_LIMIT)  # at the limit: allowed
    with pytest.raises(tiers.LaunchInFastTier, match=r"used 3\.0 s of CPU .* mark this test @pytest.mark.slow"):
        plugin.check_children(request.node, 3.0)
    request.node.add_marker(pytest.mark.slow)
    plugin.check_children(request.node, 3.0)


def test_the_record_lists_each_test_with_its_tier_and_seconds(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin("finetune-tiers")
    finished = tiers.Tiers.__new__(tiers.Tiers)  # a finished run's figures, without patching subprocess a second time
    finished.__dict__.update(config=plugin.config, started=plugin.started, failed={"t.py::b"},
                             seconds={"t.py::a": 1.34, "t.py::b": 30.0}, cpu_seconds={"t.py::a": 1.0, "t.py::b": 4.0},
                             slow={"t.py::a": False, "t.py::b": True}, launches={"t.py::b": 3}, warm={"t.py::b": 5})
    lines = finished.record(None).splitlines()
    assert "fast      1.3      1.0     0     0  t.py::a" in lines
    assert "slow     30.0      4.0     3     5  t.py::b  FAILED" in lines
    assert "# fast tier: 1 tests, 1 s wall, 1 s CPU, 0 cold launches, 0 warm" in lines
    assert "# slow tier: 1 tests, 30 s wall, 4 s CPU, 3 cold launches, 5 warm" in lines


def test_the_record_reads_back_with_and_without_the_launch_columns(tmp_path):
    """workers.py reads the record tiers.py writes, and the records written before the launch columns."""
    import workers

    (tmp_path / "new.txt").write_text("# tier     wall      cpu  cold  warm  test\n"
                                      "slow     30.0      4.0     3     5  t.py::b[a b]  FAILED\nfast  1.3  1.0  0  0  t.py::a\n")
    (tmp_path / "launches.txt").write_text("# tier     wall      cpu  launches  test\n"
                                           "slow     30.0      4.0         3  t.py::b[a b]  FAILED\nfast  1.3  1.0  0  t.py::a\n")
    (tmp_path / "old.txt").write_text("slow     30.0      4.0  t.py::b[a b]\nfast  1.3  1.0  t.py::a\n")
    for name in ("new.txt", "launches.txt", "old.txt"):
        assert workers.recorded_seconds(tmp_path / name) == {"t.py::b[a b]": 30.0, "t.py::a": 1.3}


def test_a_tests_launches_are_counted(request, tmp_path):
    """The launch guard counts every launch a test starts (the record's `cold` column); this fast one is refused
    after the count."""
    plugin = request.config.pluginmanager.get_plugin("finetune-tiers")
    before = plugin.launches.get(request.node.nodeid, 0)
    plugin.item = request.node  # as the guard sees a test that is running
    with pytest.raises(tiers.LaunchInFastTier):
        plugin.check([sys.executable, str(tmp_path / "script.py")])
    assert plugin.launches[request.node.nodeid] == before + 1
    plugin.launches[request.node.nodeid] = before  # the record keeps this test's real count
    import warm

    with pytest.raises(tiers.LaunchInFastTier):  # a warm launch is a launch too, counted in its own column
        plugin.check([sys.executable, str(warm.WARM_LAUNCH), sys.executable, str(tmp_path / "script.py")])
    assert plugin.launches[request.node.nodeid] == before and plugin.warm.pop(request.node.nodeid) == 1


def test_the_durations_record_lists_every_collected_test(request):
    """tests/durations.txt is regenerated by the change that adds tests (`make durations`): every test this run
    collected has its line there, with its wall time and launch counts, so that the growth shows in review."""
    import workers

    if request.config.getoption("durations_record"):
        pytest.skip("this run writes the record (make durations): it is checked by the runs after it")
    recorded = workers.recorded_seconds()
    missing = sorted(item.nodeid for item in request.session.items if item.nodeid not in recorded)
    assert not missing, (f"{len(missing)} tests are not in tests/durations.txt: run `make durations` and commit it "
                         f"(first: {missing[:5]})")
