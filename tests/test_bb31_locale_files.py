"""Run, model and launcher files read and written as UTF-8 whatever the locale (bug bash bb31): under LC_ALL=C with
PYTHONUTF8=0, or an ISO-8859-1 locale, `open()` and `read_text()` without an encoding take the locale's, so a run
folder's recipe.yaml, a kept chat template, an accelerate or DeepSpeed config with a comment in German, or a
tokenizer_config.json with DeepSeek's `<｜User｜>` were a UnicodeDecodeError traceback (C) or mojibake (Latin-1).
The locale cases run in a process of their own: a locale is chosen at interpreter start."""

from __future__ import annotations

import ast
import codecs
import json
import subprocess
import sys

import pytest
from conftest import REPO, child_env

from finetune.errors import LaunchError
from finetune.parallel.launcher import accelerate_config_env
from finetune.parallel.zero_json import read_config_file

# Modules of others' areas that still open text files in the locale's encoding; each leaves this list once its every
# open(), read_text() and write_text() names the encoding (recipe.yaml's: outputs/checkpoint.py, run_folder.py,
# resume_checks.py). Every other module is held to it by the test below.
NOT_YET_UTF8: set[str] = set()


def c_locale() -> dict[str, str]:
    """A process in the C locale with Python's UTF-8 mode off: files opened without an encoding are ASCII."""
    env = {name: value for name, value in child_env().items() if name not in ("LANG", "LC_CTYPE", "PYTHONIOENCODING")}
    return {**env, "LC_ALL": "C", "PYTHONUTF8": "0"}


def run_c_locale(script: str, tmp_path) -> list[str]:
    """`script` (ASCII: the C locale's argv cannot carry more) in a C-locale process, given `tmp_path`: its lines."""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=c_locale(), capture_output=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr.decode("ascii", "replace")[-3000:]
    return done.stdout.decode("ascii").splitlines()


def _locale_encoded_calls(path) -> list[str]:
    """The open() / Path.open() / read_text() / write_text() calls of a module that read or write text without naming
    its encoding (binary modes and os.open are not text)."""
    text = path.read_text(encoding="utf-8")
    if not any(name in text for name in ("open(", "read_text(", "write_text(")):
        return []
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call) or any(keyword.arg == "encoding" for keyword in node.keywords):
            continue
        function = node.func
        name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
        if name == "open" and isinstance(function, ast.Attribute) and getattr(function.value, "id", None) == "os":
            continue
        modes = [*node.args[1 if isinstance(function, ast.Name) else 0:][:1],
                 *(keyword.value for keyword in node.keywords if keyword.arg == "mode")]
        binary = any(isinstance(mode, ast.Constant) and "b" in str(mode.value) for mode in modes)
        if name in ("read_text", "write_text") or (name == "open" and not binary):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}()")
    return found


def test_every_text_file_finetune_opens_names_its_encoding():
    """Found by a bug bash: a run's files (recipe.yaml, kept.json, the kept chat_template.jinja), model folders'
    JSON (tokenizer_config.json holds `<｜User｜>` as written), accelerate and DeepSpeed configs were read and written
    in the locale's encoding. Each module now names it (UTF-8); a new call without one is found here."""
    package = REPO / "finetune"
    found = [call for path in sorted(package.rglob("*.py")) if path.relative_to(package).as_posix() not in NOT_YET_UTF8
             for call in _locale_encoded_calls(path)]
    assert found == [], "text opened in the locale's encoding (name encoding=\"utf-8\"):\n" + "\n".join(found)


def test_a_recipe_yaml_keeps_its_text_as_written_and_reads_back_in_a_c_locale(tmp_path):
    """Found by a bug bash: the run folder's recipe.yaml held `data.system_prompt: "Gr\\xFC\\xDFe \\u4F60\\u597D"`
    (PyYAML's escapes: unreadable, and unlike the recipe the user wrote). Written as the text itself it must be UTF-8
    whatever the locale: the writer (files._write_text_atomic) used the locale's encoding, a UnicodeEncodeError under
    LC_ALL=C. A NEL (U+0085), which PyYAML writes unescaped where it reads back as a line break, stays escaped."""
    lines = run_c_locale(
        "import re, sys\nfrom pathlib import Path\n"
        "from finetune.files import _write_text_atomic\n"
        "from finetune.recipe import read_yaml, recipe_to_yaml, validate_recipe\n"
        "path = Path(sys.argv[1]) / 'recipe.yaml'\n"
        "for prompt in ('Gr\\u00fc\\u00dfe \\u4f60\\u597d \\U0001f680', 'a\\x85b'):\n"
        "    recipe = validate_recipe({'model': {'name_or_path': 'x'}, 'train': {'run_name': 'lauf \\u00fc'},\n"
        "                              'data': {'datasets': [{'path': 'x.jsonl'}], 'system_prompt': prompt}},\n"
        "                             dtype_device='gpu')\n"  # (no torch: the CPU's bf16 is not asked)
        "    _write_text_atomic(path, recipe_to_yaml(recipe))\n"
        "    back = validate_recipe(read_yaml(path), dtype_device='gpu')\n"
        "    print(back.model_dump(mode='json') == recipe.model_dump(mode='json'), ascii(back.data.system_prompt))\n"
        "    written = path.read_bytes().decode('utf-8')\n"
        "    keys = ('^  system_prompt: (.*)$', 'run_name: (.*)')\n"
        "    shown = (re.search(pattern, written, re.M)[1] for pattern in keys)\n"
        "    print(*map(ascii, shown))\n",
        tmp_path)
    assert lines == ["True 'Gr\\xfc\\xdfe \\u4f60\\u597d \\U0001f680'",
                     "'Gr\\xfc\\xdfe \\u4f60\\u597d \\U0001f680' 'lauf \\xfc'",
                     "True 'a\\x85b'", "'\"a\\\\Nb\"' '\"lauf \\\\xFC\"'"]  # a NEL: all escaped, as before


