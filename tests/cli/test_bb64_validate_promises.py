"""Bug bash bb64: what `finetune validate` promises before a run against what the run then does.

#1 lora.train_router on a dense model: validate said "recipe OK", the run refused it after loading (DoRA: after every
weight was read and quantized). #3 validate said "recipe OK" without the warnings and notes the run prints before its
first step about the same data and recipe.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests.conftest import addition_rows, recipe_dict, write_jsonl, write_recipe

ROUTER_REFUSAL = "lora.train_router: true, but this model has no router finetune can train"


def _recipe(tmp_path, model_dir, **sections):
    data = write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows())
    return write_recipe(tmp_path / "r.yaml", recipe_dict(model_dir, data, tmp_path / "run", **sections))


def _validate(capsys, recipe, *overrides) -> tuple[int, str, str]:
    from finetune.cli.command import main

    code = main(["validate", str(recipe), *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------- #1 train_router on a dense model
def test_validate_refuses_train_router_on_a_dense_model(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb64 #1): `finetune validate` said "recipe OK" for lora.train_router: true on a dense
    model; only the run refused it, when LoRA was attached (after loading). Now validate refuses it from the config,
    in the run's paragraph (both call experts.lora.check_train_router)."""
    code, out, err = _validate(capsys, _recipe(tmp_path, tiny_llama), "lora.train_router=true")
    assert code == 2 and "recipe OK" not in out, out
    assert ROUTER_REFUSAL in err and "Fix: remove lora.train_router." in err, err


def test_train_router_check_passes_a_model_with_routers(tmp_path):
    """The config-level check finds the routers of a mixture-of-experts model (no false refusal), on the meta device."""
    from transformers import MixtralConfig

    from finetune.model.experts.lora import check_train_router
    from finetune.recipe import validate_recipe

    recipe = validate_recipe(recipe_dict(tmp_path, tmp_path / "d.jsonl", tmp_path / "run", lora={"train_router": True}))
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    check_train_router(recipe, config)  # no error: the routers are there to train


