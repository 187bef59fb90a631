"""A fork server for the suite's launches: the libraries a rank imports, imported once; each rank forked from here.

A cold rank spends most of a short test run importing torch, transformers, PEFT, bitsandbytes, accelerate and
torch.distributed.checkpoint (~6 CPU-s on a 2-core Zen 4, ~9 on a Zen 1), and a 2-rank launch pays that twice plus
the launcher's own import. This process pays it once per pytest process; a launch then costs a fork.

    python tests/warm_server.py SOCKET      (started by tests/warm.py; prints "ready" when it serves)

Each request comes on its own connection of the Unix socket SOCKET, as one JSON line (with file descriptors beside
it for a rank), from tests/warm_launch.py, the launcher:
  * {"op": "plan", "argv", "env", "cwd"}: the ranks `argv` would start, computed by the launcher's own code in a
    forked child (torchrun's argument parser and `config_from_args`, the environment its agent gives each worker;
    accelerate's parser, `_validate_launch_command`, `launch_command`'s choice of launcher and its
    `prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env` / `prepare_simple_launcher_cmd_env`), or {"cold": reason} where it is a launch this
    server does not reproduce (the launcher then runs `argv` itself).
  * {"op": "store", "host", "port"}: a process holding torchrun's agent store (a TCPStore server) until the
    connection closes, as torchrun's agent does for its workers (TORCHELASTIC_USE_AGENT_STORE=True).
  * {"op": "rank", "env", "cwd", "target"} with the launcher's stdin, stdout and stderr: a forked rank in a session
    of its own (as torchrun starts workers), with that environment, folder and standard streams, running the target
    as Python would (a script, `-m` module or `-c` code, with its argv); answered {"pid"}, then {"status"} (a
    Popen returncode: negative for a signal) when it ends. A connection closed early (the launcher was killed) kills
    the rank's process group.
Requests whose environment differs from this server's in a variable read at import time are answered "cold".
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import traceback

# Variables the preloaded libraries (or Python itself) read when they are imported: a request that differs from the
# server in one of them runs cold. Anything else (a test's own variables, the launchers', accelerate's, finetune's) is
# read when the rank runs, after the fork. FINETUNE_VERBOSE: quiet's filters decide which import-time warnings show.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "NCCL_", "OMP_", "MKL_",
                  "KMP_", "GOMP_", "OPENBLAS_", "LD_", "PYTHON", "BNB_", "BITSANDBYTES_", "DATASETS_", "TOKENIZERS_",
                  "XDG_", "SAFETENSORS_", "PEFT_", "TRITON_", "NUMBA_", "ACCELERATE_DISABLE_RICH", "FINETUNE_VERBOSE")
READ_AT_IMPORT_NAMES = {"HOME", "PATH", "LANG", "LANGUAGE", "TZ", "USER"}
READ_WHEN_RUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")  # set by the launchers, read by the ranks
STARTED_WITH = dict(os.environ)  # before the imports (quiet.install sets variables, as it does in every rank)


def preload() -> None:
    """What a rank of `finetune/run.py` imports, in its order (run.py's modules, quiet's filters, then the stages)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from finetune import quiet, run  # noqa: F401

    quiet.install()
    quiet.defer_bitsandbytes_compiles()
    import finetune.cli  # noqa: F401  (python -m finetune)
    from finetune import data, model, outputs, parallel, tracking, training  # noqa: F401

    model.import_backends()
    import accelerate.commands.launch  # noqa: F401
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.run  # noqa: F401
    import transformers

    for family in ("llama", "qwen2", "gemma", "mixtral", "qwen3_moe"):  # the suite's tiny models
        getattr(transformers, transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    sys.path.pop(0)


def cold_reason(env: dict[str, str]) -> str | None:
    """Why `env` cannot run in a rank forked from here (a variable read at import differs), or None. PYTHONPATH may
    differ where its folders hold no module this server has imported (a test's reward functions): the rank puts
    them on its path, where Python would."""
    # A variable the imports here set themselves (quiet.install's HF_HUB_DISABLE_PROGRESS_BARS, as in every rank) may
    # be either way: the libraries read it after it was set.
    differing = sorted(key for key in set(env) | set(STARTED_WITH)
                       if env.get(key) not in (STARTED_WITH.get(key), os.environ.get(key)))
    read_at_import = [key for key in differing if (key.startswith(READ_AT_IMPORT) or key in READ_AT_IMPORT_NAMES
                                                   or key.startswith("LC_")) and not key.startswith(READ_WHEN_RUN)]
    if read_at_import == ["PYTHONPATH"]:
        loaded = {name.partition(".")[0] for name in sys.modules}
        shadowing = sorted(name for folder in python_path(env) if os.path.isdir(folder)
                           for name in (entry.removesuffix(".py") for entry in os.listdir(folder)) if name in loaded)
        read_at_import = [f"PYTHONPATH (its folders hold {', '.join(shadowing)}, imported here)"] if shadowing else []
    return f"the environment differs in {', '.join(read_at_import)}" if read_at_import else None


def python_path(env: dict[str, str]) -> list[str]:
    return [os.path.abspath(folder) for folder in env.get("PYTHONPATH", "").split(os.pathsep) if folder]


# --- plans: what the launcher's own code would start -------------------------------------------------------------------

def plan(argv: list[str], env: dict[str, str], cwd: str) -> dict:
    reason = cold_reason(env)
    if reason:
        return {"cold": reason}
    program = os.path.basename(argv[0])
    if not (program.startswith("python") or argv[0] == sys.executable) or len(argv) < 2:
        return {"cold": f"not a Python command: {argv[0]}"}
    rest = argv[1:]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return torchrun_plan(rest[2:])
    if rest[:2] == ["-m", "accelerate.commands.launch"]:
        return accelerate_plan(rest[2:])
    target = python_target(rest)
    if target is None:
        return {"cold": f"Python options this server does not reproduce: {' '.join(rest[:3])}"}
    return {"launcher": None, "store": None, "ranks": [{"env": {}, "target": target}]}


def python_target(rest: list[str]) -> dict | None:
    """What `python REST...` runs: a script, a module (-m) or code (-c), with its argv; None for other options."""
    if rest[0] == "-m":
        return {"kind": "module", "name": rest[1], "argv": [rest[1], *rest[2:]]}
    if rest[0] == "-c":
        return {"kind": "code", "code": rest[1], "argv": ["-c", *rest[2:]]}
    if rest[0] == "-u":  # torchrun's own: unbuffered output, which every rank here has (PYTHONUNBUFFERED)
        return python_target(rest[1:])
    if rest[0].startswith("-"):
        return None
    return {"kind": "script", "path": rest[0], "argv": rest}


def torchrun_plan(args: list[str], extra_env: dict[str, str] | None = None) -> dict:
    import torch.distributed.run as distrib_run

    return torchrun_plan_from(distrib_run.get_args_parser().parse_args(args), extra_env)


def torchrun_plan_from(args, extra_env: dict[str, str] | None = None) -> dict:
    """The workers torchrun's agent starts on this machine, with the environment it gives each (local_elastic_agent)."""
    import torch.distributed.run as distrib_run

    config, command, command_args = distrib_run.config_from_args(args)  # also torchrun's OMP_NUM_THREADS default
    if config.rdzv_backend != "static" or config.min_nodes != config.max_nodes or config.max_restarts:
        return {"cold": f"torchrun with rendezvous {config.rdzv_backend}, nodes {config.min_nodes}:{config.max_nodes}, "
                        f"restarts {config.max_restarts}"}
    if not isinstance(command, str) or os.path.basename(command) != os.path.basename(sys.executable):
        return {"cold": f"torchrun running {command} (--no-python)"}
    target = python_target(list(command_args))
    if target is None:
        return {"cold": f"torchrun's worker command {command_args[:3]}"}
    nodes, node_rank = config.max_nodes, int(config.rdzv_configs.get("rank", 0))
    host, port = config.rdzv_endpoint.rsplit(":", 1)
    local = config.nproc_per_node
    ranks = []
    for local_rank in range(local):
        rank = node_rank * local + local_rank
        worker = {
            "RANK": str(rank), "GROUP_RANK": str(node_rank), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(nodes * local), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_WORLD_SIZE": str(nodes * local), "MASTER_ADDR": host, "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": config.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_RANK": str(local_rank),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        if "OMP_NUM_THREADS" in os.environ:
            worker["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        ranks.append({"env": {**(extra_env or {}), **worker}, "target": target})
    # The static rendezvous's store: node 0's agent hosts it; the other nodes' agents and every worker are clients.
    store = {"host": host, "port": int(port)} if node_rank == 0 else None
    return {"launcher": "torchrun", "store": store, "ranks": ranks}


def accelerate_plan(args: list[str]) -> dict:
    """`accelerate launch ARGS`: accelerate's own choice of launcher and the environment it gives the workers."""
    import torch.distributed.run as distrib_run
    from accelerate.commands import launch
    from accelerate.utils.launch import _filter_args, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    chosen: dict = {}

    def through_torchrun(parsed, env: dict[str, str]) -> None:  # what accelerate hands to torch.distributed.run
        torchrun_args = _filter_args(parsed, distrib_run.get_args_parser(), [
            "--training_script", parsed.training_script, "--training_script_args", parsed.training_script_args])
        chosen.update(torchrun_plan_from(torchrun_args, extra_env=_changed(env)))
        if "ranks" in chosen:
            chosen["launcher"] = "accelerate"

    def multi_gpu_launcher(parsed):
        through_torchrun(parsed, prepare_multi_gpu_env(parsed))

    def simple_launcher(parsed):
        command, env = prepare_simple_launcher_cmd_env(parsed)
        target = python_target(command[1:]) if os.path.basename(command[0]).startswith("python") else None
        if target is None:
            chosen["cold"] = f"accelerate's simple launcher running {command[:3]}"
            return
        chosen.update({"launcher": "accelerate-simple", "store": None,
                       "ranks": [{"env": _changed(env), "target": target}]})

    def deepspeed_launcher(parsed):  # one machine: accelerate runs torchrun with DeepSpeed's environment
        from accelerate.utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS
        from accelerate.utils.launch import prepare_deepspeed_cmd_env

        if parsed.num_machines > 1 and parsed.deepspeed_multinode_launcher != DEEPSPEED_MULTINODE_LAUNCHERS[1]:
            chosen["cold"] = f"accelerate's DeepSpeed launcher over machines ({parsed.deepspeed_multinode_launcher})"
            return
        through_torchrun(parsed, prepare_deepspeed_cmd_env(parsed)[1])

    def cold(kind):
        return lambda *_: chosen.setdefault("cold", f"accelerate's {kind} launcher")

    launch.multi_gpu_launcher, launch.simple_launcher = multi_gpu_launcher, simple_launcher
    launch.deepspeed_launcher = deepspeed_launcher
    launch.tpu_launcher, launch.tpu_pod_launcher = cold("TPU"), cold("TPU pod")
    launch.sagemaker_launcher = cold("SageMaker")
    launch.launch_command(launch.launch_command_parser().parse_args(args))
    return chosen


def _changed(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if os.environ.get(key) != value}


# --- ranks -----------------------------------------------------------------------------------------------------------

def run_target(target: dict) -> int:
    """Run `target` as `python` would in this process; its exit code (a traceback printed for an uncaught exception)."""
    import runpy

    sys.argv = list(target["argv"])
    try:
        if target["kind"] == "script":
            sys.path[0] = os.path.dirname(os.path.abspath(target["path"]))
            runpy.run_path(target["path"], run_name="__main__")
        elif target["kind"] == "module":
            sys.path[0] = os.getcwd()
            runpy.run_module(target["name"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = ""
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(target["code"], "<string>", "exec"), main.__dict__)  # noqa: S102  (python -c CODE)
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python ends on an uncaught KeyboardInterrupt
        return 130
    except BaseException:  # noqa: BLE001  (as Python's own top level: print it, exit 1)
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def become_rank(request: dict, fds: list[int], closing: list) -> None:
    """In the forked child: the rank's session, streams, folder and environment; run; exit as Python would."""
    code = 1
    try:
        os.setsid()
        for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for handle in closing:
            handle.close()
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        started = python_path(STARTED_WITH)
        sys.path[1:] = python_path(request["env"]) + [folder for folder in sys.path[1:] if folder not in started]
        code = run_target(request["target"])
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        from finetune.errors import exit_process

        try:
            exit_process(code)  # the interpreter's exit without its teardown: threads, atexit hooks, flush, _exit
        finally:
            os._exit(code)


def hold_store(connection: socket.socket, request: dict) -> None:
    """In the forked child: torchrun's agent store, until the launcher closes the connection."""
    code = 0
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(request["host"], request["port"], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=900), multi_tenant=True)
        connection.sendall(b'{"ready": true}\n')
        while connection.recv(4096):
            pass
        del store
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class Server:
    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "child")
        self.children: dict[int, socket.socket] = {}  # pid -> the connection that gets its status

    def serve(self) -> None:
        print("ready", flush=True)
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "child":
                    self.reap()
                else:
                    self.closed(key.fileobj, key.data)

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        while not message.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:
                break
            message += more
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            os.close(self.wakeup_r)
            os.close(self.wakeup_w)
            others = [self.selector, self.listener, *self.children.values()]
            if request["op"] == "rank":
                become_rank(request, fds, [connection, *others])
            for handle in others:
                handle.close()
            if request["op"] == "store":
                hold_store(connection, request)
            try:
                answer = plan(request["argv"], request["env"], request["cwd"])
            except BaseException as exc:  # noqa: BLE001  (a launch the parser refuses: its real launcher says why)
                answer = {"cold": f"the launcher's code raised {type(exc).__name__}: {exc}"}
            connection.sendall(json.dumps(answer).encode() + b"\n")
            os._exit(0)
        for fd in fds:
            os.close(fd)
        if request["op"] == "rank":
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            self.children[pid] = connection
            self.selector.register(connection, selectors.EVENT_READ, pid)
        else:
            connection.close()

    def closed(self, connection: socket.socket, pid: int) -> None:
        """The launcher went away (killed) while its rank runs: the rank's process group goes too."""
        try:
            if connection.recv(1):
                return
        except OSError:
            pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.selector.unregister(connection)

    def reap(self) -> None:
        try:
            while os.read(self.wakeup_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            try:
                self.selector.unregister(connection)
            except (KeyError, ValueError):
                pass
            try:
                connection.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            connection.close()


def main() -> None:
    path = sys.argv[1]
    preload()
    Server(path).serve()


if __name__ == "__main__":
    main()
