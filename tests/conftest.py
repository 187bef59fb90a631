"""Shared fixtures: tiny models and tokenizers built locally (no download), data and recipe writers, launchers."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "finetune" / "run.py"

# Never reach for the hub from the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _hermetic_cache() -> Path:
    """One FINETUNE_CACHE (and `datasets` cache) for the whole test run, in a temporary folder (inherited by every process the suite starts):
    the suite neither reads a stale tokenization or quantized cache of the machine nor fills it. Only the GGUF
    conversions stay shared (a link to the machine's folder): keyed by the file's hash, they cost ~25 s to redo."""
    import tempfile

    from finetune.model.sources.gguf import cache_root

    shared_gguf = cache_root()  # the machine's, before FINETUNE_CACHE is moved
    root = Path(tempfile.mkdtemp(prefix="finetune-tests-cache-"))
    shared_gguf.mkdir(parents=True, exist_ok=True)
    (root / "gguf").symlink_to(shared_gguf, target_is_directory=True)
    os.environ["FINETUNE_CACHE"] = str(root)
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf-datasets")  # what `datasets` makes of CSV/Parquet/folder tests
    return root


TEST_CACHE = _hermetic_cache()


def _compile_package_once() -> None:
    """With PYTHONDONTWRITEBYTECODE set (as on the development machines) no process writes finetune's bytecode, so
    every process the suite launches compiles the package's modules from source again: 0.5-0.6 s of CPU per rank
    (measured on a 2-core Zen 1: the run's imports 9.3 s -> 8.7 s). Compiled here once, beside the sources
    (finetune/**/__pycache__, ignored by git: what Python writes itself when the variable is unset), and checked
    against each source's mtime on import as always, so an edited module is never run stale."""
    if not sys.dont_write_bytecode:
        return
    import compileall

    compileall.compile_dir(REPO / "finetune", quiet=2)


_compile_package_once()


def pytest_addoption(parser):
    import tiers

    tiers.addoption(parser)


def pytest_configure(config):
    import tiers  # the fast tier's launch guard and the durations record (tests/tiers.py)

    config.pluginmanager.register(tiers.Tiers(config), "finetune-tiers")
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        import workers  # which files share a worker, longest first (tests/workers.py)

        config.pluginmanager.register(workers.Plugin(), "finetune-workers")


def pytest_sessionfinish(session, exitstatus):
    import shutil

    import warm

    cold = warm.stop()
    if cold:
        reasons = sorted({entry["why"] for entry in cold})
        print(f"\n{len(cold)} launches ran cold instead of warm: " + "; ".join(reasons))

    (TEST_CACHE / "gguf").unlink(missing_ok=True)  # the link only: the machine's conversions stay
    shutil.rmtree(TEST_CACHE, ignore_errors=True)


def _gpu_present() -> bool:
    """Asked of the driver, not of torch: torch would fix its view of the GPUs before they are hidden below."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listing.returncode == 0 and "GPU" in listing.stdout


# The CPU tests run on the CPU on every machine (gloo, the suite's tolerances; NCCL would need a GPU per process):
# CUDA is hidden from this process and from every process it starts. The `gpu` tests get it back (GPU_ENV).
GPU_PRESENT = _gpu_present()
GPU_ENV = dict(os.environ)  # as the suite was started
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if GPU_PRESENT:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The tiny models of finetune/cli/tiny.py the suite trains, one session fixture each (`tiny_<family>`), built on first
# use: tiny_llama, tiny_qwen2, tiny_gemma, tiny_mixtral, tiny_qwen3_moe, tiny_gpt_oss, and tiny_llama4 (Llama 4 in
# Scout's layout: every layer MoE, the fused experts stored (in, out) as the hub files store them).
TINY_FAMILIES = ("llama", "qwen2", "gemma", "mixtral", "qwen3_moe", "gpt_oss", "llama4_text")


def _tiny_fixture(family: str):
    @pytest.fixture(scope="session", name=f"tiny_{family.removesuffix('_text')}")
    def tiny(tmp_path_factory) -> Path:
        """A tiny model folder of the family in the fixture's name (finetune/cli/tiny.py), built once per session."""
        from finetune.cli.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family.replace('_', '-')}"), family=family)

    return tiny


for _family in TINY_FAMILIES:
    globals()[f"tiny_{_family.removesuffix('_text')}"] = _tiny_fixture(_family)


@pytest.fixture(scope="session")
def tiny_arch():
    """`build(model_type) -> folder`: a tiny bf16 model of any transformers text causal LM, built from transformers'
    own config class (finetune/cli/tiny_arch.py), once per session, under the suite's cache."""
    from finetune.cli.tiny_arch import build_tiny_arch

    built: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_tiny_arch(model_type, TEST_CACHE / "tiny-archs" / model_type)
        return built[model_type]

    return build


def addition_rows(n: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny tokenizer, built once per module (the data tests')."""
    from finetune.cli.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """This test's own token cache (FINETUNE_CACHE), so that no entry comes from another test: a module asks for it
    with `pytestmark = pytest.mark.usefixtures("private_cache")`."""
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def launches(monkeypatch):
    """What `finetune train` starts, without starting it: accelerate's command line (cli/train.py's _launch), or
    the run in this process (finetune.run.main)."""
    import finetune.run
    from finetune.cli import train

    started: dict[str, list] = {"launched": [], "in_process": []}
    monkeypatch.setattr(train, "_launch", lambda argv, drop=(): started["launched"].append(argv) or 0)
    monkeypatch.setattr(finetune.run, "main", lambda argv: started["in_process"].append(argv) or 0)
    return started


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows())


def recipe_dict(model_dir: Path, data_path: Path, out_dir: Path, **sections) -> dict:
    """A small, fast, deterministic recipe (fp32, no dropout); `sections` update each section's keys."""
    recipe = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"datasets": [{"path": str(data_path), "format": "alpaca"}], "max_length": 128},
        "train": {"max_steps": 6, "micro_batch_size": 4, "learning_rate": 3e-3, "gradient_checkpointing": True},
        "output": {"dir": str(out_dir)},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    return recipe


def objective_recipe(objective: str, data_format: str, model_dir: Path, data_path: Path, out_dir: Path,
                     **sections) -> dict:
    """`recipe_dict` training `objective` on its one dataset given in `data_format`."""
    values = recipe_dict(model_dir, data_path, out_dir, **sections)
    values["data"]["datasets"][0]["format"] = data_format
    values["train"]["objective"] = objective
    return values


def write_recipe(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "FSDP_", "ACCELERATE_"))}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_cmd(args: list[str], *, cwd: Path | None = None, timeout: int = 300, env: dict | None = None,
            warm: bool = True) -> subprocess.CompletedProcess:
    """`args` run to the end. `warm`: its ranks forked from the suite's warm servers (tests/warm.py) where it is a
    command they reproduce; False where the test's subject is the launcher itself or what a user's terminal shows."""
    import warm as warm_launches

    args = warm_launches.command(args) if warm else args
    return subprocess.run(args, cwd=cwd or REPO, env=env or child_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def accelerate_launch(config: str, recipe: Path, *overrides: str, timeout: int = 300,
                      flags: tuple[str, ...] = (), warm: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml finetune/run.py RECIPE ...` as a user runs it:
    the shipped file unchanged, plus only what this CPU machine needs (tests/shipped.py has the row per file).
    `warm`: the ranks from the suite's warm servers, with the environment accelerate's own code gives them."""
    from shipped import launch

    return launch(config, recipe, *overrides, timeout=timeout, flags=flags, warm=warm)


SHIPPED_STEPS = 3
SHIPPED_GLOBAL_BATCH = 4  # rows per optimizer step, whatever the number of processes
# The LoRA settings every library recipe but the quickstart ships with: the shipped-config table trains with these
# (fsdp1.yaml crashed in the first backward with dropout > 0 while the suite trained with 0.0).
LIBRARY_LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}


@pytest.fixture(scope="session")
def shipped_run(request, tmp_path_factory):
    """`run(config, family, checkpointing, dropout=None, train_router=False) -> (run folder, CompletedProcess)`: a tiny
    model trained for SHIPPED_STEPS steps under a shipped accelerate config, at the same global batch for every config,
    with the library's LoRA settings (`dropout` overrides only the dropout; `train_router`: lora.train_router on a MoE
    model); each run once per session. One run per config (shipped.launcher_family, checkpointing on, the library's
    settings) goes through `accelerate launch` itself: the launcher's test; the others are warm (tests/warm.py)."""
    from shipped import ACCELERATE_CONFIG_RUNS, config_file, launcher_family, recipe_dtype

    root = tmp_path_factory.mktemp("shipped")
    data = write_jsonl(root / "train.jsonl", addition_rows(48))
    done: dict[tuple, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(config: str, family: str = "llama", checkpointing: bool = True, dropout: float | None = None,
            train_router: bool = False):
        config = config_file(config)
        dropout = None if dropout == LIBRARY_LORA["dropout"] else dropout  # the same run either way
        key = (config, family, checkpointing, dropout, train_router)
        if key not in done:
            name = f"{config.removesuffix('.yaml')}-{family}-{'ckpt' if checkpointing else 'no-ckpt'}"
            name += ("" if dropout is None else f"-dropout{dropout}") + ("-router" if train_router else "")
            micro_batch = SHIPPED_GLOBAL_BATCH // ACCELERATE_CONFIG_RUNS[config].processes
            lora = dict(LIBRARY_LORA, **({} if dropout is None else {"dropout": dropout}))
            lora.update({"train_router": True} if train_router else {})
            model_dir = request.getfixturevalue(f"tiny_{family}")  # built on first use (llama, qwen2, gemma, mixtral...)
            recipe = recipe_dict(model_dir, data, root / name, model={"dtype": recipe_dtype(config)}, lora=lora,
                                 train={"max_steps": SHIPPED_STEPS, "micro_batch_size": micro_batch,
                                        "gradient_checkpointing": checkpointing, "eval_every": SHIPPED_STEPS},
                                 eval={"generation_rows": 2, "max_new_tokens": 2})
            real = family == launcher_family(config) and checkpointing and dropout is None and not train_router
            done[key] = (root / name, accelerate_launch(config, write_recipe(root / f"{name}.yaml", recipe), warm=not real))
        return done[key]

    return run


@pytest.fixture(scope="session")
def sft_adapter(tiny_llama, tmp_path_factory) -> Path:
    """The adapter of an SFT run on the preference tests' prompts (the SFT -> DPO / KTO pipeline's first half), trained
    once per session for tests/training/test_preference.py and test_kto.py (a module fixture trained it twice)."""
    from test_preference import train_sft_adapter  # tests/training/, on the path wherever this fixture is asked for

    return train_sft_adapter(tiny_llama, tmp_path_factory.mktemp("sft"))


def torchrun(recipe: Path, *overrides: str, nproc: int = 2, nnodes: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
            f"--master_port={free_port()}", str(RUN_PY), str(recipe), *overrides]
    return run_cmd(args, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_tokens(metrics: list[dict]) -> list[int]:
    """The tokens of each logged training step, from the running num_tokens of a run logged at every step."""
    counts = [m["num_tokens"] for m in metrics if "loss" in m]
    return [b - a for a, b in zip([0, *counts], counts)]


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


# Checkpointed runs, uninterrupted: tiny Llama on the addition rows, 12 steps with a checkpoint every 3 (the last 2
# kept), logged at every step, the same global batch (4 rows) for 1 and 2 processes, so that a resharded resume
# continues the same run. One per strategy per session, shared by tests/outputs/test_checkpoint.py (the reference of
# each kill and resume) and tests/outputs/test_export_step.py (a two-process run's checkpoints, exported).
CHECKPOINT_STEPS, CHECKPOINT_EVERY = 12, 3
CHECKPOINT_STRATEGIES = {  # strategy: (processes, overrides)
    "single": (1, []),
    "ddp": (2, ["parallel.strategy=ddp", "train.micro_batch_size=2"]),
    "fsdp2": (2, ["parallel.strategy=fsdp", "parallel.fsdp_version=2", "train.micro_batch_size=2"]),
    "fsdp1": (2, ["parallel.strategy=fsdp", "parallel.fsdp_version=1", "train.micro_batch_size=2"]),
}


def checkpoint_command(recipe: Path, out_dir: Path, strategy: str, *extra: str) -> list[str]:
    """The launch of `recipe` under a CHECKPOINT_STRATEGIES strategy (torchrun for 2 processes) into `out_dir`."""
    nproc, overrides = CHECKPOINT_STRATEGIES[strategy]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    return [*launcher, str(RUN_PY), str(recipe), f"output.dir={out_dir}", *overrides, *extra]


@pytest.fixture(scope="session")
def checkpoint_recipe(tiny_llama, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    data = write_jsonl(root / "train.jsonl", addition_rows())
    values = recipe_dict(tiny_llama, data, root / "unused", train={"max_steps": CHECKPOINT_STEPS, "keep_last": 2,
                                                                   "save_every": CHECKPOINT_EVERY, "log_every": 1})
    return write_recipe(root / "recipe.yaml", values)


@pytest.fixture(scope="session")
def checkpointed_run(checkpoint_recipe, tmp_path_factory):
    """`run(strategy) -> run folder`: checkpoint_recipe trained to the end under the strategy, launched on first use.
    Shared: a test that changes the folder works on a copy."""
    from processes import finish, start

    root = tmp_path_factory.mktemp("checkpointed")
    done: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in done:
            out, log = root / strategy, root / f"{strategy}.log"
            code, output = finish(start(checkpoint_command(checkpoint_recipe, out, strategy), log), log)
            assert code == 0, output[-3000:]
            done[strategy] = out
        return done[strategy]

    return run


# One run per strategy on one recipe, shared by the files that check those runs (tests/parallel/test_distributed.py:
# losses, adapters, generation; tests/planner/test_planner.py: the planner's per-rank bytes), so each is launched once
# per session. fp32, the strategy set in the recipe, launched by torchrun; packed rows (data.packing).
STRATEGY_STEPS = ["train.max_steps=5", "train.eval_every=5", "eval.generation_rows=2", "eval.max_new_tokens=3"]
STRATEGY_OVERRIDES = {"fsdp2": ["parallel.strategy=fsdp", "parallel.fsdp_version=2"],
                      "fsdp1": ["parallel.strategy=fsdp", "parallel.fsdp_version=1"],
                      "ddp": ["parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum=2"]}


@pytest.fixture(scope="session")
def strategy_recipe(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """(root folder, recipe): 48 addition rows, packed. Packing in every strategy run: the packing check runs on the
    wrapped model (DDP once crashed there, asking the DDP wrapper for the model's embeddings)."""
    root = tmp_path_factory.mktemp("dist")
    data_path = write_jsonl(root / "train.jsonl", addition_rows(48))
    values = recipe_dict(tiny_llama, data_path, root / "unused")
    values["data"]["packing"] = True
    return root, write_recipe(root / "recipe.yaml", values)


@pytest.fixture(scope="session")
def strategy_runs(strategy_recipe) -> dict[str, Path]:
    """Run folders: "single" (one process, 1 x 4 rows a step) and one per STRATEGY_OVERRIDES (torchrun, 2 x 2 rows).
    What each launch printed (stdout, then stderr) is kept beside its folder, in `<name>.log` (strategy_output)."""
    root, recipe = strategy_recipe
    out = {"single": root / "single"}
    result = run_cmd([sys.executable, str(RUN_PY), str(recipe), f"output.dir={out['single']}", *STRATEGY_STEPS])
    assert result.returncode == 0, f"single:\n{result.stderr[-4000:]}"
    (root / "single.log").write_text(result.stdout + result.stderr)
    for name, strategy in STRATEGY_OVERRIDES.items():
        out[name] = root / name
        result = torchrun(recipe, f"output.dir={out[name]}", "train.micro_batch_size=2", *strategy, *STRATEGY_STEPS)
        assert result.returncode == 0, f"{name}:\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
        (root / f"{name}.log").write_text(result.stdout + result.stderr)
    return out


def strategy_output(run_dir: Path) -> str:
    """What the strategy_runs launch of `run_dir` printed (stdout, then stderr)."""
    return run_dir.with_name(f"{run_dir.name}.log").read_text()
