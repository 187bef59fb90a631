"""bb71 (grpo.generation: vllm): the request carries neutral values for every sampling setting finetune does not
expose (F1), adapter names unique per run folder and launch in a server that outlives a run (F2), the server's
process group killed after its leader died (F3), a grpo.vllm_python without vLLM refused by `validate` (F4).

The vLLM server of F1/F2 is a stand-in speaking vLLM's HTTP API (tests/training/test_grpo_vllm.py runs the real one);
F1's oracles are TRL 1.16's VLLMClient.generate defaults and, where .venv-vllm exists, vLLM's own request parsing
(CompletionRequest.to_sampling_params with the model's generation_config.json as the server's defaults).
"""

from __future__ import annotations

import atexit
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from finetune.errors import GenerationError, RecipeError
from finetune.recipe import GRPOSection, validate_recipe
from finetune.training.objectives.grpo import vllm_server

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("FINETUNE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (`make vllm`)")


class FakeVLLM:
    """vLLM's OpenAI-compatible server as finetune speaks to it: /v1/models lists the base and the loaded adapters
    (with a `parent`), a name loaded twice is refused with vLLM 0.32's HTTP 400, an unknown one on unload with its
    404; /v1/completions answers n completions of 2 tokens. Every request body is kept."""

    def __init__(self):
        self.loaded: dict[str, str] = {}
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self._reply(200, {})
                models = [{"id": "base"}] + [{"id": name, "parent": "base"} for name in fake.loaded]
                return self._reply(200, {"data": models})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                name = body.get("lora_name")
                if self.path == "/v1/load_lora_adapter":
                    if name in fake.loaded:
                        return self._reply(400, {"error": {"message": f"The lora adapter '{name}' has already been "
                                                           "loaded. If you want to load the adapter in place, set "
                                                           "'load_inplace' to True.", "code": 400}})
                    fake.loaded[name] = body["lora_path"]
                    return self._reply(200, {})
                if self.path == "/v1/unload_lora_adapter":
                    if fake.loaded.pop(name, None) is None:
                        return self._reply(404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}})
                    return self._reply(200, {})
                if body["model"] != "base" and body["model"] not in fake.loaded:
                    return self._reply(404, {"error": {"message": f"The model `{body['model']}` does not exist."}})
                choices = [{"index": i, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                           for i in range(body["n"])]
                return self._reply(200, {"choices": choices})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake_vllm():
    server = FakeVLLM()
    yield server
    server.close()


def _generation(config: GRPOSection, server: vllm_server.Server) -> vllm_server.VLLMGeneration:
    """The sampler as VLLMGeneration.sample uses it, without a recipe (sampling reads grpo: and the server only)."""
    generation = vllm_server.VLLMGeneration.__new__(vllm_server.VLLMGeneration)
    generation.config, generation.server, generation.served, generation.base = config, server, None, "base"
    return generation


# ----------------------------------------------------------------------------------------------- F1: the request
def test_the_request_sends_trls_neutral_values_for_every_setting_finetune_does_not_expose(fake_vllm):
    """Before, the request carried temperature and top_p only: vLLM filled top_k, min_p, repetition_penalty (and the
    two OpenAI penalties) from the model's generation_config.json. Now each goes neutral, as TRL 1.16's
    VLLMClient.generate sends them by default (its signature is the oracle), the penalties at OpenAI's 0."""
    from trl.generation.vllm_client import VLLMClient

    config = GRPOSection(temperature=0.9, top_p=0.95, num_generations=3, max_completion_length=7)
    completions, logps = _generation(config, vllm_server.Server(fake_vllm.url, timeout=10)).sample(
        [[1, 2, 3]], [11], eos_ids=[2])
    assert completions == [[5, 6]] * 3 and logps == [[-0.5, -0.25]] * 3
    (path, body), = fake_vllm.requests
    assert path == "/v1/completions"
    trl = {name: p.default for name, p in inspect.signature(VLLMClient.generate).parameters.items()}
    for name in ("top_k", "min_p", "repetition_penalty"):
        assert name in body and body[name] == trl[name], (name, body)
    assert body["presence_penalty"] == 0.0 and body["frequency_penalty"] == 0.0
    assert (body["temperature"], body["top_p"], body["n"], body["max_tokens"], body["seed"]) == (0.9, 0.95, 3, 7, 11)


VLLM_ORACLE = """
import json, sys
from vllm.config import ModelConfig
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
model, bodies = sys.argv[1], json.loads(sys.argv[2])
defaults = ModelConfig(model=model, generation_config="auto").get_diff_sampling_param()  # what `vllm serve` uses
out = []
for body in bodies:
    params = CompletionRequest(**body).to_sampling_params(body["max_tokens"], defaults)
    out.append({k: getattr(params, k) for k in ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                                                "frequency_penalty", "temperature", "top_p")})
print("ORACLE " + json.dumps({"defaults": defaults, "params": out}))
"""


@needs_vllm
@pytest.mark.slow  # ~15-45 s: vLLM imported in its own venv to parse the request as its server does
def test_vllm_samples_the_request_with_neutral_settings_despite_the_models_generation_config(fake_vllm, tmp_path):
    """A tiny model whose generation_config.json sets what instruct models ship (top_k, repetition_penalty, min_p,
    temperature, top_p): vLLM's own request parsing, with that file as the server's defaults (`--generation-config
    auto`, vllm serve's default), turns finetune's request into sampling with none of them. The same request without
    the neutral values (as before the fix) takes the file's top_k and penalty: the oracle sees the file."""
    from finetune.cli.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    settings = json.loads((model / "generation_config.json").read_text())
    settings.update(do_sample=True, top_k=3, repetition_penalty=1.3, min_p=0.2, temperature=0.7, top_p=0.8)
    (model / "generation_config.json").write_text(json.dumps(settings))
    config = GRPOSection(temperature=1.0, top_p=1.0, num_generations=2, max_completion_length=4)
    _generation(config, vllm_server.Server(fake_vllm.url, timeout=10)).sample([[1, 2]], [3], eos_ids=[2])
    body = fake_vllm.requests[0][1]
    before = {k: v for k, v in body.items()
              if k not in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_ORACLE, str(model), json.dumps([body, before])],
                            capture_output=True, text=True, timeout=300, env=env, check=False)
    line = next((x for x in result.stdout.splitlines() if x.startswith("ORACLE ")), None)
    assert line is not None, result.stderr[-3000:]
    oracle = json.loads(line.removeprefix("ORACLE "))
    assert oracle["defaults"]["top_k"] == 3 and oracle["defaults"]["repetition_penalty"] == 1.3
    ours, old = oracle["params"]
    assert ours["top_k"] in (0, -1) and ours["min_p"] == 0.0 and ours["repetition_penalty"] == 1.0, ours
    assert ours["presence_penalty"] == 0.0 and ours["frequency_penalty"] == 0.0, ours
    assert ours["temperature"] == 1.0 and ours["top_p"] == 1.0, ours
    assert old["top_k"] == 3 and old["repetition_penalty"] == 1.3 and old["min_p"] == 0.2, old


