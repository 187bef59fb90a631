"""benchmarks/gpu_smoke.py without a GPU: its dry run end to end on the CPU, and its verdicts, in-process.

The GPU smoke runs where device time is scarce (a lent machine, 10 minutes a command): a KeyError there costs the
whole lease and leaves no table. Everything but the CUDA calls is checked here first.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
from conftest import REPO, child_env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_smoke  # (benchmarks/ is a script folder, not a package)
from gpu_smoke import FAIL, PASS, SKIP, Check, Cuda, Deadline, DryRun

TRAINED = ["single", "fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+dropout", "zero3"]
EXPECTED_CHECKS = [
    *(f"{name} trains" for name in TRAINED),
    *(f"{name} losses = single" for name in ("fsdp2", "fsdp2+offload", "fsdp1", "zero3")),
    "FSDP2 byte guard", "load peak vs planner", "FSDP2 step peak vs planner", "ours vs plain PEFT loop",
]
# What benchmarks/bench_loading.py's worker writes into {mode}-w{world}-rank{rank}.json (taken from a CPU run of it,
# plus the allocator's peak that it adds on a GPU). The original load check read a key no worker writes.
WORKER_RECORD = {"rank": 0, "world": 1, "mode": "sharded", "load_s": 0.17, "quantize_s": 0.008, "quantize_cpu_s": 0.008,
                 "bytes_read": 528640, "planner_bytes_read": 528640, "peak_over_baseline": 7311360,
                 "after_wrap_over_baseline": 5771264, "held_bytes": 286960, "full_4bit_base": 153728,
                 "peak_gpu_allocated": 300_000}


class H200(Cuda):
    """The GPU's own figures, with its one CUDA call the load check makes answered without a GPU."""

    def memory_bytes(self) -> int:
        return 141 * 2**30


