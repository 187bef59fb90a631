"""`finetune validate`: every check a run makes before weights load, without loading weights.

Schema and overrides, the model's config (local folder, or the architecture numbers stored in the repo when the
hub is unreachable), the tokenizer and every data row when they are local, the parallel plan for the number of
processes and the accelerate config the run will use, and the output folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from finetune import data, model, outputs, parallel
from finetune.cli.library import train_launch
from finetune.data.tokenize import check_mapped_columns
from finetune.data.vocab import check_token_ids
from finetune.distributed import DistInfo
from finetune.errors import DataError, FinetuneError, LaunchError
from finetune.model.experts.lora import check_train_router
from finetune.model.loading import check_lora_targets
from finetune.model.quantization import prequantized
from finetune.parallel.launcher import accelerate_launch_forms_group, ignored_environment_note
from finetune.recipe import load_recipe
from finetune.recipe.checks import eval_every_note, output_in_data_problem, steps_per_rows
from finetune.recipe.router_aux import check_router_aux
from finetune.recipe.text import leading_comments


def validate(recipe_path: str, overrides: list[str], *, num_processes: int | None = None,
             accelerate_config: str | None = None, check_data: bool = True, launching: bool = False) -> str:
    """Raise FinetuneError on the first failing stage; return a short report of what was checked. `launching`: the
    check before `finetune train` launches (a multi-machine config that cannot start here is refused, not noted).

    The launch checked is the one `finetune train` makes: the one given (`num_processes`, `accelerate_config`), else
    the one the recipe names in its leading comments (`# accelerate config: accelerate_configs/fsdp2.yaml`, as every
    library recipe does) when it has several processes, else one process; the report says which.
    """
    recipe = load_recipe(recipe_path, overrides)
    try:
        data.check_local_files(recipe)  # a missing or wrong-format data file fails before anything else is read
    except DataError as exc:
        origin = _data_origin(Path(recipe_path))
        raise DataError(f"{exc} {origin}" if origin and "file not found" in str(exc) else str(exc)) from None
    lines = [f"{recipe_path}: recipe OK ({recipe.description or 'no description'})"]
    accelerate_config, num_processes, launch = _launch_checked(recipe_path, accelerate_config, num_processes)
    given = num_processes  # --num-processes overrides the accelerate config's num_processes, as `accelerate launch` does
    num_processes = num_processes or 1

    config, line = _model_checked(recipe)
    lines.append(line)

    launcher = None
    machines = 1
    if accelerate_config:
        env = parallel.accelerate_config_env(accelerate_config)
        if problem := _main_machine_problem(accelerate_config, launching=launching):
            if launching:
                raise FinetuneError(problem)
            lines.append(f"  note: {problem}")
        launcher = parallel.launcher_settings(env)
        num_processes = given or int(env["ACCELERATE_NUM_PROCESSES"])
        machines = max(1, int(env["ACCELERATE_NUM_MACHINES"]))
    _check_split(num_processes, machines, accelerate_config)
    per_machine = num_processes // machines  # what LOCAL_WORLD_SIZE will be: hybrid shard's node size
    # The launched processes' group, as they will have it: several, or one that an FSDP / DeepSpeed / DDP config's
    # launcher starts (a group of 1 rank, which FSDP + CPU offload runs over); none for a run in this process.
    grouped = num_processes > 1 or bool(accelerate_config and accelerate_launch_forms_group(accelerate_config))
    info = DistInfo(rank=0, world_size=num_processes, local_rank=0, local_world_size=per_machine,
                    device=torch.device("cpu"), backend="gloo" if grouped else None)
    plan = parallel.resolve_plan(recipe, info, config, launcher=launcher, config_file=accelerate_config)
    lines.append(f"  launch: {num_processes} process{'es' if num_processes > 1 else ''}, {launch}")
    lines.append(f"  parallel: {plan.describe()}")
    if not accelerate_config and (note := ignored_environment_note()):  # a run in this process: the shell's
        lines.append(f"  note: {note}")

    train_rows = fingerprint = None
    if check_data:
        said, train_rows, fingerprint = _check_data(recipe, num_processes)
        lines += ["  data: " + said[0], *(f"  {line}" for line in said[1:])]
    problem = outputs.output_dir_problem(Path(recipe.output.dir), overwrite=recipe.output.overwrite,
                                            resume=recipe.train.resume)
    problem = problem or _unwritable(Path(recipe.output.dir)) or output_in_data_problem(recipe)
    if problem:
        raise FinetuneError(problem)
    lines.append(f"  output: {recipe.output.dir} is usable")
    if recipe.train.resume is not None:
        lines += _check_resume(recipe, plan, train_rows, fingerprint)
    return "\n".join(lines)


def _check_yaml(config_file: str) -> None:
    """An accelerate config that is not valid YAML, in one paragraph with the line and the fix (the launcher's reader
    gave PyYAML's own three lines, "while parsing a flow node ...", bb56). Anything else: the launcher's reader says."""
    import yaml

    from finetune.recipe.text import yaml_syntax_error

    try:
        yaml.safe_load(Path(config_file).read_text(encoding="utf-8-sig"))
    except yaml.YAMLError as exc:
        raise LaunchError(f"accelerate config {yaml_syntax_error(exc, config_file)}") from None
    except (OSError, ValueError):
        return


def _check_split(num_processes: int, machines: int, accelerate_config) -> None:
    """accelerate starts num_processes // num_machines on each machine: a count that does not split is another run than
    the one checked (bb22: 3 over 2 machines launched 2, and hybrid shard was dropped without a word)."""
    if num_processes % machines:
        raise FinetuneError(
            f"{num_processes} processes do not split over the {machines} machines of {accelerate_config} "
            f"(num_machines: {machines}): accelerate launch starts {num_processes} // {machines} = "
            f"{num_processes // machines} on each machine, {num_processes // machines * machines} in all, another run "
            f"than the one checked. Fix: --num-processes (or the config's num_processes) a multiple of {machines}: the "
            "processes of all the machines together.")


def _model_checked(recipe):
    """The model's config and its report line, after the checks the run makes on them before any weight loads."""
    config = model.load_config(recipe)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: its language model
    line = (f"  model: {recipe.model.name_or_path} ({getattr(config, 'model_type', '?')}, "
            f"{getattr(text, 'num_hidden_layers', '?')} layers) config read, no weights loaded")
    if prequantized.check_local_checkpoint(recipe):
        line += "; a 4-bit checkpoint quantized as the recipe says"
    check_lora_targets(recipe, config)
    check_train_router(recipe, config)  # lora.train_router on a model with no router: the run's refusal, from the config
    data.check_packing_model(recipe, config)
    check_router_aux(recipe, config)
    return config, line


def _launch_checked(recipe_path: str, accelerate_config: str | None, num_processes: int | None):
    """(accelerate config, processes or None, how chosen): the launch `finetune train` makes with these flags (as
    given, else the recipe comment's launch of several processes, else this process alone: cli/library.train_launch)."""
    launch = train_launch(recipe_path, accelerate_config, num_processes)
    if launch.config:
        _check_yaml(launch.config)
    return launch.config, launch.num_processes, launch.how


def _main_machine_problem(config_file: str, *, launching: bool) -> str | None:
    """Why a multi-machine config cannot launch here: main_process_port 0 (the single-machine configs' free port, which
    each machine would pick for itself), or, as machine 0, a main_process_ip that is no address of this machine (the
    template's placeholder 10.0.0.1 made the launcher retry it for 15 minutes, printing C++ stack traces, before any of
    finetune's code ran)."""
    import socket

    import yaml

    config = yaml.safe_load(Path(config_file).read_text(encoding="utf-8-sig")) or {}
    if int(config.get("num_machines", 1) or 1) < 2:
        return None
    if str(config.get("main_process_port")) == "0":
        return (f"accelerate config {config_file}: num_machines {config['num_machines']} with main_process_port 0 (a "
                "free port, which each machine would pick for itself: the machines would never meet). Fix: set "
                "main_process_port to one port open on the main machine, the same in every machine's config (e.g. "
                "29500, as accelerate_configs/multi_node.yaml does).")
    if int(config.get("machine_rank", 0) or 0) != 0:
        return None
    address = str(config.get("main_process_ip") or "")
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))  # only an address of this machine can be bound
        return None
    except OSError:
        pass
    return (
        f"accelerate config {config_file}: machine_rank 0 (this machine, the main one) but main_process_ip "
        f"{address or '(none)'} is not an address of this machine ({socket.gethostname()}), so "
        f"{'' if launching else '`finetune train` here refuses it: '}the launcher would wait for itself there (15 "
        "minutes of retries). Fix: set main_process_ip to this machine's address, reachable from the others "
        "(`hostname -I`), and machine_rank on each machine (0 here); or launch with `accelerate launch --config_file "
        "... --machine_rank N --main_process_ip ADDRESS` (docs/distributed.md, Multi-node).")


