"""The `finetune` command: train, validate, plan, models, data, export, checkpoints, generate, recipes, runs, quickstart, plot, quantize.

Each verb is a small function here that parses its arguments and calls the module that owns the work; heavy
imports happen inside the verb, so `finetune --help` and `finetune validate` start fast. User mistakes
(FinetuneError) print one paragraph and exit 2; there is no traceback for them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from finetune import hub, quiet
from finetune.cli import quantize
from finetune.cli.library import resolve_accelerate_config, resolve_recipe_path
from finetune.cli.train import cmd_train
from finetune.errors import EXIT_USER_ERROR, FinetuneError, exit_process


def positive_int(text: str, *, least: int = 1) -> int:
    """An argparse type: a whole number of at least `least` (argparse's own error, exit 2, for anything else)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
    return value


def count_int(text: str) -> int:
    """An argparse type: a whole number of 0 or more (`finetune data --rows 0`: the statistics alone)."""
    return positive_int(text, least=0)


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (a path, or the name of a recipe in the library)")
    # default=[]: optional, and not named with `recipe` in argparse's "the following arguments are required" (bb56)
    parser.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides, e.g. train.max_steps=50")


# ----------------------------------------------------------------------------------------------------- verbs
def cmd_validate(args: argparse.Namespace) -> int:
    from finetune.cli.validate import validate

    config = resolve_accelerate_config(args.accelerate_config) if args.accelerate_config else None
    report = validate(resolve_recipe_path(args.recipe), list(args.overrides), num_processes=args.num_processes,
                      accelerate_config=config)
    print(report)
    return 0


def _delegate(module: str, function: str):
    """A verb implemented in the module that owns its work (imported only when the verb runs)."""

    def verb(args: argparse.Namespace) -> int:
        try:
            with quiet.ctrl_c_after_imports():  # a Ctrl-C meanwhile: KeyboardInterrupt, never "not available" (bb29)
                target = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            raise FinetuneError(f"`finetune {args.verb}` is not available in this build ({exc}).") from None
        return int(target(args) or 0)

    return verb


def cmd_tiny_model(args: argparse.Namespace) -> int:
    if args.arch:
        from finetune.cli.tiny_arch import HIDDEN, LAYERS, build_tiny_arch, tiny_arch_types

        if args.arch not in tiny_arch_types():
            raise FinetuneError(f"--arch {args.arch}: not a decoder model type of this transformers (a causal LM, or "
                                f"an image-text-to-text model whose language model is one). Fix: one of "
                                f"{', '.join(tiny_arch_types())}.")
        # transformers' defaults shrunk as a whole (head sizes, experts, latent ranks agree with 2 layers of 64)
        sizes = [f"{flag} {value}" for flag, value, built in (("--layers", args.layers, LAYERS),
                                                              ("--hidden-size", args.hidden_size, HIDDEN))
                 if value is not None and value != built]
        if sizes:
            raise FinetuneError(f"--arch {args.arch} with {' and '.join(sizes)}: --arch builds transformers' default "
                                f"config shrunk to {LAYERS} layers of hidden size {HIDDEN}, the sizes its other "
                                "fields are shrunk to agree with. Fix: drop --layers/--hidden-size, or use --family "
                                "(which takes them).")
        print(f"tiny {args.arch} model + tokenizer written to {build_tiny_arch(args.arch, args.out, force=args.force)}")
        return 0
    from finetune.cli.tiny import build_tiny_model

    path = build_tiny_model(args.out, family=args.family, hidden_size=args.hidden_size or 64,
                            num_layers=args.layers or 2, force=args.force)
    print(f"tiny {args.family} model + tokenizer written to {path}")
    return 0


# ---------------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="QLoRA fine-tuning sharded by FSDP.")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show the libraries' warnings and progress "
                        "bars (anywhere on the line; or FINETUNE_VERBOSE=1)")
    parser.add_argument("--version", action="store_true", help="print the versions of finetune and of the libraries "
                        "it trains with, one a line, and exit")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    parser.verb_parsers = verbs.choices  # each verb's own parser, by name: its usage in the errors _main reports
    _add_run_verbs(verbs)
    _add_look_verbs(verbs)
    _add_output_verbs(verbs)
    quantize.add_parser(verbs, _delegate("finetune.cli.quantize", "cli_quantize"))
    return parser


