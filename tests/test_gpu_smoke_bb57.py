"""`make gpu-smoke` made ready for its first run on a lent GPU (issue 57; what bug bash bb57 predicted by reading it).

Each test says what was wrong before. The smoke's processes are stood in for (no GPU here), and the shell script runs
with a stand-in Python where the test is about the script, not about torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_smoke  # (benchmarks/ is a script folder, not a package)
import gpu_smoke_device
from gpu_smoke_device import Cuda, DryRun
from gpu_smoke_processes import Deadline
from gpu_smoke_report import FAIL, PASS, SKIP

from finetune.parallel import byte_guard

BENCH = REPO / "benchmarks"
# What the probe answers on a GPU whose copy rewrites NaNs (CUDA, pytorch #159333) with torch 2.11
COPY_IN = {"mixed_unit_as_uint8_bitwise": True, "bf16_unit_bitwise": False}
TWO_RANKS = {"copy_keeps_bytes": False, "route": "mixed", "route_keeps_bytes": True, "unguarded_keeps_bytes": False}
FSDP2_RUN = {"name": "fsdp2", "ok": True, "reason": "", "route": "mixed", "losses": [2.0, 1.5]}


# ------------------------------------------------------------------- finding 1: lines that can fail for a reason
def test_the_copy_in_line_fails_where_a_mixed_unit_loses_bytes_and_only_reports_the_bf16_fact():
    """Found by a bug bash: the probe's FSDP2 copy-in answer was only printed. Now a unit of mixed dtypes (the route
    finetune takes on torch < 2.12) must come through the copy-in bitwise, else FAIL; whether a bf16-only unit loses
    its NaN payloads is reported in the detail either way and decides nothing."""
    probe = {"fsdp_copy_in": COPY_IN}
    passed = gpu_smoke.copy_in_check(probe, Cuda())
    assert passed.verdict == PASS and "loses its NaN payloads" in passed.detail, passed
    assert gpu_smoke.copy_in_check({"fsdp_copy_in": {**COPY_IN, "bf16_unit_bitwise": True}}, Cuda()).verdict == PASS
    broken = gpu_smoke.copy_in_check({"fsdp_copy_in": {**COPY_IN, "mixed_unit_as_uint8_bitwise": False}}, Cuda())
    assert broken.verdict == FAIL and "bitwise False" in broken.detail, broken
    for probe in ({"fsdp_copy_in": {"error": "TypeError: all_gather_copy_in()"}}, {"error": "exit 1: ImportError"}):
        assert gpu_smoke.copy_in_check(probe, Cuda()).verdict == SKIP  # the probe's call failed: not the route's fault


def test_the_byte_guard_line_fails_where_the_guards_route_loses_bytes_or_the_run_took_another():
    """Found by a bug bash: "FSDP2 byte guard" compared two answers of the same op (the run's note and the smoke's own
    copy), and at world size 1 FSDP2 never runs its copy-in: it could not fail. Now it checks that the route finetune's
    guard picks for this device keeps rank 0's bytes through a real 2-rank unshard (the probe's), and that the fsdp2
    run took that route; a torch that cannot make the 2-rank group is a SKIP, never a FAIL."""
    probe = {"two_rank_unshard": TWO_RANKS}
    passed = gpu_smoke.byte_guard_check(FSDP2_RUN, probe, Cuda())
    assert passed.verdict == PASS and "route 'mixed'" in passed.detail and "dry run" not in passed.detail, passed
    lost = gpu_smoke.byte_guard_check(FSDP2_RUN, {"two_rank_unshard": {**TWO_RANKS, "route_keeps_bytes": False}}, Cuda())
    other = gpu_smoke.byte_guard_check({**FSDP2_RUN, "route": "storage"}, probe, Cuda())
    raised = gpu_smoke.byte_guard_check(FSDP2_RUN, {"two_rank_unshard": {"error": "LaunchError: ..."}}, Cuda())
    assert [lost.verdict, other.verdict, raised.verdict] == [FAIL, FAIL, FAIL], (lost, other, raised)
    cannot = gpu_smoke.byte_guard_check(FSDP2_RUN, {"two_rank_unshard": {"skip": "no fake backend"}}, Cuda())
    assert cannot.verdict == SKIP and "no fake backend" in cannot.detail
    failed_run = {"name": "fsdp2", "ok": False, "reason": "exit 1: boom", "route": "storage"}
    assert gpu_smoke.byte_guard_check(failed_run, probe, Cuda()).verdict == PASS  # the run's own line fails
    assert gpu_smoke.route_of("... all-gathered as uint8 under FSDP2, as uint8 views of units of mixed dtypes ...") == "mixed"
    assert gpu_smoke.route_of("... as uint8 parameters (same bytes, no copy)") == "uint8"
    assert gpu_smoke.route_of("[finetune] step 1") == "storage"


@pytest.mark.slow  # in-process, but ~3 s: FSDP2's first fully_shard imports torch._dynamo
def test_the_probes_two_rank_unshard_tells_the_guards_route_from_no_guard(monkeypatch):
    """The probe's 2-rank unshard in this process (a fake 2-rank group, FSDP2's real copy-in and copy-out), with the
    copy rewriting NaNs as CUDA's does (the dry run's patch): the guard's route keeps rank 0's packed bytes and the
    unguarded unit (bf16, param_dtype bf16) loses them. So the line can fail: the same code with the guard's route
    taken away answers False."""
    import gpu_probe
    import torch

    monkeypatch.setattr(torch, "_foreach_copy_", torch._foreach_copy_)  # restored after the patch below
    gpu_smoke_device.cuda_like_copy()
    answer = gpu_probe.two_rank_unshard("cpu")
    assert answer == {"copy_keeps_bytes": False, "route": byte_guard.route(False), "route_keeps_bytes": True,
                      "unguarded_keeps_bytes": False}, answer


def test_the_dry_run_starts_every_process_with_the_cuda_like_copy(monkeypatch):
    """Found by a bug bash: on a CPU the copy keeps the bytes, so the dry run took the "storage" route and never ran the
    GPU's through finetune's FSDP2 wrap. Now every process it starts goes through gpu_smoke_device.py
    --cuda-like-copy (the one op patched as tests/parallel/test_byte_guard.py does); on the GPU only the two measured
    processes go through it, to record the allocator (--memory), and the others run as they ship."""
    import torch

    dry = gpu_smoke.plans("/w/recipe.yaml", script=DryRun().script)
    launcher = str(BENCH / "gpu_smoke_device.py")
    for name in ("single", "fsdp2", "fsdp1", "zero3"):
        command = dry[name] if isinstance(dry[name], list) else []
        if command:
            at = command.index(launcher)
            assert command[at + 1] == "--cuda-like-copy" and command[-1 if name == "single" else at + 2].endswith(
                ("run.py", "--memory", "recipe.yaml")), command
    assert "--cuda-like-copy" in dry["hsdp"][2]
    gpu = gpu_smoke.plans("/w/recipe.yaml", gpus=1, script=Cuda().script)
    assert launcher not in gpu["single"] and launcher not in gpu["fsdp1"]
    assert gpu["fsdp2"][gpu["fsdp2"].index(launcher) + 1:][:2] == ["--memory", "/w/fsdp2.allocator.json"]
    monkeypatch.setattr(torch, "_foreach_copy_", torch._foreach_copy_)
    assert byte_guard.probe_copy(torch.bfloat16, "cpu")
    gpu_smoke_device.cuda_like_copy()
    assert not byte_guard.probe_copy(torch.bfloat16, "cpu")  # the guard now sees what it sees on CUDA


# ------------------------------------------------------------------------ finding 2: where the JSON goes, always
def test_the_json_goes_to_out_when_out_is_set(monkeypatch, tmp_path):
    """Found by a bug bash: without --json the JSON went into the checkout (benchmarks/), which a lent machine never
    brings back; only $OUT comes back."""
    monkeypatch.delenv("GPU_SMOKE_JSON", raising=False)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_smoke.parse_args(["--work", "w"]).json == tmp_path / "out" / "gpu_smoke.json"
    monkeypatch.setenv("GPU_SMOKE_JSON", str(tmp_path / "env.json"))
    assert gpu_smoke.parse_args(["--work", "w"]).json == tmp_path / "env.json"
    assert gpu_smoke.parse_args(["--work", "w", "--json", "x.json"]).json == Path("x.json")
    monkeypatch.delenv("GPU_SMOKE_JSON")
    monkeypatch.delenv("OUT")
    assert gpu_smoke.parse_args(["--work", "w"]).json == REPO / "benchmarks" / "gpu_smoke.json"


def fake_python(folder: Path, *, pip: str = "exit 0", imports: str = "exit 0") -> Path:
    """A Python that says it has CUDA torch; its pip and its import pre-check (gpu_probe.py --imports) do `pip` and
    `imports`; as gpu_smoke.py it writes down that it ran."""
    script = folder / "python-with-cuda"
    script.write_text(f"""#!/usr/bin/env bash
