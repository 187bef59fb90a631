"""The ranks meet, and agree on what they run.

Forming the process group: a line when the other ranks are slow to arrive, and one paragraph when they never do
(torch's own report is a 25-line traceback after the whole timeout: "Timed out after 601 seconds waiting for clients.
1/2 clients joined."), naming the address, the ranks and the likely cause: variables left over in a shell, or a node
of a multi-node job that never started. (A machine that never starts under torchrun or accelerate launch is waited for
by the launcher itself, before any rank runs: its `--rdzv_conf timeout=N`, docs/distributed.md.)

Once it formed, what every rank must share is compared (distributed.check_same_run, check_same_folder): the resolved
recipe, the finetune code, the training rows, the output folder. Each machine of a multi-node job has its own checkout,
recipe file and often its own copy of the data: one stale machine trained each rank its own way (its learning rate, its
rows, its prompt template), silently or until a misleading error. Here: the facts compared and the paragraphs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def launcher_asked_processes() -> int:
    """How many processes the parent `accelerate launch` / torchrun command line asked for (0 if unknown).

    accelerate without a multi-process config on a CPU-only machine quietly starts ONE process for
    `--num_processes 2` and sets no RANK/WORLD_SIZE; only the parent's command line still says what was asked.
    """
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return 0
    if not any("accelerate" in part or "torch.distributed.run" in part or "torchrun" in part for part in argv[:3]):
        return 0
    for index, part in enumerate(argv):
        for flag in ("--num_processes", "--num-processes", "--nproc_per_node", "--nproc-per-node"):
            if part == flag and index + 1 < len(argv) and argv[index + 1].isdigit():
                return int(argv[index + 1])
            if part.startswith(flag + "=") and part.split("=", 1)[1].isdigit():
                return int(part.split("=", 1)[1])
    return 0


def silently_split(asked: int) -> str:
    """The launcher asked for `asked` processes, and this one has no process group: the paragraph."""
    return (f"the launcher was asked for {asked} processes but this process sees no process group (WORLD_SIZE unset): "
            "accelerate without a multi-process config starts a single process on a CPU-only machine, and several "
            "such processes would train independent copies. Fix: launch with a multi-process accelerate config "
            f"(e.g. `{accelerate_launch_line('ddp', 'RECIPE.yaml', processes=asked)}`; on a CPU-only machine with "
            "ACCELERATE_USE_CPU=true in the environment, not `--cpu`, which starts one process), "
            f"or `{torchrun_line('RECIPE.yaml', asked)}`.")


# ------------------------------------------------------------------------------------------- where a rank runs
UNKNOWN_MACHINE = "unknown"


@functools.cache
def machine_id() -> str:
    """This process's kernel and PID namespace: the boot id and the inode of /proc/self/ns/pid. Two containers, or two
    nodes given one host name (`--hostname worker` in every pod), share the name but not this, and only a rank with
    the same one is seen in this host's /proc under its pid (one in another namespace named a kworker's pid here).
    UNKNOWN_MACHINE where it cannot be read (no /proc): then no peer is checked from here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return UNKNOWN_MACHINE


def same_machine(machine: str) -> bool:
    """Whether a rank's machine_id is this process's: its pid is then one this host's /proc shows."""
    return machine == machine_id() != UNKNOWN_MACHINE


def ranks_on(ranks: list[int], hosts: list[str]) -> str:
    """`ranks` named with their hosts: "rank 1 on node-b", "ranks 8-15 on node-b, 16-23 on node-c"."""
    by_host: dict[str, list[list[int]]] = {}
    for rank in ranks:
        spans = by_host.setdefault(hosts[rank] if rank < len(hosts) else "?", [])
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    said = [", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans) + f" on {host}"
            for host, spans in by_host.items()]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(said)


# ------------------------------------------------------------------------------------------- the same run
# Keys of the resolved recipe that may differ between machines: where each machine finds the same thing (output.dir:
# distributed.check_same_folder; the data files: compared by their rows, a local copy may sit elsewhere on each
# machine) and how fast this machine works. Everything else changes what is trained.
MACHINE_KEYS = ("output.dir", "data.num_proc", "train.threads")
_DATA_PATH = re.compile(r"data\.(eval_)?datasets\[\d+\]\.path")
DIGEST = "blake2b:"  # a value compared, not shown: "its files differ"
INSTALLED = "installed in"  # shown beside the finetune version, never compared (every machine installs it its own way)


