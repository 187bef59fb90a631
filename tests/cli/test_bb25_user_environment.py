"""The user's own environment around a run: accelerate's default config, a `finetune.py` in the working folder,
ACCELERATE_* variables left in the shell, and a HOME matplotlib cannot write. Found by a bug bash (bb25, findings 1,
2, 4 and 6); each test failed on the code before its fix. Every HOME here is a fake one under tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, addition_rows, child_env, recipe_dict, write_jsonl, write_recipe

from finetune import cli, precision, quiet
from finetune.distributed import DistInfo

# What `accelerate launch` always writes for its processes (finetune.precision.LAUNCH_MARKERS): a launch's environment.
LAUNCHED = {"ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_BACKEND": "NO"}


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", addition_rows(16))
    return write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "out",
                                                         train={"max_steps": 2, "gradient_checkpointing": True}))


def _fake_home(tmp_path: Path, *, mixed_precision: str | None = "fp16") -> Path:
    """A HOME whose accelerate default config is the library's fsdp2.yaml (plus `mixed_precision`, which refuses a
    float32 recipe): what `accelerate config` leaves behind on a user's machine."""
    home = tmp_path / "home"
    folder = home / ".cache" / "huggingface" / "accelerate"
    folder.mkdir(parents=True)
    text = (REPO / "accelerate_configs" / "fsdp2.yaml").read_text()
    (folder / "default_config.yaml").write_text(text + (f"mixed_precision: {mixed_precision}\n" if mixed_precision else ""))
    return home


