"""The llama.cpp verdict of `finetune export` against llama.cpp's own converter, run on the exported adapters.

finetune/outputs/runtimes.py:llama_cpp_verdict copies llama.cpp's rules by hand; here the oracle is llama.cpp itself:
convert_lora_to_gguf.py, convert_hf_to_gguf.py's model classes (`conversion/`) and gguf-py, as vendored in the
llama-cpp-python sdist from PyPI (only these scripts are extracted; nothing is built). Each case exports a real PEFT
adapter of the tiny llama with `finetune export`, converts it, and reads the GGUF adapter back. What llama.cpp then
does on load (src/llama-adapter.cpp, src/llama-adapter.h of the same sdist; building llama.cpp is out of reach here)
is applied to the converter's output by `_load_problems`, and its source lines are checked to still be there.

The scripts are fetched by `make install` (tests/llama_cpp_scripts.py: the sdist, 77 MB, extracted into the venv, ~3 MB); the
suite downloads nothing, and a missing converter fails the test with the command that fetches it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.outputs.runtimes import llama_cpp_verdict

CASES = {
    # name: (LoraConfig overrides, base with tied embeddings?)
    "plain": ({}, False),
    "plain-tied": ({}, True),
    "rank-pattern": ({"rank_pattern": {"q_proj": 4}}, False),
    "embed-tokens": ({"target_modules": ["q_proj", "embed_tokens"]}, False),
    "lm-head-untied": ({"target_modules": ["q_proj", "lm_head"]}, False),
    "lm-head-tied": ({"target_modules": ["q_proj", "lm_head"]}, True),
    "dora": ({"use_dora": True}, False),
    "rslora-r32": ({"use_rslora": True, "r": 32}, False),
    "alpha-pattern": ({"alpha_pattern": {"q_proj": 64}}, False),
    "modules-to-save-lm-head": ({"modules_to_save": ["lm_head"]}, False),
    "modules-to-save-norm": ({"modules_to_save": ["norm"]}, False),
    "lora-bias": ({"lora_bias": True}, False),
}


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """llama.cpp's converter scripts at LLAMA_CPP_PYTHON, fetched by `make install` (tests/llama_cpp_scripts.py)."""
    import llama_cpp_scripts as converter

    if not converter.present():
        pytest.fail(f"llama.cpp's converter is not in {converter.folder()}: `make install` fetches it (or run "
                    "`python tests/llama_cpp_scripts.py` with this environment's Python); the suite downloads nothing")
    return converter.folder()


def _run(args: list, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          check=False)


# Run with llama.cpp's gguf-py first on the path, as its scripts run. `base`: llama.cpp's model converter on the base
# folder, the vocabulary left out (the tensors do not depend on it), its tensors listed; `read`: a GGUF file's alpha
# and tensors, and the GGUF name of each HF module (gguf-py's tensor map, which the converter uses).
DRIVER = r"""
import json, sys
from pathlib import Path
llama_cpp, mode, path = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
import gguf
result = {}
if mode == "base":
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
    hparams = ModelBase.load_hparams(path, False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    class NoVocab(cls):
        model_arch = cls.model_arch
        def set_vocab(self):
            pass
    out = Path(sys.argv[4])
    NoVocab(path, gguf.LlamaFileType.ALL_F32, out, hparams=hparams, eager=True).write()
    path = out
    names = gguf.get_tensor_name_map(cls.model_arch, hparams["num_hidden_layers"])
    result["gguf_name"] = {m: names.get_name(m + ".weight", try_suffixes=(".weight",)) for m in sys.argv[5:]}
reader = gguf.GGUFReader(path)
alpha = reader.fields.get("adapter.lora.alpha")
result["alpha"] = float(alpha.contents()) if alpha else None
result["type"] = reader.fields["general.type"].contents() if "general.type" in reader.fields else None
result["tensors"] = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ggml order: ne[0], ne[1]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def bases(tiny_llama, tmp_path_factory, llama_cpp) -> dict:
    """The tiny llama, untied and tied, each with its GGUF as llama.cpp's model converter writes it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("llama-cpp-bases")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(root / "tied")
    modules = [n.removesuffix(".weight") for n, _ in model.named_parameters() if n.endswith(".weight")]
    found = {}
    for tied, folder in ((False, Path(tiny_llama)), (True, root / "tied")):
        listed = _run(["-c", DRIVER, llama_cpp, "base", folder, root / f"base-{tied}.gguf", *modules, "lm_head"])
        assert listed.returncode == 0, listed.stderr[-3000:]
        found[tied] = (folder, json.loads(listed.stdout.strip().splitlines()[-1]))
    return found


@pytest.mark.slow  # the first run on a machine downloads the sdist
def test_the_loader_rules_applied_below_are_llama_cpps(llama_cpp):
    """_load_problems applies these lines of llama.cpp's loader; a llama.cpp that changed them fails here first."""
    adapter_cpp = (llama_cpp / "src" / "llama-adapter.cpp").read_text()
    adapter_h = (llama_cpp / "src" / "llama-adapter.h").read_text()
    assert 'str_endswith(name, "_norm.weight")' in adapter_cpp and "TODO: add support for norm vector" in adapter_cpp
    assert "does not exist in base model" in adapter_cpp and "has unexpected suffix" in adapter_cpp
    assert "model_tensor->ne[0] != w.a->ne[0] || model_tensor->ne[1] != w.b->ne[1]" in adapter_cpp
    assert "const float rank  = (float) b->ne[0];" in adapter_h and "adapter_scale * alpha / rank" in adapter_h