def digest(data: bytes | str) -> str:
    return DIGEST + hashlib.blake2b(data.encode() if isinstance(data, str) else data, digest_size=12).hexdigest()


def recipe_facts(dumped: dict) -> dict[str, str]:
    """The resolved recipe (recipe.model_dump(mode="json"), what recipe.yaml holds) as key path -> value, without the
    keys that may differ between machines."""
    flat: dict[str, str] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        elif path not in MACHINE_KEYS and not _DATA_PATH.fullmatch(path):
            flat[path] = json.dumps(value)

    walk(dumped, "")
    return flat


@functools.cache
def code_facts() -> dict[str, str]:
    """The finetune this process runs: its version, a digest of each of its source files (code, templates, tables),
    and where it is installed (shown only). A checkout of another commit, an older venv, one edited file: all differ."""
    package = Path(__file__).resolve().parent
    files = sorted(path for path in package.rglob("*")
                   if path.suffix in (".py", ".jinja", ".json") and "__pycache__" not in path.parts)
    return {"version": sys.modules["finetune"].__version__, INSTALLED: str(package),
            **{f"finetune/{path.relative_to(package)}": digest(path.read_bytes()) for path in files}}


# What follows the peers' gather in distributed.init_distributed (code_differs): a finetune that changes it changes this
# number, so that ranks of two finetunes never wait in two different collectives (a hang of the whole timeout).
SAME_RUN_PROTOCOL = 1


def this_rank() -> tuple:
    """What a rank tells the others as the group forms (distributed._PEERS): host, pid, machine_id, and its finetune:
    (version, folder, digest of its files, SAME_RUN_PROTOCOL). A finetune before these checks sent (host, pid)."""
    code = code_facts()
    return (socket.gethostname(), os.getpid(), machine_id(),
            (code["version"], code[INSTALLED], digests({"finetune": code})["finetune"], SAME_RUN_PROTOCOL))


def code_differs(peers: list[tuple], gather) -> str | None:
    """The paragraph when the ranks run different finetunes (None when they all run this one): the files that differ,
    from one more gather (`gather`: distributed.gather_objects) where every rank speaks SAME_RUN_PROTOCOL; else
    (an older finetune, which said no code) the versions and folders alone, with no further collective."""
    codes = [peer[3] if len(peer) > 3 else None for peer in peers]
    if all(code is not None and codes[0] is not None and code[2] == codes[0][2] for code in codes):
        return None
    hosts = [peer[0] for peer in peers]
    if all(code is not None and code[3] == SAME_RUN_PROTOCOL for code in codes):
        return runs_differ([{"finetune": facts} for facts in gather(code_facts())], hosts)
    return runs_differ([{"finetune": {"version": code[0], INSTALLED: code[1], "its files": code[2]} if code else
                         {"version": "older than these checks (it said no version)", INSTALLED: ""}} for code in codes],
                       hosts)


def digests(facts: dict[str, dict[str, str]]) -> dict[str, str]:
    """One digest per group of facts (what a rank sends first: the groups' keys only where one differs)."""
    return {name: digest(json.dumps(sorted((key, value) for key, value in group.items() if key != INSTALLED)))
            for name, group in facts.items()}


_DIFFERS = {"recipe": "{has} another recipe", "finetune": "{runs} another finetune", "data": "{has} other data"}


def runs_differ(gathered: list[dict[str, dict[str, str]]], hosts: list[str]) -> str:
    """The paragraph for ranks that do not run the same thing: `gathered`, every rank's facts of the groups that
    differ (recipe, finetune, data); each other version of a group named with its ranks and the keys that differ
    from rank 0's."""
    found = []
    for name, reference in gathered[0].items():
        versions: dict[str, list[int]] = {}
        for rank, facts in enumerate(gathered):
            if digests({name: facts[name]}) != digests({name: reference}):
                versions.setdefault(json.dumps(facts[name], sort_keys=True), []).append(rank)
        for ranks in versions.values():
            one = len(ranks) == 1
            differs = _DIFFERS.get(name, "{has} another " + name).format(has="has" if one else "have",
                                                                          runs="runs" if one else "run")
            found.append(f"{ranks_on(ranks, hosts)} {differs} than rank 0 on "
                         f"{hosts[0]}: {_keys_apart(gathered[ranks[0]][name], reference)}")
    return (f"the ranks of this run do not run the same thing: {'; '.join(found)}. Every machine of a run must have "
            "the same recipe (file and command-line overrides), the same finetune (release or commit: every file) "
            "and the same training data; otherwise each rank trains its own way (its learning rate, seed, rows or "
            "prompt template) and the run ends in a wrong adapter or a misleading error later. (output.dir, the "
            "data files' paths, data.num_proc and train.threads may differ: the data is compared by its rows.) "
            "Nothing was trained. Fix: give every machine the same recipe, finetune and data (copy them, or keep "
            "them on a filesystem every machine mounts), then start the run again with the same command everywhere.")