def _unwritable(out_dir: Path) -> str | None:
    """The run's own refusal of a folder it cannot write (a read-only mount, another user's folder), said here too:
    the nearest folder that exists must take a write."""
    folder = out_dir.expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    why = "Read-only file system" if _read_only(folder) else "Permission denied"
    return f"output.dir {out_dir}: cannot write there ({why}: {folder}). Fix: choose a writable folder."


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_resume(recipe, plan, train_rows: int | None, fingerprint: str | None) -> list[str]:
    """The checkpoint train.resume names exists, is whole, and fits this run as the run checks it before loading
    (refused: its paragraph; allowed: the changes it notes)."""
    source = outputs.resume_source(recipe)
    if source is None:
        return ["  resume: auto, no checkpoint yet (starts at step 0)"]
    notes = outputs.resume_changes(source, recipe, plan, train_rows=train_rows, train_fingerprint=fingerprint)
    return [f"  resume: from {source}", *(f"    note: {note}" for note in notes)]


def _data_origin(recipe_path: Path) -> str | None:
    """What a recipe's leading comments say about where its data file comes from ("The data file is written by ...")."""
    for line in leading_comments(recipe_path):  # decoded as the loader decodes it (UTF-8 whatever the locale, a BOM)
        if "data file is written by" in line:
            return f"This recipe says: {line.lstrip('# ').strip()} Run that first, or point the path at your own file."
    return None


