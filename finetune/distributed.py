"""Process-group facts from the launcher (accelerate launch, torchrun, or a plain `python`).

We read the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and form the process
group with torch's own API: NCCL with one GPU per process (device from LOCAL_RANK, finetune/devices.py) when CUDA is
present, gloo on CPU. We deliberately do not let accelerate's state decide: on CPU it reports `DistributedType.NO` for
an FSDP config and lets N processes train N independent copies. Only this module and finetune/parallel/ touch
torch.distributed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from finetune import rank_errors, rendezvous
from finetune.devices import check_torch_sees_the_gpus, local_gpu_index, shared_gpu_refused
from finetune.errors import FinetuneError, LaunchError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when single-process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


_INFO: DistInfo | None = None
_PEERS: list[tuple] = []  # every rank's rendezvous.this_rank() (host, pid, machine, finetune), from the group's forming
_DOING = "starting"  # what this rank is doing, for the message when a collective fails (set by `doing`)
_TIMEOUT_S = 600


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_distributed(*, timeout_s: int = 600) -> DistInfo:
    """Form the process group described by the launcher's environment (idempotent)."""
    global _INFO
    if _INFO is not None:
        return _INFO
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = local_world_size(world_size)
    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() not in ("true", "1")
    visible = torch.cuda.device_count() if cuda else 0
    if cuda:  # LOCAL_RANK picks the GPU, or cuda:0 where the launcher bound one GPU to each process (devices.py)
        device = torch.device("cuda", local_gpu_index(local_rank, local_world, visible))
        torch.cuda.set_device(device)
    else:
        check_torch_sees_the_gpus()  # a CUDA torch on an older driver would train on the CPU with only a warning
        device = torch.device("cpu")
    end_with_the_launcher()
    backend = None
    # A launcher that starts one process on purpose (`torchrun --standalone --nproc_per_node 1`) gets a 1-rank group, so FSDP and
    # ZeRO run at world size 1 (one GPU with CPU offload); a plain `python` start stays without one.
    launched_alone = world_size == 1 and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if world_size > 1 or launched_alone:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise LaunchError(rendezvous.missing_address(world_size))
        backend = process_group_backend(cuda=cuda)
        if not dist.is_initialized():
            kwargs = {"device_id": device} if cuda else {}
            # NCCL's refusal of one GPU given to several ranks; ranks that never arrive as one paragraph
            with shared_gpu_refused(local_world, visible), rendezvous.forming(world_size, rank, timeout_s):
                dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        if dist.get_world_size() != world_size:
            raise LaunchError(f"process group has {dist.get_world_size()} ranks, the launcher announced {world_size}.")
        global _PEERS, _TIMEOUT_S
        _PEERS, _TIMEOUT_S = [None] * world_size, timeout_s
        with shared_gpu_refused(local_world, visible):  # (NCCL's first collective, where its init is lazy)
            dist.all_gather_object(_PEERS, rendezvous.this_rank())  # names a lost rank; the same finetune everywhere
        if problem := rendezvous.code_differs(_PEERS, gather_objects):  # before any other collective (rendezvous.py)
            raise _said_on_every_machine(LaunchError(problem))
    _INFO = DistInfo(rank, world_size, local_rank, local_world, device, backend)
    _check_not_silently_split(_INFO)
    return _INFO


def end_with_the_launcher() -> None:
    """A rank started by torch elastic (torchrun, accelerate launch) is sent SIGTERM when its launcher dies, as when
    the launcher is SIGKILLed, or killed by a signal it does not handle (SIGUSR1: SLURM's usual warning before
    preemption). The agent starts each rank in a session of its own, so a kill of the launcher's process group missed
    the ranks too: they trained on as orphans, writing the run where nobody looked. SIGTERM takes the preemption path
    (the step finishes, every rank checkpoints, exit 143). A launcher gone between reading the parent's pid and the
    prctl call is acted on at once (prctl(2)'s idiom: the parent pid changed; never "is 1": a container's launcher is
    pid 1)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def local_world_size(world_size: int) -> int:
    """Processes on this node: torchrun/accelerate say LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE (and on a
    multi-node DeepSpeed launch WORLD_SIZE is every node's processes, so falling back to it would refuse valid launches
    in the one-GPU-per-process check); WORLD_SIZE only when neither is set (one node)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name) not in (None, ""):
            return _env_int(name, world_size)
    return world_size