[ "$1" = -c ] && exit 0
[ "$1" = -m ] && [ "$2" = pip ] && {{ {pip}; }}
[ "$2" = --imports ] && {{ {imports}; }}
echo ran > {folder / "smoke-ran"}
exit 0
""")
    script.chmod(0o755)
    return script


def run_script(env: dict, *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("WHEELS", "GPU_SMOKE_JSON", "OUT", "PY")}
    return subprocess.run(["bash", str(BENCH / "gpu_smoke.sh"), *args], capture_output=True, text=True, timeout=60,
                          check=False, env={**clean, **env})


def test_a_pip_failure_writes_the_json_with_its_reason(tmp_path):
    """Found by a bug bash: pip's failure ended the script (set -e) before Python started: no JSON, even with --json,
    and on a lent machine nothing came back."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1-py3-none-any.whl").write_text("")
    pip = "echo 'ERROR: Cannot install dill 0.3.8 and dill 0.4.1' >&2; exit 1"
    env = {"PY": str(fake_python(tmp_path, pip=pip)), "WHEELS": str(wheels), "OUT": str(tmp_path / "out")}
    result = run_script(env)
    report = json.loads((tmp_path / "out" / "gpu_smoke.json").read_text())
    assert result.returncode == 1 and report["stage"] == "wheels" and report["exit_code"] == 1, result.stdout
    assert "Cannot install dill 0.3.8 and dill 0.4.1" in report["error"] and not (tmp_path / "smoke-ran").exists()
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("gpu-smoke: pip could not install")