@pytest.fixture
def shell(monkeypatch, tmp_path):
    """This process's environment as a user's shell outside any launch: a fake HOME with an FSDP default config, no
    launcher variables (the suite's own process has none either)."""
    monkeypatch.setenv("HOME", str(_fake_home(tmp_path)))
    for name in ("HF_HOME", "XDG_CACHE_HOME", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in [name for name in os.environ if name.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    return monkeypatch


# ------------------------------------------------------------------------------ 1: --num-processes N without a config
def test_num_processes_alone_launches_the_library_ddp_config_that_validate_checks(recipe, shell, launches, capsys):
    """Found by a bug bash: `finetune validate --num-processes 2` said "DDP over 2 processes" while `finetune train
    --num-processes 2` passed no --config_file, so `accelerate launch` took the user's default config: an FSDP one
    trained FSDP2 (or, with mixed_precision: fp16, both ranks refused after the launch, torch elastic's lines
    included), and a CPU machine without one started 2 processes without a group (refused). Now train passes the
    library's ddp.yaml, the launch validate checks, and both say so."""
    assert cli.main(["validate", str(recipe), "--num-processes", "2"]) == 0
    out = capsys.readouterr().out
    assert "launch: 2 processes, as given, with the library's ddp config" in out, out
    assert "parallel: DDP over 2 processes" in out, out
    assert cli.main(["train", str(recipe), "--num-processes", "2"]) == 0
    said = capsys.readouterr().out
    assert "[finetune] launch: 2 processes, as given, with the library's ddp config" in said, said
    (argv,) = launches["launched"]
    assert Path(argv[argv.index("--config_file") + 1]) == REPO / "accelerate_configs" / "ddp.yaml", argv
    assert argv[argv.index("--num_processes") + 1] == "2"
    # one process stays in this process; an explicit config is the one given
    assert cli.main(["train", str(recipe), "--num-processes", "1"]) == 0 and len(launches["in_process"]) == 1
    assert cli.main(["train", str(recipe), "--accelerate-config", "fsdp2", "--num-processes", "2"]) == 0
    assert launches["launched"][-1][launches["launched"][-1].index("--config_file") + 1].endswith("fsdp2.yaml")
    # a recipe that names a launch of several processes keeps its config at another count (not ddp.yaml)
    recipe.write_text("# accelerate config: accelerate_configs/fsdp2.yaml with num_processes: 2\n" + recipe.read_text())
    assert cli.main(["train", str(recipe), "--num-processes", "4"]) == 0
    assert "as given, with the config the recipe names (accelerate_configs/fsdp2.yaml" in capsys.readouterr().out
    assert launches["launched"][-1][launches["launched"][-1].index("--config_file") + 1].endswith("fsdp2.yaml")
    assert launches["launched"][-1][launches["launched"][-1].index("--num_processes") + 1] == "4"


# ------------------------------------------------------------------------------ 2: a finetune.py in the working folder
def test_train_starts_the_launcher_by_its_file_not_with_dash_m(recipe, shell, launches):
    """Found by a bug bash: `finetune train ... --num-processes 2` started `python -m finetune.cli.accelerate_launch`,
    and `-m` puts the working folder first on sys.path: a user's own finetune.py there was run ("USER finetune.py
    EXECUTED"), then "No module named 'finetune.cli'" (exit 1). Now the launcher is started by its file."""
    assert cli.main(["train", str(recipe), "--accelerate-config", "ddp", "--num-processes", "2"]) == 0
    (argv,) = launches["launched"]
    assert argv[0] == sys.executable and "-m" not in argv[:3], argv
    assert Path(argv[1]) == REPO / "finetune" / "cli" / "accelerate_launch.py", argv
    assert Path(argv[argv.index(str(Path(argv[1]).parent.parent / "run.py"))]).is_file()


def _user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "finetune.py").write_text('print("USER finetune.py EXECUTED")\n')
    return folder


@pytest.mark.slow
def test_a_users_finetune_py_and_fsdp_default_config_leave_the_launch_as_checked(recipe, tmp_path):
    """Found by a bug bash: from a folder holding the user's finetune.py, `finetune train --num-processes 2` ran that
    file and failed; and with an FSDP default config (mixed_precision: fp16) the ranks refused after the launch, with
    torch elastic's SIGTERM lines. Now it trains the DDP run validate checked, from that folder, with that config."""
    home = _fake_home(tmp_path)
    env = {k: v for k, v in child_env(HOME=str(home)).items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    finetune = Path(sys.executable).parent / "finetune"  # the console script, as a user runs it
    out = tmp_path / "run"
    result = subprocess.run([str(finetune), "train", str(recipe), "--num-processes", "2", f"output.dir={out}"],
                            cwd=_user_folder(tmp_path), env=env, capture_output=True, text=True, timeout=400,
                            check=False)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-4000:]
    assert "USER finetune.py EXECUTED" not in said and "closing signal" not in said, said[-4000:]
    assert "[finetune] parallel: DDP over 2 processes" in said, said[-4000:]
    assert json.loads((out / "ranks" / "rank0.json").read_text())["strategy"] == "ddp"


# ------------------------------------------------------------------------------ 4: ACCELERATE_* left in the shell
def test_a_shell_accelerate_mixed_precision_is_named_and_ignored_outside_a_launch(recipe, shell, capsys):
    """Found by a bug bash: ACCELERATE_MIXED_PRECISION=fp16 left in the shell refused `finetune train R.yaml` (and
    validate) as "the accelerate config has mixed_precision: fp16 ... Fix: set mixed_precision: no in the config" with
    no config anywhere, while the same shell trained under --accelerate-config (accelerate replaces the variable). Now
    it is ignored outside a launch, as in one, and named with its fix; in a launch's environment it is the config's."""
    shell.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert cli.main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "parallel: single process" in out, out
    note = " ".join(line for line in out.splitlines() if line.startswith("  note:"))
    assert "ACCELERATE_MIXED_PRECISION=fp16 is set in the environment" in note, out
    assert "Fix: unset ACCELERATE_MIXED_PRECISION" in note and "the accelerate config has" not in out, out
    for name, value in LAUNCHED.items():  # the same variable in accelerate launch's environment: the config's
        shell.setenv(name, value)
    assert cli.main(["validate", str(recipe)]) == 2
    assert "the accelerate config has mixed_precision: fp16" in capsys.readouterr().err


def test_the_run_notes_the_ignored_variables_and_auto_keeps_the_devices_dtype(tmp_path, shell):
    """Found by a bug bash: FINETUNE_NATIVE_BF16=0 ACCELERATE_MIXED_PRECISION=bf16 with model.dtype: auto trained in
    bfloat16 ("the accelerate config's mixed_precision: bf16 chose bfloat16 ... remove mixed_precision from the
    config"), ~30x slower on such a CPU, although no config existed. Now auto follows the device, and the run's plan
    notes the variables it ignored (ACCELERATE_USE_FSDP too), naming each and the fix."""
    import torch

    from finetune import parallel
    from finetune.recipe import validate_recipe

    shell.setenv(precision.NATIVE_BF16_ENV, "0")
    shell.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    shell.setenv("ACCELERATE_USE_FSDP", "true")
    shell.setenv("ACCELERATE_DISABLE_RICH", "1")  # read by nothing of a plan: not named
    choice = precision.choose_dtype("auto")
    assert choice.dtype == "float32" and "mixed_precision" not in choice.reason and choice.warning is None, choice
    values = recipe_dict(tmp_path / "model", tmp_path / "rows.jsonl", tmp_path / "out")
    values["model"]["name_or_path"] = "some/model"
    recipe = validate_recipe(values)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend=None)
    plan = parallel.resolve_plan(recipe, info, _tiny_config())
    assert plan.strategy == "single", plan
    (note,) = [note for note in plan.notes if "set in the environment" in note]
    assert note.startswith("ACCELERATE_MIXED_PRECISION=bf16, ACCELERATE_USE_FSDP=true are set in the environment"), note
    assert "Fix: unset ACCELERATE_MIXED_PRECISION ACCELERATE_USE_FSDP" in note and "RICH" not in note, note
    for name, value in LAUNCHED.items():  # in a launch: the config's bf16 decides auto, and nothing is noted
        shell.setenv(name, value)
    assert precision.choose_dtype("auto").dtype == "bfloat16"
    assert parallel.launcher.ignored_environment() == []


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256)


