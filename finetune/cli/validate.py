"""`finetune validate`: every check a run makes before weights load, without loading weights.

Schema and overrides, the model's config (local folder, or the architecture numbers stored in the repo when the
hub is unreachable), the tokenizer and every data row when they are local, the parallel plan for the number of
processes and the accelerate config the run will use, and the output folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune import data, model, outputs, parallel
from finetune.distributed import DistInfo
from finetune.errors import FinetuneError
from finetune.recipe import load_recipe


def validate(recipe_path: str, overrides: list[str], *, num_processes: int = 1, accelerate_config: str | None = None,
             check_data: bool = True) -> str:
    """Raise FinetuneError on the first failing stage; return a short report of what was checked."""
    recipe = load_recipe(recipe_path, overrides)
    data.check_local_files(recipe)  # a missing or wrong-format data file fails before anything else is read
    lines = [f"{recipe_path}: recipe OK ({recipe.description or 'no description'})"]

    config = model.load_config(recipe)
    lines.append(f"  model: {recipe.model.name_or_path} ({getattr(config, 'model_type', '?')}, "
                 f"{getattr(config, 'num_hidden_layers', '?')} layers) config read, no weights loaded")

    launcher = None
    if accelerate_config:
        env = parallel.accelerate_config_env(accelerate_config)
        launcher = parallel.launcher_settings(env)
        num_processes = max(num_processes, int(env["ACCELERATE_NUM_PROCESSES"]))
    info = DistInfo(rank=0, world_size=num_processes, local_rank=0, local_world_size=num_processes,
                    device=torch.device("cpu"), backend=None)
    plan = parallel.resolve_plan(recipe, info, config, launcher=launcher)
    lines.append(f"  parallel: {plan.describe()}")

    if check_data:
        lines.append("  data: " + _check_data(recipe))
    problem = outputs.output_dir_problem(Path(recipe.output.dir), overwrite=recipe.output.overwrite,
                                            resume=recipe.train.resume)
    if problem:
        raise FinetuneError(problem)
    lines.append(f"  output: {recipe.output.dir} is usable")
    return "\n".join(lines)


def _check_data(recipe) -> str:
    """Tokenize every row when the tokenizer is local; otherwise check the files and columns only."""
    tokenizer_name = recipe.model.tokenizer or recipe.model.name_or_path
    if model.is_local(tokenizer_name):
        tokenizer = model.load_tokenizer(recipe)
        _, _, stats = data.build_examples(recipe, tokenizer)
        packed = f", packed into {stats.train_sequences} rows" if recipe.data.packing else ""
        return (f"{stats.rows} rows -> {stats.train_examples} train / {stats.eval_examples} eval examples{packed} "
                f"({stats.skipped} skipped, {stats.truncated} truncated, {stats.dropped} dropped; "
                f"batch efficiency {stats.batch_efficiency:.1%})")
    total = 0
    for spec in [*recipe.data.datasets, *recipe.data.eval_datasets]:
        if not Path(spec.path).expanduser().exists():
            continue  # a `datasets` hub name: checked when the run loads it
        rows = data.load_rows(spec)
        for number, row in enumerate(rows, start=1):
            data.check_row(row, spec, f"{spec.path} row {number}")
        total += len(rows)
    return f"{total} local rows have the fields their format needs (tokenizer not local: not tokenized)"
