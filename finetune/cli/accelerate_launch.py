"""`accelerate launch`, as `finetune train --accelerate-config` runs it, without the launcher's own traceback.

When a rank fails, accelerate's launcher re-raises torch's ChildFailedError (or, with one process, a
CalledProcessError): Python prints the launcher's traceback, twenty lines of accelerate and torch.distributed
frames after the rank's own words. Here those are caught. torch's failure report (which rank, its exit code,
the signal) is printed unless the first rank to fail (the root cause; torch stops the others) ended as finetune
ends a user's mistake (exit 2, its paragraph already printed) or a Ctrl-C (130). A signal to the launcher
itself (Ctrl-C reaches it with the ranks) is its exit code, 128 + the signal. Otherwise the process exits 1, as
the launcher would; `finetune train` reads the ranks' own code.

    python .../finetune/cli/accelerate_launch.py [accelerate launch arguments] .../finetune/run.py RECIPE ...

`finetune train` starts it by its file (as the launcher starts run.py), not with `-m`: `python -m` puts the working
folder first on sys.path, and a user's own `finetune.py` there was imported (and run) instead of the package.
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__" and __package__ in (None, ""):
    # Started as a script: the folder holding the package this file belongs to (not finetune/cli/) comes first on the
    # path, so `finetune` is that package, whatever the working folder holds.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

QUIET_CODES = (2, 130)  # finetune's exit for a user's mistake, and a Ctrl-C after its checkpoint


def main() -> int:
    from finetune import quiet

    quiet.install()  # the launcher's own noise too (DeepSpeed's accelerator line, torchrun's threads banner)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(sys.argv[1:])
    try:
        launch_command(args)
    except DistError as exc:  # the launcher's rendezvous, before any rank ran: a machine that never joined
        print(_not_joined(args, exc), file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()  # the root cause: the others were stopped because of it (SIGTERM)
        if first.exitcode not in QUIET_CODES:
            print(exc.format_msg(), file=sys.stderr, flush=True)
        return 1
    except subprocess.CalledProcessError as exc:  # one process: accelerate's simple launcher
        return 128 - exc.returncode if exc.returncode < 0 else exc.returncode or 1  # (killed by a signal: 128 + it)
    except SignalException as exc:  # Ctrl-C (or a scheduler's SIGTERM): torch passed it to the ranks, which stopped
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # the simple launcher's Ctrl-C: its one rank got it too and is saving; wait for it
        return _rank_exit()
    return 0


def _not_joined(args, exc: Exception) -> str:
    """The paragraph for a rendezvous that timed out or lost its main machine (torch's traceback, after 900 s of
    silence by default, named neither the machines nor the way to shorten the wait: bb22)."""
    machines = getattr(args, "num_machines", None) or 1
    where = f"{getattr(args, 'main_process_ip', None) or '?'}:{getattr(args, 'main_process_port', None) or '?'}"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"finetune: error: the launch's machines did not all meet: this is machine {getattr(args, 'machine_rank', 0)} "
            f"of {machines}, meeting at {where}, and the launcher's rendezvous ended before every machine joined "
            f"({first}). Nothing was trained. Fix: start the same command on every machine (each with its own "
            "machine_rank, the same main_process_ip and main_process_port, and that port open from the others); "
            "the launcher waits 900 s by default: `--rdzv_conf timeout=N` on every machine's command shortens it "
            "(docs/distributed.md, several machines).")


def _rank_exit() -> int:
    """The exit code of the simple launcher's rank (a child of this process), once it has saved and stopped; 130
    where there is none left to wait for."""
    code = 130
    while True:
        try:
            _, status = os.wait()
        except ChildProcessError:
            return code
        except KeyboardInterrupt:  # a second Ctrl-C: the rank is already stopping
            continue
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
