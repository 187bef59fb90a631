"""finetune export (clean adapter, --merge round trip, refusals) and finetune generate, on a tiny model trained once."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import recipe_dict, run_cmd, write_recipe

from finetune.cli import main
from finetune.outputs import as_trained


@pytest.fixture(scope="module")
def trained_run(tiny_llama, tmp_path_factory) -> Path:
    """A finished 6-step run of the tiny llama (adapter/, recipe.yaml), trained once for this module."""
    from conftest import addition_rows, write_jsonl

    root = tmp_path_factory.mktemp("export")
    data = write_jsonl(root / "data.jsonl", addition_rows())
    recipe = write_recipe(root / "recipe.yaml", recipe_dict(tiny_llama, data, root / "run"))
    result = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe)], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "run"


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def _ids() -> torch.Tensor:
    return torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])


@pytest.mark.slow
def test_clean_adapter_loads_in_plain_peft(trained_run, tiny_llama, tmp_path, capsys):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    assert main(["export", str(trained_run), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "verify:" in printed and "Where this adapter runs" in printed
    assert {item["status"] for item in json.loads((out / "runtimes.json").read_text())} == {"valid"}
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.") and ".default." not in k for k in tensors)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["inference_mode"] is True and config["r"] == 8
    assert (out / "tokenizer.json").exists()

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    reference = _logits(base, _ids())
    exported = PeftModel.from_pretrained(base, str(out))
    loaded = {k: v for k, v in exported.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(tensors)
    assert any(v.abs().sum() > 0 for k, v in loaded.items() if "lora_B" in k), "the trained lora_B must not be zero"
    assert (_logits(exported, _ids()) - reference).abs().max() > 1e-4, "the exported adapter must change the model"


@pytest.mark.slow
def test_merged_model_matches_base_plus_adapter(trained_run, tiny_llama, tmp_path, capsys):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["export", str(trained_run), str(out), "--merge"]) == 0
    report = capsys.readouterr().out
    assert "max abs logit diff" in report and "saved model (reloaded) vs the merged model in bf16" in report
    runtimes = {item["runtime"]: item["status"] for item in json.loads((out / "runtimes.json").read_text())}
    assert runtimes["transformers (merged model, no PEFT)"] == "valid" and "the adapter merged into this model" in report
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}  # noqa: SIM118 (not a dict)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # plain transformers, no PEFT
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    reference = _logits(PeftModel.from_pretrained(base, str(trained_run / "adapter")), _ids())
    got = _logits(merged, _ids())
    assert (got - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16 rounding of the merged weights
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    # The weights themselves: PEFT's own merge_and_unload of the run's adapter/ folder (not the adapter folder export
    # writes and merges: export's checks compare with that one, so a wrong tensor or config there passed them and the
    # logits above, within bf16 rounding; bug bash bb50), in fp32 as export merges, then rounded to bf16 as it saves.
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    oracle = PeftModel.from_pretrained(base, str(trained_run / "adapter")).merge_and_unload().state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
        assert any(name.endswith("q_proj.weight") for name in names)
        for name in names:
            assert torch.equal(handle.get_tensor(name), oracle[name].to(torch.bfloat16)), name


@pytest.mark.slow
@pytest.mark.parametrize("where", ["merge", "save"])
def test_a_wrong_merge_or_save_is_refused_and_nothing_is_written(trained_run, tmp_path, monkeypatch, capsys, where):
    """One merged tensor corrupted, in memory after PEFT's merge or in the saved file: the verification names the step
    and nothing is written (the tolerances measure what each step can change, not bf16 rounding)."""
    from peft.tuners.tuners_utils import BaseTuner
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedModel

    if where == "merge":
        merge = BaseTuner.merge_and_unload  # what PeftModel.merge_and_unload calls

        def wrong_merge(self, *args, **kwargs):
            merged = merge(self, *args, **kwargs)
            weight = merged.model.layers[0].self_attn.q_proj.weight
            weight.data += 0.05 * weight.data.abs().mean()  # as if one layer's update were applied twice
            return merged

        monkeypatch.setattr(BaseTuner, "merge_and_unload", wrong_merge)
    else:
        save = PreTrainedModel.save_pretrained

        def damaging_save(self, folder, *args, **kwargs):
            save(self, folder, *args, **kwargs)
            path = Path(folder) / "model.safetensors"
            tensors = load_file(str(path))
            name = next(k for k in tensors if k.endswith("layers.1.mlp.down_proj.weight"))
            tensors[name] = tensors[name] * 1.25
            save_file(tensors, str(path), metadata={"format": "pt"})

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", damaging_save)
    out = tmp_path / "merged"
    assert main(["export", str(trained_run), str(out), "--merge"]) == 2
    err = capsys.readouterr().err
    expected = "merged fp32 model vs base + adapter" if where == "merge" else "saved model (reloaded) vs the merged model"
    assert "export verification failed, nothing was written" in err and expected in err, err
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


@pytest.mark.slow
def test_wrapper_prefixed_keys_are_normalized(trained_run, tmp_path):
    """An adapter gathered from FSDP1-wrapped modules (prefixes, adapter names) exports as a standard one."""
    from safetensors.torch import load_file, save_file

    dirty = tmp_path / "dirty"
    shutil.copytree(trained_run / "adapter", dirty)
    tensors = load_file(str(dirty / "adapter_model.safetensors"))
    wrapped = {
        k.replace("model.layers.", "model._fsdp_wrapped_module.layers.").replace(".weight", ".default.weight"): v
        for k, v in tensors.items()
    }
    save_file(wrapped, str(dirty / "adapter_model.safetensors"))
    assert main(["export", str(dirty), str(tmp_path / "clean")]) == 0
    assert load_file(str(tmp_path / "clean" / "adapter_model.safetensors")).keys() == tensors.keys()


@pytest.mark.slow
def test_run_without_adapter_exits_2(trained_run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(trained_run / "recipe.yaml", unfinished / "recipe.yaml")
    assert main(["export", str(unfinished), str(tmp_path / "out")]) == 2
    assert "holds no adapter" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # a run stopped with checkpoints kept: the refusal names them and the --step that works (it named none)
    shutil.copytree(trained_run / "checkpoints", unfinished / "checkpoints")
    newest = max(int(p.name.split("-")[1]) for p in (unfinished / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert main(["export", str(unfinished), str(tmp_path / "out")]) == 2
    assert f"add --step {newest} to use the newest" in capsys.readouterr().err
    assert main(["export", str(unfinished), str(tmp_path / "out"), "--step", str(newest)]) == 0


@pytest.mark.slow
def test_existing_output_is_never_overwritten(trained_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--merge"]):
        assert main(["export", str(trained_run), str(out), *extra]) == 2
        assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, kwargs, words", [("qwen2", {}, "model_type"), ("llama", {"hidden_size": 32}, "hidden_size")]
)
def test_merge_onto_another_architecture_exits_2(trained_run, tmp_path, capsys, family, kwargs, words):
    from finetune.cli.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", family=family, **kwargs)
    out = tmp_path / "out"
    assert main(["export", str(trained_run), str(out), "--merge", "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Nothing was written" in err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
def test_merge_onto_another_vocabulary_exits_2(trained_run, tiny_llama, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama)
    config.vocab_size = 300  # smaller than the run's tokenizer
    other = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    assert main(["export", str(trained_run / "adapter"), str(tmp_path / "out"), "--merge", "--base", str(other)]) == 2
    assert "vocab" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_push_to_hub_offline_fails_clearly_and_keeps_the_export(trained_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "adapter"
    assert main(["export", str(trained_run), str(out), "--push-to-hub", "someone/some-adapter"]) == 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE" in err and "hf upload" in err
    assert (out / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_generate_with_and_without_adapter(trained_run, capsys):
    assert main(["generate", str(trained_run), "--prompt", "Add the two numbers.", "--max-new-tokens", "4"]) == 0
    with_adapter = capsys.readouterr().out
    assert "base + adapter" in with_adapter and "> Add the two numbers." in with_adapter
    assert main(["generate", str(trained_run), "--prompt", "Add the two numbers.", "--no-adapter"]) == 0
    assert "base model alone" in capsys.readouterr().out


@pytest.mark.slow
def test_a_moe_run_exports_as_an_adapter_and_merged_and_both_reload_without_finetune(shipped_run, tiny_mixtral, tmp_path,
                                                                                     capsys):
    """A tiny Mixtral trained with the library's settings (LoRA with dropout 0.05 on every expert projection; the same
    run as tests/parallel/test_experts_parallel.py) exports both ways. The adapter, named as the checkpoint names its
    experts, reloads with plain PEFT on a stock transformers 5 model (PEFT fuses it for the fused experts) and computes
    what finetune's per-expert layout computes; the merged folder reloads with plain transformers (experts fused back).
    Before, export built the stock fused model and refused the adapter (8 missing / 48 unexpected keys)."""
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.model.experts import load_adapter, split_experts

    run_dir, result = shipped_run("single_gpu", "mixtral", True)
    assert result.returncode == 0, result.stderr[-3000:]
    started = time.perf_counter()
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run_dir), str(adapter)]) == 0
    assert main(["export", str(run_dir), str(merged), "--merge"]) == 0
    printed = capsys.readouterr().out
    assert "lora_dropout 0 (trained with 0.05)" in printed
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0 and json.loads((as_trained(run_dir) / "adapter_config.json").read_text())[
        "lora_dropout"] == 0.05
    # The run's own adapter/ is already this form (plain PEFT silently dropped the per-expert tensors it had before);
    # the adapter as trained is adapter-as-trained/, which export read.
    assert as_trained(run_dir) == run_dir / "adapter-as-trained"
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text()) == config
    ran, exported = (load_file(str(folder / "adapter_model.safetensors")) for folder in (run_dir / "adapter", adapter))
    assert ran.keys() == exported.keys() and all(torch.equal(ran[k], exported[k]) for k in ran)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert sum(".block_sparse_moe.experts." in k for k in keys) == 2 * 4 * 3 * 2 and not [k for k in keys if ".mlp." in k]
    verdicts = {item["runtime"].split(" ")[0]: item["status"] for item in json.loads((adapter / "runtimes.json").read_text())}
    assert verdicts == {"PEFT": "valid", "vLLM": "unverified", "llama.cpp": "unverified"}

    ids = _ids()
    ours = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32)
    split_experts(ours, dtype=torch.float32, quantized=False)
    reference = _logits(load_adapter(ours, run_dir / "adapter"), ids)  # as trained: per-expert LoRA, the run's names
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32), str(adapter))
    assert type(stock.base_model.model.model.layers[0].mlp.experts).__name__ == "ParamWrapper"  # on the fused experts
    got = _logits(stock, ids)
    assert (got - reference).abs().max() < 1e-5
    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32), ids)
    assert (reference - base).abs().max() > 1e-3, "the exported adapter must change the model"

    reloaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)  # plain transformers, no PEFT
    assert type(reloaded.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    with safe_open(str(merged / "model.safetensors"), "pt") as handle:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in handle.keys()  # noqa: SIM118 (not a dict)
    got = _logits(reloaded, ids)
    assert (got - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16 rounding of the merged weights
    assert torch.equal(got.argmax(-1), reference.argmax(-1))

    # And a new run can start from the exported adapter (model.adapter): every expert LoRA found under its model name.
    from finetune.model.base import build_model
    from finetune.recipe import load_recipe

    recipe = load_recipe(run_dir / "recipe.yaml")
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"adapter": str(adapter)})})
    started_from = build_model(recipe, device=torch.device("cpu"), gradient_checkpointing=False)
    trained = load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))
    held = {k.replace(".default.", ".").replace(".base_layer.", "."): v for k, v in started_from.state_dict().items()}
    assert all(torch.equal(held[k].to(v.dtype), v) for k, v in trained.items())
    print(f"export + reload checks: {time.perf_counter() - started:.1f} s")


@pytest.mark.slow
def test_a_llama4_run_learns_4bit_and_exports_for_plain_peft_and_merged(shipped_run, tiny_llama4, tmp_path, capsys):
    """A tiny Llama 4 (Scout's layout: fused experts stored (in, out)) trained single-process with the library's LoRA
    settings and lora.train_router: the loss falls, every expert's LoRA moved, the routers were trained in full (no
    LoRA on them: Llama 4's router is a Linear returning scores). Exported: the adapter holds the experts' LoRA as
    PEFT's LoRA on the fused expert parameters, which plain PEFT loads with the trained model's logits, and the merged
    folder holds exactly the checkpoint's own tensor names (fused `experts.gate_up_proj` / `down_proj`, transposed back), reloading in plain
    transformers with the trained model's logits. Before: refused before loading (the experts read as Mixtral's)."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.model.experts import load_adapter, split_experts

    run_dir, result = shipped_run("single_gpu", "llama4", True, train_router=True)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and "eval" not in line]
    assert losses[-1] < losses[0]
    trained = load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))
    expert_b = {name: t for name, t in trained.items() if ".feed_forward.experts." in name and "lora_B" in name}
    assert len(expert_b) == 2 * 4 * 3  # layers x experts x projections
    # Llama 4 scales an expert's input by its router score, zero where not routed (top-1 of 4 here): an expert that
    # no token chose gets no gradient at all. Each expert's three projections moved together, and most experts did.
    moved: dict[str, set[bool]] = {}
    for name, t in expert_b.items():
        moved.setdefault(name.rsplit(".", 3)[0], set()).add(bool(t.abs().sum() > 0))
    assert all(len(flags) == 1 for flags in moved.values()) and sum(True in f for f in moved.values()) >= 4, moved
    assert not [name for name in trained if ".router." in name and ".lora_" in name]
    assert sorted(name for name in trained if ".router." in name) == [
        f"base_model.model.model.layers.{i}.feed_forward.router.weight" for i in (0, 1)]

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run_dir), str(adapter)]) == 0
    assert main(["export", str(run_dir), str(merged), "--merge"]) == 0
    capsys.readouterr()
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    # Plain PEFT on the stock Llama 4 has no per-expert modules (its experts are two raw 3-D parameters, and PEFT 0.21
    # converts no Llama 4 per-expert layout): the expert LoRA is written on the fused parameters, which PEFT loads.
    assert "base_model.model.model.layers.1.feed_forward.experts.lora_A.weight" in keys
    assert not [key for key in keys if ".experts.0." in key]
    verdicts = {item["runtime"].split(" ")[0]: (item["status"], item["reasons"]) for item in
                json.loads((adapter / "runtimes.json").read_text())}
    assert verdicts["PEFT"][0] == "valid" and verdicts["vLLM"][0] == "invalid", verdicts
    with safe_open(str(tiny_llama4 / "model.safetensors"), "pt") as stock, \
            safe_open(str(merged / "model.safetensors"), "pt") as handle:
        assert sorted(handle.keys()) == sorted(stock.keys())  # the checkpoint's own names, fused experts included
        assert handle.get_slice("model.layers.0.feed_forward.experts.gate_up_proj").get_shape() == \
            stock.get_slice("model.layers.0.feed_forward.experts.gate_up_proj").get_shape()

    ids = _ids()
    ours = AutoModelForCausalLM.from_pretrained(tiny_llama4, dtype=torch.float32)
    split_experts(ours, dtype=torch.float32, quantized=False)
    reference = _logits(load_adapter(ours, run_dir / "adapter"), ids)  # as trained: per-expert LoRA, trained routers
    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_llama4, dtype=torch.float32), ids)
    assert (reference - base).abs().max() > 1e-3, "the adapter must change the model"
    from peft import PeftModel

    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama4, dtype=torch.float32), str(adapter))
    assert (_logits(plain, ids) - reference).abs().max() <= 1e-5 * reference.abs().max()  # routers trained in full too
    # The run's own adapter/, as a user loads it (README): the same. Before, it held the per-expert tensors, which plain
    # PEFT skipped without a word (the bug bash measured logits 0.19 apart on DeepSeek-V4, of the adapter's 0.89).
    own = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama4, dtype=torch.float32),
                                    str(run_dir / "adapter"))
    assert (_logits(own, ids) - reference).abs().max() <= 1e-5 * reference.abs().max()
    reloaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)  # plain transformers, no PEFT
    assert type(reloaded.model.layers[0].feed_forward.experts).__name__ == "Llama4TextExperts"
    got = _logits(reloaded, ids)
    assert (got - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16 rounding of the merged weights
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
