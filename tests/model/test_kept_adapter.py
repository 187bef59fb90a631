"""A run started from model.adapter keeps what it started from (finetune/model/lora/kept.py): the adapter's files are
copied into the run folder (start-adapter/, hashed) when it starts, and its resume, `finetune validate` of the resume,
export, `export --step` and generate read that copy; its recipe.yaml says the resolved targets; the chat template is
the adapter's where the recipe sets none; a lora key the recipe sets is compared even at its default value.

In-process: the run folder is written as a run writes it (outputs.begin_outputs with the resolved recipe), the start
folder then retrained, moved or re-ranked, and the recipe read as each command reads it. The slow test runs the bug
bash's path with real processes: SFT, DPO from it, SFT retrained, DPO resumed (bitwise the uninterrupted steps),
SFT deleted, the DPO run exported and generated from.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import objective_recipe, recipe_dict, run_cmd, write_jsonl, write_recipe

from finetune.errors import ModelLoadError, RecipeError
from finetune.model import base as model_stage
from finetune.model.lora import kept
from finetune.model.lora.attach import adapter_start
from finetune.outputs import begin_outputs
from finetune.outputs.export_source import resolve_source
from finetune.outputs.run_folder import saved_recipe
from finetune.recipe import Recipe, recipe_to_yaml, validate_recipe

TEMPLATE = "{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"


def _adapter(model_dir: Path, folder: Path, *, r: int = 4, seed: int = 0, targets=("q_proj", "v_proj"),
             template: str | None = None) -> dict[str, torch.Tensor]:
    """A PEFT adapter of `model_dir` in `folder` (its B moved off zero by `seed`), as an SFT run leaves one; returns
    its tensors as saved."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(peft_model.named_parameters()):
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    shutil.rmtree(folder, ignore_errors=True)
    peft_model.save_pretrained(folder)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return load_file(str(folder / "adapter_model.safetensors"))


def _recipe(model_dir: Path, adapter: Path | None, out_dir: Path, **sections) -> Recipe:
    model = {"adapter": str(adapter) if adapter else None, **sections.pop("model", {})}
    values = recipe_dict(model_dir, out_dir.parent / "unused.jsonl", out_dir, model=model,
                         quantization={"method": "none"}, **sections)
    values["lora"] = {"dropout": 0.0, **sections.get("lora", {})}  # r and alpha left to the adapter
    return validate_recipe(values)


def _started_run(model_dir: Path, adapter: Path, run: Path, **sections) -> Recipe:
    """A run folder as a run from `adapter` leaves it when training starts: the recipe resolved (load_config, as
    run.py's pre-flight), then begin_outputs writes recipe.yaml (and keeps the start adapter)."""
    recipe = _recipe(model_dir, adapter, run, **sections)
    model_stage.load_config(recipe)
    run.mkdir(parents=True, exist_ok=True)
    begin_outputs(run, recipe_to_yaml(recipe), None)
    return recipe


def _starts_from(recipe: Recipe) -> dict[str, torch.Tensor]:
    model_stage.load_config(recipe)
    return adapter_start(recipe)


