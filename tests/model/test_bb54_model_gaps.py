"""Mutation testing round 4 (mut4, of bb54's plan): rules of the adapter handling (model/lora/kept.py, attach.py,
adapter.py), the checkpoint checks of model/loading.py, the 4-bit cache and the FSDP1 embedding-LoRA refusal that no
test read.

Found by a bug bash: each test below is the one check that a surviving mutant broke without any test failing.
In-process; the models are the suite's tiny ones, on the meta device where only names and shapes matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.model.lora.attach import target_modules_problem
from finetune.model.lora.kept import _continued_runs, saved_template


def test_a_resume_from_a_checkpoint_continues_the_run_that_holds_it(tmp_path):
    """Found by a bug bash (mut4 KP01): train.resume=RUN/checkpoints/step-N continues RUN, whose kept copy of
    model.adapter is in RUN/start-adapter; `given.parent` looked in RUN/checkpoints and no test noticed."""
    step = tmp_path / "run" / "checkpoints" / "step-4"
    assert _continued_runs(str(step), str(tmp_path / "other")) == [step, tmp_path / "run"]
    assert _continued_runs("auto", str(tmp_path / "run")) == [tmp_path / "run"]
    assert _continued_runs(None, str(tmp_path / "run")) == []


def test_the_default_of_named_chat_templates_is_the_saved_template(tmp_path):
    """Found by a bug bash (mut4 KP03): a tokenizer_config.json with named templates ([{"name": "tool_use", ...},
    {"name": "default", ...}]) is read as transformers reads it: the `default` one; the first of the list was taken
    instead, with no test to notice."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": "{{ 'chat' }}"}]}),
        encoding="utf-8")
    assert saved_template([tmp_path]) == ("{{ 'chat' }}", tmp_path / "tokenizer_config.json")


def _meta_llama(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def test_a_target_name_matches_whole_module_names_only(tiny_llama):
    """Found by a bug bash (mut4 AT01): lora.target_modules names match as PEFT matches them, a whole name or the
    last parts after a dot: `proj` is no module of Llama (PEFT would put LoRA nowhere); with `endswith(t)` it matched
    q_proj, k_proj, ... and the refusal was lost."""
    model = _meta_llama(tiny_llama)
    problem = target_modules_problem(model, ["proj"])
    assert problem is not None and "proj" in problem
    assert target_modules_problem(model, ["q_proj", "self_attn.v_proj"]) is None


def test_an_adapter_whose_regex_targets_the_embedding_is_refused_under_fsdp1(tiny_llama, tmp_path):
    """Found by a bug bash (mut4 PC05): with model.adapter, lora.target_modules left at all-linear means the adapter's
    own targets; an adapter saved with a regex (no name list, so the recipe keeps all-linear) that puts LoRA on
    embed_tokens is refused under FSDP1 as a listed one is. Returning early for all-linear whatever model.adapter
    says let it through to the first step's crash."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune import parallel
    from finetune.distributed import DistInfo
    from finetune.errors import LaunchError
    from finetune.model import load_config
    from finetune.recipe import validate_recipe

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=r"model\.(embed_tokens|layers\.\d+\.self_attn\.q_proj)")
    get_peft_model(base, config).save_pretrained(tmp_path)
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32", "adapter": str(tmp_path)},
                              "data": {"datasets": [{"path": "x.jsonl"}]}})
    assert recipe.lora.target_modules == "all-linear"
    launcher = parallel.launcher_settings({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                                           "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                                           "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"})
    two_ranks = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"),
                         backend=None)
    with pytest.raises(LaunchError, match=r"model.adapter's LoRA .* embedding layer model.embed_tokens under FSDP1"):
        parallel.resolve_plan(recipe, two_ranks, load_config(recipe), launcher=launcher)


def test_dora_is_never_read_tensor_by_tensor(tiny_llama):
    """Found by a bug bash (mut4 LD03): DoRA's magnitudes come from the full weights, so a DoRA run loads the whole
    model, never through the per-tensor reader (which holds the 4-bit model and one tensor); without the dora check
    the per-tensor folder was chosen for it and no test noticed."""
    from finetune.model.loading import _per_tensor_folder
    from finetune.recipe import validate_recipe

    def recipe(**lora):
        return validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "float32"}, "lora": lora,
                                "data": {"datasets": [{"path": "x.jsonl"}]}})

    assert _per_tensor_folder(recipe(), None) is not None
    assert _per_tensor_folder(recipe(dora=True), None) is None


def test_the_4bit_cache_entry_depends_on_double_quant(tmp_path, private_cache):
    """Found by a bug bash (mut4 QC01): quantization.double_quant changes the 4-bit bytes (the quant state's absmax is
    itself quantized), so it is part of the cache entry's key; without it a run with double_quant false read the
    entry another run wrote with it true."""
    from finetune.model.quantization.cache import entry_folder
    from finetune.recipe import validate_recipe

    def recipe(double_quant: bool):
        return validate_recipe({"model": {"name_or_path": str(tmp_path), "dtype": "bfloat16"},
                                "quantization": {"method": "nf4", "double_quant": double_quant},
                                "data": {"datasets": [{"path": "x.jsonl"}]}}, dtype_device="gpu")

    assert entry_folder(recipe(True), tmp_path) != entry_folder(recipe(False), tmp_path)
    assert entry_folder(recipe(True), tmp_path) == entry_folder(recipe(True), tmp_path)


def test_a_quantized_cache_entry_with_a_file_cut_short_is_rebuilt(tmp_path):
    """Mutation testing (round 4, QC02): with the size comparison gone, an entry whose file was cut short (a copy
    interrupted, a disk that filled) was read as whole: no test had a file of the wrong size beside its manifest."""
    import json

    from finetune.model.quantization.cache import MANIFEST, _stale_reason

    identity = {"config.json": [10, 1.0, "abc"]}
    (tmp_path / "x.safetensors").write_bytes(b"12345")  # 5 bytes of the 10 the manifest records
    (tmp_path / MANIFEST).write_text(json.dumps({"identity": identity, "files": {"x.safetensors": 10}}))
    assert "damaged (x.safetensors)" in _stale_reason(tmp_path, identity)
    (tmp_path / "x.safetensors").write_bytes(b"1234567890")  # whole: read as it is (no sampled sums recorded)
    assert _stale_reason(tmp_path, identity) is None


def test_an_already_4bit_base_is_loaded_as_it_is_never_cached_again(tmp_path, monkeypatch):
    """Mutation testing (round 4, QC03): with the 4-bit check gone from cached_checkpoint, a bitsandbytes 4-bit
    checkpoint (a `finetune quantize` output, a hub NF4 upload) went to the quantized cache, to be quantized again: no
    test gave the cache a base that is 4-bit already."""
    import json

    import torch

    from finetune.model.quantization.cache import cache_root, cached_checkpoint
    from finetune.recipe import validate_recipe

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "nf4"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}))
    recipe = validate_recipe({"model": {"name_or_path": str(base), "quantized_cache": "auto"},
                              "data": {"datasets": [{"path": "rows.jsonl"}]}})
    assert recipe.quantization.method != "none"
    assert cached_checkpoint(recipe, base, device=torch.device("cpu")) == base
    assert not cache_root().exists()  # nothing built, nothing locked
