"""The benchmark scripts' own logic, in-process or with cheap helper processes (no benchmark run): their argument
checks, the figures they derive from a run's files, where their paths point, what they leave behind, and
benchmarks/group_run.py (a run that ends with its benchmark); also `make help`."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))  # benchmarks/ is a script folder, not a package

import bench_ddp_vs_fsdp
import bench_dtype
import bench_grpo_vllm
import bench_train_peak
import bench_warm_launch
import group_run


def own_peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def test_a_one_rank_scale_run_reports_its_own_peak_not_its_starters():
    """Found by a bug bash: bench_data's 1-rank runs reported ru_maxrss, which Linux carries across exec from the
    process that starts the rank: every 1-rank row read 1373 MB, the harness's peak after converting a GGUF file.
    A child started from this grown process must report its own few dozen MB."""
    ballast = b"\x01" * (300 * 2**20)  # written, so resident: this process's peak is at least 300 MB
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import data_scale; print(data_scale.own_peak_rss_mb())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert own_peak_mb() > 300 and len(ballast) > 0
    assert 0 < float(result.stdout) < 150, result.stdout


def test_ddp_vs_fsdp_refuses_too_few_steps_before_launching(monkeypatch, capsys):
    """Found by a bug bash: `--steps 3` ran the whole DDP launch, then crashed with statistics.StatisticsError (the
    step time is the median of steps 4..N). Now refused up front with the minimum."""
    monkeypatch.setattr(bench_ddp_vs_fsdp, "write_inputs", lambda *a, **k: pytest.fail("launched despite --steps 3"))
    monkeypatch.setattr(sys, "argv", ["bench_ddp_vs_fsdp.py", "--steps", "3", "--no-deepspeed"])
    with pytest.raises(SystemExit) as stop:
        bench_ddp_vs_fsdp.main()
    assert stop.value.code == 2 and "--steps must be at least 4" in capsys.readouterr().err


def fake_launch(metrics: list[dict], *, ranks: bool = False):
    """A stand-in for group_run.run that writes what a run would (metrics.jsonl, ranks/) where its output.dir says."""
    def run(command, **kwargs):
        out = Path(next(arg.split("=", 1)[1] for arg in command if str(arg).startswith("output.dir=")))
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))
        if ranks:
            (out / "ranks").mkdir()
            for rank in (0, 1):
                (out / "ranks" / f"rank{rank}.json").write_text(json.dumps(
                    {"frozen_bytes": 2**20, "trainable_bytes": 2**20, "peak_rss_bytes": 100 * 2**20}))
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


# Four logged steps of 272 tokens each (8 rows of ~34 tokens), each step's own rate very different from the run's.
STEPS = [{"step": s, "loss": 1.0, "num_tokens": 272 * s, "tokens_per_s": rate, "elapsed_s": end}
         for s, rate, end in ((1, 50.0, 5.0), (2, 272.0, 6.0), (3, 136.0, 8.0), (4, 2720.0, 8.1))]


def test_ddp_vs_fsdp_header_gives_the_tokens_the_batch_held(monkeypatch, tmp_path):
    """Found by a bug bash: the header said "global batch 8 x 128 tokens" whatever ran; 128 is max_length and the
    rows are ~35 tokens. The tokens a step trained are now read from the run (num_tokens)."""
    monkeypatch.setattr(bench_ddp_vs_fsdp.group_run, "run", fake_launch(STEPS, ranks=True))
    result = bench_ddp_vs_fsdp.run_strategy("ddp.yaml", tmp_path / "recipe.yaml", tmp_path / "ddp", 4, gpu=False)
    assert result["tokens_per_step"] == 272 and result["step_s"] == pytest.approx(0.1)  # step 4 only
    args = types.SimpleNamespace(hidden_size=64, layers=2, gpu=False)
    line = bench_ddp_vs_fsdp.header(args, result)
    assert "global batch 8 rows x ~34 tokens (272 non-pad tokens a step; max_length 128)" in line
    assert "8 x 128 tokens" not in line


def test_dtype_tokens_per_s_is_the_runs_not_the_last_steps(monkeypatch, tmp_path):
    """Found by a bug bash: bench_dtype's quickstart tokens/s was the last step's own rate (metrics.jsonl's
    tokens_per_s of one step, the noisiest figure on a shared machine), though it says "over the run's steps". Now
    the tokens of steps 2..N over their time, as bench_peers counts; the run goes through group_run."""
    from finetune.cli import quickstart

    monkeypatch.setattr(quickstart, "prepare", lambda out, tiny: [f"output.dir={out}"])
    monkeypatch.setattr(quickstart, "quickstart_recipe", lambda: tmp_path / "quickstart.yaml")
    monkeypatch.setattr(bench_dtype.group_run, "run", fake_launch(STEPS))
    speed, _ = bench_dtype.quickstart_tokens_per_s("float32", 4, tmp_path)
    assert speed == pytest.approx(272 * 3 / 3.1)  # steps 2..4: 816 tokens from 5.0 s to 8.1 s, not 2720


def process_gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` ended (a zombie waiting for its reaper counts as ended) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_sigterm_to_the_benchmark_ends_its_run_and_the_runs_children(tmp_path):
    """Found by a bug bash: `timeout 300 bench_dtype.py` left its training run going on as an orphan for minutes (and
    its temporary folder behind): subprocess.run passes no SIGTERM on. group_run starts the run in a process group
    of its own and ends that group when the benchmark, SIGTERMed, exits."""
    pids = tmp_path / "pids"
    code = ("import os, subprocess, sys, time\n"
            "grand = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{grand.pid}}')\n"
            "time.sleep(30)\n")
    child = [sys.executable, "-c", code]

    def terminate_when_started():
        while not pids.exists() or len(pids.read_text().split()) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    group_run.stop_on_sigterm()
    threading.Thread(target=terminate_when_started, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as stop:
            group_run.run(child, capture_output=True, text=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - started < group_run.GRACE_S + 10  # ended, not waited for (the run sleeps 30 s)
    assert all(process_gone(int(pid), timeout=5) for pid in pids.read_text().split())


def test_grpo_vllm_resolves_a_relative_out_against_the_callers_folder(monkeypatch, tmp_path):
    """Found by a bug bash: `--out gv_rel` from any folder but the checkout failed: the data was written under the
    caller's folder and the runs (started in the checkout) looked for it there. Now --out is made absolute first."""
    calls = []

    def first_run(*args, log):
        calls.append(args)
        raise SystemExit("stop after the first run's command")

    monkeypatch.setattr(bench_grpo_vllm, "vllm_problem", lambda: None, raising=False)
    monkeypatch.setattr(bench_grpo_vllm, "finetune", first_run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_grpo_vllm.py", "--seeds", "1", "--steps", "2", "--out", "gv_rel"])
    with pytest.raises(SystemExit, match="stop after"):
        bench_grpo_vllm.main()
    settings = dict(arg.split("=", 1) for arg in calls[0] if "=" in arg)
    assert settings["output.dir"] == str(tmp_path / "gv_rel" / "sft")
    assert Path(settings["data.datasets.0.path"]).is_absolute() and Path(settings["data.datasets.0.path"]).is_file()


def test_grpo_vllm_says_vllm_is_missing_before_the_first_run(monkeypatch, tmp_path):
    """Found by a bug bash: without vLLM the script ran the SFT and the whole built-in GRPO run of seed 0 before the
    vLLM run failed. Now it stops first, with finetune's own message (where it looked, `make vllm`)."""
    monkeypatch.setenv("FINETUNE_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    monkeypatch.setattr(bench_grpo_vllm, "finetune", lambda *a, **k: pytest.fail("a run started without vLLM"))
    monkeypatch.setattr(sys, "argv", ["bench_grpo_vllm.py", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="does not exist.*make vllm"):
        bench_grpo_vllm.main()


def test_warm_launch_leaves_no_folder_behind(monkeypatch, tmp_path):
    """Found by a bug bash: every run left /tmp/bench-warm-* (a mkdtemp never removed) and
    /tmp/finetune-tests-cache-* (tests/conftest.py's, made at import, removed only by a pytest session's end). The
    launches are stood in for here; the script imports a conftest of its own, as when run from a shell."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for name in ("FINETUNE_CACHE", "HF_DATASETS_CACHE", "CUDA_VISIBLE_DEVICES"):  # what conftest's import sets
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.delitem(sys.modules, "conftest")
    warm = types.ModuleType("warm")
    warm.command, warm.stop = (lambda argv: argv), list
    warm._servers = types.SimpleNamespace(processes=[])
    monkeypatch.setitem(sys.modules, "warm", warm)
    monkeypatch.setenv("FINETUNE_WARM_DIR", str(tmp_path / "warm"))
    monkeypatch.setattr(bench_warm_launch, "launch", lambda argv, env, folder, servers: (1.0, 1.0))
    monkeypatch.setattr(sys, "argv", ["bench_warm_launch.py", "--repeats", "1"])
    bench_warm_launch.main()
    assert sorted(path.name for path in scratch.iterdir()) == []


def test_gpu_smoke_resolves_relative_paths_against_the_callers_folder(tmp_path):
    """Found by a bug bash: `bash benchmarks/gpu_smoke.sh --json out.json` run from another folder wrote the JSON into
    the checkout (the script moves there first). --json, GPU_SMOKE_JSON, WHEELS and PY are now the caller's. A fake
    Python stands in (it answers the CUDA probe and records what gpu_smoke.py would have been given)."""
    caller = tmp_path / "caller"
    caller.mkdir()
    fake = caller / "fakepy"
    fake.write_text('#!/bin/bash\ncase "$*" in *torch.cuda.is_available*|*importlib.util*) exit 0;; esac\n'
                    'printf "%s\\n" "$@" > "$FAKE_ARGS"\nprintf "%s\\n" "$GPU_SMOKE_JSON" >> "$FAKE_ARGS"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": "./fakepy", "FAKE_ARGS": str(tmp_path / "args"), "GPU_SMOKE_JSON": "env.json"}
    for form in (["--json", "smoke.json"], ["--json=smoke.json"]):
        result = subprocess.run(["bash", str(BENCH / "gpu_smoke.sh"), "--dry-run", *form], cwd=caller, env=env,
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        given = (tmp_path / "args").read_text().splitlines()
        assert given[0] == "benchmarks/gpu_smoke.py" and "--dry-run" in given
        assert str(caller / "smoke.json") in (given[given.index("--json") + 1] if "--json" in given else
                                              next(arg.split("=", 1)[1] for arg in given if arg.startswith("--json=")))
        assert given[-1] == str(caller / "env.json")
    assert not (REPO / "smoke.json").exists()


def test_train_peak_refuses_an_env_setting_without_a_value(monkeypatch, capsys):
    """Found by a bug bash: `--env NAME` (no =VALUE) ended in a ValueError traceback; now argparse's message."""
    monkeypatch.setattr(bench_train_peak, "write_inputs", lambda *a, **k: pytest.fail("ran despite --env NAME"))
    monkeypatch.setattr(sys, "argv", ["bench_train_peak.py", "--env", "FINETUNE_CPU_ALLOCATOR"])
    with pytest.raises(SystemExit) as stop:
        bench_train_peak.main()
    assert stop.value.code == 2 and "'FINETUNE_CPU_ALLOCATOR' is not NAME=VALUE" in capsys.readouterr().err
    assert bench_train_peak.env_setting("A=") == ("A", "") and bench_train_peak.env_setting("A=b=c") == ("A", "b=c")


def test_gpu_probe_answers_help_without_probing(monkeypatch, capsys):
    """Found by a bug bash: `gpu_probe.py --help` ran the probe (~2 s) and printed its JSON."""
    monkeypatch.setattr(sys, "argv", ["gpu_probe.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCH / "gpu_probe.py"), run_name="__main__")
    assert stop.value.code == 0 and "--cpu" in capsys.readouterr().out


def test_make_help_lists_every_target_with_a_line():
    """Found by a bug bash: `make help` was "No rule to make target 'help'". Every .PHONY target has its line."""
    result = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    listed = dict(line.strip().split(None, 1) for line in result.stdout.splitlines() if line.strip())
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*?)(?<!\\)\n", makefile, re.DOTALL | re.MULTILINE).group(1).replace("\\\n", " ").split()
    assert set(phony) == set(listed) and all(len(text) > 10 for text in listed.values())