def _load_problems(converted: dict, base: dict, peft_scales: dict) -> list[str]:
    """What llama.cpp's loader (src/llama-adapter.cpp) and its scale (src/llama-adapter.h: alpha / rank, rank = the
    rows of lora_b) make of a converted adapter: each way the result differs from the adapter PEFT trained."""
    problems, pairs = [], {}
    for name, shape in converted["tensors"].items():
        if name.endswith((".lora_a", ".lora_b")):
            pairs.setdefault(name[:-7], {})[name[-1]] = shape
        elif name.endswith("_norm.weight"):
            problems.append(f"norm dropped: {name}")  # the loader skips it: the trained norm is not applied
        else:
            problems.append(f"unexpected suffix: {name}")
    for name, ab in pairs.items():
        if name not in base["tensors"]:
            problems.append(f"not in base: {name}")
            continue
        ne0, ne1 = base["tensors"][name][:2]
        (a0, a1), (b0, b1) = ab["a"][:2], ab["b"][:2]
        embedding = name.endswith("token_embd.weight")
        if (embedding and (ne0, ne1) != (b1, a1)) or (not embedding and ((ne0, ne1) != (a0, b1) or a1 != b0)):
            problems.append(f"shape: {name}")
    gguf_scales = {name: converted["alpha"] / ab["b"][0] for name, ab in pairs.items()}
    if set(gguf_scales) != set(peft_scales):
        problems.append(f"modules: GGUF {sorted(gguf_scales)} vs PEFT {sorted(peft_scales)}")
    problems += [f"scale {name}: llama.cpp {gguf_scales[name]:g}, PEFT {scale:g}"
                 for name, scale in peft_scales.items() if name in gguf_scales and abs(gguf_scales[name] - scale) > 1e-6]
    return problems


def _peft_scales(peft_model, gguf_name: dict) -> dict:
    """Each LoRA module's scale as PEFT computes it (module.scaling), keyed by the module's GGUF tensor name."""
    from peft.tuners.lora import LoraLayer

    scales = {}
    for path, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.scaling:
            scales[gguf_name[path.removeprefix("base_model.model.")]] = float(module.scaling["default"])
    return scales


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_verdict_agrees_with_llama_cpps_converter(case, bases, llama_cpp, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    overrides, tied = CASES[case]
    base_folder, base = bases[tied]
    settings = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False, **overrides}
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder), LoraConfig(**settings))
    peft_model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "adapter"), str(out)]) == 0
    capsys.readouterr()
    verdict = next(v for v in json.loads((out / "runtimes.json").read_text()) if v["runtime"].startswith("llama.cpp"))
    reasons = " ".join(verdict["reasons"])

    converted = _run([llama_cpp / "convert_lora_to_gguf.py", "--base", base_folder, "--outfile", tmp_path / "a.gguf",
                      out])
    if converted.returncode != 0:  # the converter refused it: the verdict must say so, quoting the converter's words
        said = converted.stderr.strip().splitlines()
        assert verdict["status"] == "invalid", (verdict, said[-5:])
        quoted = reasons.split("`")[1::2]  # the converter's own words, as the verdict quotes them
        assert "the converter stops" in reasons and quoted and all(
            part in converted.stderr for q in quoted for part in q.split("...")), (reasons, said[-5:])
        return
    read = _run(["-c", DRIVER, llama_cpp, "read", tmp_path / "a.gguf"])
    assert read.returncode == 0, read.stderr[-3000:]
    adapter = json.loads(read.stdout.strip().splitlines()[-1])
    assert adapter["type"] == "adapter" and adapter["alpha"] == settings["lora_alpha"]
    problems = _load_problems(adapter, base, _peft_scales(peft_model, base["gguf_name"]))
    assert "the converter stops" not in reasons, (reasons, "but the converter wrote", sorted(adapter["tensors"]))
    assert (verdict["status"] == "valid") == (not problems), (verdict, problems)
    for problem, words in (("norm dropped", "norm"), ("not in base", "does not exist in base model"),
                           ("scale", "scale")):
        if any(p.startswith(problem) for p in problems):
            assert words in reasons, (problem, reasons)


@pytest.mark.slow
def test_an_adapter_without_lora_alpha_stops_the_converter(bases, llama_cpp, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base_folder, _ = bases[False]
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder),
                                LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    folder = tmp_path / "no-alpha"
    shutil.copytree(tmp_path / "exported", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as handle:
        verdict = llama_cpp_verdict(config, list(handle.keys()), tied_embeddings=False)
    converted = _run([llama_cpp / "convert_lora_to_gguf.py", "--base", base_folder, "--outfile", tmp_path / "a.gguf",
                      folder])
    assert converted.returncode != 0 and "KeyError: 'lora_alpha'" in converted.stderr, converted.stderr[-2000:]
    assert verdict.status == "invalid" and "no lora_alpha" in verdict.reasons[0]