@pytest.mark.slow
def test_dry_run_reaches_every_check_without_a_traceback(tmp_path):
    """The dry run on the CPU with a tiny model: every plan, the bench_loading worker, the step record, bench_peers;
    each check has a verdict and a detail in the JSON; ZeRO-3 is a SKIP exactly when deepspeed is not importable."""
    report_path = tmp_path / "x.json"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_smoke.py"), "--dry-run", "--work",
                             str(tmp_path / "work"), "--json", str(report_path), "--hidden", "64", "--layers", "2",
                             "--steps", "3", "--deadline-s", "300"],
                            capture_output=True, text=True, timeout=600, check=False, env=child_env())
    print(f"dry run: {time.perf_counter() - started:.0f} s")
    output = result.stdout[-3000:] + result.stderr[-5000:]
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, output
    report = json.loads(report_path.read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == EXPECTED_CHECKS, output
    assert all(c["verdict"] in (PASS, FAIL, SKIP) and c["detail"] for c in checks.values()), report["checks"]
    assert not [c for c in checks.values() if c["detail"].startswith("error:")], report["checks"]
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    skipped = [name for name, c in checks.items() if c["verdict"] == SKIP]
    assert skipped == ([] if deepspeed else ["zero3 trains", "zero3 losses = single"]), report["checks"]
    counts = report["summary"]
    assert result.returncode == (1 if counts["failed"] else 0), output
    assert (f"gpu-smoke: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
            in result.stdout), output
    assert report["dry_run"] is True and "dry run" in checks["load peak vs planner"]["detail"], report


def test_load_check_reads_the_worker_record_as_bench_loading_writes_it(tmp_path, monkeypatch):
    """The load check against the record bench_loading.py's worker writes and the planner's load term of the same
    model and recipe (the original check raised KeyError: 'planner_sharded_load', with no table and no JSON)."""
    source = (REPO / "benchmarks" / "bench_loading.py").read_text()
    assert all(f'"{key}"' in source for key in WORKER_RECORD), "bench_loading's worker record changed: update it here"
    work = tmp_path / "work"
    recipe = gpu_smoke.write_inputs(work, 64, 2, 3)
    planned = gpu_smoke.planned_load_bytes(work, recipe, H200())

    def worker_wrote(command, **kwargs):  # as the worker does: one JSON file per rank into the folder it is given
        (work / "sharded-w1-rank0.json").write_text(json.dumps(dict(WORKER_RECORD, peak_gpu_allocated=planned)))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(gpu_smoke, "run_quietly", worker_wrote)
    check = gpu_smoke.load_check(work, recipe, H200(), Deadline(60))
    assert check.verdict == PASS and "ratio 1.00" in check.detail, check
    assert check.figures == {"measured_bytes": planned, "planned_bytes": planned}
    # The term is the sharded one at one rank, without the CUDA context the allocator never sees.
    assert 153728 < planned < 2**20, planned

    too_high = gpu_smoke.load_verdict(dict(WORKER_RECORD, peak_gpu_allocated=int(planned * 1.2)), planned, Cuda())
    missing = gpu_smoke.load_verdict({k: v for k, v in WORKER_RECORD.items() if k != "peak_gpu_allocated"}, planned,
                                     Cuda())
    dry = gpu_smoke.load_verdict(WORKER_RECORD, planned, DryRun())
    assert too_high.verdict == FAIL and "ratio 1.20" in too_high.detail
    assert missing.verdict == FAIL and "no load peak allocated figure" in missing.detail
    assert dry.figures["measured_bytes"] == WORKER_RECORD["peak_over_baseline"] and "dry run" in dry.detail


def peer_run(runner: str, mode: str, tokens_per_s: float, peak_mb: float) -> dict:
    """One run as bench_peers.py's --json lists it."""
    return {"runner": runner, "mode": mode, "procs": 1, "strategy": "single", "median_tokens_per_s": tokens_per_s,
            "peak_gpu_mb": peak_mb, "peak_rss_mb": 500.0}


@pytest.mark.parametrize(("ours_speed", "ours_peak", "expected"), [
    (140.0, 90.0, PASS),  # 1.4x tokens/s, 0.9x memory
    (120.0, 90.0, FAIL),  # 1.2x tokens/s: below 1.3x
    (140.0, 110.0, FAIL),  # 1.1x memory: above 1.0x
    (140.0, 0.0, FAIL),  # no peak figure
])
def test_peer_line_checks_both_ratios_in_both_modes(ours_speed, ours_peak, expected):
    runs = [run for mode in ("unpacked", "packed")
            for run in (peer_run("ours", mode, ours_speed, ours_peak), peer_run("peft", mode, 100.0, 100.0))]
    check = gpu_smoke.peer_verdict(runs, Cuda(), "tiny model")
    assert check.verdict == expected, check
    assert "unpacked" in check.detail and "packed" in check.detail
    only_unpacked = [r for r in runs if r["mode"] == "unpacked"]
    assert gpu_smoke.peer_verdict(only_unpacked, Cuda(), "tiny model").verdict == FAIL  # a mode not measured


def test_skips_are_listed_but_never_passes(tmp_path):
    """A skipped run is SKIP (not PASS) for its own checks; skips alone exit 0, any failure exits 1; the deadline
    turns what has not started into FAIL 'not run: deadline' without starting it."""
    skipped = gpu_smoke.train("zero3", "deepspeed is not installed in this Python", tmp_path, Cuda(), Deadline(60))
    single = {"name": "single", "ok": True, "reason": "", "losses": [2.0, 1.5]}
    checks = [gpu_smoke.trains_check(single), gpu_smoke.trains_check(skipped), gpu_smoke.losses_check(skipped, single)]
    assert [c.verdict for c in checks] == [PASS, SKIP, SKIP]
    assert checks[1].detail == "deepspeed is not installed in this Python"
    assert gpu_smoke.summary(checks) == {"passed": 1, "failed": 0, "skipped": 2}
    assert gpu_smoke.exit_code(checks) == 0

    passed = Deadline(0)
    late = gpu_smoke.train("fsdp1", ["false"], tmp_path, Cuda(), passed)
    checks += [gpu_smoke.trains_check(late), gpu_smoke.losses_check(late, single),
               gpu_smoke.load_check(tmp_path, tmp_path / "recipe.yaml", Cuda(), passed),
               gpu_smoke.peer_check(tmp_path, Cuda(), passed)]
    assert [(c.verdict, c.detail) for c in checks[3:]] == [(FAIL, "not run: deadline")] * 4
    assert gpu_smoke.exit_code(checks) == 1
    assert gpu_smoke.trains_check({"name": "single", "ok": True, "reason": "", "losses": [2.0, 2.1]}).verdict == FAIL


def test_a_subprocess_gets_no_more_than_the_time_left():
    started = time.perf_counter()
    result = gpu_smoke.run_quietly(["sleep", "30"], timeout=240, deadline=Deadline(1), env=child_env())
    assert result.returncode == 124 and "the smoke's deadline" in result.stderr
    assert time.perf_counter() - started < 10


def test_a_check_that_raises_is_a_failed_check(capsys):
    """The table and the JSON are still written; the traceback goes to stderr (where the dry run's test looks)."""
    check = gpu_smoke.guarded("load peak vs planner", lambda: {}["planner_sharded_load"])
    assert check == Check("load peak vs planner", FAIL, "error: KeyError: 'planner_sharded_load'")
    assert "Traceback" in capsys.readouterr().err
