"""The shipped accelerate configs, run as shipped on a CPU machine: one row per file, and the launcher the suite uses.

Every file in accelerate_configs/ needs a row in ACCELERATE_CONFIG_RUNS (tests/parallel/test_shipped.py fails for a file
without one, and trains every row). A row says only what a CPU-only machine needs on top of the shipped file; the
file itself goes to `accelerate launch --config_file` unchanged:
  * the CPU switch, ACCELERATE_USE_CPU=true, for every row (accelerate's own `--cpu` flag is no good: it starts one
    process whatever the config says);
  * the process count (`--num_processes`; the shipped files say how many GPUs);
  * for a multi-machine template, one `accelerate launch` per machine on this one: `--machine_rank`,
    `--main_process_ip 127.0.0.1` and a free `--main_process_port` (the values the file tells users to set per machine);
  * `env` / `flags`: anything else a row needs on CPU, stated in the row (the DeepSpeed configs need nothing more).
The recipe's model.dtype must equal the config's mixed precision and its gradient checkpointing must agree with
fsdp_activation_checkpointing (finetune checks both): `recipe_dtype` and `checkpointing_choices` read them from the file.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from conftest import REPO, RUN_PY, child_env, free_port

CONFIG_DIR = REPO / "accelerate_configs"
CPU_SWITCH = {"ACCELERATE_USE_CPU": "true"}


@dataclass(frozen=True)
class CpuLaunch:
    """How the suite runs one shipped accelerate config on a CPU-only machine."""

    processes: int  # --num_processes, over all machines
    machines: int = 1  # > 1: one `accelerate launch` per machine, all on 127.0.0.1
    env: dict[str, str] = field(default_factory=dict)  # environment besides the CPU switch
    flags: tuple[str, ...] = ()  # launch flags besides the process count (and the per-machine ones)


ACCELERATE_CONFIG_RUNS: dict[str, CpuLaunch] = {
    "single_gpu.yaml": CpuLaunch(processes=1),
    "ddp.yaml": CpuLaunch(processes=2),
    "fsdp1.yaml": CpuLaunch(processes=2),
    "fsdp2.yaml": CpuLaunch(processes=2),
    "multi_node.yaml": CpuLaunch(processes=2, machines=2),  # 2 "machines" x 1 process on loopback
    # DeepSpeed on CPU needs nothing more: finetune drives the engine itself (DeepSpeed's CPU accelerator, gloo), so
    # ACCELERATE_USE_CPU does not turn it into accelerate's CPU DDP.
    "deepspeed_zero2.yaml": CpuLaunch(processes=2),
    "deepspeed_zero3.yaml": CpuLaunch(processes=2),
}


def launcher_family(name: str) -> str:
    """The family whose run (checkpointing on, the library's LoRA) goes through `accelerate launch` itself for this config:
    the launcher's own test; the config's other runs are warm (tests/warm.py). A multi-machine template trains Gemma."""
    return "gemma" if settings(name).get("num_machines", 1) > 1 else "llama"


def config_file(name: str) -> str:
    """`fsdp2` or `fsdp2.yaml` -> `fsdp2.yaml` (a key of ACCELERATE_CONFIG_RUNS)."""
    return name if name.endswith(".yaml") else f"{name}.yaml"


def settings(name: str) -> dict:
    """The shipped file's keys, as accelerate reads them."""
    return yaml.safe_load((CONFIG_DIR / config_file(name)).read_text()) or {}


def recipe_dtype(name: str) -> str:
    """The model.dtype a recipe takes under this config: the default (auto: the device's dtype) where the config states
    no mixed precision, as every shipped one does; else the stated one (finetune refuses anything else)."""
    mixed = settings(name).get("mixed_precision")
    return {None: "auto", "no": "float32", "bf16": "bfloat16", "fp16": "float16"}[mixed]


def checkpointing_choices(name: str) -> tuple[bool, ...]:
    """train.gradient_checkpointing values this config accepts (an FSDP config that turns activation checkpointing on
    requires it in the recipe too)."""
    fsdp = settings(name).get("fsdp_config") or {}
    return (True,) if fsdp.get("fsdp_activation_checkpointing") is True else (True, False)


def expected_strategy(name: str) -> str:
    """What finetune must report for a run under this config (`parallel.strategy: auto`)."""
    kind = settings(name).get("distributed_type")
    if kind == "FSDP":
        return "fsdp"
    if kind == "DEEPSPEED":
        return "deepspeed"
    return "ddp" if ACCELERATE_CONFIG_RUNS[config_file(name)].processes > 1 else "single"


def launch(name: str, recipe: Path, *overrides: str, timeout: int = 300, cwd: Path = REPO,
           flags: tuple[str, ...] = (), warm: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/NAME finetune/run.py RECIPE ...` with only the row's CPU needs.

    A multi-machine row starts one launcher per machine and waits for all; the result joins their outputs and has the
    first non-zero exit code. `flags`: accelerate launch options that override the file's keys, as a user's would.
    `warm`: the ranks forked from the suite's warm servers with the environment accelerate's own code gives them
    (tests/warm.py; a DeepSpeed config runs cold: accelerate hands it to DeepSpeed's launcher); False: `accelerate
    launch` itself, for the tests of the launcher.
    """
    import warm as warm_launches

    command = warm_launches.command if warm else list
    row = ACCELERATE_CONFIG_RUNS[config_file(name)]
    env = child_env(**CPU_SWITCH, **row.env)
    base = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG_DIR / config_file(name)),
            "--num_processes", str(row.processes), *row.flags, *flags]
    script = [str(RUN_PY), str(recipe), *overrides]
    if row.machines == 1:
        args = command([*base, *script])  # the file's own port: main_process_port 0, a free one
        return subprocess.run(args, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    port = free_port()
    machines = [
        subprocess.Popen(command([*base, "--num_machines", str(row.machines), "--machine_rank", str(rank),
                                  "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *script]),
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(row.machines)
    ]
    try:
        outputs = [machine.communicate(timeout=timeout) for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
    codes = [machine.returncode for machine in machines]
    return subprocess.CompletedProcess(machines[0].args, next((c for c in codes if c), 0),
                                       "".join(out for out, _ in outputs), "".join(err for _, err in outputs))