def test_run_refuses_train_router_before_a_from_pretrained_load(tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash (bb64 #1): with lora.dora (a load through from_pretrained, which attaches LoRA only after
    every weight is loaded and quantized), the run refused lora.train_router on a dense model only after loading.
    Now load_model refuses it beside check_lora_targets, before any weight is read."""
    import torch

    from finetune.errors import ModelLoadError
    from finetune.model import base as model_stage
    from finetune.model.loading import load_model
    from finetune.recipe import load_recipe

    def loaded(*args, **kwargs):
        raise AssertionError("weights were loaded before lora.train_router was checked")

    monkeypatch.setattr(model_stage, "build_model", loaded)
    recipe = load_recipe(str(_recipe(tmp_path, tiny_llama, lora={"train_router": True, "dora": True})), [])
    with pytest.raises(ModelLoadError, match=ROUTER_REFUSAL):
        load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None, gradient_checkpointing=False)


# ------------------------------------------------------------------------ #3 the run's warnings and notes, said here
def test_validate_warns_of_eval_examples_that_are_training_examples(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb64 #3): two datasets from one file put the same examples in train and eval; the run
    warned of it before its first step, validate said only "recipe OK"."""
    from finetune.data.build import eval_overlap

    data = write_jsonl(tmp_path / "data" / "train.jsonl", addition_rows())
    values = recipe_dict(tiny_llama, data, tmp_path / "run")
    values["data"]["datasets"] = [{"path": str(data), "format": "alpaca"}] * 2
    values["data"]["eval_fraction"] = 0.2
    code, out, _ = _validate(capsys, write_recipe(tmp_path / "r.yaml", values))
    assert code == 0 and "recipe OK" in out, out
    found = re.search(r"\n  warning: (\d+) of (\d+) eval examples are also training examples", out)
    assert found, out
    said = SimpleNamespace(eval_in_train=int(found[1]), eval_examples=int(found[2]))
    assert f"\n  warning: {eval_overlap(said)}\n" in out, out  # the run's sentence (data.data_line's)


def test_validate_warns_of_truncation_that_cut_much(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb64 #3): data.max_length far below the rows' length cut most of the tokens; the run warned
    ("truncation cut N of M tokens"), validate said only "N truncated"."""
    rows = [{"text": " ".join(f"word{row}x{word}" for word in range(40))} for row in range(40)]
    values = recipe_dict(tiny_llama, write_jsonl(tmp_path / "t.jsonl", rows), tmp_path / "run")
    values["data"].update(datasets=[{"path": str(tmp_path / "t.jsonl"), "format": "text"}], max_length=32)
    code, out, _ = _validate(capsys, write_recipe(tmp_path / "r.yaml", values))
    assert code == 0 and "recipe OK" in out, out
    assert re.search(r"\n  warning: truncation cut [\d,]+ of [\d,]+ tokens \(\d+%\): 40 rows longer than "
                     r"data\.max_length 32 keep only the first 32 tokens", out), out


@pytest.mark.parametrize("overrides", [["train.eval_every=1"], ["train.keep_best=true", "train.eval_every=2",
                                                                 "train.save_every=2"]])
def test_validate_notes_eval_every_with_no_eval_examples(tiny_llama, tmp_path, capsys, overrides):
    """Found by a bug bash (bb64 #3): train.eval_every (or train.keep_best, which needs the evals) with an
    eval_fraction that rounds to no row: the run noted that nothing evaluates, validate said "recipe OK" alone."""
    from finetune.recipe import load_recipe
    from finetune.recipe.checks import eval_every_note

    recipe = _recipe(tmp_path, tiny_llama)
    args = ["data.eval_fraction=0.001", *overrides]
    code, out, _ = _validate(capsys, recipe, *args)
    assert code == 0 and "recipe OK" in out, out
    assert f"\n  note: {eval_every_note(load_recipe(str(recipe), args), 0)}\n" in out, out


def test_validate_notes_warmup_clamped_under_num_epochs(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb64 #3): under train.num_epochs, a warmup longer than the resolved max_steps is clamped
    and the run notes it; validate noted it only for train.max_steps (at load), not once num_epochs was resolved."""
    values = recipe_dict(tiny_llama, write_jsonl(tmp_path / "d.jsonl", addition_rows()), tmp_path / "run",
                         train={"num_epochs": 1, "warmup_steps": 50})
    del values["train"]["max_steps"]
    code, out, _ = _validate(capsys, write_recipe(tmp_path / "r.yaml", values))
    assert code == 0 and "recipe OK" in out, out
    assert re.search(r"\n  note: train\.warmup_steps \(50\) is not below train\.max_steps \(\d+\): warming up over \d+ "
                     r"steps instead\.\n", out), out


def test_validate_says_no_extra_notes_for_a_plain_recipe(tiny_llama, tmp_path, capsys):
    """A recipe the run says nothing more about gets no warning or note from validate either."""
    code, out, _ = _validate(capsys, _recipe(tmp_path, tiny_llama))
    assert code == 0 and "  warning:" not in out and "  note:" not in out, out


def test_finetune_data_says_the_length_notes_the_run_says(tiny_llama, tmp_path, capsys):
    """Found by a bug bash (bb64 #3, its fixer's note): `finetune data` left out the notes the run prints once its
    length is known: a warmup clamped under train.num_epochs, train.eval_every with no eval examples."""
    from finetune import cli

    values = recipe_dict(tiny_llama, write_jsonl(tmp_path / "d.jsonl", addition_rows()), tmp_path / "run",
                         train={"num_epochs": 1, "warmup_steps": 50, "eval_every": 2},
                         data={"eval_fraction": 0.001})
    del values["train"]["max_steps"]
    assert cli.main(["data", str(write_recipe(tmp_path / "r.yaml", values)), "--rows", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\nnote: train\.warmup_steps \(50\) is not below train\.max_steps \(\d+\): warming up over \d+ "
                     r"steps instead\.\n", out), out
    from finetune.recipe import load_recipe
    from finetune.recipe.checks import eval_every_note

    assert f"\nnote: {eval_every_note(load_recipe(str(tmp_path / 'r.yaml')), 0)}\n" in out, out
