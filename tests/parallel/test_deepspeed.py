"""DeepSpeed ZeRO-3 and ZeRO-2 with real processes on CPU (gloo): the shipped accelerate configs as shipped, torchrun
and the `deepspeed` launcher, against one process at the same global batch (1 x 4 rows or 2 x 2 rows per step).

Runs, made once per module and shared: one process in fp32 and in bf16; ZeRO-3 through torchrun in fp32 (also the
reference of the kill test); ZeRO-3 and ZeRO-2 through `accelerate launch --config_file accelerate_configs/
deepspeed_zero{3,2}.yaml` (bf16, as shipped); a ZeRO-3 run that loses one rank (SIGKILL at a random step) and resumed through the
`deepspeed` launcher. The fp32 runs must agree to 1e-4 (the FSDP tests' tolerance); the bf16 runs to 1e-3, since one
process multiplies 4-row and two processes 2-row bf16 batches (different kernel blocking, last-bit differences).

The recipe points parallel.deepspeed_config at a JSON with the ZeRO-3 persistence thresholds at 0: DeepSpeed keeps
every parameter smaller than stage3_param_persistence_threshold (default 1e5 elements) whole on every rank, which
is every parameter of a tiny model; real models' projections are far above it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    REPO,
    RUN_PY,
    addition_rows,
    child_env,
    free_port,
    read_metrics,
    recipe_dict,
    run_cmd,
    torchrun,
    train_losses,
    write_jsonl,
    write_recipe,
)
from safetensors.torch import load_file

from finetune import cli
from finetune.outputs import as_trained, step_folders
from finetune.parallel import zero, zero_checkpoint

pytestmark = [
              pytest.mark.skipif(not zero.installed(), reason="deepspeed not installed (pip install 'finetune[deepspeed]')")]

MAX_STEPS, SAVE_EVERY = 6, 2
TWO = ["train.micro_batch_size=2"]
GENERATION = ["eval.generation_rows=2", "eval.max_new_tokens=3"]
BF16 = ["model.dtype=bfloat16"]


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    data = write_jsonl(root / "train.jsonl", addition_rows(48))
    tuning = root / "zero3_tuning.json"
    tuning.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                                        "stage3_model_persistence_threshold": 0}}))
    values = recipe_dict(tiny_llama, data, root / "unused", train={"max_steps": MAX_STEPS, "save_every": SAVE_EVERY,
                                                                   "keep_last": 2, "eval_every": MAX_STEPS})
    values["parallel"] = {"deepspeed_config": str(tuning)}  # read only when the strategy is deepspeed
    return root, write_recipe(root / "recipe.yaml", values)


def _singles(recipe: Path, runs: dict[str, tuple[Path, list[str]]]) -> dict[str, Path]:
    """One-process references, started together (each uses one core). parallel.deepspeed_config applies to DeepSpeed
    runs only: they drop it."""
    started = {name: subprocess.Popen([sys.executable, str(RUN_PY), str(recipe), f"output.dir={out}",
                                       "parallel.deepspeed_config=null", *extra], env=child_env(), cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (out, extra) in runs.items()}
    for name, process in started.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}:\n{stderr[-4000:]}"
    return {name: out for name, (out, _) in runs.items()}


def _accelerate(config: str, recipe: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/CONFIG.yaml finetune/run.py ...`: the shipped file as it is
    (2 processes, bf16), plus the CPU switch the suite gives every shipped config, ACCELERATE_USE_CPU=true. That
    variable makes accelerate's own Accelerator drop DeepSpeed for CPU DDP without a word; finetune drives DeepSpeed
    itself, so the run must still be DeepSpeed (asserted on the runs below)."""
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / f"{config}.yaml"),
            "--main_process_port", str(free_port()), str(RUN_PY), str(recipe), *overrides]
    return run_cmd(args, env=child_env(ACCELERATE_USE_CPU="true"))


