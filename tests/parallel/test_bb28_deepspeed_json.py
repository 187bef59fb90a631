"""DeepSpeed JSON files users bring (bug bash bb28: LLaMA-Factory's and HF Trainer's ZeRO configs, shorthands, typos):
what deepspeed.initialize gets, and that every key of the file is used, refused or named. In process: zero.resolve
and the installed DeepSpeed's own schema (DeepSpeedZeroConfig), nothing launched."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune import cli
from finetune.parallel import zero
from finetune.planner.memory import BUCKET_ELEMENTS
from finetune.recipe import validate_recipe

pytestmark = pytest.mark.skipif(not zero.installed(), reason="deepspeed not installed (pip install 'finetune[deepspeed]')")

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json, as users copy it.
LLAMA_FACTORY_Z3 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
             "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def resolve(tiny_llama, tmp_path, config: dict) -> tuple[zero.ZeroSettings, list[str], list[str]]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_llama), "dtype": "bfloat16"},
                              "data": {"datasets": [{"path": "x.jsonl"}]},
                              "parallel": {"strategy": "deepspeed", "deepspeed_config": str(path)}})
    problems, notes = [], []
    settings = zero.resolve(recipe, {"strategy": "deepspeed"}, world_size=2, device_type="cpu", problems=problems,
                            notes=notes)
    return settings, problems, notes


def deepspeed_reads(settings: zero.ZeroSettings):
    """What DeepSpeed itself makes of the ZeRO section finetune hands deepspeed.initialize."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**settings.engine_config["zero_optimization"])


# ------------------------------------------------------------------------------------- finding 2: "auto" values
def test_bb28_auto_in_the_zero_section_keeps_finetunes_buckets(tiny_llama, tmp_path):
    """Found by a bug bash: LLaMA-Factory's ZeRO-3 JSON ("reduce_bucket_size": "auto") replaced finetune's 5e7-element
    buckets with "auto", which DeepSpeed drops for its own 5e8: 2 GB of fp32 gradient buffer per GPU that
    `finetune plan` did not count. "auto" means the trainer decides (HF's meaning): finetune's value stays."""
    settings, problems, notes = resolve(tiny_llama, tmp_path, LLAMA_FACTORY_Z3)
    assert problems == [] and notes == []
    read = deepspeed_reads(settings)
    assert read.reduce_bucket_size == read.prefetch_bucket_size == read.allgather_bucket_size == BUCKET_ELEMENTS
    assert read.contiguous_gradients and read.max_live_parameters == 1e9  # the file's own values still win
    assert read.param_persistence_threshold == 100_000  # "auto" where finetune has no value: DeepSpeed's default


def test_bb28_a_number_in_the_zero_section_still_wins(tiny_llama, tmp_path):
    """The user's tuning is kept where it is a value (only "auto" defers to finetune); a stage "auto" is no refusal."""
    settings, problems, _ = resolve(tiny_llama, tmp_path, {"zero_optimization": {"stage": "auto", "reduce_bucket_size": 1e6}})
    assert problems == [] and settings.stage == 3
    assert deepspeed_reads(settings).reduce_bucket_size == 1e6


# ---------------------------------------------------------------------- finding 4: sections of the wrong shape
@pytest.mark.parametrize("config,needle", [
    ({"bf16": True, "zero_optimization": {"stage": 3}}, 'bf16 must be an object such as {"enabled": false}, found true'),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
     "zero_optimization.offload_param must be an object such as {\"device\": \"cpu\"}, found the string 'cpu'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": True}},
     "zero_optimization.offload_optimizer must be an object such as {\"device\": \"cpu\"}, found true"),
    ({"zero_optimization": 3}, 'zero_optimization must be an object of ZeRO settings, e.g. {"stage": 3}, found the number 3'),
    ({"zero_optimization": "stage3"}, "zero_optimization must be an object of ZeRO settings"),
])
def test_bb28_a_section_of_the_wrong_shape_is_one_sentence(config, needle, tiny_llama, tmp_path):
    """Found by a bug bash: `"bf16": true` (a common shorthand), `"offload_param": "cpu"` and `"zero_optimization": 3`
    were AttributeError / TypeError tracebacks from `finetune validate` and `finetune train`."""
    _, problems, _ = resolve(tiny_llama, tmp_path, config)
    assert len(problems) == 1 and needle in problems[0] and str(tmp_path / "ds.json") in problems[0]
    assert "Fix:" in problems[0]


def test_bb28_a_wrong_shape_reaches_the_terminal_without_a_traceback(tiny_llama, tmp_path, capsys):
    """Found by a bug bash: `finetune validate` printed "AttributeError: 'bool' object has no attribute 'get'"."""
    (tmp_path / "ds.json").write_text('{"bf16": true, "zero_optimization": {"stage": 3}}')
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tiny_llama, data, tmp_path / "run"))
    code = cli.main(["validate", str(recipe), f"parallel.deepspeed_config={tmp_path / 'ds.json'}",
                     "--accelerate-config", str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "bf16 must be an object" in err and "Traceback" not in err


# -------------------------------------------------------------------------------- finding 5: top-level keys
def test_bb28_a_misspelled_section_is_refused_with_the_right_name(tiny_llama, tmp_path):
    """Found by a bug bash: `{"zero_optimisation": {"stage": 2}}` gave no problem and the engine got finetune's
    default, ZeRO-3: the user's ZeRO-2 became ZeRO-3 without a word."""
    _, problems, _ = resolve(tiny_llama, tmp_path, {"zero_optimisation": {"stage": 2}, "zero_optimizaton_typo_2": 1})
    assert len(problems) == 2
    assert "`zero_optimisation` is not a key of DeepSpeed's config (did you mean zero_optimization?)" in problems[0]
    assert "`zero_optimizaton_typo_2` is not a key of DeepSpeed's config" in problems[1]


def test_bb28_bfloat16_the_older_name_of_bf16_is_refused_as_bf16_is(tiny_llama, tmp_path):
    """Found by a bug bash: `{"bfloat16": {"enabled": true}}` (DeepSpeed still reads that name) escaped the refusal
    of `bf16.enabled: true`, which would cast the packed 4-bit storage."""
    _, problems, _ = resolve(tiny_llama, tmp_path, {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    assert len(problems) == 1 and "`bfloat16.enabled: true` (DeepSpeed's older name of bf16) would cast" in problems[0]


def test_bb28_the_sections_finetune_does_not_pass_on_are_named(tiny_llama, tmp_path):
    """Found by a bug bash: communication_data_type, activation_checkpointing and data_types were dropped without a
    note (the docs: only zero_optimization is used)."""
    config = {"communication_data_type": "fp16", "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 10,
              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
              "zero_optimization": {"stage": 3}}
    _, problems, notes = resolve(tiny_llama, tmp_path, config)
    assert problems == [] and len(notes) == 1
    for key in ("communication_data_type (gradients are reduced", "data_types (", "steps_per_print (",
                "activation_checkpointing (train.gradient_checkpointing"):
        assert key in notes[0]