def test_a_resume_starts_from_the_adapter_the_run_started_from_whatever_its_folder_holds_now(tiny_llama, tmp_path,
                                                                                               capsys):
    """Found by a bug bash: a DPO run from model.adapter, resumed after its SFT run was retrained (same layout, other
    seed), re-read the start adapter from its folder: steps 4-6 optimized against another reference than steps 1-3
    (0.6453 for 0.6248), without a word. Now the run keeps a copy when it starts and a resume (`train.resume=auto`, and
    `finetune validate` of it, which reads the same) starts from that copy, with a note that the folder changed; the
    copy's hashes are checked; the folder moved away is no error either."""
    live, run = tmp_path / "sft" / "adapter", tmp_path / "dpo"
    started = _adapter(tiny_llama, live, seed=1)
    _started_run(tiny_llama, live, run)
    retrained = _adapter(tiny_llama, live, seed=2)  # the SFT recipe run again
    assert not torch.equal(retrained["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                           started["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    capsys.readouterr()
    tensors = _starts_from(_recipe(tiny_llama, live, run, train={"resume": "auto"}))
    assert all(torch.equal(tensors[key.removeprefix("base_model.model.")], value) for key, value in started.items())
    assert f"model.adapter ({live}) changed since this run started; the run continues from the copy it kept when it " \
           f"started ({run / kept.KEPT})" in capsys.readouterr().out
    assert sorted(p.name for p in (run / kept.KEPT).iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                    "kept.json"]
    fresh = _starts_from(_recipe(tiny_llama, live, tmp_path / "new"))  # a new run reads the folder as it is now
    assert torch.equal(fresh["model.layers.0.self_attn.q_proj.lora_B.weight"],
                       retrained["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])

    shutil.rmtree(live.parent)  # the SFT run cleaned up
    tensors = _starts_from(_recipe(tiny_llama, live, run, train={"resume": "auto"}))
    assert all(torch.equal(tensors[key.removeprefix("base_model.model.")], value) for key, value in started.items())

    copy = run / kept.KEPT / "adapter_model.safetensors"
    copy.write_bytes(copy.read_bytes()[:-8] + b"\0" * 8)  # the kept copy damaged
    kept._CHECKED.clear()
    with pytest.raises(ModelLoadError, match=r"no longer holds the files recorded in its kept.json"):
        _starts_from(_recipe(tiny_llama, live, run, train={"resume": "auto"}))


@pytest.mark.parametrize("change", ["moved", "rank"])
def test_a_finished_run_exports_from_its_own_recipe_whatever_became_of_its_start_adapter(change, tiny_llama, tmp_path):
    """Found by a bug bash: once the start adapter's folder was moved away, `finetune export RUN` (also of RUN/adapter
    in place, `--step`, generate) failed with "model.adapter ...: not a PEFT adapter folder"; retrained with another
    rank, each refused "the recipe's lora.r 8 differs" though the user set no lora.r (finetune wrote it into the run's
    recipe.yaml). Now the run's recipe.yaml (and a checkpoint's) reads the run's kept copy: the model config loads as
    export loads it, with the run's layout."""
    live, run = tmp_path / "sft" / "adapter", tmp_path / "run"
    _adapter(tiny_llama, live)
    _started_run(tiny_llama, live, run)
    shutil.copytree(live, run / "adapter")  # the finished run's own adapter (any PEFT adapter will do here)
    (run / "checkpoints" / "step-00000003").mkdir(parents=True)
    shutil.copy(run / "recipe.yaml", run / "checkpoints" / "step-00000003" / "recipe.yaml")
    if change == "moved":
        shutil.move(live.parent, tmp_path / "elsewhere")
    else:
        _adapter(tiny_llama, live, r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    for source in (resolve_source(run), resolve_source(run / "adapter")):  # export / generate RUN, RUN/adapter
        model_stage.load_config(source.recipe)
        assert (source.recipe.lora.r, source.recipe.lora.target_modules) == (4, ["q_proj", "v_proj"])
    checkpoint = saved_recipe(run / "checkpoints" / "step-00000003" / "recipe.yaml")  # export / generate --step
    model_stage.load_config(checkpoint)
    assert kept.start_folder(checkpoint) == (run / kept.KEPT).resolve()


def test_the_run_recipe_says_the_adapters_targets_and_an_older_run_still_resumes(tiny_llama, tmp_path):
    """Found by a bug bash: a run from model.adapter wrote `target_modules: all-linear` (the placeholder for "the
    adapter's targets") into its recipe.yaml, although r and alpha were resolved, so a resume without model.adapter
    was refused as a changed target list. Now the resolved list is written (sorted); a regex adapter keeps all-linear;
    a checkpoint of an older run (all-linear) is read as the adapter's targets, not refused."""
    from finetune.outputs.resume_checks import _adapter_layout_as_resolved, differences

    live = tmp_path / "adapter"
    _adapter(tiny_llama, live, targets=("v_proj", "q_proj"))
    recipe = _started_run(tiny_llama, live, tmp_path / "run")
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["lora"]["target_modules"] == ["q_proj", "v_proj"]
    old = _recipe(tiny_llama, live, tmp_path / "run").model_dump(mode="json")  # what an older finetune wrote
    old["lora"].update(r=4, alpha=8.0)
    lora_keys = [key for key, _, _ in differences(old, recipe.model_dump(mode="json")) if key.startswith("lora.")]
    assert lora_keys == ["lora.target_modules"]
    _adapter_layout_as_resolved(old, recipe.model_dump(mode="json"))
    assert not [key for key, _, _ in differences(old, recipe.model_dump(mode="json")) if key.startswith("lora.")]

    config = json.loads((live / "adapter_config.json").read_text())
    (live / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q_proj|v_proj)"}))
    regex = _recipe(tiny_llama, live, tmp_path / "regex")
    model_stage.load_config(regex)
    assert regex.lora.target_modules == "all-linear"


@pytest.mark.parametrize("recipe_sets", [False, True])
def test_the_chat_template_is_the_start_adapters_unless_the_recipe_sets_one(recipe_sets, tiny_llama, tmp_path, capsys):
    """Found by a bug bash: a run from an adapter trained with its own template (model.chat_template: `### role:`),
    with no model.chat_template, rendered its rows with the base's ChatML without a word (SFT -> DPO in another format;
    eval loss 6.0883 for 6.0748). Now the adapter's template is used, with a note; a recipe that sets one keeps it, with
    a note that the adapter's differs. A resume reads the template from the run's kept copy."""
    live = tmp_path / "sft" / "adapter"
    _adapter(tiny_llama, live, template=TEMPLATE)
    model = {"chat_template": "chatml"} if recipe_sets else {}
    recipe = _recipe(tiny_llama, live, tmp_path / "run", model=model)
    base_template = model_stage.load_tokenizer(_recipe(tiny_llama, None, tmp_path / "x")).chat_template
    capsys.readouterr()
    tokenizer = model_stage.load_tokenizer(recipe)
    said = capsys.readouterr().out
    if recipe_sets:
        assert tokenizer.chat_template != TEMPLATE
        assert "model.chat_template is used (the recipe sets it), while model.adapter's own chat template" in said
        return
    assert tokenizer.chat_template == TEMPLATE != base_template
    assert f"model.adapter's chat template is used ({live / 'chat_template.jinja'})" in said
    _started_run(tiny_llama, live, tmp_path / "run")
    (live / "chat_template.jinja").write_text("{{ messages }}")  # the SFT run's template changed since
    resumed = _recipe(tiny_llama, live, tmp_path / "run", train={"resume": "auto"})
    assert model_stage.load_tokenizer(resumed).chat_template == TEMPLATE


def test_a_lora_key_the_recipe_sets_to_its_default_is_compared_with_the_adapters(tiny_llama, tmp_path):
    """Found by a bug bash: `lora.r: 16` (or alpha 32, the defaults) beside an r 4 model.adapter was replaced by the
    adapter's value with a note, while `r: 12` was refused: the check compared with the default value, not with what
    the recipe sets. Now a key the recipe sets is refused alike, with the override that fixes it; a key it leaves out
    still takes the adapter's; an older run's recipe.yaml (every key dumped, no kept copy) still reads as before."""
    live = tmp_path / "adapter"
    _adapter(tiny_llama, live)
    with pytest.raises(RecipeError, match=r"the recipe's lora.r 16, lora.alpha 32 differ from the adapter's "
                                          r"adapter_config.json \(lora.r 4, lora.alpha 8\).*lora.r=4 lora.alpha=8"):
        model_stage.load_config(_recipe(tiny_llama, live, tmp_path / "run", lora={"r": 16, "alpha": 32}))
    left = _recipe(tiny_llama, live, tmp_path / "run")
    model_stage.load_config(left)
    assert (left.lora.r, left.lora.alpha) == (4, 8.0)

    older = tmp_path / "older"  # a run folder an older finetune wrote: defaults dumped, no start-adapter/
    older.mkdir()
    dumped = _recipe(tiny_llama, live, older).model_dump(mode="json")
    (older / "recipe.yaml").write_text(yaml.safe_dump(dumped))
    model_stage.load_config(saved_recipe(older / "recipe.yaml"))


# --------------------------------------------------------------------------------------------------- the CLI path
def _train(recipe: Path, *overrides: str) -> str:
    result = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe), *overrides], warm=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow  # 4 processes as a user runs them: SFT, DPO, its resume, an export (cold: the result is the subject)
def test_sft_then_dpo_resumes_bitwise_and_exports_after_the_sft_run_is_retrained_and_deleted(tiny_llama, tmp_path):
    """Found by a bug bash (its repro1 and repro2 scripts): after SFT -> DPO, retraining the SFT run changed the DPO
    resume's reference silently (step 3: 0.687162 for 0.691066 here), and deleting it broke the DPO run's
    export. Now the resumed steps equal the uninterrupted run's, bitwise, with a note; the export works with the SFT
    run gone."""
    from safetensors.torch import load_file, save_file

    pairs = [{"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}.", "rejected": f"{a + b + 3}."}
             for a, b in zip(range(24), range(5, 29))]
    rows = [{"instruction": r["prompt"], "output": r["chosen"]} for r in pairs]
    sft = write_recipe(tmp_path / "sft.yaml", recipe_dict(tiny_llama, write_jsonl(tmp_path / "sft.jsonl", rows),
                                                          tmp_path / "sft", train={"max_steps": 2}))
    _train(sft)
    values = objective_recipe("dpo", "preference", tiny_llama, write_jsonl(tmp_path / "pairs.jsonl", pairs),
                              tmp_path / "dpo", model={"adapter": str(tmp_path / "sft" / "adapter")},
                              train={"max_steps": 4, "save_every": 2, "learning_rate": 1e-2})
    del values["lora"]["r"], values["lora"]["alpha"]
    dpo = write_recipe(tmp_path / "dpo.yaml", values)
    _train(dpo)
    whole = [m["loss"] for m in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
             if "loss" in m]
    weights = tmp_path / "sft" / "adapter" / "adapter_model.safetensors"  # the SFT run retrained: other values
    save_file({key: value * 1.5 for key, value in load_file(str(weights)).items()}, str(weights))
    shutil.rmtree(tmp_path / "dpo" / "checkpoints" / "step-00000004")
    shutil.rmtree(tmp_path / "dpo" / "adapter")
    said = _train(dpo, "train.resume=auto")
    resumed = [m["loss"] for m in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
               if "loss" in m]
    assert resumed == whole
    assert "changed since this run started; the run continues from the copy it kept" in said
    shutil.rmtree(tmp_path / "sft")
    result = run_cmd([sys.executable, "-m", "finetune", "export", str(tmp_path / "dpo"), str(tmp_path / "out")],
                     warm=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
