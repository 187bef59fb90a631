"""Quiet by default (finetune/quiet.py): a run shows finetune's own lines, the libraries' noise only with --verbose;
and DeepSpeed, and torch's compiler (which bitsandbytes' import-time torch.compile calls would load), are imported only
by processes that use them (real 2-process DDP, real export)."""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import addition_rows, child_env, free_port, recipe_dict, run_cmd, write_jsonl, write_recipe

NOISE = ("FutureWarning", "Failed to load CPU gemm_4bit_forward", "Loading weights", "real_accelerator")
WORKER = """
import json, os, sys
from finetune.run import main
code = main(sys.argv[1:])
rank = os.environ["RANK"]
open(os.path.join(os.environ["REPORT_DIR"], f"rank{rank}.json"), "w").write(json.dumps(
    {"code": code, "deepspeed": "deepspeed" in sys.modules, "accelerate": "accelerate" in sys.modules,
     "compiler": "torch._inductor.compile_fx" in sys.modules, "bitsandbytes": "bitsandbytes" in sys.modules}))
"""


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", addition_rows(32))
    return write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_llama, data, tmp_path / "run", train={"max_steps": 2},
                                                        lora={"dropout": 0.05}))


@pytest.mark.slow
def test_a_run_prints_only_its_own_lines_unless_verbose(recipe):
    # cold (not warm): the import-time noise is part of what a user's terminal shows
    quiet = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe)], warm=False)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert not [word for word in NOISE if word in quiet.stdout + quiet.stderr], quiet.stderr[-2000:]
    loud = run_cmd([sys.executable, "-m", "finetune", "train", str(recipe), "output.overwrite=true", "--verbose"],
                   warm=False)
    assert loud.returncode == 0 and "is_gradient_checkpointing" in loud.stderr, loud.stderr[-2000:]


@pytest.mark.slow
def test_ddp_and_export_never_import_deepspeed_or_the_compiler(recipe, tmp_path):
    pytest.importorskip("deepspeed")  # installed (make install does): the case where an import could happen
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            str(worker), str(recipe), "parallel.strategy=ddp"]
    result = run_cmd(args, env=child_env(REPORT_DIR=str(tmp_path)), warm=False)  # what each rank imports itself
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # accelerate is imported (it asks); bitsandbytes is, and its kernels' torch.compile calls wait for a first use
        assert report == {"code": 0, "deepspeed": False, "accelerate": True, "compiler": False, "bitsandbytes": True}, report
    export = ("import sys\nfrom finetune.cli import main\n"
              f"code = main(['export', {str(tmp_path / 'run')!r}, {str(tmp_path / 'merged')!r}, '--merge'])\n"
              "print('RESULT', code, 'deepspeed' in sys.modules, 'torch._inductor.compile_fx' in sys.modules)\n")
    result = run_cmd([sys.executable, "-c", export], warm=False)
    assert "RESULT 0 False False" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_deferred_compile_compiles_once_at_the_first_call():
    from finetune.quiet import compile_on_first_call

    calls = []

    def compile_(fn, **options):
        calls.append(options)
        return lambda *args: ("compiled", fn(*args))

    deferred = compile_on_first_call(compile_)
    add_one = deferred(lambda x: x + 1, dynamic=False)
    double = deferred(dynamic=True)(lambda x: 2 * x)  # the decorator form
    assert calls == []
    assert add_one(1) == ("compiled", 2) and add_one(2) == ("compiled", 3) and double(3) == ("compiled", 6)
    assert calls == [{"dynamic": False}, {"dynamic": True}]



FSDP1_NOISE = ("FutureWarning", "UserWarning", "state_dict_type", "ShardedTensor", "NO_SHARD", "publisher trust check")


@pytest.mark.slow
def test_an_fsdp1_run_is_quiet_unless_verbose(recipe, strategy_runs, shipped_run):
    """FSDP1 (gloo): torch's FSDP.state_dict_type() and ShardedTensor FutureWarnings, said at every checkpoint save by
    every process, and the NO_SHARD UserWarnings of a one-process run stay out of the output; FINETUNE_VERBOSE=1 (what
    --verbose sets for the processes a launch starts) lets them through. Two processes: the suite's shared FSDP1 runs,
    through torchrun (tests/conftest.py strategy_runs, fp32) and through the shipped fsdp1.yaml (shipped_run: bf16, the
    library's LoRA dropout 0.05); one process: this recipe (dropout 0.05) through torchrun, quiet and verbose."""
    from conftest import RUN_PY, strategy_output

    def launch(nproc: int, **env: str):
        args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                str(RUN_PY), str(recipe), "parallel.strategy=fsdp", "parallel.fsdp_version=1",
                f"train.micro_batch_size={4 // nproc}", "output.overwrite=true"]
        result = run_cmd(args, env=child_env(**env), warm=False)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    _, shipped = shipped_run("fsdp1", "llama", True)
    assert shipped.returncode == 0, shipped.stderr[-3000:]
    # strategy_runs' torchrun launch is warm (its import-time lines are the server's); the shipped fsdp1.yaml run is
    # `accelerate launch` itself, and launch() below is cold: the import-time noise is checked there
    two_processes = {"torchrun": strategy_output(strategy_runs["fsdp1"]), "fsdp1.yaml": shipped.stdout + shipped.stderr}
    assert all("parallel: FSDP1 over 2 processes" in output for output in two_processes.values()), two_processes
    for output in [*two_processes.values(), launch(1)]:
        assert not [word for word in FSDP1_NOISE if word in output], output[-4000:]
    loud = launch(1, FINETUNE_VERBOSE="1")
    assert "NO_SHARD" in loud and "FSDP.state_dict_type() and FSDP.set_state_dict_type()" in loud, loud[-3000:]


