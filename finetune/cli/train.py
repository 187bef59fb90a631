"""`finetune train`: a recipe run in this process, or launched through accelerate on several (every pre-flight check
made here first, then accelerate's launcher, whose ranks' own exit code, signals and Ctrl-C are passed through)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from finetune.cli.library import resolve_recipe_path, train_launch


def cmd_train(args: argparse.Namespace) -> int:
    recipe = resolve_recipe_path(args.recipe)
    # The launch: the flags', else the one the recipe's comment names when it has several processes (validate checks
    # that same launch: cli/library.train_launch), else this process.
    launch = train_launch(recipe, args.accelerate_config, args.num_processes)
    if launch.launches:
        if launch.how != "as given":  # a launch the flags did not spell out: the recipe's, or ddp.yaml for N alone
            count = f"{launch.num_processes} processes" if launch.num_processes else "the config's processes"
            alone = "" if launch.how.startswith("as given") else "; --num-processes 1 to run in this process"
            print(f"[finetune] launch: {count}, {launch.how}{alone}", flush=True)
        else:  # the ranks' first lines come after each has imported torch: tens of seconds of silence (bug bash)
            count = f"{launch.num_processes} processes" if launch.num_processes else "the config's processes"
            print(f"[finetune] launch: {count} ({launch.config or 'accelerate defaults'}), starting", flush=True)
        # Several processes: check everything we can here first (a clean exit 2 instead of N failing workers and the
        # launcher's report), then hand over to accelerate's launcher, which runs finetune/run.py in each.
        from finetune.cli.validate import validate
        from finetune.recipe import announcements_muted

        with announcements_muted():  # the launched rank 0 says them, once
            validate(recipe, list(args.overrides), num_processes=launch.num_processes,
                     accelerate_config=launch.config, check_data=False, launching=True)
        # accelerate launch, minus its traceback; started by its file, as the ranks' run.py is: `-m` would put the
        # working folder first on sys.path, where a user's own finetune.py would be imported (and run) instead.
        command = [sys.executable, str(Path(__file__).resolve().parent / "accelerate_launch.py")]
        if launch.config:
            command += ["--config_file", launch.config]
        if launch.num_processes:
            command += ["--num_processes", str(launch.num_processes)]
        script = Path(__file__).resolve().parent.parent / "run.py"
        command += [str(script)]
        command += [recipe, *args.overrides]
        return _said_next(_launch(command, drop=_stray_launch_settings()), recipe, args.overrides)
    from finetune.run import main as run_main  # the launched ranks' own main: one path for errors and a full disk

    return _said_next(run_main([recipe, *args.overrides]), recipe, args.overrides)


def _said_next(code: int, recipe: str, overrides: list[str]) -> int:
    """After a run that ended well, the commands that use its adapter (its JSON `done:` line said nothing of them). A
    reward model's adapter generates no text and is not merged here (both refused, bb68): its export, and GRPO's
    grpo.reward_models, which scores with it (docs/reward.md)."""
    from finetune.recipe import announcements_muted, load_recipe
    from finetune.recipe.objectives import spec_of

    if code == 0:
        try:
            with announcements_muted():  # the run said its dtype line and notes: not twice (a launched run's test)
                loaded = load_recipe(recipe, list(overrides))
        except Exception:  # noqa: BLE001 - a recipe edited since the run started: nothing to add
            return code
        out = loaded.output.dir
        if spec_of(loaded.train.objective).head == "score":
            print(f"[finetune] next: finetune export {out} {out}-adapter (a sequence classifier's adapter: "
                  f"docs/reward.md loads it)   |   grpo.reward_models: [{out}] in a GRPO recipe", flush=True)
        else:
            print(f"[finetune] next: finetune generate {out} --prompt '...'   |   finetune export {out} {out}-merged "
                  "--merge", flush=True)
    return code


def _stray_launch_settings() -> list[str]:
    """The names of the shell's ACCELERATE_* / FSDP_* settings that no launch made (parallel.launcher's
    ignored_environment), said in one note and kept from the launch: accelerate writes only the variables of its
    config's kind, so ACCELERATE_USE_FSDP=true left in a shell reached every rank of a ddp.yaml launch, which ran
    another strategy than the one `validate` checked (bb25)."""
    from finetune.parallel.launcher import ignored_environment, ignored_environment_note

    stray = [item.split("=", 1)[0] for item in ignored_environment()]
    if stray:
        print(f"[finetune] note: {ignored_environment_note()}", file=sys.stderr, flush=True)
    return stray


def _launch(command: list[str], drop: list[str] = ()) -> int:
    """accelerate's launcher, and the ranks' own exit code: it exits 1 whatever a rank's was, so each rank writes its
    code (2: a user error, 130: stopped by Ctrl-C after its checkpoint) where this process reads it. Ctrl-C reaches the
    launcher and every rank too (one process group): this process waits for them to save and stop, never kills them.
    SIGTERM and SIGHUP sent to this process alone (`kill`, `timeout`, a container's stop, a closed terminal) are passed
    to the launcher, which passes them to the ranks: they checkpoint and stop. SIGUSR1 (SLURM's warning before
    preemption) is passed as SIGTERM, which torch elastic passes on (it does not handle SIGUSR1). If this process is
    killed outright, the launcher gets SIGTERM (and its ranks end with it: distributed.end_with_the_launcher)."""
    import signal
    import tempfile
    import threading

    from finetune.errors import EXIT_CODE_FILE
    from finetune.held_signals import parent_death_signal

    with tempfile.TemporaryDirectory(prefix="finetune-launch-") as folder:
        relay = Path(folder) / "exit_code"
        launched: list[subprocess.Popen] = []
        passed_on = {signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGHUP, signal.SIGUSR1: signal.SIGTERM}
        previous = {}

        def forward(number, frame) -> None:
            for process in launched:
                process.send_signal(passed_on[number])

        if threading.current_thread() is threading.main_thread():  # (signal handlers are the main thread's alone)
            for signum in passed_on:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # `nohup finetune train`: SIGHUP stays ignored
                    previous[signum] = signal.signal(signum, forward)
        interrupted = False
        try:
            env = {name: value for name, value in os.environ.items() if name not in drop}
            process = subprocess.Popen(command, env=dict(env, **{EXIT_CODE_FILE: str(relay)}),
                                       preexec_fn=parent_death_signal())  # noqa: PLW1509 (calls prctl alone)
            launched.append(process)
            while True:
                try:
                    code = process.wait()
                    break
                except KeyboardInterrupt:
                    interrupted = True
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        ranks = relay.read_text(encoding="utf-8").strip() if relay.exists() else ""
    if code != 0 and ranks.isdigit():
        return int(ranks)
    return 130 if interrupted and code != 0 else code