def _check_data(recipe, num_processes: int) -> tuple[list[str], int | None, str | None]:
    """Tokenize every row when the tokenizer is local (with train.num_epochs, check that an epoch holds a whole
    optimizer step and resolve max_steps, as the run's start does); otherwise check the files and columns only.
    Returns the report line and the run's warnings and notes about the same data and length (`_run_notes`), the
    training rows and their data.rows_fingerprint (None when not counted)."""
    tokenizer_name = recipe.model.tokenizer or recipe.model.name_or_path
    if model.is_local(tokenizer_name):
        tokenizer = model.load_tokenizer(recipe)
        if recipe.data.streaming:  # the first rows of each dataset only: a stream is never read whole
            _, evaluation, stats = data.stream_examples(recipe, tokenizer)
            check_token_ids(recipe, tokenizer)  # (a stream: against the tokenizer's size alone)
            note = eval_every_note(recipe, len(evaluation))
            return ([data.streaming_line(stats, recipe).removeprefix("[finetune] data: "),
                     *([f"note: {note}"] if note else [])], None, None)
        train, evaluation, stats = data.build_examples(recipe, tokenizer)
        check_token_ids(recipe, tokenizer, train, evaluation)  # every id has an embedding row, as the run checks
        packed = f", packed into {stats.train_sequences} rows" if recipe.data.packing else ""
        t = recipe.train
        data.check_enough_rows(stats.train_sequences, micro_batch_size=recipe.rows_per_micro_batch,
                               world_size=num_processes)
        count = data.checked_steps_per_epoch if t.num_epochs is not None else data.steps_per_epoch
        per_epoch = count(stats.train_sequences, micro_batch_size=recipe.rows_per_micro_batch, world_size=num_processes,
                          grad_accum=t.grad_accum, iterations=steps_per_rows(recipe))  # GRPO: x grpo.num_iterations
        known = len(recipe.notes)
        if t.num_epochs is not None:  # the run's max_steps, which a resume compares with its checkpoint's step
            recipe.resolve_num_epochs(per_epoch, launch=f"{num_processes} process{'es' if num_processes > 1 else ''}")
        left = data.rows_left_note(stats.train_sequences, micro_batch_size=recipe.rows_per_micro_batch,
                                   world_size=num_processes, grad_accum=t.grad_accum)
        if recipe.train.num_epochs is None and (note := data.step_over_rows_note(
                stats.train_sequences, micro_batch_size=recipe.rows_per_micro_batch, world_size=num_processes,
                grad_accum=t.grad_accum)):
            left += f"; note: {note}"
        line = (f"{stats.rows} rows -> {stats.train_examples} train / {stats.eval_examples} eval examples{packed} "
                f"({stats.skipped} skipped, {stats.truncated} truncated, {stats.dropped} dropped{data.dropped_note(stats)}; "
                f"batch efficiency {stats.batch_efficiency:.1%}); {per_epoch} steps per epoch{left}")
        return [line, *_run_notes(recipe, stats, recipe.notes[known:])], stats.train_sequences, data.rows_fingerprint(train)
    total, hub = 0, []
    for spec in [*recipe.data.datasets, *recipe.data.eval_datasets]:
        if not Path(spec.path).expanduser().exists():
            hub.append(spec.path)  # a `datasets` hub name: checked when the run loads it
            continue
        rows = data.load_rows(spec)
        check_mapped_columns([row for row in rows[:1000] if isinstance(row, dict)], spec, spec.path,
                             whole=len(rows) <= 1000)
        for number, row in enumerate(rows, start=1):
            data.check_row(row, spec, f"{spec.path} row {number}")
        total += len(rows)
    said = [f"{total} local rows have the fields their format needs"] if total or not hub else []
    if hub:
        said.append(f"{', '.join(hub)}: hub dataset{'s' if len(hub) > 1 else ''}, read when the run starts (not here)")
    return ["; ".join(said) + " (tokenizer not local: rows not tokenized)"], None, None


def _run_notes(recipe, stats, length_notes: list[str]) -> list[str]:
    """What the run prints about the same data and length before its first step, as `warning: ...` / `note: ...`
    lines in the run's own words (bug bash bb64 #3: validate said only "recipe OK"): its data line's warnings and notes
    (eval examples that are training examples too, truncation that cut much of the tokens, the prompts' notes:
    data.data_line), the notes of resolving train.num_epochs (a warmup clamped to the resolved max_steps), and
    train.eval_every with no eval examples (the loop's eval_every_note; train.keep_best too, which needs the evals)."""
    run_lines = data.data_line(stats, recipe).splitlines()[1:]  # after its first line, the counts validate says itself
    lines = [line.removeprefix("[finetune] ") for line in run_lines]
    lines += [f"note: {note}" for note in length_notes]
    if note := eval_every_note(recipe, stats.eval_examples):
        lines.append(f"note: {note}")
    return lines
