"""What a launch costs before its first line of work: cold (torchrun starting fresh ranks) against warm (the suite's
launcher, tests/warm_launch.py, forking the ranks from servers that imported the libraries: tests/warm.py).

    python benchmarks/bench_warm_launch.py [--ranks 2] [--repeats 3]

Each launch runs a worker that imports what a rank of finetune/run.py imports (run.py's modules, the stages,
transformers' model classes, torch.distributed.checkpoint) and ends: its whole cost is the floor. CPU seconds counted:
the launcher and everything it waited for (getrusage of the children), plus, warm, the ranks' own CPU (they are the
servers' children: each reports its process time at its end) and what the servers spent forking them (/proc). The
servers' one-time start (the imports, once per pytest process) is printed apart. Figures are medians of --repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import group_run

WORKER = """
import os, sys, time
from finetune import run  # noqa: F401  (what run.py imports, then what run() imports)
from finetune import data, model, outputs, parallel, tracking, training  # noqa: F401
model.import_backends()
import torch.distributed.checkpoint  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401
with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '0')}"), "w") as out:
    out.write(str(time.process_time()))
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launch(argv: list[str], env: dict, folder: Path, servers: list[int]) -> tuple[float, float]:
    """(wall s, CPU s) of one launch."""
    for old in folder.glob("rank*"):
        old.unlink()
    before_children, before_servers = children_cpu(), sum(process_cpu(pid) for pid in servers)
    started = time.perf_counter()
    result = group_run.run(argv, env=env, capture_output=True)
    if result.returncode:
        raise subprocess.CalledProcessError(result.returncode, argv, result.stdout, result.stderr)
    wall = time.perf_counter() - started
    cpu = children_cpu() - before_children
    if servers:  # the ranks are the servers' children, not ours: their own figures, and the servers' fork work
        cpu += sum(float(path.read_text()) for path in folder.glob("rank*"))
        cpu += sum(process_cpu(pid) for pid in servers) - before_servers
    return wall, cpu


@contextlib.contextmanager
def scratch():
    """A temporary folder for the worker script and the ranks' files, removed at exit with the folder that
    tests/conftest.py makes at import (its FINETUNE_CACHE, which only a pytest session's end removes) when this
    script imported it; inside pytest (conftest already imported) the session's own folder is left to pytest."""
    ours = "conftest" not in sys.modules
    import conftest

    try:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as folder:
            yield Path(folder)
    finally:
        if ours:
            (conftest.TEST_CACHE / "gguf").unlink(missing_ok=True)  # a link to the machine's GGUF conversions: kept
            shutil.rmtree(conftest.TEST_CACHE, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    group_run.stop_on_sigterm()  # a timeout's SIGTERM ends the launch and removes the folders too
    with scratch() as folder:
        measure(args, folder)


def measure(args: argparse.Namespace, folder: Path) -> None:
    """Cold and warm launches of the worker, --repeats each; prints the medians (exits non-zero if a warm one ran cold)."""
    import warm
    from conftest import child_env, free_port

    from finetune.precision import cpu_summary

    script = folder / "worker.py"
    script.write_text(WORKER)

    def argv() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
                f"--master_port={free_port()}", str(script), str(folder)]

    started = time.perf_counter()
    try:
        warm.command(["true"])  # starts the servers: their imports, once per pytest process
        servers = [process.pid for process in warm._servers.processes]
        server_start = time.perf_counter() - started
        server_cpu = sum(process_cpu(pid) for pid in servers)
        env = child_env()
        figures = {mode: [launch(warm.command(argv()) if mode == "warm" else argv(), env, folder,
                                 servers if mode == "warm" else []) for _ in range(args.repeats)]
                   for mode in ("cold", "warm")}
        cold_log = Path(os.environ["FINETUNE_WARM_DIR"]) / "cold.log"
        ran_cold = cold_log.read_text() if cold_log.exists() else ""
    finally:
        warm.stop()  # the servers and their folder, whatever stopped the launches
    median = {mode: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
              for mode, runs in figures.items()}
    print(f"machine: {cpu_summary()}; {args.ranks} ranks, median of {args.repeats}")
    print(f"servers' start (once per pytest process): {server_start:.1f} s wall, {server_cpu:.1f} CPU-s for "
          f"{len(servers)} servers")
    for mode, (wall, cpu) in median.items():
        print(f"{mode:5s} launch to the first line of work: {wall:5.2f} s wall, {cpu:5.2f} CPU-s")
    print(f"warm / cold: {median['warm'][0] / median['cold'][0]:.3f}x wall, {median['warm'][1] / median['cold'][1]:.3f}x "
          f"CPU; warm CPU per launch {median['warm'][1]:.2f} s (goal: <= 1)")
    print(json.dumps({"cold": median["cold"], "warm": median["warm"], "servers_start_s": server_start}))
    if ran_cold:
        sys.exit(f"some warm launches ran cold:\n{ran_cold}")


if __name__ == "__main__":
    main()