def _add_run_verbs(verbs) -> None:
    """train, validate: a recipe run, or every check it makes first."""
    p = verbs.add_parser("train", help="train a recipe (one process, or several through accelerate)")
    _add_recipe_args(p)
    p.add_argument("--accelerate-config", help="accelerate config: a file, or a library config by name (fsdp2, fsdp1, ddp, ...); launches "
                   "through `accelerate launch`")
    p.add_argument("--num-processes", type=positive_int, help="processes to launch (with accelerate)")
    p.set_defaults(func=cmd_train)

    p = verbs.add_parser("validate", help="check a recipe (schema, files, parallel setup) without loading weights")
    _add_recipe_args(p)
    p.add_argument("--num-processes", type=positive_int, default=None, help="processes the run will have (default: those of "
                   "the accelerate config the recipe names in its comments, else 1)")
    p.add_argument("--accelerate-config", help="accelerate config (file or library name) the run will use (checked against the recipe)")
    p.set_defaults(func=cmd_validate)


def _add_look_verbs(verbs) -> None:
    """plan, data: what a recipe will cost and what it trains on, before any weight loads."""
    p = verbs.add_parser("plan", help="memory plan: which strategy fits on which GPUs")
    _add_recipe_args(p)
    p.add_argument("--gpus", default=None, help="GPUs per node (default: the processes of the accelerate config the "
                   "recipe names, else 1)")
    p.add_argument("--gpu-memory", default="24GiB", help="memory per GPU, e.g. 24GiB, 80GB (default 24GiB)")
    p.add_argument("--nodes", default=None, help="number of nodes (default: the machines of the accelerate config the "
                   "recipe names, else 1)")
    p.add_argument("--accelerate-config", help="accelerate config (file or library name) the run will use; default: the "
                   "one the recipe names in its `# accelerate config:` comment")
    p.add_argument("--cpu-memory", default=None, help="CPU RAM per node, e.g. 128GiB")
    p.add_argument("--read-bandwidth", default=None, help="what one node reads from the checkpoint's storage per second, "
                   "e.g. 2GB (default 2GB): the load time next to the bytes each rank and node reads")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_delegate("finetune.cli.plan", "cli_plan"))

    p = verbs.add_parser("models", help="the architectures the suite trains (and those refused, with the reason)")
    p.add_argument("--doc", action="store_true", help="print docs/models.md as generated from the table")
    p.set_defaults(func=_delegate("finetune.cli.models", "cli_models"))

    p = verbs.add_parser("data", help="preview rendered examples with trained spans, and data statistics")
    _add_recipe_args(p)
    p.add_argument("--rows", type=count_int, default=3, help="examples to show (default 3)")
    p.add_argument("--num-processes", type=positive_int, default=None, help="processes the run will have, for the steps per "
                   "epoch (default: those of the accelerate config the recipe names in its comments, else 1)")
    p.set_defaults(func=_delegate("finetune.cli.preview", "cli_data"))


