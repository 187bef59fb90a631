"""Warm launches (tests/warm.py) behave as the launchers they stand in for: the oracle is the launcher itself.

A worker script records what it was given (its environment's launcher variables, argv, cwd, sys.path[0], session) and
can exit with a code or wait for a signal; each case runs it through the real command and through the warm launcher,
and the records must be equal, except for what differs from launch to launch (ports, the run id, pids).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm
from conftest import REPO, child_env, free_port
from shipped import CONFIG_DIR, CPU_SWITCH

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not warm.enabled(), reason="FINETUNE_WARM=0: every launch is cold")]

WORKER = r"""
import json, os, sys, time
out = os.environ["WORKER_OUT"]
mode = sys.argv[1] if len(sys.argv) > 1 else "record"
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
record = {"env": {k: v for k, v in os.environ.items() if k in names or k.startswith(("ACCELERATE_", "FSDP_"))},
          "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "own_session": os.getsid(0) == os.getpid(),
          "main": __name__}
rank = os.environ.get("RANK", "0")
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
if mode == "store":  # the launcher's store: every rank meets the others through it, as init_process_group would
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
if mode == "fail" and rank == "1":
    sys.exit(3)
if mode in ("fail", "wait"):
    print("waiting", flush=True)
    time.sleep(120)
"""
VARYING = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _cold_launches() -> list[dict]:
    """The launches this pytest process asked to be warm that ran cold, with why (tests/warm_launch.py logs them)."""
    warm.command(["true"])  # the servers (and their folder) exist from here on
    log = Path(os.environ["FINETUNE_WARM_DIR"]) / "cold.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module", autouse=True)
def cold_before() -> int:
    """How many launches of this process had run cold before this module's first test (a file runs whole in one
    process, under xdist's --dist loadfile too)."""
    return len(_cold_launches())


def _records(folder: Path) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))}


