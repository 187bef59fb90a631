"""The `finetune` command and its verbs. Nothing under finetune/ imports this package (tests/cli/test_library.py).

    command.py     the parser and the dispatch (`finetune.cli:entry` is the console script)
    train.py       `train`: in this process, or launched through accelerate (exit codes, signals, Ctrl-C passed through)
    validate.py    `validate`: every pre-flight check of a run, no weights      plan.py      `plan`, the library table
    preview.py     `data`: rendered examples with their trained spans          library.py   `recipes`: the library
    generate.py    `generate`: prompts or a chat through a run's adapter       quickstart.py `quickstart` (+ tasks.py)
    export.py      `export`: a clean adapter or a verified merge, of a run or a kept checkpoint (--step); `checkpoints`:
                   a run's kept checkpoints with their eval losses (the work is in finetune/outputs/)
    tiny.py        `tiny-model`: tiny random models + tokenizers for tests, smoke runs and benchmarks
    tiny_arch.py   `tiny-model --arch`: a tiny model of any transformers decoder model type, from its own config class
    models.py      `models`: the architectures the suite's matrix trains or refuses (docs/models.md, generated)
    quantize.py    `quantize`: a bf16 base written as a 4-bit checkpoint, or into the quantized cache
"""

from finetune.cli.command import entry, main

__all__ = ["entry", "main"]
