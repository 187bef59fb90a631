"""Forming the process group: a line when the other ranks are slow to arrive, and one paragraph when they never do
(torch's own report is a 25-line traceback after the whole timeout: "Timed out after 601 seconds waiting for clients.
1/2 clients joined."), naming the address, the ranks and the likely cause: variables left over in a shell, or a node
of a multi-node job that never started."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from finetune.errors import LaunchError, accelerate_launch_line, torchrun_line

LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_SIZE")  # torch elastic (torchrun, accelerate launch); DeepSpeed's
UNSET = "unset WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT"


def launched() -> bool:
    """Whether a launcher that sets the process-group variables started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def missing_address(world_size: int) -> str:
    """WORLD_SIZE without MASTER_ADDR/MASTER_PORT: the paragraph."""
    leftover = ("" if launched() else f" This process was not started by a launcher: are WORLD_SIZE/RANK left over in "
                f"this shell from another job? `{UNSET}` trains in one process.")
    return (f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set, so no process group can be formed."
            f"{leftover} Start a multi-process run with `{accelerate_launch_line('<config>', 'RECIPE.yaml')}` or "
            f"`{torchrun_line()}`.")


@contextmanager
def forming(world_size: int, rank: int, timeout_s: int) -> Iterator[None]:
    """Around init_process_group: after a while without every rank, rank 0 says it is waiting (and for how long it
    will); a rendezvous that times out or cannot connect is a LaunchError paragraph, not torch's traceback."""
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    said = threading.Event()

    def waiting() -> None:
        if rank == 0 and not said.is_set():
            print(f"[finetune] waiting for the other {world_size - 1} rank(s) at {address} (up to "
                  f"parallel.collective_timeout_s = {timeout_s} s)", flush=True)

    timer = threading.Timer(min(15.0, timeout_s / 2), waiting)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:  # DistStoreError, DistNetworkError (RuntimeErrors), TimeoutError
        text = str(exc).strip().splitlines()[-1][:240] if str(exc).strip() else type(exc).__name__
        if not any(word in text.lower() for word in ("timed out", "timeout", "failed to connect", "connection refused")):
            raise
        raise LaunchError(_no_group(world_size, address, timeout_s, f"{type(exc).__name__}: {text}")) from None
    finally:
        said.set()
        timer.cancel()


def _no_group(world_size: int, address: str, timeout_s: int, error: str) -> str:
    if launched():
        cause = ("The other ranks never arrived. On a multi-node launch every machine starts the same command: check "
                 "each node's log, that --num_machines/--nnodes and --machine_rank are right, and that "
                 f"{address.rsplit(':', 1)[0]} is machine 0's address, reachable from the others (a firewall, a "
                 "template's placeholder address). If the nodes start far apart, raise parallel.collective_timeout_s.")
    else:
        cause = ("This process was not started by torchrun or accelerate launch, yet WORLD_SIZE, RANK and MASTER_ADDR "
                 f"are set: left over in this shell from another job? `{UNSET}` trains in one process. If another "
                 f"tool (srun, a script) starts each rank, all {world_size} of them must start.")
    return (f"the process group of {world_size} ranks did not form at {address} within "
            f"parallel.collective_timeout_s = {timeout_s} s. {cause} ({error})")