def process_group_backend(*, cuda: bool) -> str:
    """gloo on CPU; on GPUs NCCL for CUDA tensors and gloo for CPU tensors.

    With CPU offload (FSDP2's CPUOffloadPolicy, FSDP1's CPUOffload, ZeRO offload) the gradients live in CPU memory,
    so clipping's norm all-reduce runs on CPU tensors: an NCCL-only group fails there with "No backend type
    associated with device type cpu" (pytorch #148532, torchtune #1977). Every collective on a CUDA tensor still
    goes through NCCL.
    """
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _check_not_silently_split(info: DistInfo) -> None:
    """Refuse processes that do not form the group the launcher was asked for (the accelerate-on-CPU traps)."""
    asked = _env_int("FINETUNE_EXPECT_WORLD_SIZE", 0) or rendezvous.launcher_asked_processes()
    if asked > 1 and info.world_size == 1:
        raise LaunchError(rendezvous.silently_split(asked))


def info() -> DistInfo:
    if _INFO is None:
        return init_distributed()
    return _INFO


def is_main() -> bool:
    return _INFO is None or _INFO.is_main


def print0(*args, sep: str = " ", end: str = "\n", file=None) -> None:
    """Print on rank 0. While a progress bar is drawn (the training loop's, a tokenizing one) the line is written above
    it by tqdm, which clears the bar and draws it again below: a plain print wrote over the bar's line."""
    if not is_main():
        return
    bars = sys.modules.get("tqdm.std")  # (a bar another thread's run is still building has no `disable` yet)
    if bars is not None and any(not getattr(bar, "disable", True) for bar in list(bars.tqdm._instances)):
        bars.tqdm.write(sep.join(str(arg) for arg in args), file=file, end=end)
        (file or sys.stdout).flush()
        return
    print(*args, sep=sep, end=end, file=file, flush=True)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list, device: torch.device | None = None) -> list[float]:
    """Sum a few numbers over all ranks (loss and token counts for logging); 0-d tensors among them stay on their
    device until the one host transfer at the end."""
    initialized = dist.is_available() and dist.is_initialized()
    if device is None:
        tensors = [v.device for v in values if isinstance(v, torch.Tensor)]
        device = info().device if initialized else (tensors[0] if tensors else torch.device("cpu"))
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in values])
    if initialized:
        dist.all_reduce(tensor)
    return tensor.tolist()