def test_a_module_that_does_not_import_stops_the_smoke_once_with_its_error(tmp_path):
    """Found by a bug bash: the pre-check asked find_spec, which finds a module that then fails to import, so the same
    ImportError would have failed each of the runs in turn. Now each module is imported (gpu_probe.py --imports); the
    first error stops the smoke with that one message, in the output and the JSON (--json here)."""
    error = ("echo \"gpu-smoke: /x/python3 cannot import datasets: AttributeError: module 'pyarrow' has no attribute "
             "'json_' (versions here: /opt: pyarrow 18.1.0)\"; exit 1")
    result = run_script({"PY": str(fake_python(tmp_path, imports=error))}, "--json", str(tmp_path / "s.json"))
    report = json.loads((tmp_path / "s.json").read_text())
    assert result.returncode == 1 and report["stage"] == "imports" and not (tmp_path / "smoke-ran").exists()
    assert report["error"].startswith("/x/python3 cannot import datasets: AttributeError: module 'pyarrow'"), report
    assert result.stdout.count("cannot import") == 1


def test_the_import_pre_check_names_the_first_module_that_fails(monkeypatch):
    """gpu_probe.py --imports: every module imported in turn; the first failure is the message, with pip show's
    versions of what it met; a module that imports is not reported."""
    import gpu_probe

    ok, line = gpu_probe.check_imports(("json", "no_such_module_bb57", "also_missing"))
    assert not ok and "cannot import no_such_module_bb57: ModuleNotFoundError" in line and "also_missing" not in line
    assert re.search(r"pyarrow \d", line) and "typing_extensions" in line, line
    assert gpu_probe.check_imports(("json",))[0]