def _deepspeed_launcher(recipe: Path, *overrides: str) -> list[str]:
    """`deepspeed --num_gpus 2 finetune/run.py RECIPE ...` (on CPU its workers get --local_rank=N and a gloo group)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
            str(RUN_PY), str(recipe), *overrides]


@pytest.fixture(scope="module")
def runs(setup):
    root, recipe = setup
    # ZeRO-3 runs LoRA through PEFT's forward (the fused path cannot see partitioned weights; lora_fused.py): in bf16
    # its reference is a one-process run on that path too. ZeRO-2 keeps the fused path, like the default reference.
    out = _singles(recipe, {"single": (root / "single", GENERATION), "single_bf16": (root / "single-bf16", BF16),
                            "single_bf16_peft": (root / "single-bf16-peft", [*BF16, "lora.fused=false"])})
    out["zero3"] = root / "zero3"
    _ok(torchrun(recipe, f"output.dir={out['zero3']}", "parallel.strategy=deepspeed", "parallel.zero_stage=3", *TWO, *GENERATION))
    for stage in (3, 2):
        out[f"accelerate_zero{stage}"] = root / f"accelerate-zero{stage}"
        result = _ok(_accelerate(f"deepspeed_zero{stage}", recipe, f"output.dir={out[f'accelerate_zero{stage}']}", *TWO, *BF16))
        assert f"parallel: DeepSpeed ZeRO-{stage} over 2 processes" in result.stdout
        assert "ACCELERATE_USE_CPU: DeepSpeed runs on the CPU" in result.stdout
    return out


def rank_stats(run_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((run_dir / "ranks").glob("rank*.json"))]


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(as_trained(run_dir / "adapter") / "adapter_model.safetensors"))


# ------------------------------------------------------------------------------------------------ the runs
@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "accelerate_zero3", "accelerate_zero2"])
def test_two_deepspeed_ranks(runs, name):
    stats = rank_stats(runs[name])
    assert [(s["rank"], s["world_size"], s["strategy"]) for s in stats] == [(0, 2, "deepspeed"), (1, 2, "deepspeed")]
    if name == "accelerate_zero2":  # each rank's own full LoRA replica (ZeRO-3's is gathered: equal by construction)
        assert len({s["lora_checksum"] for s in stats}) == 1
    assert "DeepSpeed ZeRO-" in json.loads((runs[name] / "checkpoints" / f"step-{MAX_STEPS:08d}" / "trainer_state.json")
                                           .read_text())["strategy"]


@pytest.mark.slow
@pytest.mark.parametrize("name,reference,tolerance", [("zero3", "single", 1e-4), ("accelerate_zero3", "single_bf16_peft", 1e-3),
                                                      ("accelerate_zero2", "single_bf16", 1e-3)])
def test_loss_curve_equals_one_process(runs, name, reference, tolerance):
    losses = train_losses(runs[name])
    assert len(losses) == MAX_STEPS and losses[-1] < losses[0]
    assert losses == pytest.approx(train_losses(runs[reference]), abs=tolerance)
    norms = [m["grad_norm"] for m in read_metrics(runs[name]) if "grad_norm" in m]
    reference_norms = [m["grad_norm"] for m in read_metrics(runs[reference]) if "grad_norm" in m]
    assert all(n > 0 for n in norms) and norms == pytest.approx(reference_norms, rel=20 * tolerance)


@pytest.mark.slow
def test_zero3_cpu_offload_runs_its_code_and_trains_the_same(setup, runs):
    """ZeRO-3 with optimizer and parameter offload on a CPU-only machine: DeepSpeed's offload code runs (its CPU
    accelerator pins nothing) instead of being switched off, with the losses and adapter of the run without offload.
    The checkpoint's DeepSpeed config shows what the engine was given."""
    root, recipe = setup
    out = root / "zero3-offload"
    result = _ok(torchrun(recipe, f"output.dir={out}", "parallel.strategy=deepspeed", "parallel.zero_stage=3",
                          "parallel.cpu_offload=true", *TWO, *GENERATION))
    assert "optimizer and parameters offloaded to CPU" in result.stdout
    assert "the offload code runs, but saves no memory here" in result.stdout
    state = next((out / "checkpoints" / f"step-{MAX_STEPS:08d}").rglob("zero_pp_rank_0_mp_rank_00_model_states.pt"))
    zero = torch.load(state, weights_only=False)["ds_config"]["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu", zero
    assert train_losses(out) == pytest.approx(train_losses(runs["zero3"]), abs=1e-5)
    got, reference = adapter(out), adapter(runs["zero3"])
    assert got.keys() == reference.keys() and all(torch.allclose(got[k], reference[k], atol=1e-5) for k in got)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "accelerate_zero3"])
