"""`finetune export SOURCE OUT [--step N] [--merge] [--base B] [--push-to-hub REPO]`: the verb over
finetune/outputs/export.py; `finetune checkpoints RUN`: the kept checkpoints of a run with their eval losses."""

from __future__ import annotations

import argparse
from pathlib import Path

from finetune.files import destination_problem
from finetune.outputs.export import ExportError, check_out_free, export_adapter, export_merged, open_source
from finetune.outputs.publish import push_to_hub


def local_base(base: str | None) -> str | None:
    """--base as the exported adapter_config.json will name it: a local folder by its absolute path (`./rel` written
    as given failed to load from any other folder: bug bash), a hub id as it is."""
    return str(Path(base).expanduser().resolve()) if base and Path(base).expanduser().exists() else base


def cli_export(args: argparse.Namespace) -> int:
    """`finetune export SOURCE OUT [--step N] [--merge] [--base B] [--push-to-hub REPO]`."""
    out = Path(args.out).expanduser()
    check_out_free(out)
    if problem := destination_problem(out):  # before the work: the system's error came after it, as a traceback
        raise ExportError(f"finetune export: {problem}; nothing was written. Fix: choose another output folder.")
    base = local_base(getattr(args, "base", None))
    with open_source(args.source, step=getattr(args, "step", None), base=base) as source:
        if args.merge:
            print(f"[finetune] merging {source.origin} into {base or source.base_name} (full precision, saved as bf16)")
            report = export_merged(source, out, base=base)
        else:
            report = export_adapter(source, out, base=base)
    print(f"[finetune] exported {'merged model' if args.merge else 'adapter'} to {out}")
    print(f"[finetune] {report}")
    if getattr(args, "push_to_hub", None):
        print(f"[finetune] {push_to_hub(out, args.push_to_hub)}")
    return 0


def cli_checkpoints(args: argparse.Namespace) -> int:
    """`finetune checkpoints RUN`: step, eval loss, train loss, state and size of every kept checkpoint; the best marked."""
    from finetune.outputs.run_folder import running_owner
    from finetune.outputs.step_folders import checkpoints_table

    run = Path(args.run).expanduser()
    print(checkpoints_table(run, running=running_owner(run)))  # a live run's checkpoints: never "damaged" (bb29)
    return 0