# ------------------------------------------------------------------------------ 6: matplotlib and an unwritable HOME
def _matplotlib_import(home: Path, **extra: str) -> str:
    env = {k: v for k, v in child_env(HOME=str(home), **extra).items()
           if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    code = "from finetune import quiet; quiet.install(); import matplotlib"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                            check=False, cwd=home.parent)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_matplotlibs_unwritable_home_lines_show_only_with_verbose(tmp_path):
    """Found by a bug bash: with a read-only HOME, the end of a quiet run printed matplotlib's two lines ("mkdir -p
    failed for path .../.config/matplotlib: [Errno 30] Read-only file system", "Matplotlib created a temporary cache
    directory at ..."): it logs them when the plot imports it. Now quiet.py filters them unless --verbose. (A HOME that
    is a file: its folders cannot be made, as on a read-only mount, whoever runs the test.)"""
    home = tmp_path / "home-file"
    home.write_text("")
    assert _matplotlib_import(home) == ""
    loud = _matplotlib_import(home, **{quiet.VERBOSE_ENV: "1"})
    assert "mkdir -p failed for path" in loud and "Matplotlib created a temporary cache directory" in loud, loud


def test_the_matplotlib_filter_drops_exactly_its_lines(tmp_path, monkeypatch, caplog):
    """The filter matches matplotlib's own messages as it logs them (its _get_config_or_cache_dir, called with a folder
    that cannot be made), and lets its other warnings through."""
    import logging

    import matplotlib

    monkeypatch.setenv("MPLCONFIGDIR", "")  # (recorded, so that what matplotlib sets below is undone)
    monkeypatch.delenv("MPLCONFIGDIR")
    monkeypatch.setattr(logging.getLogger("matplotlib"), "filters", [])
    quiet.install()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="matplotlib"):
        folder = matplotlib._get_config_or_cache_dir(lambda: str(blocked))
        logging.getLogger("matplotlib").warning("%s is a warning of matplotlib's own", "this")
    assert Path(folder).is_dir()
    assert [record.getMessage() for record in caplog.records] == ["this is a warning of matplotlib's own"]


def test_the_shells_launch_settings_are_said_and_kept_from_a_configured_launch(recipe, shell, monkeypatch, capsys):
    """Found by a bug bash (bb25, after #4): under `--accelerate-config ddp`, ACCELERATE_USE_FSDP / FSDP_* left in the
    shell reached every rank (accelerate writes only the variables of its config's kind), so the ranks ran another
    strategy than the one validate checked. They are named in one note and kept from the launcher's environment."""
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, env=None, **kw: started.append(env) or _Done())
    shell.setenv("ACCELERATE_USE_FSDP", "true")
    shell.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    shell.setenv("ACCELERATE_USE_CPU", "true")  # not a strategy setting: passed on
    assert cli.main(["train", str(recipe), "--accelerate-config", "ddp", "--num-processes", "2"]) == 0
    (env,) = started
    assert "ACCELERATE_USE_FSDP" not in env and "FSDP_SHARDING_STRATEGY" not in env, sorted(env)
    assert env.get("ACCELERATE_USE_CPU") == "true"
    said = capsys.readouterr().err
    assert "ACCELERATE_USE_FSDP=true" in said and "no accelerate launch started this process: ignored" in said, said


class _Done:
    def wait(self):
        return 0