def world_size() -> int:
    """Ranks in the process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_padded(tensor: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Every rank's 1-D `tensor` (rank r's has lengths[r] elements, known on every rank), in rank order: one
    all-gather of pieces padded to the longest (sharded loading's absmax, finetune/model/sources/shard_reads.py)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [tensor]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()] = tensor
    # dist.all_gather into views of one buffer, not all_gather_single (torch 2.13+ only) nor all_gather_into_tensor
    # (gloo lacks it before torch 2.4): the same one collective on every torch this project supports.
    out = torch.empty(longest * len(lengths), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(out.split(longest)), padded)
    return [out[rank * longest : rank * longest + length] for rank, length in enumerate(lengths)]


def all_reduce_max(values: list[float]) -> list[float]:
    """The largest of each number over all ranks (the smallest: negate in and out)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=info().device if dist.is_initialized() else "cpu")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (one item when there is no process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first_of_ranks(value):
    """The first non-None `value` over the ranks (rank order); every rank gets it."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return next((v for v in values if v is not None), None)


def any_rank(flag: bool) -> bool:
    """True if `flag` is true on any rank (used for NaN checks and preemption)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=info().device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def rank_max(value: int) -> int:
    """The largest of an integer over the ranks (the stop signal any rank received: every rank names the same one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([float(value)], device=info().device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def check_same_on_all_ranks(value: float, what: str) -> None:
    """Refuse a `value` that differs between ranks (the LoRA start's checksum: ranks that start apart diverge)."""
    values = gather_objects(float(value))
    if any(v != values[0] for v in values):
        raise _said_on_every_machine(LaunchError(rendezvous.start_differs(what, values, _hosts())))


def check_same_run(facts: dict[str, dict[str, str]]) -> None:
    """Refuse ranks that do not run the same thing: `facts` (group -> key -> value: the recipe, the training rows;
    rendezvous.py), one digest per group gathered, then a differing group's keys, to name them (exit 2)."""
    sums = gather_objects(rendezvous.digests(facts))
    if differing := [name for name in facts if any(other[name] != sums[0][name] for other in sums)]:
        gathered = gather_objects({name: facts[name] for name in differing})
        raise _said_on_every_machine(LaunchError(rendezvous.runs_differ(gathered, _hosts())))


def check_same_folder(folder: Path, key: str) -> None:
    """Refuse a `folder` (the recipe's `key`: output.dir) that is not one folder for every rank, as a node-local path:
    rank 0 writes a token there, every rank reads it back (it failed at the first checkpoint, hiding why)."""
    if world_size() < 2:
        return
    marker = Path(folder) / rendezvous.SHARED_CHECK_FILE
    token = broadcast_object(rendezvous.write_token(marker) if is_main() else None)
    seen = gather_objects((token is None or rendezvous.reads_back(marker, token), str(folder)))
    if is_main():
        marker.unlink(missing_ok=True)
    if unseen := [rank for rank, (found, _) in enumerate(seen) if not found]:
        raise _said_on_every_machine(LaunchError(rendezvous.folder_not_shared(key, [f for _, f in seen], unseen, _hosts())))


def _said_on_every_machine(error: FinetuneError) -> FinetuneError:
    """Raised alike by every rank after a gather: printed by rank 0 and each other machine's first rank (run.py main)."""
    error.alike_on_every_rank = error.said_on_every_machine = True
    return error


def _hosts() -> list[str]:
    return [peer[0] for peer in _PEERS] or ["?"] * world_size()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: LoRA init is then identical without a broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def teardown(*, clean: bool = False) -> None:
    """Close the process group. `clean` (every rank finished the run): meet once more first, so no rank closes its
    connections while a peer's transport threads still finish the last collective. A gloo run was seen, once under
    heavy load, to abort at exit ("terminate called without an active exception") after training had finished."""
    global _INFO
    if dist.is_available() and dist.is_initialized():
        if clean:
            import gc

            dist.barrier()
            gc.collect()  # drop finished async work objects (they hold tensors) while the interpreter is whole
        dist.destroy_process_group()
    _INFO = None


# ------------------------------------------------------------------------------------------- a lost peer
class PeerLost(FinetuneError):
    """A collective failed because another rank died or stopped answering. Exit code 1 (not a recipe mistake)."""

    exit_code = 1
    is_error = True


_COMMUNICATION_MARKERS = ("gloo/transport", "nccl", "connection reset", "connection closed", "connection refused",
                          "broken pipe", "timed out", "socket timeout")


def doing(what: str) -> None:
    """Say what this rank does now (e.g. "step 5: forward and backward"); named if a collective fails meanwhile."""
    global _DOING
    _DOING = what


def is_communication_failure(exc: BaseException) -> bool:
    """A failed collective (a peer died, stopped, or the network broke), not a bug of ours, a user mistake or an error
    of this rank's own (rank_errors.raised_by_this_rank: a peer that died of the same is not the story).
    torch.distributed.checkpoint wraps the failures of every rank in a CheckpointException (a BaseException)."""
    if not _PEERS or len(_PEERS) < 2 or rank_errors.raised_by_this_rank(exc):
        return False
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    wrapped = isinstance(exc, RuntimeError) or type(exc).__name__ == "CheckpointException"
    if not wrapped:
        return False
    # The backend's words for a broken connection vary with where the transfer was (gloo's pair, unbound buffer,
    # store; NCCL's watchdog): a peer on this host that is dead, gone or stopped settles it whatever the words.
    return any(marker in str(exc).lower() for marker in _COMMUNICATION_MARKERS) or _a_local_peer_is_down()


def _a_local_peer_is_down() -> bool:
    return any(peer_state(host, pid) != "alive" for _, host, pid in _local_peers(_INFO.rank if _INFO else -1))


def _local_peers(me: int) -> list[tuple[int, str, int]]:
    """(rank, host, pid) of the other ranks this host's /proc shows: the same host name, and the same kernel and PID
    namespace where the rank said its own (rendezvous.machine_id; a (host, pid) pair is compared by the name)."""
    return [(rank, peer[0], peer[1]) for rank, peer in enumerate(_PEERS) if rank != me
            and peer[0] == socket.gethostname() and (len(peer) < 3 or rendezvous.same_machine(peer[2]))]


def _here_alive(me: int) -> str:
    return "every other rank on this host is still alive" if _local_peers(me) else "no other rank runs on this host"


def _elsewhere(me: int) -> list[str]:
    """The hosts of the other ranks this host cannot check; one of this host's name is another machine or container."""
    local = {rank for rank, _, _ in _local_peers(me)} | {me}
    return sorted({f"{peer[0]} (another machine or container of this host's name: not checked from here)"
                   if peer[0] == socket.gethostname() else peer[0] for rank, peer in enumerate(_PEERS) if rank not in local})


def peer_state(host: str, pid: int, machine: str | None = None) -> str:
    """Alive, stopped, dead, gone, stuck or not checkable: a rank's process seen from here (`machine`: its
    machine_id); on this host rank_errors.local_peer_state reads it (a peer in state D is watched a moment)."""
    if host != socket.gethostname() or not (machine is None or rendezvous.same_machine(machine)):
        return f"on host {host}, not checked from here"
    return rank_errors.local_peer_state(pid)


def _lost_peers(me: int, *, wait_s: float) -> list[str]:
    """The ranks on this host that are dead, gone or stopped. A broken connection with every local peer alive is
    looked at again for up to `wait_s`: a process being killed can break its connections a moment before it is seen
    to die."""
    deadline, local = time.monotonic() + wait_s, _local_peers(me)
    while True:
        states = [(rank, host, pid, peer_state(host, pid)) for rank, host, pid in local]
        lost = [f"rank {rank} (pid {pid} on {host}) is {state}" for rank, host, pid, state in states if state != "alive"]
        if lost or time.monotonic() >= deadline or not local:
            return lost
        time.sleep(0.1)


def _slow_peer(me: int, checkpoints: str, error: str) -> str:
    """A collective that timed out with every rank on this host alive: a peer busy for longer than the timeout (a slow
    reward function, work on rank 0 alone) is as likely as a failure, and only the timeout knob helps it."""
    here, remote = socket.gethostname(), _elsewhere(me)
    where = (f"every other rank is alive on this host ({here}), so one of them is still busy or hung" if not remote
             else f"{_here_alive(me)}; a rank on {', '.join(remote)} may be busy, hung or gone, or the network failed")
    return (f"rank {me} waited for its peers during {_DOING} longer than parallel.collective_timeout_s = {_TIMEOUT_S} s: "
            f"{where}. A step that is slower on one rank than this (a reward function or reward model, work on rank 0 "
            "alone, data loading, a long generation) stops the run the same way as a hung rank. The job cannot "
            f"continue without every rank and stops (the launcher ends the other ranks); {checkpoints} If that rank "
            "was slow but working, raise parallel.collective_timeout_s (the recipe key; HF's ddp_timeout is read as "
            f"it) and run the same command with train.resume=auto added. ({error})")


def peer_failure(exc: BaseException, *, checkpoints: str) -> PeerLost:
    """The paragraph for a failed collective: what this rank was doing, which ranks are dead or stopped, the timeout,
    where the run stands (`checkpoints`: what is on disk) and the way back."""
    me = info().rank
    text = str(exc).strip().splitlines()[-1][:240] if str(exc).strip() else type(exc).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    lost = _lost_peers(me, wait_s=0.0 if timed_out else 3.0)
    waited = (f"no answer within parallel.collective_timeout_s = {_TIMEOUT_S} s" if timed_out
              else "the connection to a peer broke")
    if timed_out and not lost:
        return PeerLost(_slow_peer(me, checkpoints, f"{type(exc).__name__}: {text}"))
    remote = ", ".join(_elsewhere(me))
    who = "; ".join(lost) or _here_alive(me) + (f"; a rank on {remote} failed, or the network did" if remote else
                                                 ", yet a connection broke (the network, or a rank closing its own)")
    return PeerLost(
        f"rank {me} lost a peer during {_DOING} ({waited}): {who}. The job cannot continue without every rank and stops "
        f"(the launcher ends the other ranks); {checkpoints} Once the cause is gone (a dead node, an out-of-memory "
        f"kill, a hung process), run the same command with train.resume=auto added. ({type(exc).__name__}: {text})"
    )