def _add_quickstart(verbs) -> None:
    p = verbs.add_parser("quickstart", help="fine-tune a real small model offline and show before/after")
    p.add_argument("--out", default=None, help="run folder (default runs/quickstart, with --dpo runs/quickstart-dpo, "
                   "with --grpo runs/quickstart-grpo)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random model instead (seconds, no learning shown)")
    second = p.add_mutually_exclusive_group()  # one second stage (--dpo --grpo ran GRPO alone without a word)
    second.add_argument("--dpo", action="store_true", help="SFT -> DPO: a short SFT run, then DPO from its adapter on "
                        "preference pairs (default --out runs/quickstart-dpo)")
    second.add_argument("--grpo", action="store_true", help="SFT -> GRPO: a short SFT run, then GRPO from its adapter "
                        "with an exact-match reward, exact match before and after (default --out runs/quickstart-grpo)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_delegate("finetune.cli.quickstart", "cli_quickstart"))


def _add_output_verbs(verbs) -> None:
    """export, checkpoints, generate, recipes, runs, quickstart, plot, tiny-model: what runs produce, and where to start."""
    p = verbs.add_parser("export", help="export a run's adapter, or merge it into a full bf16 model")
    p.add_argument("source", help="run folder, adapter folder, or checkpoint folder (RUN/checkpoints/step-N)")
    p.add_argument("out", help="output folder (must not exist)")
    p.add_argument("--step", type=positive_int, help="the run's kept checkpoint of this step instead of its final adapter "
                   "(`finetune checkpoints RUN` lists them)")
    p.add_argument("--merge", action="store_true", help="merge into the base and save a full model + tokenizer")
    p.add_argument("--base", help="base model folder or hub id (default: from the adapter/run)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload to this hub repo")
    p.set_defaults(func=_delegate("finetune.cli.export", "cli_export"))

    p = verbs.add_parser("checkpoints", help="a run's kept checkpoints with their eval losses (the best marked)")
    p.add_argument("run", help="run folder (output.dir)")
    p.set_defaults(func=_delegate("finetune.cli.export", "cli_checkpoints"))
    p = verbs.add_parser("generate", help="generate with a run's adapter (or chat interactively)")
    p.add_argument("source", help="run folder, adapter folder, or checkpoint folder (RUN/checkpoints/step-N)")
    p.add_argument("--step", type=positive_int, help="the run's kept checkpoint of this step instead of its final adapter")
    p.add_argument("--prompt", action="append", help="prompt (repeatable); none: interactive chat")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens per reply at most (default 64)")
    p.add_argument("--no-adapter", action="store_true", help="the base model alone, for comparison")
    p.add_argument("--base", help="the base model, where it is no longer where the run's recipe.yaml names it")
    p.add_argument("--tools", metavar="FILE", help="tool schemas offered to every prompt (a JSON list, OpenAI's form)")
    p.set_defaults(func=_delegate("finetune.cli.generate", "cli_generate"))

    p = verbs.add_parser("recipes", help="the recipe library: list, show NAME, copy NAME DEST")
    p.add_argument("action", nargs="?", default="list", choices=["list", "show", "copy"])
    p.add_argument("name", nargs="?")
    p.add_argument("dest", nargs="?")
    p.set_defaults(func=_delegate("finetune.cli.library", "cli_recipes"))

    p = verbs.add_parser("runs", help="the runs of an MLflow store (run folders or a URI) with their final losses")
    p.add_argument("where", nargs="*", help="run folder, folder of run folders, or tracking URI (default: "
                   "$MLFLOW_TRACKING_URI, else runs/)")
    p.set_defaults(func=_delegate("finetune.tracking.runs", "cli_runs"))

    _add_quickstart(verbs)

    p = verbs.add_parser("plot", help="plot loss and learning rate of one or more runs into a PNG")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: plot.png in the first run, or compare.png)")
    p.set_defaults(func=_delegate("finetune.tracking.plot", "cli_plot"))

    p = verbs.add_parser("tiny-model", help="write a tiny random-init model + tokenizer (tests, smoke runs)")
    p.add_argument("out")
    p.add_argument("--family", default="llama", choices=["llama", "qwen2", "qwen3", "mistral", "gemma", "mixtral", "qwen3_moe", "gpt_oss",
                                                                 "llama4_text"])
    p.add_argument("--arch", metavar="MODEL_TYPE", help="any transformers decoder model type instead (e.g. gemma3_text, "
                   "qwen3_next, mistral4, glm5_next): transformers' default config of it, shrunk to 2 layers of hidden "
                   "size 64 (--layers and --hidden-size apply to --family only)")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="--family only (default 64)")
    p.add_argument("--layers", type=positive_int, default=None, help="--family only (default 2)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (everything in it is removed)")
    p.set_defaults(func=cmd_tiny_model)


def versions() -> str:
    """finetune's version and the installed versions of the libraries a run's results depend on, one a line (read
    from their metadata: nothing heavy is imported)."""
    from importlib import metadata

    import finetune

    lines = [f"finetune {finetune.__version__}"]
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} not installed")
    return "\n".join(lines)


def _recipes_extra(args: argparse.Namespace) -> str | None:
    """What `finetune recipes` was given beyond its action's arguments (`recipes list extra` listed, exit 0)."""
    takes = {"list": 0, "show": 1, "copy": 2}[args.action]
    given = [value for value in (args.name, args.dest) if value is not None]
    if len(given) > takes:
        wanted = {0: "no other argument", 1: "one NAME", 2: "NAME and DEST"}[takes]
        return f"unrecognized arguments: {' '.join(given[takes:])} (`recipes {args.action}` takes {wanted})"
    return None


def _check_paths(args: argparse.Namespace) -> None:
    """The folders `checkpoints` and `runs` are given, said for what they are: a file given to `checkpoints` was "not
    found", a missing folder given to `runs` had "no MLflow store" (bb29)."""
    if args.verb == "checkpoints" and Path(args.run).expanduser().is_file():
        raise FinetuneError(f"{args.run}: is a file, not a run folder. Fix: pass a run's folder (its output.dir), the "
                            "one that holds checkpoints/.")
    if args.verb == "train":
        _check_streamed_recipe(args)
    given = args.where if args.verb == "runs" else []  # (none given: cli_runs names its default's store)
    for where in given:
        if "://" not in where and not where.startswith("file:") and not Path(where).expanduser().exists():
            raise FinetuneError(f"{where}: no such file or folder. Fix: pass a run folder, a folder of run folders, an "
                                "mlflow.db file, or a tracking URI (sqlite:///path/mlflow.db, http://host:5000).")