def test_zero3_ranks_hold_half_of_the_4bit_base(runs, name):
    """Measured from DeepSpeed's partitions (`ds_tensor` of every parameter), after training, eval and generation."""
    whole = rank_stats(runs["single" if name == "zero3" else "single_bf16"])[0]["frozen_bytes"]
    for stats in rank_stats(runs[name]):
        assert stats["gathered_bytes"] == 0, stats  # nothing stays gathered between steps
        assert stats["packed_4bit_whole_bytes"] > 0
        # Each parameter's partition is padded to a multiple of the world size: "half, give or take a few elements".
        assert 0.5 <= stats["packed_4bit_bytes"] / stats["packed_4bit_whole_bytes"] <= 0.51, stats
        assert 0.45 * whole <= stats["frozen_bytes"] <= 0.56 * whole, (stats, whole)


@pytest.mark.slow
def test_planner_predicts_the_measured_zero3_partitions(runs, setup):
    """planner.held_parameter_bytes for ZeRO-3 (threshold 0, as in this recipe's JSON) = DeepSpeed's own partitions."""
    from transformers import AutoConfig

    from finetune.planner import facts_from_config, held_parameter_bytes
    from finetune.recipe import load_recipe

    recipe = load_recipe(str(setup[1]), [])
    facts = facts_from_config(AutoConfig.from_pretrained(recipe.model.name_or_path), recipe)
    predicted = held_parameter_bytes(facts, strategy="zero3", world_size=2, persistence_threshold=0)
    for stats in rank_stats(runs["zero3"]):
        assert (stats["frozen_bytes"], stats["trainable_bytes"]) == (predicted["frozen_bytes"], predicted["trainable_bytes"])


@pytest.mark.slow
def test_zero2_ranks_hold_the_whole_base(runs):
    whole = rank_stats(runs["single_bf16"])[0]["frozen_bytes"]
    assert all(s["frozen_bytes"] == whole and s["gathered_bytes"] == 0 for s in rank_stats(runs["accelerate_zero2"]))


@pytest.mark.slow
@pytest.mark.parametrize("name,reference,tolerance", [("zero3", "single", 1e-4), ("accelerate_zero3", "single_bf16_peft", 5e-3),
                                                      ("accelerate_zero2", "single_bf16", 5e-3)])
def test_adapter_gathered_from_partitions(runs, name, reference, tolerance):
    """A plain PEFT adapter: every tensor whole (none empty), every lora_B moved off its zero init (its gradient
    arrived), the same values as one process's (bf16: the last-bit differences of the losses, through 8 Adam steps,
    measured up to 3.2e-3 on LoRA values of ~1e-2; a lost gradient or a wrong gather is off by the whole value)."""
    tensors, expected = adapter(runs[name]), adapter(runs[reference])
    assert tensors.keys() == expected.keys() and len(tensors) == 28
    for key, value in tensors.items():
        assert value.numel() > 0 and value.shape == expected[key].shape, key
        if "lora_B" in key:
            assert value.abs().sum() > 0, f"{key} never received a gradient"
        torch.testing.assert_close(value, expected[key], atol=tolerance, rtol=0)