@pytest.mark.slow  # the script tries .venv/bin/python, which imports torch (~2 s)
def test_a_gpu_without_a_cuda_python_is_told_what_to_do_and_nothing_is_installed(tmp_path):
    """Found by a bug bash: with an NVIDIA driver but no Python with CUDA torch the script ran `make install`, which
    cannot work on a machine without network and would have spent the rest of the command. Now it says what to do,
    exits 2 and writes the JSON."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    (bin_folder / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (bin_folder / "make").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'make-ran'}\n")
    for tool in ("nvidia-smi", "make"):
        (bin_folder / tool).chmod(0o755)
    no_cuda = tmp_path / "python-without-cuda"
    no_cuda.write_text("#!/bin/sh\nexit 1\n")
    no_cuda.chmod(0o755)
    env = {"PATH": f"{bin_folder}:{os.environ['PATH']}", "PY": str(no_cuda), "CUDA_VISIBLE_DEVICES": "",
           "GPU_SMOKE_JSON": str(tmp_path / "s.json")}
    result = run_script(env)
    report = json.loads((tmp_path / "s.json").read_text())
    assert result.returncode == 2 and not (tmp_path / "make-ran").exists(), result.stdout + result.stderr
    assert report["stage"] == "python" and "make install" in report["error"] and "WHEELS=DIR" in report["error"]


# --------------------------------------------------------------------------- finding 3: the wheels that travel
def test_the_carried_wheels_are_the_floors_where_requirements_decide_the_import():
    """Found by a bug bash: the carried wheels were the newest set (constraints/tested.txt): datasets 5.2.0 asks
    pyarrow >= 24 (and does not import with pyarrow < 21), pydantic-core 2.50 typing_extensions >= 4.16, versions the
    GPU image may not have. Now the declared floor's (constraints/floor.txt) for those, bitsandbytes the newest 0.50
    (CUDA 13.0 kernels), each pinned once."""
    script = (BENCH / "gpu_wheels.sh").read_text()
    pins = dict(re.findall(r"\b([a-z][a-z0-9_-]*)==([0-9][0-9.]*)", script.split("PLAT=")[0]))
    floor_text = (REPO / "constraints" / "floor.txt").read_text()
    floor = dict(re.findall(r"^([a-z][a-z0-9_-]*)==(\S+)$", floor_text, re.MULTILINE))
    for name in ("datasets", "pydantic", "deepspeed"):
        assert pins[name] == floor[name], (name, pins[name], floor[name])
    assert pins["bitsandbytes"].startswith("0.50.") and pins["bitsandbytes"] != floor["bitsandbytes"]
    assert pins["pydantic-core"] == "2.18.1" and pins["dill"] == "0.3.8" and pins["multiprocess"] == "0.70.16"
    assert "typing-inspection" not in pins and "tested.txt" not in script.split("set -euo")[1]


# ---------------------------------------------------------------------------------- finding 6: time and order
def test_the_most_informative_processes_run_first_and_a_hung_run_costs_at_most_120_s(tmp_path, monkeypatch):
    """Found by a bug bash: the load worker and the peers ran after all eight training runs, so one hung run (240 s
    each) pushed them past the deadline; the model build was neither timed nor counted. Now, on the GPU: single,
    fsdp2, load, peers, then the other runs; runs time out at 120 s; the build is timed as "build"."""
    started = []
    monkeypatch.setattr(gpu_smoke, "train_logged", lambda name, *a: started.append(name) or {"name": name})
    monkeypatch.setattr(gpu_smoke, "load_check", lambda *a: started.append("load") or "load")
    monkeypatch.setattr(gpu_smoke, "peer_check", lambda *a: started.append("peers") or "peers")

    class OneGpu(Cuda):
        def gpus(self) -> int:
            return 1

    runs, load, peers = gpu_smoke.run_processes(tmp_path, tmp_path / "recipe.yaml", OneGpu(), Deadline(60))
    assert started == list(gpu_smoke.ORDER) and started[:4] == ["single", "fsdp2", "load", "peers"], started
    assert set(runs) == set(gpu_smoke.RUNS) and (load, peers) == ("load", "peers")
    assert Cuda.timeouts["train"] <= 120 and Cuda.timeouts["load"] <= 120 and "build" in Cuda.needs

    deadline = Deadline(100, {"build": 30})
    monkeypatch.setattr(gpu_smoke, "write_inputs", lambda *a: None)
    assert gpu_smoke.build_inputs(tmp_path, Cuda.sizes, Cuda(), deadline) is None and "build" in deadline.taken
    late = gpu_smoke.build_inputs(tmp_path, Cuda.sizes, Cuda(), Deadline(10, {"build": 30}))
    assert late.startswith("not run: deadline") and "a build process needs ~30 s" in late
