"""`finetune export SOURCE OUT [--merge] [--base B] [--push-to-hub REPO]`: the verb over finetune/outputs/export.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from finetune.outputs.export import check_out_free, export_adapter, export_merged, resolve_source
from finetune.outputs.publish import push_to_hub


def cli_export(args: argparse.Namespace) -> int:
    """`finetune export SOURCE OUT [--merge] [--base B] [--push-to-hub REPO]`."""
    out = Path(args.out).expanduser()
    check_out_free(out)
    source = resolve_source(args.source)
    base = getattr(args, "base", None)
    if args.merge:
        print(
            f"[finetune] merging {source.adapter_dir} into {base or source.base_name} (full precision, saved as bf16)"
        )
        report = export_merged(source, out, base=base)
    else:
        report = export_adapter(source, out, base=base)
    print(f"[finetune] exported {'merged model' if args.merge else 'adapter'} to {out}")
    print(f"[finetune] {report}")
    if getattr(args, "push_to_hub", None):
        print(f"[finetune] {push_to_hub(out, args.push_to_hub)}")
    return 0