# ---------------------------------------------------------------------------------- F2: adapter names per run
@pytest.fixture
def no_weights(monkeypatch):
    """sync without a model: the LoRA state is empty and the adapter folder holds a marker (the names are tested)."""
    import finetune.outputs
    import finetune.parallel

    def save(config, key_map, state, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "adapter_config.json").write_text("{}")

    monkeypatch.setattr(finetune.parallel, "trainable_state_dict", lambda model, key_map: {})
    monkeypatch.setattr(finetune.outputs, "save_adapter", save)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from finetune.cli.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-bb71"))


def _launch(tiny: Path, url: str, out_dir: Path) -> vllm_server.VLLMGeneration:
    """A run's launch against a server of the user's (grpo.vllm_server_base_url)."""
    from test_grpo import grpo_recipe

    recipe = validate_recipe(grpo_recipe(tiny, "unused.jsonl", out_dir, {"generation": "vllm",
                                                                          "vllm_server_base_url": url}))
    generation = vllm_server.VLLMGeneration(recipe, out_dir, "cpu")
    atexit.unregister(generation.close)  # closed by the test (a launch left open stands for a killed one)
    return generation


def _adapters(fake: FakeVLLM) -> set[str]:
    return set(fake.loaded)


def test_a_resume_and_a_second_run_on_a_users_server_take_names_of_their_own(tiny, fake_vllm, no_weights, tmp_path):
    """Before, adapters were named step<N> in the server: a launch killed after loading step3 left it loaded, and the
    resume (or a second run, or a run sharing the server) was refused at step 3 with HTTP 400 'already been
    loaded'. Now a name is the run folder's and the launch's; a resume unloads what its killed launch left, every
    sync unloads the previous adapter, and the run's end unloads its last one."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    killed = _launch(tiny, fake_vllm.url, run_a)
    for step in (1, 2, 3):
        killed.sync(None, step)
    assert len(_adapters(fake_vllm)) == 1  # step 1's unloaded at step 2, step 2's at step 3
    left = next(iter(_adapters(fake_vllm)))
    assert left.endswith("step3") and left != "step3"
    assert not (run_a / "vllm" / "step2").exists() and (run_a / "vllm" / "step3").is_dir()

    resumed = _launch(tiny, fake_vllm.url, run_a)  # train.resume=auto after the kill (no close)
    assert _adapters(fake_vllm) == set()  # the killed launch's adapter, left loaded, is unloaded at the start
    resumed.sync(None, 3)  # was: HTTP 400, the adapter 'step3' has already been loaded
    other = _launch(tiny, fake_vllm.url, run_b)  # a second run on the same server, at the same steps
    other.sync(None, 3)
    assert len(_adapters(fake_vllm)) == 2
    resumed.sample([[1, 2]], [5], eos_ids=[2])
    other.sample([[1, 2]], [5], eos_ids=[2])
    asked = [body["model"] for path, body in fake_vllm.requests if path == "/v1/completions"]
    assert len(set(asked)) == 2 and set(asked) == _adapters(fake_vllm)  # each run samples with its own adapter
    assert resumed.served_name(resumed.served).startswith("a-") and other.served_name(other.served).startswith("b-")

    resumed.close()  # the run's end: its last adapter unloaded, the other run's kept
    assert _adapters(fake_vllm) == {other.served_name("step3")}
    other.close()
    assert _adapters(fake_vllm) == set()
    other.close()  # again (atexit): nothing sent
    assert [path for path, _ in fake_vllm.requests].count("/v1/unload_lora_adapter") == 5


def test_a_request_the_server_refuses_gets_a_fix_about_the_server_not_about_memory(fake_vllm):
    """Before, an HTTP 4xx refusal ended with the memory / timeout Fix (lower vllm_gpu_memory_utilization)."""
    server = vllm_server.Server(fake_vllm.url, timeout=10)
    server.load_adapter("x", Path("/tmp"))
    with pytest.raises(GenerationError) as caught:
        server.load_adapter("x", Path("/tmp"))
    message = str(caught.value)
    assert "HTTP 400" in message and "already been loaded" in message and "\n" not in message
    assert "vllm_gpu_memory_utilization" not in message and "Fix: " in message and "--enable-lora" in message


# ------------------------------------------------------------------------ F3: the group outlives its leader
CHILD = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
         "time.sleep(600)")
LEADER = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
          "print(child.pid, flush=True); sys.stdin.readline()")


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (None: gone; 'Z': exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.slow  # ~1 s: launches two processes
def test_closing_a_server_whose_api_process_died_kills_the_rest_of_its_group():
    """As vLLM's: the API server leads a process group (start_new_session) and its EngineCore child lives in it.
    The leader dies (an OOM kill); close() must still end the child, here one that ignores SIGTERM. Before, close
    signalled nothing once the leader was dead, and the child ran on (bb71: 660 MB, minutes after the run)."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    said = sorted(leader.stdout.readline().strip() for _ in range(2))  # the child's pid, and its 'ready' (one pipe)
    child = int(said[0])
    try:
        assert said[1] == "ready" and os.getpgid(child) == leader.pid
        leader.stdin.close()  # the leader exits; the child lives on in its group
        leader.wait(timeout=30)
        time.sleep(0.2)
        assert _state(child) not in (None, "Z")
        vllm_server.Server("http://127.0.0.1:9", timeout=5, process=leader).close()
        deadline = time.monotonic() + 15
        while _state(child) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(child) in (None, "Z"), "the leader's group outlived close()"
    finally:
        if _state(child) not in (None, "Z"):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------- F4: a Python without vLLM
