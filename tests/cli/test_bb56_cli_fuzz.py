"""Bug bash bb56 (fuzzing the command line): tracebacks of `quantize` and `tiny-model`, `plan --gpus 100000` silent for
minutes, `runs file:/missing` creating a store, a recipe from a pipe, a step larger than the data passing `validate`,
and argparse's words where the verb's own were due. In this process, through `finetune.cli.main`: exit 2, one
paragraph, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from conftest import addition_rows, recipe_dict, write_jsonl, write_recipe
from test_newcomer_mistakes import refused

from finetune import cli


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    return write_recipe(tmp_path / "recipe.yaml",
                        recipe_dict(tiny_llama, write_jsonl(tmp_path / "rows.jsonl", addition_rows(16)), tmp_path / "out"))


def usage_error(capsys, *argv: str) -> str:
    """argparse's refusal (exit 2 through SystemExit): its last line."""
    with pytest.raises(SystemExit) as caught:
        cli.main(list(argv))
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------- F2: quantize
def test_quantize_refuses_a_bad_or_missing_device_in_one_paragraph(tiny_llama, tmp_path, capsys):
    """Found by a bug bash: `--device bogus` ended in torch's RuntimeError traceback, `--device cuda` on a machine
    without CUDA in "AssertionError: Torch not compiled with CUDA enabled" (exit 1 both)."""
    said = refused(capsys, "quantize", str(tiny_llama), str(tmp_path / "a"), "--device", "bogus")
    assert "--device bogus: not a device torch knows. Fix: --device cpu" in said, said
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    said = refused(capsys, "quantize", str(tiny_llama), str(tmp_path / "b"), "--device", f"cuda:{count}")
    assert (f"--device cuda:{count}: this machine has no cuda device" in said if count == 0 else
            f"this machine has {count} cuda device" in said), said
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_quantize_refuses_what_is_no_model_folder_in_one_paragraph(tiny_llama, tmp_path, capsys):
    """Found by a bug bash: an adapter folder as the base ended in transformers' "Unrecognized model" ValueError, a
    file or a folder whose config.json is cut short in its OSError, each a traceback with exit 1."""
    adapter = tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_llama)}))
    file = tmp_path / "notamodel.txt"
    file.write_text("x")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "config.json").write_text('{"model_type": ')
    cases = {adapter: f"is a LoRA adapter, not a base model: it holds no base weights to quantize. Fix: quantize the "
                      f"base it was trained on ({tiny_llama})",
             adapter.parent: "is a run folder (its LoRA adapter:",
             file: "is a file, not a model folder. Fix: give the folder of a bf16 model",
             broken: "cannot read the model's config (config.json Expecting value"}
    for base, answer in cases.items():
        said = refused(capsys, "quantize", str(base), str(tmp_path / "out"), "--device", "cpu")
        assert answer in said, said
        assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- F3: plan --gpus