def test_accelerate_and_deepspeed_configs_in_another_encoding_are_named_so(tmp_path):
    """Found by a bug bash: an accelerate config or a DeepSpeed JSON saved in Windows-1252 (`# für 2 GPUs`) was a
    UnicodeDecodeError traceback at `finetune train`; a DeepSpeed JSON saved "UTF-8 with BOM" was "not valid JSON"
    (which it is: the mark is no part of it). Both read as UTF-8, a byte-order mark dropped; other text is refused
    with the fix."""
    shipped = (REPO / "accelerate_configs" / "ddp.yaml").read_text(encoding="utf-8")
    latin = tmp_path / "ddp.yaml"
    latin.write_bytes(f"# für 2 GPUs\n{shipped}".encode("cp1252"))
    with pytest.raises(LaunchError, match=r"not UTF-8 text \(byte 0xfc at byte 3\)\. Fix: save it as UTF-8"):
        accelerate_config_env(str(latin))
    config = {"_comment": "für ZeRO-2", "zero_optimization": {"stage": 2}}
    marked = tmp_path / "marked.json"
    marked.write_bytes(codecs.BOM_UTF8 + json.dumps(config, ensure_ascii=False).encode("utf-8"))
    assert read_config_file(str(marked), "parallel.deepspeed_config") == config
    marked.write_bytes(json.dumps(config, ensure_ascii=False).encode("cp1252"))
    with pytest.raises(LaunchError, match="parallel.deepspeed_config: DeepSpeed config .* is not UTF-8 text"):
        read_config_file(str(marked), "parallel.deepspeed_config")


@pytest.mark.slow
def test_launcher_configs_kept_templates_and_metrics_are_utf8_in_a_c_locale(tmp_path):
    """Found by a bug bash: under LC_ALL=C (PYTHONUTF8=0) an accelerate config with `# für 2 GPUs` (the shipped
    ddp.yaml and a comment), a DeepSpeed JSON with one, metrics.jsonl with a non-ASCII value, and a start adapter's
    chat template (`<｜User｜>`: the run's copy, written and read back, and a tokenizer_config.json's) were each a
    UnicodeDecodeError traceback; the tokenizer_config.json's template was dropped without a word."""
    shipped = (REPO / "accelerate_configs" / "ddp.yaml").read_text(encoding="utf-8")
    (tmp_path / "ddp.yaml").write_bytes(f"# für 2 GPUs ✓\n{shipped}".encode())
    (tmp_path / "zero.json").write_bytes('{"_comment": "für", "zero_optimization": {"stage": 2}}'.encode())
    (tmp_path / "metrics.jsonl").write_bytes('{"step": 1, "loss": 2.0, "note": "für"}\n'.encode())
    template = "<｜User｜>{% for m in messages %}{{ m.content }}{% endfor %}"
    adapter, tokenizer = tmp_path / "adapter", tmp_path / "tokenizer"
    adapter.mkdir()
    tokenizer.mkdir()
    (adapter / "adapter_config.json").write_bytes(b'{"r": 8}')
    (adapter / "chat_template.jinja").write_bytes(template.encode())
    (tokenizer / "tokenizer_config.json").write_bytes(json.dumps({"chat_template": template}, ensure_ascii=False)
                                                      .encode())
    lines = run_c_locale(
        "import sys\nfrom pathlib import Path\n"
        "from finetune.model.lora import kept\n"
        "from finetune.parallel.launcher import accelerate_config_env, accelerate_launch_forms_group\n"
        "from finetune.parallel.zero_json import read_config_file\n"
        "from finetune.tracking.metrics_file import read_records\n"
        "tmp = Path(sys.argv[1])\n"
        "print(accelerate_config_env(str(tmp / 'ddp.yaml'))['ACCELERATE_NUM_PROCESSES'],\n"
        "      accelerate_launch_forms_group(str(tmp / 'ddp.yaml')))\n"
        "print(ascii(read_config_file(str(tmp / 'zero.json'), 'parallel.deepspeed_config')['_comment']))\n"
        "print(ascii(read_records(tmp / 'metrics.jsonl')[0]['note']))\n"
        "run = tmp / 'run'\nrun.mkdir()\n"
        "recipe_yaml = f'model:\\n  adapter: {tmp / \"adapter\"}\\ndata:\\n  system_prompt: Gr\\u00fc\\u00dfe\\n'\n"
        "kept.keep_start(run, recipe_yaml)\n"
        "(run / 'recipe.yaml').write_bytes(recipe_yaml.encode('utf-8'))\n"
        "print(ascii(kept.saved_template([run / kept.KEPT])[0][:8]), kept._names_adapter(run, str(tmp / 'adapter')),\n"
        "      kept._kept_record(run / kept.KEPT) is not None)\n"
        "print(ascii(kept.saved_template([tmp / 'tokenizer'])[0][:8]))\n",
        tmp_path)
    assert lines == ["2 True", "'f\\xfcr'", "'f\\xfcr'", "'<\\uff5cUser\\uff5c>' True True", "'<\\uff5cUser\\uff5c>'"]