@pytest.mark.slow  # ~1-3 s: launches a Python per check
def test_a_vllm_python_without_vllm_is_refused_by_validate(tmp_path, monkeypatch):
    """Before, grpo.vllm_python had only to exist: a Python without vLLM passed `finetune validate`, and the run
    failed after loading the model, with a Fix about memory. This test's own Python has no vLLM (the premise is
    checked here), so naming it is refused with the recipe: where it came from, the Python, and the fix."""
    from test_grpo import grpo_recipe

    assert importlib.util.find_spec("vllm") is None  # the main venv: vLLM lives in a venv of its own
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out",
                         {"generation": "vllm", "vllm_python": sys.executable})
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    problem = str(caught.value).split("train.objective grpo: ", 1)[1]  # (after the recipe's header)
    assert problem.startswith(f"grpo.vllm_python: {sys.executable} has no vllm module"), problem
    assert "Fix: install vLLM into that Python" in problem and "make vllm" in problem and "\n" not in problem

    monkeypatch.setenv("FINETUNE_VLLM_PYTHON", sys.executable)
    values["grpo"]["vllm_python"] = None
    with pytest.raises(RecipeError, match=r"FINETUNE_VLLM_PYTHON: .* has no vllm module"):
        validate_recipe(values)

    not_python = tmp_path / "python"
    not_python.write_text("#!/bin/sh\necho 'not a python here' >&2\nexit 3\n")
    not_python.chmod(0o755)
    values["grpo"]["vllm_python"] = str(not_python)
    with pytest.raises(RecipeError, match=r"grpo.vllm_python: .*python cannot be run as Python \(exit code 3: not a "
                                          r"python here\)\. Fix: install vLLM"):
        validate_recipe(values)


@needs_vllm
@pytest.mark.slow  # ~1-3 s: launches the vLLM venv's Python
def test_the_vllm_venvs_python_passes_validate(tmp_path):
    from test_grpo import grpo_recipe

    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out",
                         {"generation": "vllm", "vllm_python": str(VLLM_PYTHON)})
    assert validate_recipe(values).grpo.vllm_python == str(VLLM_PYTHON)