def _keys_apart(theirs: dict[str, str], reference: dict[str, str], most: int = 6) -> str:
    """"train.learning_rate 0.03 vs 0.003; finetune/data/templates.py: different": theirs first, rank 0's after."""
    keys = sorted((key for key in dict.fromkeys([*reference, *theirs])
                   if key not in (INSTALLED, "version") and theirs.get(key) != reference.get(key)),
                  key=lambda key: DIGEST in theirs.get(key, "") + reference.get(key, ""))  # values first, then digests
    said = [f"{key}: different" if DIGEST in theirs.get(key, "") + reference.get(key, "")
            else f"{key} {theirs.get(key, '(none)')} vs {reference.get(key, '(none)')}" for key in keys[:most]]
    if len(keys) > most:
        said.append(f"and {len(keys) - most} more")
    if INSTALLED in theirs:  # the finetune: its version and where each is installed first
        said.insert(0, f"finetune {theirs.get('version')}{f' in {theirs[INSTALLED]}' * bool(theirs[INSTALLED])} vs "
                       f"{reference.get('version')} in {reference.get(INSTALLED)}")
    return "; ".join(said)


SHARED_CHECK_FILE = ".finetune.shared-check"


def write_token(marker: Path) -> str | None:
    """Rank 0: a new token written into `marker`, on the disk before any other machine looks (fsync: an NFS server's
    copy); None when it cannot be written (claim_output_dir said so, or the first write will)."""
    token = os.urandom(12).hex()
    try:
        with open(marker, "w", encoding="utf-8") as handle:
            handle.write(token)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        return None
    return token


def reads_back(marker: Path, token: str, wait_s: float = 5.0) -> bool:
    """Whether `marker` holds `token`, looked at again for up to `wait_s` (an NFS client's cached view of a folder may
    be a few seconds old)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.listdir(marker.parent)  # the folder's entries read again, not only a cached lookup
            if marker.read_text(encoding="utf-8") == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def folder_not_shared(key: str, folders: list[str], unseen: list[int], hosts: list[str]) -> str:
    """The paragraph for a folder (the recipe's `key`) that is not the same one on every rank."""
    theirs = sorted({folders[rank] for rank in unseen})
    return (f"{key} is not one folder every rank sees: rank 0 on {hosts[0]} wrote a file into {folders[0]}, and "
            f"{ranks_on(unseen, hosts)} {'does' if len(unseen) == 1 else 'do'} not find it in "
            f"{'its' if len(unseen) == 1 else 'their'} {key} ({', '.join(theirs)}). Every rank writes its "
            "shard of each checkpoint there and rank 0 the adapter, so the run would fail at its first checkpoint, "
            f"or leave its files split over the machines. Nothing was trained. Fix: set {key} to a folder on a "
            "filesystem every machine mounts (NFS, Lustre, a shared disk), the same folder from every machine.")


def start_differs(what: str, values: list[float], hosts: list[str]) -> str:
    """The paragraph for a value every rank computed alike and that differs (the LoRA weights' checksum)."""
    apart = [rank for rank, value in enumerate(values) if value != values[0]]
    return (f"{what} differ between ranks: {ranks_on(apart, hosts)} computed {values[apart[0]]!r}, rank 0 on "
            f"{hosts[0]} {values[0]!r}; the ranks would train apart. The recipe and the finetune code were compared "
            "at the start and are the same, so the machines differ in another way: their torch, transformers or peft "
            "versions, or the base model's files. Fix: the same Python environment and model files on every "
            "machine, then start the run again.")
