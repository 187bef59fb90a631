"""The spine of a run: recipe -> model (4-bit base + LoRA) -> parallel wrap -> data -> train -> adapter.

    accelerate launch [--config_file accelerate_configs/fsdp2.yaml] finetune/run.py RECIPE.yaml [key.path=value ...]
    torchrun --standalone --nproc_per_node 2 finetune/run.py RECIPE.yaml ...
    deepspeed --num_gpus 2 finetune/run.py RECIPE.yaml parallel.strategy=deepspeed ...
    finetune train RECIPE.yaml ...          (same function, one process)

From an installed package (no checkout): the module, `accelerate launch -m finetune.run`, `torchrun ... -m
finetune.run`, `deepspeed ... --module finetune.run`; `--help` prints the form that works from where it runs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    # Started as a script: put the repository root (not finetune/) on the path so `finetune` is the package.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

try:
    from finetune import quiet

    with quiet.ctrl_c_after_imports():  # torch swallowed a Ctrl-C while importing numpy, leaving it half imported (bb29)
        from finetune import distributed, held_signals, host_memory, hub, rank_errors, rendezvous
        from finetune.errors import EXIT_USER_ERROR, FinetuneError, exit_process
except KeyboardInterrupt:  # Ctrl-C in a launch's first seconds, while torch imports: no traceback from any rank
    if __name__ != "__main__":
        raise
    if os.environ.get("RANK", "0") in ("", "0"):
        print("finetune: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def run(recipe_path: str, overrides: list[str]) -> dict:
    """Train one recipe end to end in this process (one rank of the launcher's group); returns a summary. A process
    that goes on (a notebook, a sweep script) is left as the call found it, however it ends: the random generators,
    SIGINT and SIGTERM's handlers, the hub's offline switches, the progress bars (`_LEFT_AS_FOUND`)."""
    with quiet.left_as_found(*_LEFT_AS_FOUND), held_signals.released_as_it_ends():
        return _run(recipe_path, overrides)


def _run(recipe_path: str, overrides: list[str]) -> dict:
    """The spine, recipe to adapter (run() without the caller's state kept; main() keeps it and the signals itself)."""
    from finetune import data, model, outputs, parallel, tracking, training
    from finetune.data.vocab import check_token_ids

    recipe = _checked_recipe(recipe_path, overrides)
    info = distributed.init_distributed(timeout_s=recipe.parallel.collective_timeout_s)
    _same_run_on_every_rank(recipe, info)  # every machine has the same recipe: a stale one trained apart
    with outputs.claim_output_dir(recipe) as folder, _lost_peers_named(folder.path):  # checked before anything loads
        out_dir = folder.path
        distributed.check_same_folder(out_dir, "output.dir")  # one folder every machine sees, not a node-local path
        plan = _checked_plan(recipe, info)  # the recipe against the model's config: no weight read yet
        tokenizer = model.load_tokenizer(recipe)
        train_examples, eval_examples = _built_data(recipe, tokenizer, info)  # the same rows on every rank
        check_token_ids(recipe, tokenizer, train_examples, eval_examples)  # an id past the embedding: refused here
        host_memory.bound_heap_growth_for(plan.strategy, info.device)  # FSDP on CPU: freed tensors leave the process
        # train.num_epochs -> max_steps (not for a stream); then the checkpoint of a resume fits this run, or one paragraph
        training.resolve_length(recipe, train_examples, plan, resume_from=folder.resume_from)
        distributed.seed_everything(recipe.train.seed)  # same LoRA init on every rank
        with quiet.one_thread_importing():
            model.import_backends()  # so the RSS baseline below is the runtime's own, not half-imported
        rss_before_model = outputs.current_rss_bytes()
        # Under FSDP a meta-device skeleton: the wrap builds and shards one decoder layer at a time.
        loaded = model.load_model(recipe, sharded=plan.sharded_loading, device=info.device, device_map=plan.device_map,
                                  gradient_checkpointing=plan.activation_checkpointing, shard=plan.own_shard(info.rank))
        peft_model = model.with_score_head(loaded.model, recipe, info.device)  # train.objective reward: its head
        trainable, total = model.count_parameters(peft_model)
        distributed.print0(f"[finetune] model: {total:,} stored parameters, {trainable:,} trainable (LoRA)")
        key_map = outputs.adapter_key_map(peft_model)  # before wrapping (FSDP1 changes module names)
        wrapped = parallel.wrap(peft_model, plan, info, materialize=loaded.materialize)
        model.release_freed_memory(info.device)  # what loading and wrapping freed goes back to the OS (and CUDA)
        distributed.check_same_on_all_ranks(loaded.lora_checksum(), "the initial LoRA weights (train.seed)")
        held = parallel.local_parameter_bytes(wrapped)  # before any forward: FSDP1 keeps its root unit whole after one
        if recipe.data.packing:
            data.verify_packing(wrapped, device=info.device)  # the attention really keeps packed examples apart
        distributed.print0(f"[finetune] ready: rank 0 holds {held['frozen_bytes'] / 2**20:,.1f} MiB of the base and "
                           f"{held['trainable_bytes'] / 2**20:,.1f} MiB of LoRA")  # under FSDP, loading ends here
        rank_stats = {"rank": info.rank, "world_size": info.world_size, "strategy": plan.strategy,
                      "rss_before_model_bytes": rss_before_model, "checkpoint_bytes_read": loaded.bytes_read, **held}
        distributed.seed_everything(recipe.train.seed + info.rank)  # dropout differs per rank
        result = training.train(wrapped, recipe, train_examples, eval_examples, pad_id=tokenizer.pad_token_id,
                                out_dir=out_dir, trainable_names=list(key_map), resume_from=folder.resume_from,
                                parallel=plan.describe(), tokenizer=tokenizer)
        distributed.doing("the gather of the trained adapter")
        state = parallel.trainable_state_dict(wrapped, key_map)  # collective: every rank takes part
        outputs.write_rank_stats(out_dir, rank_stats, state)
        if info.is_main:  # a mixture-of-experts run: adapter-as-trained/ now, adapter/ (PEFT's form) after the barrier
            outputs.save_run_adapter(model.adapter_config(peft_model, recipe), key_map, state, out_dir, tokenizer, recipe)
        distributed.barrier()
        if info.is_main:  # the rest is rank 0's alone: no rank waits on it (a large MoE's export takes minutes)
            outputs.finish_run_adapter(out_dir, recipe)
            tracking.finish_run(out_dir)  # plot.png (loss, eval, learning rate); adapter, recipe, plot into MLflow
    best_step = outputs.report_best_eval(out_dir, result.eval_losses)  # the lowest eval loss: its step and checkpoint
    summary = {"steps": result.steps, "first_loss": result.losses[0] if result.losses else None,
               "last_loss": result.losses[-1] if result.losses else None,
               "eval_loss": result.eval_losses[-1][1] if result.eval_losses else None, "best_eval_step": best_step,
               "tokens_per_s": round(result.tokens_per_s, 1) or None, "adapter": str(out_dir / "adapter"),
               **({"skipped_steps": result.skipped_steps} if result.skipped_steps else {})}
    distributed.print0(f"[finetune] done: {json.dumps(summary)}")  # JSON: what a script reads of the run (bb29)
    return summary


def _random_state():
    """A snapshot for quiet.left_as_found: the random generators a run seeds (train.seed, then + rank), which the
    caller gets back as they were, CUDA's too where it is initialized. A notebook's random search drew the same
    "random" hyperparameters on every trial after the first (bb39). The run's own draws are unchanged."""
    import random

    import numpy as np
    import torch

    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    lazy = getattr(torch.cuda, "_lazy_seed_tracker", None)  # CUDA not initialized: torch.manual_seed queues its seed
    queued = dict(vars(lazy)) if lazy is not None and cuda is None else None

    def put_back() -> None:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif queued is not None and not torch.cuda.is_initialized():  # the run's seed is not the caller's first draw
            vars(lazy).update(queued)

    return put_back


# What a call from a process that goes on leaves as it found it (quiet.left_as_found).
_LEFT_AS_FOUND = (_random_state, quiet.output_settings, hub.offline_switches)


def _same_run_on_every_rank(recipe, info) -> None:
    """The resolved recipe, compared over the ranks before anything loads (the finetune code was, as the group formed:
    rendezvous.py): each machine of a run has its own recipe file and command line, and one stale machine trained
    its own way, silently or until a misleading error."""
    if info.world_size > 1:
        distributed.check_same_run({"recipe": rendezvous.recipe_facts(recipe.model_dump(mode="json"))})


def _built_data(recipe, tokenizer, info):
    """The training and eval examples and their stats, the same rows on every rank (each machine of a run reads its
    own copy of the files), and the run's line about them. A stream's rows are read, tokenized and packed while
    training (data/streaming.py)."""
    from finetune import data

    streaming = recipe.data.streaming
    train_examples, eval_examples, stats = (data.stream_examples if streaming else data.build_examples)(recipe, tokenizer)
    if info.world_size > 1:
        distributed.check_same_run({"data": _data_facts(train_examples, eval_examples, stats, streaming=streaming)})
    distributed.print0((data.streaming_line if streaming else data.data_line)(stats, recipe))
    return train_examples, eval_examples


def _data_facts(train_examples, eval_examples, stats, *, streaming: bool) -> dict[str, str]:
    """What every rank must share of its data (rendezvous.runs_differ names what differs): each file's rows and
    examples, and the tokens of the eval rows and of the training rows (a stream's are read while training)."""
    from finetune.data import rows_fingerprint

    facts = {"eval rows": rendezvous.DIGEST + rows_fingerprint(list(eval_examples))}  # few: not the stores they are in
    if not streaming:
        facts["training rows"] = rendezvous.DIGEST + rows_fingerprint(train_examples)
    counted = {"train": 0, "eval": 0}
    for entry in stats.per_dataset:
        role = "eval" if entry.get("role") == "eval" else "train"
        facts[f"data.{'eval_' * (role == 'eval')}datasets[{counted[role]}]"] = (f"{entry.get('rows')} rows, "
                                                                                f"{entry.get('examples')} examples")
        counted[role] += 1
    return facts


def _checked_plan(recipe, info):
    """The parallel plan, reported, after the checks of the recipe against the model's config that every rank makes
    alike before any weight loads (held signals: a rank that fails one first must not cut rank 0's paragraph short)."""
    from finetune import data, model, parallel
    from finetune.recipe.router_aux import check_router_aux

    quiet.import_run_libraries()  # once, one thread at a time: runs started at once from threads raced (bb39)
    with held_signals.checks_every_rank_makes():
        config = model.load_config(recipe)
        plan = parallel.resolve_plan(recipe, info, config)
        data.check_packing_model(recipe, config)  # verify_packing checks the loaded model again
        check_router_aux(recipe, config)  # the run asks again with the loaded model's class
    if plan.strategy != "deepspeed":
        quiet.keep_deepspeed_out()
    parallel.report(plan)
    return plan


def _checked_recipe(recipe_path: str, overrides: list[str]):
    """The recipe, its data files checked (missing / wrong format: exit 2 before anything loads)."""
    from finetune import data
    from finetune import recipe as recipes

    with held_signals.checks_every_rank_makes():  # a peer that fails first must not cut rank 0's paragraph short
        recipe = recipes.load_recipe(recipe_path, overrides)
        data.check_local_files(recipe)
    return recipe


@contextmanager
def _lost_peers_named(out_dir: Path) -> Iterator[None]:
    """A collective that failed because a peer died or stopped becomes one paragraph naming that peer (PeerLost)."""
    try:
        yield
    except BaseException as exc:
        if not distributed.is_communication_failure(exc):
            raise
        held_signals.hold_stop_signals()  # released once main() has printed the paragraph
        from finetune import outputs

        raise distributed.peer_failure(exc, checkpoints=outputs.newest_kept(out_dir)) from None


def _attach_diagnostics() -> None:
    """The tensor-bytes meter around the steps FINETUNE_MEASURE_STEP names (training/tensor_bytes.py): a diagnostic
    the loop does not import; attached to its step hooks only when asked for."""
    if os.environ.get("FINETUNE_MEASURE_STEP"):
        from finetune.training import tensor_bytes

        tensor_bytes.attach()


def usage() -> str:
    """How to launch a run, in the form that works from here: the checkout's files, or the installed module and the
    library's accelerate configs by name (errors.run_script)."""
    from finetune.errors import in_checkout, run_script, torchrun_line

    config = "accelerate_configs/fsdp2.yaml" if in_checkout() else "CONFIG.yaml"
    return "\n".join([
        "The spine of a run: recipe -> model (4-bit base + LoRA) -> parallel wrap -> data -> train -> adapter.", "",
        f"    accelerate launch [--config_file {config}] {run_script()} RECIPE.yaml [key.path=value ...]",
        f"    {torchrun_line('RECIPE.yaml', 2)} ...",
        f"    deepspeed --num_gpus 2 {run_script('deepspeed')} RECIPE.yaml parallel.strategy=deepspeed ...",
        "    finetune train RECIPE.yaml [--accelerate-config NAME --num-processes N] ...",
        "        (a library accelerate config by name; one process without them, unless the recipe names several)",
    ])


def main(argv: list[str] | None = None) -> int:
    """A run's command line: its exit code. Called in a process that goes on, that process is left as it found it
    (as run() leaves it; the signal handlers are put back once the error paragraph is printed)."""
    with quiet.left_as_found(*_LEFT_AS_FOUND):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The `deepspeed` launcher passes --local_rank=N to its workers; the rank comes from the environment (LOCAL_RANK).
    argv = [arg for arg in argv if not arg.startswith(("--local_rank=", "--local-rank="))]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else EXIT_USER_ERROR
    quiet.printable_streams()  # a character the locale cannot print is an escape, not a UnicodeEncodeError
    clean = False
    quiet.install()
    quiet.defer_bitsandbytes_compiles()
    _attach_diagnostics()
    try:
        from finetune.recipe.text import undecodable_argument
        from finetune.recipe_library import resolve_recipe_path  # a library name, as `finetune train` takes it

        if problem := undecodable_argument(argv):  # an override typed in UTF-8 under LC_ALL=C: refused, not misread
            raise FinetuneError(problem)
        _run(resolve_recipe_path(argv[0]), argv[1:])
        clean = True
    except FinetuneError as exc:
        rank = int(os.environ.get("RANK", "0") or 0)
        code = getattr(exc, "exit_code", EXIT_USER_ERROR)
        # A mistake every rank finds alike (the recipe, its files, the plan) is printed once, whole, by rank 0; the
        # others stay silent until it has (or print it whole themselves if it never does). A lost peer is named by
        # every rank that saw it (rank 0 may be the one that died); another rank's own problem by that rank, whole.
        alike = getattr(exc, "alike_on_every_rank", False) and not isinstance(exc, distributed.PeerLost)
        if rank != 0 and alike and not rank_errors.says_it_too(exc) and rank_errors.wait_for_rank0_paragraph():
            return code
        text = str(exc) if rank == 0 or isinstance(exc, distributed.PeerLost) else f"(rank {rank}) {exc}"
        kind = "error: " if getattr(exc, "is_error", True) else ""  # Preempted (exit 128 + signal) is no error
        print(f"finetune: {kind}{text}", file=sys.stderr, flush=True)
        if rank == 0:
            rank_errors.rank0_printed(peers_waiting=alike)
        return code
    except KeyboardInterrupt:  # before training's own handler (which saves a checkpoint first) was installed
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print("finetune: interrupted", file=sys.stderr, flush=True)
        return 130
    except OSError as exc:  # a full disk outside the checkpoint and adapter writes (metrics.jsonl, plot.png)
        from finetune.files import no_room

        if not no_room(exc):
            raise
        print(f"finetune: error: no space left on device writing {exc.filename or 'a file of the run'} ({exc.strerror}). "
              "Nothing already written is lost: free space on that filesystem, then run the same command with "
              "train.resume=auto added (it continues from the newest checkpoint).", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        held_signals.release_stop_signals()
        distributed.teardown(clean=clean)
    return 0


if __name__ == "__main__":
    exit_process(main())
