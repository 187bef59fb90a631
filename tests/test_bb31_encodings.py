"""Text from other systems and locales (bug bash bb31): files saved by Windows editors (a byte-order mark, UTF-16, `\\`
in paths, tabs), file names from macOS (NFD), and processes whose locale is not UTF-8 (LC_ALL=C with PYTHONUTF8=0,
PYTHONIOENCODING=ascii). The locale cases run in a process of their own: a locale is chosen at interpreter start."""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
import unicodedata
import warnings

import pytest
from conftest import REPO, child_env, recipe_dict, write_jsonl, write_recipe

from finetune.chat_templates import named_templates, resolve_chat_template
from finetune.cli import main as cli_main
from finetune.cli.library import describe, named_launch
from finetune.cli.validate import _data_origin
from finetune.data.conversations import dataset_tools
from finetune.data.sources import open_source
from finetune.errors import DataError, RecipeError
from finetune.recipe import DatasetSpec, read_yaml

LAUNCH = "# accelerate config: accelerate_configs/ddp.yaml with num_processes: 2\n"
TOOLS = [{"type": "function", "function": {"name": "wetter", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object", "properties": {}}}}]
CJK_ROWS = [{"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "Grüße 世界"}]}] * 8


def c_locale(**extra: str) -> dict[str, str]:
    """A process in the C locale with Python's UTF-8 mode off: file names, files and stdout in ASCII."""
    env = {name: value for name, value in child_env(**extra).items() if name not in ("LANG", "LC_CTYPE",
                                                                                      "PYTHONIOENCODING")}
    return {**env, "LC_ALL": "C", "PYTHONUTF8": "0", **extra}


def small_python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`script` (ASCII: the C locale's argv cannot carry more) in a process of its own, run from the repository."""
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          encoding="utf-8", errors="replace", timeout=60, check=False)


# ------------------------------------------------------------------------------- files from Windows editors
def test_a_chat_template_file_with_a_bom_renders_without_it(tmp_path):
    """Found by a bug bash: model.chat_template naming a file saved "UTF-8 with BOM" (Notepad, VS Code) put U+FEFF
    before the first turn of every trained example (3 tokens more each), and the adapter's chat_template.jinja kept
    it: the file was read with read_text(), which keeps the mark (data files and recipes drop it)."""
    text = named_templates()["chatml"]
    plain, marked = tmp_path / "plain.jinja", tmp_path / "marked.jinja"
    plain.write_bytes(text.encode("utf-8"))
    marked.write_bytes(codecs.BOM_UTF8 + text.replace("\n", "\r\n").encode("utf-8"))
    assert resolve_chat_template(str(marked)) == resolve_chat_template(str(plain)) == text


def test_the_launch_comment_of_a_recipe_saved_with_a_bom_or_as_utf16_is_read(tmp_path):
    """Found by a bug bash: the recipe loader takes a recipe with a byte-order mark or in UTF-16, but the reader of its
    leading `# accelerate config:` comment did not (its first line was "\\ufeff#", UTF-16 a NUL between every
    letter): `finetune train` ran one process where the recipe names two, and validate said the recipe names no
    config. The "data file is written by" hint was lost alike."""
    body = LAUNCH + "# The data file is written by make_data.py.\nmodel: {name_or_path: some/model}\n"
    for name, raw in (("bom.yaml", codecs.BOM_UTF8 + body.replace("\n", "\r\n").encode("utf-8")),
                      ("utf16.yaml", body.encode("utf-16"))):
        path = tmp_path / name
        path.write_bytes(raw)
        launch = named_launch(path)
        assert launch is not None and (launch.config, launch.num_processes) == ("accelerate_configs/ddp.yaml", 2), name
        assert "make_data.py" in (_data_origin(path) or ""), name


def test_a_library_recipe_saved_as_utf16_is_listed_and_copied_as_utf8(tmp_path, monkeypatch):
    """Found by a bug bash: `finetune recipes` read library files with read_text(): a recipe in UTF-16 (which the
    loader takes) was "not UTF-8 text", one with a byte-order mark kept it before its first comment in a copy."""
    library = tmp_path / "library"
    library.mkdir()
    body = f"{LAUNCH}description: Grüße\nmodel: {{name_or_path: some/model}}\n"
    (library / "wide.yaml").write_bytes(body.encode("utf-16"))
    monkeypatch.setenv("FINETUNE_RECIPES", str(library))
    assert describe(library / "wide.yaml")["description"] == "Grüße"
    assert cli_main(["recipes", "copy", "wide", str(tmp_path / "mine.yaml")]) == 0
    copied = (tmp_path / "mine.yaml").read_bytes()
    assert copied.startswith(b"# accelerate config:") and "Grüße".encode() in copied


def test_a_tools_file_with_a_bom_is_read_and_one_not_utf8_is_named_so(tmp_path):
    """Found by a bug bash: a tools JSON file saved with a byte-order mark was refused with "Fix the path" (json
    refuses the mark); the file from the same editor as the data files, which are read. A file in another encoding
    now says so, with the fix (not "the path")."""
    marked = tmp_path / "tools.json"
    marked.write_bytes(codecs.BOM_UTF8 + json.dumps(TOOLS, ensure_ascii=False).encode("utf-8"))
    assert dataset_tools(DatasetSpec(path="x.jsonl", format="chat", tools=str(marked))) == TOOLS
    latin = tmp_path / "latin.json"
    latin.write_bytes(json.dumps(TOOLS, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text .*save it as UTF-8"):
        dataset_tools(DatasetSpec(path="x.jsonl", format="chat", tools=str(latin)))


def test_the_preflight_check_reads_past_a_bom_where_two_windows_files_were_joined(tmp_path):
    """Found by a bug bash: `cat a.jsonl b.jsonl` of two files saved with a byte-order mark puts the second mark at the
    start of a line in the middle: the pre-flight check of the first lines refused that valid row as "not valid JSON"
    (fix: "delete that line"). The mark is no part of the row, as at the file's start."""
    from finetune.data.sources import check_local_files
    from finetune.recipe import validate_recipe

    joined = tmp_path / "joined.jsonl"
    row = json.dumps(CJK_ROWS[0], ensure_ascii=False).encode() + b"\r\n"
    joined.write_bytes(codecs.BOM_UTF8 + row * 3 + codecs.BOM_UTF8 + row * 3)
    check_local_files(validate_recipe({"model": {"name_or_path": "x"}, "data": {
        "datasets": [{"path": str(joined), "format": "chat"}], "bad_rows": "error"}}))


@pytest.mark.parametrize("text", ["model:\n  name_or_path: x\n\tdtype: auto\n", "model:\n  name_or_path: x\t\n"], ids=["indenting", "trailing"])
def test_a_tab_in_a_recipe_is_said_to_be_replaced_by_spaces(tmp_path, text):
    """Found by a bug bash: a tab indenting a line, or left after a value, was refused with the fix for text that
    needs quotes ("text that starts with [, {, ... goes in quotes"), which does not apply: the fix is spaces."""
    path = tmp_path / "tab.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as caught:
        read_yaml(path)
    assert "replace the tab with spaces" in str(caught.value) and "quotes" not in str(caught.value)


def test_a_windows_path_with_backslashes_says_to_write_slashes(tmp_path, monkeypatch):
    """Found by a bug bash: `path: data\\x.jsonl` (a recipe from Windows) was a plain "file not found", and a folder
    `data\\chats` was looked up as a hub dataset name; neither said that `\\` separates folders only on Windows."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "data" / "x.jsonl", CJK_ROWS)
    write_jsonl(tmp_path / "data" / "chats" / "a.jsonl", CJK_ROWS)
    for written, meant in (("data\\x.jsonl", "data/x.jsonl"), ("data\\chats", "data/chats")):
        with pytest.raises(DataError) as caught:
            open_source(DatasetSpec(path=written, format="chat"))
        message = str(caught.value)
        assert "separates folders on Windows" in message and f"write the path with `/`: `{meant}`" in message
        assert "hub" not in message


def test_a_file_name_in_nfd_is_named_for_the_nfc_path(tmp_path):
    """Found by a bug bash: a file named on macOS (`café.jsonl` stored as e + U+0301, NFD) and the recipe's path typed
    as é (NFC): "file not found", the two names printed alike, and no near name was offered."""
    stored = tmp_path / unicodedata.normalize("NFD", "café.jsonl")
    write_jsonl(stored, CJK_ROWS)
    with pytest.raises(DataError) as caught:
        open_source(DatasetSpec(path=str(tmp_path / unicodedata.normalize("NFC", "café.jsonl")), format="chat"))
    message = str(caught.value)
    assert str(stored) in message and "only in Unicode normalization" in message and "Fix:" in message


def test_a_run_named_in_cjk_plots_without_glyph_warnings(tmp_path):
    """Found by a bug bash: a run folder named `lauf ü 运行 🚀` (the chart's title and legend) added 6 `UserWarning:
    Glyph ... missing from font(s) DejaVu Sans` lines to the end of the run's log. The boxes in the chart are kept."""
    pytest.importorskip("matplotlib")
    from finetune.tracking import plot

    run = tmp_path / "lauf ü 运行 🚀"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s}) + "\n" for s in (1, 2, 3)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plot.plot_runs([run], tmp_path / "plot.png")
    assert [str(w.message) for w in said if "Glyph" in str(w.message)] == []
    assert (tmp_path / "plot.png").stat().st_size > 0


# ------------------------------------------------------------------------------ locales that are not UTF-8
def test_templates_and_template_files_are_utf8_in_a_c_locale(tmp_path):
    """Found by a bug bash: the templates finetune ships (deepseek-r1's `<｜User｜>`, gpt-oss's) and a template file
    were read in the locale's encoding: under LC_ALL=C every recipe that sets model.chat_template was a
    UnicodeDecodeError traceback; under ISO-8859-1 the tokens were mojibake, trained without a word."""
    template = tmp_path / "mine.jinja"
    template.write_bytes(codecs.BOM_UTF8 + "Grüße{% for m in messages %}{{ m.content }}{% endfor %}".encode())
    done = small_python(
        "from finetune.chat_templates import named_templates, resolve_chat_template\n"
        "print('<\\uff5cUser\\uff5c>' in named_templates()['deepseek-r1'])\n"
        f"print(ascii(resolve_chat_template({str(template)!r})[:5]))\n", c_locale())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True", "'Gr\\xfc\\xdfe'"]


def test_paths_a_c_locale_cannot_name_are_one_paragraph_with_the_fix(tmp_path):
    """Found by a bug bash: under LC_ALL=C (PYTHONUTF8=0) a data file in `d ü 数据/` was "file not found" (the file
    exists: is_file() swallowed the UnicodeEncodeError), and an output.dir with an emoji was a UnicodeEncodeError
    traceback (realpath in the recipe's checks). Both are named, with the fix: a UTF-8 locale or PYTHONUTF8=1."""
    data = write_jsonl(tmp_path / "d ü 数据" / "chat.jsonl", CJK_ROWS)
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tmp_path / "no-model", data, tmp_path / "runs" / "r 🚀"))
    done = small_python(
        "from finetune.recipe import load_recipe\nfrom finetune.errors import RecipeError\n"
        f"try:\n    load_recipe({str(recipe)!r})\nexcept RecipeError as exc:\n    print('REFUSED', ascii(str(exc)))\n",
        c_locale())
    assert done.stdout.startswith("REFUSED"), done.stdout + done.stderr
    for key in ("data.datasets[0].path", "output.dir"):
        assert f"{key} `" in done.stdout
    assert done.stdout.count("cannot be written in this locale's encoding (ascii, LC_ALL=C)") == 2
    assert "PYTHONUTF8=1" in done.stdout and "not found" not in done.stdout


def test_a_utf8_file_name_under_a_latin1_locale_is_said_to_exist_in_utf8(tmp_path, monkeypatch):
    """Found by a bug bash (ISO-8859-1 locale): a path with `ü` is written by the locale as other bytes than the UTF-8
    name the file has, so it was "file not found" of a file that `ls` shows; no other locale is made in the tests,
    so the file-name encoding is the locale's as this process reports it."""
    from finetune.recipe.text import locale_path_problem

    (tmp_path / "grüße.jsonl").write_bytes(b"{}\n")
    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "iso8859-1")
    problem = locale_path_problem(str(tmp_path / "grüße.jsonl")) or ""
    assert "exists in UTF-8" in problem and "(iso8859-1" in problem and "PYTHONUTF8=1" in problem
    assert locale_path_problem(str(tmp_path / "nowhere-ü.jsonl")) is None  # no file by either name: not found


def test_an_argument_the_locale_could_not_decode_is_refused(tmp_path, capsys):
    """Found by a bug bash: under LC_ALL=C, `finetune generate RUN --prompt 你好` (and an override such as
    data.system_prompt=Grüße) reached the tokenizer as lone surrogates: a TypeError traceback. Refused with the fix,
    by `finetune` and by finetune/run.py (what a launcher starts)."""
    import finetune.run

    typed = "你好".encode().decode("ascii", "surrogateescape")  # what Python makes of UTF-8 bytes under LC_ALL=C
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", typed]) == 2
    assert finetune.run.main([str(tmp_path / "r.yaml"), f"data.system_prompt={typed}"]) == 2
    err = capsys.readouterr().err
    assert err.count("holds bytes that this locale's encoding") == 2 and "你好" in err and "PYTHONUTF8=1" in err


@pytest.mark.slow
def test_finetune_data_in_a_c_locale_reads_utf8_and_prints_escapes(tiny_qwen2, tmp_path):
    """Found by a bug bash: under LC_ALL=C (PYTHONUTF8=0) `finetune data` of CJK rows was a UnicodeEncodeError
    traceback at its first print, a recipe naming any template one at reading the shipped ones, and a tools file was
    read in the locale's encoding (ISO-8859-1: `für` rendered `fÃ¼r`, and the token cache handed that to later runs
    in any locale). Files are UTF-8 whatever the locale; what the terminal cannot show prints as escapes."""
    data = write_jsonl(tmp_path / "chat.jsonl", CJK_ROWS)
    tools = tmp_path / "tools.json"
    tools.write_bytes(codecs.BOM_UTF8 + json.dumps(TOOLS, ensure_ascii=False).encode("utf-8"))
    values = recipe_dict(tiny_qwen2, data, tmp_path / "runs" / "c", model={"chat_template": "qwen2.5"})
    values["data"].update(eval_fraction=0.0, max_length=2048,
                          datasets=[{"path": str(data), "format": "chat", "tools": str(tools)}])
    recipe = write_recipe(tmp_path / "r.yaml", values)
    done = subprocess.run([sys.executable, "-m", "finetune", "data", str(recipe), "--rows", "1"], cwd=tmp_path,
                          env=c_locale(FINETUNE_CACHE=str(tmp_path / "cache")), capture_output=True, timeout=300,
                          check=False)
    out = done.stdout.decode("ascii")  # nothing but ASCII reached the terminal
    assert done.returncode == 0, done.stderr.decode("ascii", "replace")[-2000:]
    assert "\\u4f60\\u597d" in out and "Wetter f\\xfcr eine Stadt" in out


@pytest.mark.slow
def test_a_launched_rank_prints_what_its_stream_cannot_encode(tiny_qwen2, tmp_path):
    """Found by a bug bash: with PYTHONIOENCODING=ascii (or a locale that is not UTF-8) a rank's print of a path or a
    template's token (`<｜end▁of▁sentence｜>`) was a UnicodeEncodeError that ended the run. finetune/run.py, what
    accelerate and torchrun start, prints it as escapes, as `finetune` does."""
    data = write_jsonl(tmp_path / "chat.jsonl", CJK_ROWS)
    out_dir = tmp_path / "runs" / "运行"
    values = recipe_dict(tiny_qwen2, data, out_dir, train={"max_steps": 1, "micro_batch_size": 2,
                                                           "gradient_checkpointing": False})
    values["data"].update(eval_fraction=0.0, datasets=[{"path": str(data), "format": "chat"}])
    recipe = write_recipe(tmp_path / "r.yaml", values)
    done = subprocess.run([sys.executable, str(REPO / "finetune" / "run.py"), str(recipe)], cwd=tmp_path,
                          env=child_env(PYTHONIOENCODING="ascii", FINETUNE_CACHE=str(tmp_path / "cache")),
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode("ascii", "replace")[-2000:]
    assert "\\u8fd0\\u884c" in done.stdout.decode("ascii") and (out_dir / "adapter").is_dir()