def test_the_launchers_torchrun_banner_is_filtered_by_its_exact_text(caplog):
    """accelerate's DeepSpeed path starts torchrun in the launcher without OMP_NUM_THREADS: its 4-line banner (and
    DeepSpeed's accelerator line) showed under `finetune train --accelerate-config deepspeed_zero2` (bug bash). The
    launcher (finetune/cli/accelerate_launch.py) installs the filters; torch's own call is the text filtered."""
    import inspect
    import logging

    import torch.distributed.run as torchrun

    from finetune import quiet

    start = quiet._LOGGED["torch.distributed.run"]
    assert start.replace("\n", "\\n") in inspect.getsource(torchrun).replace('"\n            "', "")  # torch's text
    quiet.install()
    logger = torchrun.logger if hasattr(torchrun, "logger") else logging.getLogger("torch.distributed.run")
    with caplog.at_level(logging.WARNING):
        logger.warning(start + " environment variable for each process to be 1 in default")
        logger.warning("another torchrun warning")
    assert [record.getMessage() for record in caplog.records] == ["another torchrun warning"]
    assert "quiet.install()" in inspect.getsource(__import__("finetune.cli.accelerate_launch", fromlist=["main"]).main)


def test_a_line_printed_while_a_progress_bar_is_drawn_goes_above_the_bar(capsys):
    """On a terminal, the training loop's tqdm bar is drawn on stderr; a log line printed on stdout wrote over it
    (`train:  40%|####      | 4/10 [00:02<...]step 4 loss 2.1`). print0 now has tqdm write it: the bar is cleared,
    the line written, and the bar drawn again below it."""
    from tqdm.auto import tqdm

    from finetune.distributed import print0

    bar = tqdm(total=10, desc="train", file=sys.stderr, disable=False, ascii=True, ncols=60)
    bar.update(4)
    capsys.readouterr()
    print0("step 4 loss 2.1")
    out, err = capsys.readouterr()
    bar.close()
    capsys.readouterr()
    assert out == "step 4 loss 2.1\n"
    assert re.fullmatch(r"\r {60}\r\rtrain:  40%\|.*\| 4/10 \[.*\]", err)  # cleared, then drawn again below
    silent = tqdm(total=10, disable=True)
    print0("no bar drawn", file=sys.stderr)
    silent.close()
    assert capsys.readouterr() == ("", "no bar drawn\n")


@pytest.mark.parametrize("argv", [["validate", "llama-4-scout"], ["plan", "gpt-oss-20b"]], ids=lambda argv: argv[1])
def test_a_stored_configs_transformers_warnings_show_only_with_verbose(argv, monkeypatch, tmp_path):
    """transformers' warnings about two configs as the hub publishes them (Llama 4 Scout's equal rope frequency
    factors; gpt-oss's missing dtype, read through the deprecated `torch_dtype` alias) were printed by validate and plan
    without --verbose: nothing a user can change."""
    import logging

    from transformers.utils import logging as transformers_logging

    from finetune.cli import main

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    # Caught where transformers' own handler sits (a record reaches it past the filters of the logger that says it):
    # its stream is whatever stderr was when transformers was imported, not necessarily this test's.
    library = transformers_logging.get_logger()
    level = library.level
    monkeypatch.delenv("FINETUNE_VERBOSE", raising=False)
    monkeypatch.chdir(tmp_path)
    transformers_logging.warning_once.cache_clear()  # said once per process: an earlier test may have said it
    library.setLevel(logging.WARNING)
    library.addHandler(handler)
    try:
        assert main(argv) == 0
    finally:
        library.removeHandler(handler)
        library.setLevel(level)
    assert not [message for message in said if "rope_parameters" in message or "torch_dtype" in message], said


def test_peft_saying_a_moe_adapters_expert_ranks_were_ignored_is_filtered(tiny_llama):
    """Found by a bug bash: every MoE run and export ended with PEFT's "The following rank_pattern keys did not match
    any targeted module and were ignored" (4 lines), raised by PEFT's conversion while finetune checks the adapter;
    the ranks are applied (outputs/export_experts.py). The filter matches the message PEFT writes."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune import quiet

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    config = LoraConfig(r=4, target_modules=["q_proj"], rank_pattern={r".*\.gate_up_proj": 8},
                        alpha_pattern={r".*\.gate_up_proj": 16})
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        get_peft_model(model, config)
    assert any("rank_pattern keys did not match" in str(w.message) for w in shown)  # PEFT still says it
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for category, message in quiet._WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), config)
    assert not [str(w.message) for w in shown if "_pattern keys" in str(w.message)]
