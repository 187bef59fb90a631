"""model.adapter from plain PEFT: what finetune cannot start from as PeftModel.from_pretrained loads it is refused
before any weight loads (an init PEFT redoes on the base, fields finetune does not apply), PEFT's older .bin adapters
load, and the adapter a run writes says finetune's own init (finetune/model/lora/adapter.py, attach.py).

The adapters are written by PEFT itself on the tiny llama, with their LoRA moved off its start as training leaves it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.errors import ModelLoadError
from finetune.model import base as model_stage
from finetune.model import loading
from finetune.model.lora.attach import lora_config
from finetune.recipe import Recipe, validate_recipe

CPU = torch.device("cpu")
IDS = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(1))


def _peft_model(model_dir: Path, **config):
    """A PeftModel of `config` (r 4, alpha 8, q_proj/v_proj unless said) on the fp32 base, its LoRA B moved off zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                                    **config}))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    return peft_model


def _peft_logits(model_dir: Path, folder: Path) -> torch.Tensor:
    """The oracle: PeftModel.from_pretrained of the adapter on a fresh base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, folder).eval()(input_ids=IDS).logits


def _recipe(model_dir: Path, adapter: Path) -> Recipe:
    return validate_recipe({"model": {"name_or_path": str(model_dir), "dtype": "float32", "adapter": str(adapter)},
                            "quantization": {"method": "none"}, "lora": {"dropout": 0.0},
                            "data": {"datasets": [{"path": "unused.jsonl"}]}})


def _started_logits(recipe: Recipe) -> torch.Tensor:
    """The model a single-process run starts from (its pre-flight first, as the run makes it)."""
    model_stage.load_config(recipe)
    loaded = loading.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False)
    with torch.no_grad():
        return loaded.model.eval()(input_ids=IDS).logits


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_whose_init_peft_redoes_on_the_base_is_refused_before_weights_load(init, tiny_llama, tmp_path):
    """Found by a bug bash: a PiSSA / OLoRA adapter as PEFT saves it by default (no conversion) started from W + BA
    (logits 0.25 / 0.67 away from PEFT's), while PeftModel.from_pretrained rewrites each targeted base weight into its
    residual and computes W_res + BA; no word was said. Now the pre-flight check (`finetune validate`, the run) refuses
    it, naming the value and PEFT's conversion."""
    folder = tmp_path / init
    _peft_model(tiny_llama, init_lora_weights=init).save_pretrained(folder)
    with pytest.raises(ModelLoadError) as refused:
        model_stage.load_config(_recipe(tiny_llama, folder))
    message = str(refused.value)
    assert f'init_lora_weights: "{init}"' in message and "path_initial_model_for_weight_conversion" in message
    assert "merge_and_unload" in message


def test_an_adapter_peft_converted_to_plain_lora_starts_from_peft_s_model(tiny_llama, tmp_path):
    """The refusal above spares a PiSSA adapter converted on save (path_initial_model_for_weight_conversion: PEFT marks
    it init_lora_weights true, r doubled): it is W + BA on the base as it is, and the run starts from PEFT's model."""
    peft_model = _peft_model(tiny_llama, init_lora_weights="pissa")
    peft_model.peft_config["default"].init_lora_weights = True  # the initial adapter, saved as PEFT's guide says
    peft_model.save_pretrained(tmp_path / "initial")
    peft_model.peft_config["default"].init_lora_weights = "pissa"
    peft_model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    started = _started_logits(_recipe(tiny_llama, tmp_path / "converted"))
    assert torch.equal(started, _peft_logits(tiny_llama, tmp_path / "converted"))


@pytest.mark.parametrize("init", ["gaussian", "eva"])
def test_the_adapter_a_run_writes_says_finetunes_own_init(init, tiny_llama, tmp_path):
    """Found by a bug bash: the adapter a run wrote carried model.adapter's own init_lora_weights ("pissa"), so PEFT
    rebuilt the base on loading it: a model finetune never trained. The config a run's adapter is saved with now says
    finetune's own init (true: the run starts from the adapter's tensors, W + BA on the base as it is)."""
    folder = tmp_path / init
    _peft_model(tiny_llama, init_lora_weights=init).save_pretrained(folder)
    config = lora_config(_recipe(tiny_llama, folder))
    assert config.init_lora_weights is True and config.eva_config is None


@pytest.mark.parametrize(("field", "value"), [("trainable_token_indices", [5, 6, 7]),
                                               ("layer_replication", [[0, 2], [1, 2]]),
                                               ("alora_invocation_tokens", [5, 6])])
def test_a_peft_field_finetune_does_not_apply_is_refused_before_weights_load(field, value, tiny_llama, tmp_path):
    """Found by a bug bash: an adapter with trainable_token_indices passed `finetune validate`, then training failed
    saying the base checkpoint did not match its config.json (PEFT's token_adapter tensors taken for base tensors), with
    "re-download the model" as the fix; layer_replication failed the same way. Now the pre-flight check names the
    field."""
    folder = tmp_path / field
    _peft_model(tiny_llama, **{field: value}).save_pretrained(folder)
    with pytest.raises(ModelLoadError, match=rf"adapter_config.json sets {field} \("):
        model_stage.load_config(_recipe(tiny_llama, folder))


def test_another_adapter_type_than_lora_is_refused_before_weights_load(tiny_llama, tmp_path):
    """Found by a bug bash (the fields finetune does not apply): an IA3 adapter passed `finetune validate` as if it
    were LoRA. Now its peft_type is named."""
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    get_peft_model(base, IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
                   ).save_pretrained(tmp_path / "ia3")
    with pytest.raises(ModelLoadError, match="peft_type: IA3"):
        model_stage.load_config(_recipe(tiny_llama, tmp_path / "ia3"))


def test_a_bin_adapter_starts_from_the_model_peft_loads(tiny_llama, tmp_path):
    """Found by a bug bash: an adapter saved as adapter_model.bin (PEFT before 0.6, safe_serialization=False) was called
    "not a PEFT adapter folder". It is read now, as plain tensors (torch.load weights_only), and the run starts from
    PEFT's model; a .bin that is no dict of tensors is refused with how to re-save it."""
    folder = tmp_path / "bin"
    _peft_model(tiny_llama).save_pretrained(folder, safe_serialization=False)
    assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    assert torch.equal(_started_logits(_recipe(tiny_llama, folder)), _peft_logits(tiny_llama, folder))
    torch.save({"base_model.model.lm_head.weight": [1.0]}, folder / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match=r"adapter_model.bin cannot be read as plain tensors .* as safetensors"):
        loading.load_model(_recipe(tiny_llama, folder), sharded=False, device=CPU, device_map=None,
                           gradient_checkpointing=False)
