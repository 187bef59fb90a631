"""Which models can pack: found by a bug bash of packing. The hybrid linear-attention models (Qwen3-Next, Qwen3.5,
MiniMax, OLMo hybrid, LARA) were accepted with data.packing: their recurrent layers carry state from one packed
example into the next (transformers separates them only given flash-attention sequence lengths), an effect too small
on a random tiny model for verify_packing's bf16-sized limit; gpt-oss (whose masks ignore position_ids) passed
validate and was refused only after every weight had loaded, with advice (sdpa) it cannot take. The rule is read
from the config before any weight loads; the slow test measures it against the models themselves, in fp32. (A review
found the first rule refused the top-k indexed attention of DeepSeek-V3.2 / Mistral Large 4, which packs exactly.)"""

from __future__ import annotations

import pytest
import torch
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

from finetune import cli, data

MIXING = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "minimax", "olmo_hybrid", "lara_mini", "deepseek_v4",
          "gpt_oss"]
APART = ["llama", "qwen2", "gemma3_text", "llama4_text", "cohere2", "mistral", "deepseek_v32", "mistral_large4"]


def _config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


@pytest.mark.parametrize("model_type", MIXING)
def test_packing_is_refused_for_models_that_carry_one_example_into_the_next(model_type):
    problem = data.packing_model_problem(_config(model_type))
    assert problem and problem.startswith(f"data.packing: {model_type} cannot pack examples") and \
        "Set data.packing: false" in problem and "sdpa" not in problem, problem


@pytest.mark.parametrize("model_type", APART)
def test_packing_stays_allowed_for_attention_that_keeps_examples_apart(model_type):
    assert data.packing_model_problem(_config(model_type)) is None


def test_validate_refuses_packing_for_a_hybrid_model_before_any_weight_loads(tiny_arch, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", addition_rows(8))
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_arch("qwen3_next"), rows, tmp_path / "out",
                                                          data={"packing": True}))
    assert cli.main(["validate", str(recipe)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "qwen3_next cannot pack examples: its linear_attention layers carry state" in said, said


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [*MIXING, *(t for t in APART if t != "mistral_large4")])  # (image-text)
def test_the_rule_matches_what_each_model_does_with_two_examples_in_one_row(model_type, tiny_arch):
    """The oracle: the second example's fp32 logits packed after the first against run alone (restarting position ids,
    as finetune's rows have them). Exact (<1e-5) where packing is allowed; moved where it is refused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch(model_type), dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().num_embeddings
    first, second = (torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (24, 16))
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second])[None], use_cache=False,
                       position_ids=torch.tensor(list(range(24)) + list(range(16)))[None]).logits[0, 24:]
        alone = model(input_ids=second[None], use_cache=False).logits[0]
    moved = float((packed - alone).abs().max() / alone.std())
    refused = data.packing_model_problem(model.config) is not None
    assert (moved > 1e-3) if refused else (moved < 1e-5), (model_type, moved)