def test_plan_bounds_the_gpus_of_one_node(recipe, capsys):
    """Found by a bug bash: `finetune plan qwen2.5-7b --gpus 100000` ran for more than 300 s without a word (the
    checkpoint reads are counted for every rank of a node). Above 64 GPUs per node: refused at once, with --nodes."""
    started = time.perf_counter()
    said = refused(capsys, "plan", str(recipe), "--gpus", "100000")
    assert time.perf_counter() - started < 5
    assert "--gpus 100000: more GPUs than one machine holds (at most 64" in said and "--gpus 8 --nodes 12500" in said
    assert cli.main(["plan", str(recipe), "--gpus", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"]


# ------------------------------------------------------------------------------------------ F4: runs file:/missing
def test_runs_of_a_missing_file_store_is_refused_without_creating_it(tmp_path, capsys, monkeypatch):
    """Found by a bug bash: `finetune runs file:/tmp/x/mlruns` said "0 runs", exit 0, and MLflow's file store left
    /tmp/x/mlruns/.trash and 0/ behind; a plain path that does not exist was refused."""
    monkeypatch.chdir(tmp_path)
    for uri in (f"file:{tmp_path}/nostore/mlruns", f"file://{tmp_path}/nostore/mlruns", "file:nostore"):
        said = refused(capsys, "runs", uri)
        assert f"{uri}: no such folder" in said and "listing never creates one" in said, said
    assert not (tmp_path / "nostore").exists()


# -------------------------------------------------------------------------------------------- F5: tiny-model sizes
@pytest.mark.parametrize("flags,answer", [
    (["--hidden-size", "65"], "--hidden-size 65 is not a multiple of 8: the model's 4 attention heads"),
    (["--hidden-size", "3"], "--hidden-size 3 is not a multiple of 8"),
    (["--hidden-size", "100000000"], "a model 100000000 wide (--hidden-size) of 2 layers (--layers) is about")])
def test_tiny_model_refuses_sizes_it_cannot_build(flags, answer, tmp_path, capsys):
    """Found by a bug bash: `--hidden-size 65` ended in transformers' StrictDataclassClassValidationError traceback,
    `--hidden-size 100000000` in torch's "can't allocate memory: you tried to allocate 181600000000 bytes"."""
    said = refused(capsys, "tiny-model", str(tmp_path / "tiny"), *flags)
    assert answer in said, said
    assert not (tmp_path / "tiny").exists()


def test_tiny_model_refuses_more_layers_than_the_memory_holds(tmp_path, capsys, monkeypatch):
    """The same bound for --layers, on a machine of 256 MiB (os.sysconf pretends it: 3,000 layers of 64 are ~0.5 GB
    of float32 weights, which the code before built and saved)."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 256 * 2**20 // 4096}
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name] if name in pages else real(name))
    said = refused(capsys, "tiny-model", str(tmp_path / "tiny"), "--layers", "3000")
    assert "a model 64 wide (--hidden-size) of 3000 layers (--layers) is about 1.2e+08 parameters" in said, said
    assert "more than half of this machine's 0.2 GiB of memory" in said and not (tmp_path / "tiny").exists()


# ---------------------------------------------------------------------------------------- F7: a recipe from a pipe
def _pipe(text: str) -> tuple[int, str]:
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    return read, f"/dev/fd/{read}"


def test_a_recipe_from_a_pipe_validates_and_trains_here_but_a_launch_says_why_not(recipe, capsys, launches):
    """Found by a bug bash: `finetune validate <(cat r.yaml)` said "/dev/fd/63: recipe file not found". It is read now;
    `finetune train` of it runs in this process, and a launch, whose processes would each read the pipe again, is
    refused saying so (never "not found")."""
    text = recipe.read_text()
    read, path = _pipe(text)
    try:
        assert cli.main(["validate", path]) == 0
        assert f"{path}: recipe OK" in capsys.readouterr().out
    finally:
        os.close(read)
    read, path = _pipe(text)
    try:
        said = refused(capsys, "train", path, "--num-processes", "2")
        assert f"{path}: not a regular file (a pipe" in said and "save it to a file first" in said, said
        assert launches["launched"] == []
        assert cli.main(["train", path]) == 0
        assert launches["in_process"] == [[path]]
    finally:
        os.close(read)


# --------------------------------------------------------------------------------- F8: a step larger than the data
def test_validate_notes_a_grad_accum_whose_step_outgrows_the_data(recipe, capsys):
    """Found by a bug bash: `validate tinyalp.yaml train.grad_accum=1000000` said "0 steps per epoch" and "recipe OK"
    with no word, and the run then went over 19 rows a million times for one step. A step larger than the data is
    allowed with train.max_steps (docs/data.md: a smoke run of a grad_accum 32 recipe on 40 rows), so validate says it
    in a note with the numbers and the grad_accum that takes each row once."""
    assert cli.main(["validate", str(recipe), "train.grad_accum=1000000"]) == 0
    said = capsys.readouterr().out
    assert "note: one optimizer step takes 4,000,000 rows (4 per micro-batch x 1 process x train.grad_accum 1000000)" \
           " of" in said, said
    assert "train.grad_accum=3 or less takes each row once at most" in said, said
    assert cli.main(["validate", str(recipe), "train.grad_accum=3"]) == 0
    assert "one optimizer step takes" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- F9: the small messages
def test_only_the_recipe_is_named_as_required(capsys):
    """Found by a bug bash: `finetune validate` (plan, data) alone said "the following arguments are required: recipe,
    overrides", but the overrides are optional."""
    for verb in ("validate", "plan", "data"):
        assert usage_error(capsys, verb).endswith("the following arguments are required: recipe")


def test_a_negative_size_gets_the_verbs_own_answer(recipe, capsys):
    """Found by a bug bash: `plan --gpu-memory -5GB` and `--read-bandwidth -1GB` said "expected one argument" (argparse
    took -5GB for an option), where `0` got "must be more than 0"."""
    said = refused(capsys, "plan", str(recipe), "--gpu-memory", "-5GB")
    assert "--gpu-memory '-5GB': a memory size must be more than 0" in said, said
    said = refused(capsys, "plan", str(recipe), "--read-bandwidth", "-1GB")
    assert "--read-bandwidth '-1GB': a memory size must be more than 0" in said, said


def test_a_broken_accelerate_config_is_one_paragraph_with_its_line(recipe, tmp_path, capsys):
    """Found by a bug bash: `--accelerate-config BROKEN.yaml` printed PyYAML's own three lines ("while parsing a flow
    node / expected the node content ..."), with no fix; a recipe's YAML error is one paragraph."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [\n")
    assert cli.main(["validate", str(recipe), "--accelerate-config", str(broken)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the whole paragraph, on its one line
    assert last.startswith(f"finetune: error: accelerate config {broken}: line 2, column 1: YAML syntax error: while "
                           "parsing a flow node, expected the node content"), last
    assert "Fix the YAML at that place" in last



def test_a_broken_accelerate_config_named_by_the_recipe_is_one_paragraph_in_finetune_data(recipe, tmp_path, capsys,
                                                                                            monkeypatch):
    """Found by the last session's note: the launcher's own reader (what `finetune data` and a launch reach through the
    recipe's `# accelerate config:` comment, past validate's check) still printed PyYAML's text in parentheses."""
    (tmp_path / "accelerate_configs").mkdir()
    (tmp_path / "accelerate_configs" / "broken.yaml").write_text("a: [\n")
    named = tmp_path / "named.yaml"
    named.write_text("# accelerate config: accelerate_configs/broken.yaml\n" + recipe.read_text(encoding="utf-8"),
                     encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["data", str(named)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("finetune: error: accelerate config accelerate_configs/broken.yaml: line 2, column 1: YAML "
                           "syntax error: "), last
    assert "Fix the YAML at that place" in last and "while parsing" in last

def test_generate_refuses_a_step_with_no_adapter(tmp_path, capsys):
    """Found by a bug bash: `generate RUN --no-adapter --step 2` said the step's adapter was read from its training
    state, then generated with the base model alone: --step was passed over in silence."""
    line = usage_error(capsys, "generate", str(tmp_path), "--no-adapter", "--step", "2", "--prompt", "hi")
    assert "--step 2 picks a checkpoint's adapter and --no-adapter generates with none" in line, line