def _check_streamed_recipe(args: argparse.Namespace) -> None:
    """A recipe from a pipe (`finetune train <(...)`, /dev/stdin, a FIFO) is read once, here: a launch of several
    processes, each of which reads the recipe again, would find it empty, so it is refused saying so. A run in this
    process reads it (its bytes kept: recipe_library.file_bytes)."""
    from finetune.cli.library import train_launch
    from finetune.recipe_library import streamed

    if streamed(args.recipe) and train_launch(args.recipe, args.accelerate_config, args.num_processes).launches:
        raise FinetuneError(f"{args.recipe}: not a regular file (a pipe: process substitution `<(...)`, /dev/stdin or "
                            "a FIFO), which can be read once, and this launch starts processes that each read the "
                            "recipe again. Fix: save it to a file first (`... > my.yaml`, then `finetune train "
                            "my.yaml`), or run it in this process (without --accelerate-config / --num-processes, and "
                            "without a leading `# accelerate config:` comment, which names a launch).")


def _value_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The options of every verb that take a value (`--gpu-memory`, `--step` ...)."""
    parsers = [parser, *parser.verb_parsers.values()]
    return {flag for each in parsers for action in each._actions if action.option_strings and action.nargs is None
            for flag in action.option_strings}  # (flags such as --json take none: nargs 0)


def _negative_values_joined(argv: list[str], flags: set[str]) -> list[str]:
    """`--gpu-memory -5GB` as `--gpu-memory=-5GB`: argparse takes a value that starts with `-` and is no plain number
    for an option, and said "expected one argument" where the verb's own check says what is wrong with -5GB (bb56)."""
    joined: list[str] = []
    for item in argv:
        negative = len(item) > 1 and item[0] == "-" and (item[1].isdigit() or item[1] == ".")
        if joined and joined[-1] in flags and negative:
            joined[-1] = f"{joined[-1]}={item}"
        else:
            joined.append(item)
    return joined


def main(argv: list[str] | None = None) -> int:
    """The command line: one paragraph and exit 2 for a user's mistake, 130 and one line for Ctrl-C, whenever it comes
    (while torch is still importing too). Called in a process that goes on (a notebook), what a call sets for the
    whole process is put back as it ends: --verbose, the progress bars, the hub's offline switches (bb39: one
    `--verbose` call made every later one verbose)."""
    with quiet.left_as_found(quiet.output_settings, hub.offline_switches):
        return _main_said(argv)


def _main_said(argv: list[str] | None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("finetune: interrupted", file=sys.stderr)
        return 130
    finally:
        # Never imported here: after a Ctrl-C during torch's import, importing it again fails inside torch.
        teardown = getattr(sys.modules.get("finetune.distributed"), "teardown", None)  # absent or half-imported: none
        if teardown is not None:
            teardown()


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not all(item.isascii() for item in argv):  # (recipe.text imports pydantic: not for `finetune --help`)
        from finetune.recipe.text import undecodable_argument

        if problem := undecodable_argument(argv):
            print(f"finetune: error: {problem}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
    if "--verbose" in argv or "-v" in argv:  # anywhere on the line; the processes a launch starts inherit it
        argv = [item for item in argv if item not in ("--verbose", "-v")]
        os.environ[quiet.VERBOSE_ENV] = "1"
    quiet.install()
    quiet.defer_bitsandbytes_compiles()
    parser = build_parser()
    argv = _negative_values_joined(argv, _value_flags(parser))
    # Overrides may come after options (`validate r.yaml --num-processes 2 train.max_steps=5`): collect the leftovers.
    args, extra = parser.parse_known_args(argv)
    verb_parser = parser.verb_parsers.get(args.verb, parser)  # the verb's usage in its errors, as argparse's own
    stray = [item for item in extra if item.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        verb_parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if args.version:
        print(versions())
        return 0
    if not getattr(args, "func", None):  # a usage error: argparse's form, on stderr (the help went to stdout, exit 2)
        parser.print_usage(sys.stderr)
        print("finetune: error: a verb is needed (`finetune --help` lists them)", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if args.verb == "recipes" and (surplus := _recipes_extra(args)):
        verb_parser.error(surplus)
    if args.verb == "generate" and args.no_adapter and args.step is not None:  # --step was passed over in silence
        verb_parser.error(f"--step {args.step} picks a checkpoint's adapter and --no-adapter generates with none: give "
                          "one of them (--no-adapter: the base model alone)")
    try:
        _check_paths(args)
        # torch whole before any verb runs (Ctrl-C held over it); train decides on DeepSpeed in finetune/run.py
        quiet.import_libraries(deepspeed_out=args.verb != "train")
        return args.func(args)
    except FinetuneError as exc:
        code = getattr(exc, "exit_code", EXIT_USER_ERROR)  # preemption: 128 + signal, and not an "error"
        print(f"finetune: {'error: ' if code == EXIT_USER_ERROR else ''}{exc}", file=sys.stderr, flush=True)
        return code


def entry() -> None:
    """The console script `finetune`: main(), then out without the interpreter's slow teardown (errors.exit_process)."""
    quiet.printable_streams()
    exit_process(main())


if __name__ == "__main__":
    entry()
