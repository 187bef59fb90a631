"""Bug bash bb73 #2: `finetune generate` (or `export`) of the folder `finetune export --merge` wrote said "holds no
adapter ... The run did not finish or saved nothing", a false cause for a complete model; the way that works is the
folder as the base, without an adapter. The oracle for "what works" is the command the message names, as the bug
bash ran it (`finetune generate RUN --no-adapter --base MERGED`)."""
from __future__ import annotations

import json

from finetune.cli import main


def test_a_merged_model_folder_is_named_as_a_model_with_the_command_that_takes_it(tmp_path, capsys):
    merged = tmp_path / "qs-merged"
    merged.mkdir()
    (merged / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (merged / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["generate", str(merged), "--prompt", "hi"]) == 2
    said = capsys.readouterr().err
    assert "holds a whole model" in said and f"--no-adapter --base {merged}" in said, said
    assert "did not finish" not in said