@pytest.mark.slow
def test_adapter_reloads_with_plain_peft_to_the_trained_model(runs, setup):
    """transformers + BitsAndBytesConfig + PeftModel.from_pretrained: the held-out loss the run logged at its last step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from finetune import data, model, training
    from finetune.recipe import load_recipe

    _, recipe_path = setup
    recipe = load_recipe(str(recipe_path), [f"output.dir={runs['zero3']}"])
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=torch.float32, quantization_config=quantization)
    model.keep_4bit_weights_trainable_on_cpu(base)
    peft_model = PeftModel.from_pretrained(base, str(runs["zero3"] / "adapter"))
    tokenizer = AutoTokenizer.from_pretrained(str(runs["zero3"] / "adapter"))
    _, eval_examples, _ = data.build_examples(recipe, tokenizer)
    logged = [m["eval_loss"] for m in read_metrics(runs["zero3"]) if "eval_loss" in m][-1]
    assert training.evaluate(peft_model, eval_examples, recipe, pad_id=tokenizer.pad_token_id) == pytest.approx(logged, abs=1e-5)
    # and an oracle that is not the function that logged it (found by a bug bash: the two sides above are one
    # computation): F.cross_entropy summed over every trained token of the eval rows, one row at a time, over their count
    total, count = 0.0, 0
    with torch.no_grad():
        for example in eval_examples:
            logits = peft_model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1].float()
            labels = torch.tensor(example.labels[1:])
            total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    assert count > 0 and total / count == pytest.approx(logged, abs=1e-4)


@pytest.mark.slow
def test_generation_eval_under_zero3_answers_like_one_process(runs):
    """Greedy generation before and after training with ZeRO-3 partitions (fixed-length decoding on every rank)."""
    def answers(run_dir):
        return [(m["phase"], m["generation_sample"]["generated"]) for m in read_metrics(run_dir) if "generation_score" in m]

    assert [phase for phase, _ in answers(runs["zero3"])] == ["before", "after"]
    assert answers(runs["zero3"]) == answers(runs["single"])


# ------------------------------------------------------------------------------------------ kill and resume
@pytest.mark.slow
def test_sigkill_then_resume_through_the_deepspeed_launcher_is_exact(setup, runs, tmp_path):
    """torchrun ZeRO-3, one worker SIGKILLed at a random step (the launcher ends the job); `deepspeed` resumes it from DeepSpeed's checkpoint: the
    same losses and, bitwise, the same adapter as the uninterrupted ZeRO-3 run."""
    from processes import finish, kill_plan, start, wait_for_step, worker_pids

    from finetune import model, outputs
    from finetune.errors import CheckpointError
    from finetune.outputs import checkpoint_load, step_folders
    from finetune.recipe import load_recipe

    _, recipe = setup
    run = tmp_path / "run"
    overrides = [f"output.dir={run}", "parallel.strategy=deepspeed", *TWO]  # greedy generation changes no state: left out
    log = tmp_path / "killed.log"
    process = start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                     str(RUN_PY), str(recipe), *overrides], log)
    step, rank, note = kill_plan("zero3-one-rank", SAVE_EVERY + 1, MAX_STEPS - 1, ranks=2)
    wait_for_step(process, run, step, log)
    workers = worker_pids(process.pid)
    os.kill(workers[rank], signal.SIGKILL)  # one worker: torchrun ends the job, a survivor names the dead rank
    code = process.wait(timeout=40)
    died = log.read_text()
    assert code != 0 and f"rank {rank} (pid {workers[rank]} on " in died and "lost a peer" in died, (note, died[-3000:])
    assert not (run / "adapter").exists(), f"the run finished before the kill landed ({note})"
    saved = step_folders.newest_good_checkpoint(run)  # the kill may land inside a save: that one is skipped on resume
    assert saved is not None
    files = {p.name for p in (saved / zero_checkpoint.CHECKPOINT_FOLDER / zero_checkpoint.CHECKPOINT_TAG).iterdir()}
    # One ZeRO partition of the fp32 LoRA weights and AdamW moments per rank (DeepSpeed's format, not DCP).
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files, files
    shutil.copytree(run, tmp_path / "killed")

    code, output = finish(start(_deepspeed_launcher(recipe, *overrides, "train.resume=auto"), tmp_path / "resumed.log"),
                          tmp_path / "resumed.log")
    assert code == 0, output[-3000:]
    assert f"resumed from {saved}" in output
    assert train_losses(run) == train_losses(runs["zero3"])
    reference = adapter(runs["zero3"])
    for key, value in adapter(run).items():
        assert torch.equal(value, reference[key]), key

    # A DeepSpeed checkpoint loads only into DeepSpeed: a one-process model without it refuses it before reading any
    # tensor (in this process: the same CheckpointError run.py turns into exit 2).
    one = load_recipe(str(recipe), [f"output.dir={tmp_path / 'killed'}", "parallel.deepspeed_config=null"])
    peft_model = model.build_model(one, device=torch.device("cpu"), gradient_checkpointing=False)
    names = set(outputs.adapter_key_map(peft_model))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad])
    before = _snapshot(tmp_path / "killed")
    with pytest.raises(CheckpointError, match="resume it with DeepSpeed at the ZeRO stage that wrote it"):
        checkpoint_load.load_checkpoint(tmp_path / "killed" / saved.relative_to(run), peft_model, optimizer, names)
    assert _snapshot(tmp_path / "killed") == before

    # ZeRO-3 on another number of ranks (2 -> 1, the same global batch of 4 rows): converted to DeepSpeed's universal
    # checkpoint, said so, and the run continues within FSDP's resharded-resume tolerance of the uninterrupted runs.
    result = _ok(torchrun(recipe, f"output.dir={tmp_path / 'killed'}", "parallel.strategy=deepspeed", "train.resume=auto",
                          nproc=1))
    assert "written by 2 ranks, this run has 1: converted to DeepSpeed's universal checkpoint" in result.stdout
    assert "now DeepSpeed ZeRO-3 over 1 process: adapter and optimizer state resharded" in result.stdout
    assert not list((tmp_path / "killed" / "checkpoints").glob(".*")), "the converted copy is removed"
    for reference in (runs["zero3"], runs["single"]):
        torch.testing.assert_close(adapter(tmp_path / "killed"), adapter(reference), rtol=1e-3, atol=5e-4)


@pytest.mark.slow
def test_nan_loss_under_zero3_stops_before_the_update(setup, tmp_path):
    """ZeRO computes the gradient norm inside its step and skips an update whose norm is NaN/inf; the loop then applies
    train.nan_policy (stop): no NaN reaches a checkpoint or the adapter."""

    _, recipe = setup
    run = tmp_path / "run"
    result = torchrun(recipe, f"output.dir={run}", "parallel.strategy=deepspeed", *TWO, "train.max_steps=3",
                      "train.learning_rate=1e30", "train.save_every=1")
    assert result.returncode != 0 and "is not finite; stopped before the optimizer step" in result.stderr, result.stderr[-3000:]
    assert not (run / "adapter").exists()
    checkpoints = step_folders.list_checkpoints(run)
    assert checkpoints and all(step_folders.checkpoint_problem(path) is None for _, path in checkpoints)


# ------------------------------------------------------------------------------------- pre-flight refusals
def _snapshot(root: Path) -> list[str]:
    """Every file and its size, but the lock a killed run leaves behind (the next run clears it)."""
    return sorted(f"{p}:{p.stat().st_size}" for p in root.rglob("*") if p.is_file() and p.name != ".finetune.lock")


@pytest.fixture
def workspace(setup, tmp_path):
    _, recipe = setup
    values = yaml.safe_load(recipe.read_text())
    values["output"]["dir"] = str(tmp_path / "out")
    values["parallel"] = {}
    return tmp_path, values


def _write_json(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# name -> (files to write {name: text}, accelerate config or None, extra argv, text the message must hold)
PREFLIGHT = {
    "invalid JSON": ({"ds.json": '{"zero_optimization": {"stage": 3,}}'}, "deepspeed_zero3", ["parallel.deepspeed_config=ds.json"],
                     "ds.json is not valid JSON (line 1"),
    "ZeRO stage 1": ({"ds.json": '{"zero_optimization": {"stage": 1}}'}, None,
                     ["parallel.strategy=deepspeed", "parallel.deepspeed_config=ds.json"], "zero_optimization.stage is 1"),
    "stages disagree": ({"ds.json": '{"zero_optimization": {"stage": 3}}'}, "deepspeed_zero2", ["parallel.deepspeed_config=ds.json"],
                        "the ZeRO stage disagrees"),
    "NVMe offload": ({"ds.json": '{"zero_optimization": {"offload_param": {"device": "nvme"}}}'}, "deepspeed_zero3",
                     ["parallel.deepspeed_config=ds.json"], "zero_optimization.offload_param.device is `nvme`"),
    "param offload under ZeRO-2": ({"ds.json": '{"zero_optimization": {"offload_param": {"device": "cpu"}}}'}, "deepspeed_zero2",
                                   ["parallel.deepspeed_config=ds.json"], "parameter offload (offload_param) needs ZeRO stage 3"),
    "key the installed DeepSpeed does not know": ({"ds.json": '{"zero_optimization": {"stage3_param_persistance": 0}}'},
                                                  "deepspeed_zero3", ["parallel.deepspeed_config=ds.json"],
                                                  "zero_optimization.stage3_param_persistance: Extra inputs are not permitted"),
    "batch size disagrees": ({"ds.json": '{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"}'},
                             "deepspeed_zero3", ["parallel.deepspeed_config=ds.json"],
                             "ds.json: train_micro_batch_size_per_gpu is 8 but the recipe gives 4 (train.micro_batch_size)"),
    "DeepSpeed optimizer": ({"ds.json": '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}'}, "deepspeed_zero3",
                            ["parallel.deepspeed_config=ds.json"], "the `optimizer` section is not used"),
    "bf16 section": ({"ds.json": '{"bf16": {"enabled": true}}'}, "deepspeed_zero3", ["parallel.deepspeed_config=ds.json"],
                     "`bf16.enabled: true` would cast the model"),
    "8-bit optimizer": ({}, "deepspeed_zero3", ["train.optimizer=adamw_8bit"], "train.optimizer `adamw_8bit`"),
    # ZeRO++ int8 weight quantization would round the packed 4-bit bytes on every gather (issue: GPU path, round 2).
    "ZeRO++ quantized weights": ({"ds.json": '{"zero_optimization": {"zero_quantized_weights": true}}'}, "deepspeed_zero3",
                                 ["parallel.deepspeed_config=ds.json"], "zero_optimization.zero_quantized_weights: true would"),
    "ZeRO++ quantized frozen weights": ({"ds.json": '{"zero_optimization": {"zero_quantized_nontrainable_weights": true}}'},
                                        "deepspeed_zero3", ["parallel.deepspeed_config=ds.json"],
                                        "zero_quantized_nontrainable_weights: true would int8-quantize"),
    # A user's config that states bf16 (the shipped ones leave the dtype to the recipe) against an explicit float32:
    # the refusal speaks of DeepSpeed, the config's own engine.
    "mixed precision vs model dtype": ({"zero3-bf16.yaml": (REPO / "accelerate_configs" / "deepspeed_zero3.yaml").read_text()
                                        + "mixed_precision: bf16\n"}, "zero3-bf16.yaml", ["model.dtype=float32"],
                                       "mixed_precision: bf16 but the recipe has model.dtype: float32: DeepSpeed would"),
    # Found by a bug bash (bb49 #2): accepted, then step 1's backward failed on both ranks with a traceback.
    "DoRA on a 4-bit base under ZeRO-3": ({}, "deepspeed_zero3", ["lora.dora=true"],
                                          "lora.dora with a 4-bit base under ZeRO-3"),
    "strategy contradicts the config": ({}, "deepspeed_zero3", ["parallel.strategy=fsdp"],
                                        "the accelerate config is a DeepSpeed config"),
    "ZeRO keys without DeepSpeed": ({}, None, ["parallel.strategy=ddp", "parallel.zero_stage=3"],
                                    "parallel.zero_stage / parallel.deepspeed_config are set but the strategy is ddp"),
    "missing config file": ({}, "deepspeed_zero3", ["parallel.deepspeed_config=nowhere.json"], "nowhere.json cannot be read"),
}


@pytest.mark.parametrize("name", list(PREFLIGHT))
def test_preflight_refusals(name, workspace, monkeypatch, capsys):
    """`finetune train` runs every check in the parent before launching: exit 2, one paragraph, nothing written."""
    root, values = workspace
    files, config, extra, expected = PREFLIGHT[name]
    for file_name, text in files.items():
        _write_json(root / file_name, text)
    monkeypatch.chdir(root)  # relative config paths resolve against the folder the run starts in
    recipe = write_recipe(root / "recipe.yaml", values)
    before = _snapshot(root)
    config_path = root / config if config and config.endswith(".yaml") else REPO / "accelerate_configs" / f"{config}.yaml"
    argv = ["train", str(recipe), *extra] + (["--accelerate-config", str(config_path)] if config else ["--num-processes", "2"])
    if config is None:  # torchrun-style: no accelerate config, the recipe names the strategy
        argv = ["validate", str(recipe), *extra, "--num-processes", "2"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert expected in err and "Traceback" not in err, err[-2000:]
    assert _snapshot(root) == before


def test_deepspeed_not_installed_gives_the_install_hint(workspace, monkeypatch, capsys):
    root, values = workspace
    monkeypatch.setattr(zero, "installed", lambda: False)
    recipe = write_recipe(root / "recipe.yaml", values)
    code = cli.main(["train", str(recipe), "--accelerate-config", str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'finetune[deepspeed]'" in err and "Traceback" not in err


@pytest.mark.slow
def test_import_finetune_does_not_need_deepspeed():
    """`import finetune` and every stage module work where deepspeed is not installed (imports blocked here)."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'deepspeed' or name.startswith('deepspeed.'):\n"
            "            raise ImportError('blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import finetune, finetune.run, finetune.parallel, finetune.training, finetune.outputs.checkpoint, finetune.cli\n"
            "from finetune.parallel import zero\n"
            "assert 'deepspeed' not in sys.modules\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_deepspeed_older_than_the_tested_floor_is_refused_before_loading(workspace, monkeypatch, capsys):
    """DeepSpeed <= 0.19.2 fails ZeRO-3 on the mixed fp32/bf16 gather (seen by `make test-compat`): refused up front."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.2" if name == "deepspeed" else real(name))
    root, values = workspace
    recipe = write_recipe(root / "recipe.yaml", values)
    code = cli.main(["train", str(recipe), "--accelerate-config", str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "DeepSpeed 0.19.2 is installed; finetune needs 0.19.3 or newer" in err and "Traceback" not in err
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.3" if name == "deepspeed" else real(name))
    assert zero.too_old() is None
