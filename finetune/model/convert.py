"""`python -m finetune.model.convert FOLDER`: a checkpoint's pickle shards (pytorch_model*.bin) rewritten as
model*.safetensors beside them, read with torch's weights-only loader (sources/files.py), for the loaders that read
safetensors headers only. A module of its own, which the package does not import: `python -m` of a module the package
has already imported runs it twice (runpy's warning, which `finetune.model.loading` gave)."""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.model.sources.files import convert_to_safetensors


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m finetune.model.convert FOLDER", file=sys.stderr)
        return 2
    for path in convert_to_safetensors(Path(argv[0])):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