def _both(tmp_path, argv_for, env=None) -> tuple[dict, dict]:
    """The worker's records under the real command and under the warm launcher."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    records = {}
    for mode in ("cold", "warm"):
        out = tmp_path / mode
        out.mkdir()
        argv = argv_for(str(script))
        result = subprocess.run(warm.command(argv) if mode == "warm" else argv, check=False, cwd=tmp_path, capture_output=True,
                                text=True, timeout=240, env={**(env or child_env()), "WORKER_OUT": str(out)})
        assert result.returncode == 0, (mode, result.stderr[-3000:])
        records[mode] = _records(out)
    return records["cold"], records["warm"]


def _torchrun(nproc: int = 2, *extra: str):
    return lambda script: [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                           f"--master_port={free_port()}", *extra, script]


def test_a_python_script_gets_its_argv_folder_and_path_as_under_python(tmp_path):
    cold, warm_ = _both(tmp_path, lambda script: [sys.executable, script, "record", "x=1"])
    # (a warm rank is always in a session of its own, which its server kills it by; `python` is in the caller's)
    assert warm_["rank0.json"].pop("own_session") and not cold["rank0.json"].pop("own_session")
    assert cold == warm_ and cold["rank0.json"]["main"] == "__main__" and cold["rank0.json"]["env"] == {
        "OMP_NUM_THREADS": "1"}


def test_torchruns_workers_get_torchruns_environment(tmp_path):
    cold, warm_ = _both(tmp_path, lambda script: [*_torchrun()(script), "store"])
    assert cold.keys() == warm_.keys() == {"rank0.json", "rank1.json"}
    for name in cold:
        assert {k: v for k, v in cold[name]["env"].items() if k not in VARYING} == warm_[name]["env"]
        assert cold[name]["own_session"] and warm_[name]["own_session"]  # torchrun starts each worker in a session
        assert {k: v for k, v in cold[name].items() if k != "env"} == {k: v for k, v in warm_[name].items() if k != "env"}


@pytest.mark.parametrize("config", ["fsdp2", "fsdp1", "ddp", "deepspeed_zero3"])
def test_accelerate_launchs_workers_get_accelerates_environment(config, tmp_path):
    def accelerate(script):
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG_DIR / f"{config}.yaml"),
                "--num_processes", "2", "--main_process_port", str(free_port()), script, "store"]

    cold, warm_ = _both(tmp_path, accelerate, env=child_env(**CPU_SWITCH))
    assert cold.keys() == {"rank0.json", "rank1.json"}
    for name in cold:
        assert cold[name]["env"]["ACCELERATE_USE_CPU"] == "true" and any(k.startswith("FSDP_") for k in cold[name]["env"]) \
            is config.startswith("fsdp")
        assert ("ACCELERATE_DEEPSPEED_ZERO_STAGE" in cold[name]["env"]) is config.startswith("deepspeed")
        assert {k: v for k, v in cold[name]["env"].items() if k not in VARYING} == warm_[name]["env"]


def test_a_failed_rank_stops_the_others_and_the_launcher_exits_1_as_torchrun(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    codes = {}
    for mode in ("cold", "warm"):
        argv = [*_torchrun()(str(script)), "fail"]
        started = time.monotonic()
        result = subprocess.run(warm.command(argv) if mode == "warm" else argv, check=False, capture_output=True, text=True,
                                timeout=120, env={**child_env(), "WORKER_OUT": str(tmp_path)})
        codes[mode] = (result.returncode, time.monotonic() - started < 60)  # rank 0 was stopped, not waited for
    assert codes["cold"] == codes["warm"] == (1, True)
    plain = subprocess.run(warm.command([sys.executable, "-c", "import sys; sys.exit(3)"]), check=False, timeout=60,
                           env=child_env())
    assert plain.returncode == 3  # one process: its own exit code, as `python` gives it


def test_signals_reach_the_ranks_and_a_killed_launcher_takes_them_along(tmp_path):
    """SIGTERM to the launcher: passed to every rank, exit as torchrun's (compared). SIGKILL: warm only (a killed
    torchrun leaves its workers running; here the server kills them, and wait() returns once they are gone)."""
    from processes import worker_pids

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**child_env(), "WORKER_OUT": str(tmp_path)}
    codes = {}
    for mode, kill in (("cold", signal.SIGTERM), ("warm", signal.SIGTERM), ("warm", signal.SIGKILL)):
        log = tmp_path / f"{mode}-{kill.name}.log"
        argv = [*_torchrun()(str(script)), "wait"]
        with open(log, "w") as handle:
            process = (warm.Popen(warm.command(argv), stdout=handle, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True) if mode == "warm" else
                       subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + 60
        while log.read_text().count("waiting") < 2:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        ranks = worker_pids(process.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(process.pid, kill)
        codes[(mode, kill)] = process.wait(timeout=60)
        time.sleep(0.2 if mode == "cold" else 0)  # (warm: wait() returned once the ranks were gone)
        assert not [pid for pid in ranks.values() if warm._alive(pid)], (mode, kill)
    assert codes[("warm", signal.SIGTERM)] == codes[("cold", signal.SIGTERM)]
    assert codes[("warm", signal.SIGKILL)] == -signal.SIGKILL


def test_an_environment_the_imports_read_runs_cold_and_says_why(tmp_path):
    marker = tmp_path / "marker"
    code = f"import os; open({str(marker)!r}, 'w').write(str(os.getppid()))"
    result = subprocess.run(warm.command([sys.executable, "-c", code]), check=False, capture_output=True, text=True, timeout=60,
                            env=child_env(HF_HOME=str(tmp_path / "hf")))  # read by huggingface_hub at import
    assert result.returncode == 0, result.stderr
    cold = [json.loads(line) for line in (Path(os.environ["FINETUNE_WARM_DIR"]) / "cold.log").read_text().splitlines()]
    assert any("HF_HOME" in entry["why"] and entry["argv"][-1] == code for entry in cold), cold


def test_the_launches_of_this_module_were_warm(cold_before, tmp_path):
    """The cases above compare the two paths; this one checks the warm path is taken at all (not silently cold): the
    launches of this module ran warm but the one that asks for cold, and a warm `python -c` finds torch imported.
    (Its fixture is the module's, autouse: it counts before the module's first test.)"""
    probe = "import sys; print('torch' in sys.modules)"
    result = subprocess.run(warm.command([sys.executable, "-c", probe]), check=False, capture_output=True, text=True,
                            timeout=60, env=child_env(), cwd=REPO)
    assert result.stdout.strip() == "True", result.stderr  # a cold `python -c` has not imported torch
    cold = _cold_launches()[cold_before:]
    assert all("HF_HOME" in entry["why"] for entry in cold), cold  # only the case that asks for it
