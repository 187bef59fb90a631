"""The `finetune` command inside scripts (bug bash bb29): a reader of stdout that stops early (`| head`, `| grep -q`),
`plan --json` as a CI gate, `quickstart --out`, and the command line's usage conventions. Each test failed on the code
before its fix. In-process through `finetune.cli.main`, but for what a real process's streams do (the slow ones).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, addition_rows, child_env, recipe_dict, write_jsonl, write_recipe

from finetune import cli, quiet
from finetune.errors import FinetuneError


@pytest.fixture
def recipe(tiny_llama, tmp_path):
    return write_recipe(tmp_path / "recipe.yaml",
                        recipe_dict(tiny_llama, write_jsonl(tmp_path / "rows.jsonl", addition_rows(16)), tmp_path / "out"))


# ------------------------------------------------------------------------------ 1: a reader that stops early
def _reader_gone(command: list[str], env: dict) -> subprocess.CompletedProcess:
    """`command` with its stdout a pipe whose reader has already gone (as `head -1` or `grep -q` after its match)."""
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300,
                                 cwd=REPO, check=False)
    finally:
        os.close(write)
    return process


def test_output_whose_reader_has_gone_is_dropped(monkeypatch):
    """Found by a bug bash: every write to a closed stdout raised BrokenPipeError, which ended a listing with a
    traceback and exit 1, and a run at its next log line. Now the first such write points the descriptor at
    os.devnull: that line and every later one are dropped, and the process goes on."""
    read, write = os.pipe()
    os.close(read)
    stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(write, "wb", closefd=True)), encoding="utf-8",
                              errors="backslashreplace")
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "__stdout__", stream)  # the process's own stdout: the one that is guarded
    quiet.drop_output_nobody_reads()
    guarded = sys.stdout
    assert guarded is not stream and guarded.errors == "backslashreplace" and guarded.fileno() == write
    for number in range(3):
        print(f"line {number}", flush=True)  # BrokenPipeError here before
    assert os.readlink(f"/proc/self/fd/{write}") == os.devnull
    monkeypatch.undo()
    stream.close()


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "buffered"), [(["--version"], False), (["recipes", "list"], False),
                                                (["models"], True)], ids=["version", "recipes-list", "models-buffered"])
def test_a_listing_whose_reader_stops_early_ends_quietly_with_0(argv, buffered):
    """Found by a bug bash: `finetune recipes list | grep -q NAME` and `finetune --version | grep -q torch` exited 1
    with a BrokenPipeError traceback, which fails a script under `set -o pipefail` although grep found its match.
    Buffered (no PYTHONUNBUFFERED), the same once a listing is longer than the buffer (`finetune models`: 37 kB)."""
    env = child_env()
    if buffered:
        env.pop("PYTHONUNBUFFERED")
    result = _reader_gone([sys.executable, "-m", "finetune", *argv], env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_a_run_goes_on_when_the_reader_of_its_stdout_has_gone(recipe, tmp_path):
    """Found by a bug bash: `finetune train r.yaml | head -2` killed the run at its third line (print0's
    BrokenPipeError), before its first step. Its lines are dropped now and the run ends as it would have."""
    result = _reader_gone([sys.executable, "-m", "finetune", "train", str(recipe)], child_env())
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------ 4: plan --json as a gate
def _plan_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0  # a plan was made, fits or not (docs/planner.md)
    return json.loads(capsys.readouterr().out)


def test_plan_json_fits_is_the_verdict_on_the_recipe_as_written(capsys):
    """Found by a bug bash: `plan --json` carried only auto's choice, so `finetune plan r.yaml --gpus 2 --json | jq -e
    .fits` passed a recipe whose own parallel.strategy (DDP of a 70B on 2 x 24 GiB) is 21.6 GiB short."""
    ddp = _plan_json(capsys, "llama-3.1-70b", "parallel.strategy=ddp", "--gpus", "2", "--gpu-memory", "24GiB")
    asked = ddp["recipe_strategy"]
    assert (ddp["fits"], ddp["auto_fits"], ddp["chosen"]) == (False, True, "fsdp_offload")
    assert (asked["strategy"], asked["estimate"], asked["fits"]) == ("ddp", "ddp", False)
    row = next(e for e in ddp["estimates"] if e["strategy"] == "ddp")
    assert asked["short_bytes"] > 20 * 2**30 and asked["needs_bytes"] == max(row["peak_bytes"], row["load_peak_bytes"])
    assert "does not fit (21.6 GiB short)" in asked["summary"]
    auto = _plan_json(capsys, "llama-3.1-70b", "parallel.strategy=auto", "--gpus", "2", "--gpu-memory", "24GiB")
    assert auto["recipe_strategy"] is None and auto["fits"] is auto["auto_fits"] is True
    unplanned = _plan_json(capsys, "llama-3.1-70b", "parallel.strategy=layer_split", "--gpus", "1")
    assert unplanned["fits"] is False and unplanned["recipe_strategy"]["estimate"] is None
    assert "not planned on 1 GPU(s)" in unplanned["recipe_strategy"]["summary"]


# ------------------------------------------------------------------------------ 5: quickstart --out
def test_quickstart_writes_where_it_is_told_even_the_default_folder(tmp_path, monkeypatch, capsys):
    """Found by a bug bash: `finetune quickstart --dpo --out runs/quickstart` wrote runs/quickstart-dpo (and so did
    `output.dir=runs/quickstart`), since the value was compared with the default string instead of asking whether
    --out was given. The defaults without --out stay as they were."""
    from finetune.cli import quickstart

    seen = []

    def stop(out, run_dirs, overrides):
        seen.append(str(out))
        raise FinetuneError("stopped before anything is written")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quickstart, "check_out", stop)
    asked = {("--dpo", "--out", "runs/quickstart"): "runs/quickstart",
             ("--grpo", "output.dir=runs/quickstart"): "runs/quickstart", ("--dpo",): "runs/quickstart-dpo",
             ("--grpo",): "runs/quickstart-grpo", (): "runs/quickstart"}
    for argv in asked:
        assert cli.main(["quickstart", "--tiny", *argv]) == 2
    assert seen == list(asked.values()), capsys.readouterr().err


# ------------------------------------------------------------------------------ 6: the command line's conventions
def test_no_verb_is_a_usage_error_on_stderr(capsys):
    """Found by a bug bash: `finetune` alone printed the whole help to stdout and exited 2 (a usage error belongs on
    stderr; argparse's convention: the usage and one error line)."""
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: finetune ") and "finetune: error: a verb is needed" in err


@pytest.mark.parametrize("argv", [["validate", "r.yaml", "--bogus"], ["recipes", "list", "extra"],
                                  ["recipes", "show", "quickstart", "extra"]], ids=lambda argv: "-".join(argv))
def test_an_argument_a_verb_does_not_take_is_refused_with_the_verbs_usage(argv, capsys):
    """Found by a bug bash: an unknown option after a verb showed the top-level usage, not the verb's; and
    `finetune recipes list extra` / `recipes show quickstart extra` were accepted (exit 0)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"usage: finetune {argv[0]} ")
    assert f"finetune {argv[0]}: error: unrecognized arguments: {argv[-1]}" in err


def test_checkpoints_of_a_file_and_runs_of_a_missing_path_say_so(tmp_path, capsys):
    """Found by a bug bash: `finetune checkpoints train.jsonl` said "train.jsonl: not found" of a file that exists, and
    `finetune runs /no/such/dir` said "no MLflow store in /no/such/dir"."""
    rows = write_jsonl(tmp_path / "train.jsonl", addition_rows(2))
    assert cli.main(["checkpoints", str(rows)]) == 2
    assert f"{rows}: is a file, not a run folder" in capsys.readouterr().err
    assert cli.main(["runs", str(tmp_path / "no-such-dir")]) == 2
    assert f"{tmp_path / 'no-such-dir'}: no such file or folder" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_data_marks_trained_spans_without_colour_when_asked(recipe, monkeypatch):
    """Found by a bug bash: on a terminal `finetune data` marked trained spans with ANSI green alone, NO_COLOR and
    TERM=dumb notwithstanding: on a dumb terminal the trained span could not be seen. Now the `[[ ]]` marks."""
    for env, colour in (({"TERM": "xterm"}, True), ({"NO_COLOR": "1", "TERM": "xterm"}, False), ({"TERM": "dumb"}, False)):
        monkeypatch.delenv("NO_COLOR", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        assert cli.main(["data", str(recipe), "--rows", "1"]) == 0
        shown = terminal.getvalue()
        assert ("\033[32m" in shown) is colour and ("[[" in shown) is not colour, (env, shown)


def test_generate_max_new_tokens_says_its_default():
    """Found by a bug bash: `finetune generate --help` gave --max-new-tokens no help, so its default (64) was unseen."""
    from finetune.cli.command import build_parser

    text = " ".join(build_parser().verb_parsers["generate"].format_help().split())
    assert "--max-new-tokens MAX_NEW_TOKENS new tokens per reply at most (default 64)" in text


def test_a_train_that_ended_well_says_the_commands_that_use_its_adapter(tmp_path, capsys):
    """Found by a bug bash: `finetune train` ended on its JSON `done:` line alone, with nothing of what to do next
    (the quickstart says it). One line now names generate and export on the run folder; a failed run says nothing."""
    from finetune.cli.train import _said_next

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: m}\ndata: {datasets: [{path: d.jsonl}]}\noutput: {dir: runs/a}\n",
                      encoding="utf-8")
    assert _said_next(0, str(recipe), [f"output.dir={tmp_path / 'b'}"]) == 0
    said = capsys.readouterr().out
    assert f"[finetune] next: finetune generate {tmp_path / 'b'} --prompt" in said, said
    assert f"finetune export {tmp_path / 'b'} {tmp_path / 'b'}-merged --merge" in said, said
    assert _said_next(2, str(recipe), []) == 2 and capsys.readouterr().out == ""
