"""The reward objective against what serves its adapter (bug bash bb68): transformers' AutoModelForSequenceClassification.

1. The score trained is the score served: MiniCPM3 divides the decoder's output by logits_scaling before its LM head,
   and the reward was taken from the head's input (x 1/logits_scaling: 4 on the tiny model, 10 on MiniCPM3-4B); the
   sequence classifier scores the decoder's output. Oracle: the classifier built by transformers from the same
   config and weights (LoRA merged, the same score weight), per row, right-padded as a user has them.
2. A base transformers has no sequence classifier for (cohere2, granite, Gemma 4, Llama 4, ...): the run trained, then
   nothing could load the adapter and `finetune export` died with a ValueError traceback. Refused now from config.json
   (validate and the run, before any weight loads), and the export of a run made before that says so in one paragraph.
   Oracle: whether transformers builds AutoModelForSequenceClassification from the config.
3. The closing `next:` line of a reward run names commands that take a reward adapter (generate and --merge refuse it).
"""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import objective_recipe, write_jsonl, write_recipe

from finetune.cli.tiny import build_tokenizer
from finetune.cli.tiny_arch import tiny_config

CPU = torch.device("cpu")


def _classifier_of(config):
    """transformers' sequence classifier for `config` (one label) on the meta device, or None where it has none."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    config.num_labels = 1
    try:
        with torch.device("meta"):
            return AutoModelForSequenceClassification.from_config(config)
    except ValueError:
        return None


@pytest.mark.parametrize("model_type", ["minicpm3", "llama"])
def test_the_reward_trained_is_the_reward_the_sequence_classifier_serves(model_type):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from finetune.model.reward_head import attach_score_head
    from finetune.training.objectives.reward import rewards

    tokenizer = build_tokenizer()
    pad = tokenizer.pad_token_id
    config = tiny_config(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    if model_type == "minicpm3":
        assert config.logits_scaling == 0.25  # hidden 64 / dim_model_base 256: the head's input is the output x 4
    config.num_labels = 1  # one score, as docs/reward.md loads the classifier
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)  # the weights
    causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = causal.load_state_dict(base.state_dict(), strict=False)
    assert set(missing) <= {"lm_head.weight"}  # every decoder weight is the classifier's (the head: its own or tied)
    model = get_peft_model(causal, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    score = attach_score_head(model, seed=0, device=CPU)
    with torch.no_grad():
        score.weight.mul_(50.0)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tokenizer), (4, 12), generator=generator)
    ids[ids == pad] = 5
    mask = torch.ones_like(ids)
    for row, length in enumerate((12, 9, 7, 11)):  # right padding, as the user's rows come
        ids[row, length:], mask[row, length:] = pad, 0
    got = rewards(model, {"input_ids": ids, "attention_mask": mask}, CPU, pad)
    got.sum().backward()

    served = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    merged = copy.deepcopy(model).merge_and_unload()  # the LoRA in the weights, as the served adapter acts
    served.load_state_dict({**merged.state_dict(), "score.weight": score.weight.detach().clone()}, strict=False)
    served.eval()
    want = served(input_ids=ids, attention_mask=mask).logits[:, 0]
    want.sum().backward()
    assert want.abs().max() > 1, want
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-4)
    # the trained head's gradient is the served head's: the hidden state scored, at the served scale
    torch.testing.assert_close(score.weight.grad, served.score.weight.grad, rtol=1e-4, atol=1e-4)


def _reward_recipe(tmp_path, model_dir, **sections):
    from finetune.recipe import validate_recipe

    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{i} + {i}?", "chosen": f"{2 * i}.",
                                                   "rejected": f"{2 * i + 3} apples."} for i in range(8)])
    values = objective_recipe("reward", "preference", model_dir, data, tmp_path / "run", **sections)
    return values, validate_recipe(copy.deepcopy(values))


def test_a_reward_model_is_refused_from_config_json_where_transformers_has_no_sequence_classifier(tmp_path):
    """Every trained architecture: `load_config` (what `finetune validate`, `finetune plan` and the run ask before any
    weight loads) refuses train.objective: reward exactly where transformers builds no sequence classifier."""
    from finetune.errors import ModelLoadError
    from finetune.model import load_config
    from finetune.model.support import TRAINED

    refused, kept = [], []
    for model_type in sorted(TRAINED):
        config = tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0)
        config.save_pretrained(tmp_path / model_type)
        _, recipe = _reward_recipe(tmp_path, tmp_path / model_type)
        try:
            load_config(recipe)
            said = ""
        except ModelLoadError as error:
            said = str(error)
        (kept if _classifier_of(config) is not None else refused).append(model_type)
        assert ("train.objective: reward" in said) == (model_type in refused), (model_type, said)
    assert {"cohere2", "granite", "gemma4", "llama4_text", "mistral_large4", "olmoe"} <= set(refused)
    assert {"llama", "qwen3", "mistral", "gemma3_text"} <= set(kept)


@pytest.mark.parametrize("model_type", ["cohere2", "granite"])
def test_validate_and_train_refuse_it_in_one_paragraph_before_any_weight(model_type, tmp_path, capsys):
    """A folder holding config.json only: had the refusal needed more than the config, the run would have gone on to
    the tokenizer and the weights, which are not there, and failed with another message."""
    from finetune.cli.command import main
    from finetune.run import main as run_main

    tiny_config(model_type, vocab_size=512, eos_token_id=2, pad_token_id=0).save_pretrained(tmp_path / model_type)
    values, _ = _reward_recipe(tmp_path, tmp_path / model_type)
    recipe = str(write_recipe(tmp_path / "reward.yaml", values))
    for verb in (lambda: main(["validate", recipe]), lambda: run_main([recipe])):
        code, err = verb(), capsys.readouterr().err
        assert code == 2, err
        said = [line for line in err.strip().splitlines() if line.startswith("finetune: error:")]
        assert len(said) == 1 and "Traceback" not in err, err
        assert "train.objective: reward" in said[0] and f"no sequence classifier for {model_type}" in said[0]
        assert "Fix: train the reward model from a base of a family that has one, e.g. Llama 3.x" in said[0]
    assert not (tmp_path / "run").exists()


def test_a_reward_run_made_before_the_refusal_exports_to_one_paragraph(tiny_arch, tmp_path, monkeypatch, capsys):
    """A cohere2 reward run trained (the refusal switched off, as before bb68): `finetune export` of its folder and of
    its adapter/ alone exit 2 with one paragraph (was: a ValueError traceback from the classifier build)."""
    from finetune.cli.command import main
    from finetune.model import support

    values, _ = _reward_recipe(tmp_path, tiny_arch("cohere2"), train={"max_steps": 1, "micro_batch_size": 2},
                               quantization={"method": "none"})
    recipe = str(write_recipe(tmp_path / "reward.yaml", values))
    with monkeypatch.context() as patched:
        patched.setattr(support, "sequence_classifier_problem", lambda config: None, raising=False)
        assert main(["train", recipe]) == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()
    shutil.copytree(tmp_path / "run" / "adapter", tmp_path / "lone")  # an adapter without its run's recipe
    for source in (tmp_path / "run", tmp_path / "lone"):
        code = main(["export", str(source), str(tmp_path / f"out-{source.name}")])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "no sequence classifier for cohere2" in err and "Fix:" in err, err
        assert not (tmp_path / f"out-{source.name}").exists()


def test_a_reward_runs_next_line_names_what_takes_its_adapter(tiny_llama, tmp_path, capsys):
    """The line `finetune train` ends on, for a reward run: its suggested export works (exit 0, the adapter a
    sequence classifier's), and it names neither `finetune generate` nor `--merge`, which refuse a reward adapter."""
    import shlex

    from finetune.cli.command import main

    values, _ = _reward_recipe(tmp_path, tiny_llama, train={"max_steps": 1, "micro_batch_size": 2},
                               quantization={"method": "none"})
    assert main(["train", str(write_recipe(tmp_path / "reward.yaml", values))]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[finetune] next:")]
    assert len(said) == 1, said
    assert "generate" not in said[0] and "--merge" not in said[0], said
    assert f"grpo.reward_models: [{tmp_path / 'run'}]" in said[0], said
    export = shlex.split(said[0].removeprefix("[finetune] next: ").split("(")[0])
    assert export[:2] == ["finetune", "export"], export
    assert main(export[1:]) == 0
    written = json.loads((tmp_path / "run-adapter" / "adapter_config.json").read_text())
    assert written["task_type"] == "SEQ_CLS"
