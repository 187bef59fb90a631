"""The training loop, top to bottom, and evaluate().

Loss normalization: the loss of an optimizer step is (sum of token losses over every micro-batch on every rank)
divided by (number of trained tokens in that whole step). Each micro-batch backpropagates its token-loss sum
times world_size / global_tokens, because DDP, FSDP and DeepSpeed average gradients over ranks. So a step gives the same
gradient for 1 process x batch 4 as for 2 processes x batch 2, whatever the padding or the tokens per rank.
A mixture-of-experts model's load-balancing loss is added as TRL adds it: coef x its mean over the step's forwards and
ranks (training/router_aux.py); that mean depends on the micro-batches, as TRL's does.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from finetune import distributed, held_signals, outputs
from finetune.data import (
    BatchStream,
    Example,
    batch_stream,
    check_enough_rows,
    checked_steps_per_epoch,
    rows_fingerprint,
    rows_left_note,
    steps_per_epoch,
)
from finetune.errors import FinetuneError
from finetune.outputs import checkpoint, checkpoint_load, step_folders
from finetune.parallel import backward, engine_optimizer, gradient_sync, optimizer_step
from finetune.recipe import Recipe, recipe_to_yaml
from finetune.recipe.checks import eval_every_note, steps_per_rows
from finetune.recipe.train import lr_factors
from finetune.tracking import Trackers, run_tags
from finetune.training import objectives
from finetune.training.loss import token_loss_sum
from finetune.training.stopping import StopSignals

# Context managers entered around each training step, `hook(step, out_dir, rank)`: what diagnostics attach (the
# tensor-bytes meter, training/tensor_bytes.py, when FINETUNE_MEASURE_STEP asks for it: run.py), never the loop itself.
STEP_HOOKS: list[Callable[[int, Path, int], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def around_step(step: int, out_dir: Path, rank: int):
    with contextlib.ExitStack() as stack:
        for hook in STEP_HOOKS:
            stack.enter_context(hook(step, out_dir, rank))
        yield


class NumericalFault(FinetuneError):
    """The loss or the gradient became NaN/inf."""


class Preempted(FinetuneError):
    """SIGTERM/SIGINT: the run finished its step, wrote a checkpoint and stopped. Exit code 128 + signal number."""

    is_error = False

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass
class TrainResult:
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    resumed_tokens: int = 0  # of the steps before the checkpoint this launch resumed from: not trained in `seconds`
    seconds: float = 0.0
    step_seconds: float = 0.0  # of the trained optimizer steps alone (no eval, checkpoint, generation eval, skipped step)
    skipped_steps: int = 0  # nan_policy: skip: steps of this launch not applied (their loss or gradient not finite)
    generation: dict | None = None  # the "after" generation eval record, when the recipe asks for one
    elapsed_before: float | None = None  # elapsed_s at the checkpoint resumed from (None: none, or one without it)

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second of the steps themselves, as each step's line says (eval and saves left out)."""
        trained = self.tokens - self.resumed_tokens
        return trained / self.step_seconds if self.step_seconds and trained else 0.0


def lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    """The learning-rate factor of each step (from 0): recipe/train.py lr_factors (resume checks read it too)."""
    return lr_factors(recipe.train)


def resolve_max_steps(recipe: Recipe, train_rows: int, world_size: int) -> None:
    """The run's length for this launch, before any weight loads: train.num_epochs becomes train.max_steps
    (Recipe.resolve_num_epochs; an epoch without a whole optimizer step is an error). Said once, by rank 0."""
    t, iterations = recipe.train, steps_per_rows(recipe)
    rows = objectives.rows_per_micro_batch(recipe)  # GRPO: prompts (micro_batch_size counts its completions)
    check_enough_rows(train_rows, micro_batch_size=rows, world_size=world_size)  # as validate: before the length line
    per_batch = (f"{rows} prompts per micro-batch (micro_batch_size {t.micro_batch_size} completions / "
                 f"grpo.num_generations {recipe.grpo.num_generations})" if rows != t.micro_batch_size
                 else f"micro_batch_size {rows}")  # GRPO: a micro-batch of completions holds that many prompts
    launch = (f"{train_rows} rows // ({per_batch} x {world_size} process{'es' if world_size > 1 else ''} x grad_accum "
              f"{t.grad_accum})" + (f" x grpo.num_iterations {iterations}" if iterations > 1 else ""))
    count = checked_steps_per_epoch if t.num_epochs is not None else steps_per_epoch  # num_epochs needs a whole step
    per_epoch = count(train_rows, micro_batch_size=rows, world_size=world_size, grad_accum=t.grad_accum,
                      iterations=iterations)
    known = len(recipe.notes)
    told = recipe.resolve_num_epochs(per_epoch, launch=launch)
    if told is None:  # the recipe gave max_steps: the epochs it makes
        told = (f"train.max_steps {t.max_steps} = {_epochs(t.max_steps / per_epoch)} epochs of {per_epoch:,} steps "
                f"({launch})"
                if per_epoch else f"train.max_steps {t.max_steps}; fewer rows than one step takes ({launch}): each "
                "step takes rows of more than one epoch")
    left = rows_left_note(train_rows, micro_batch_size=rows, world_size=world_size, grad_accum=t.grad_accum)
    distributed.print0(f"[finetune] length: {told}{left}")
    for note in recipe.notes[known:]:  # a warmup longer than the resolved run
        distributed.print0(f"[finetune] note: {note}")


def resolve_length(recipe: Recipe, train_examples, plan, *, resume_from: Path | None) -> None:
    """Before any weight loads: train.num_epochs becomes max_steps for this launch (not for a stream, whose length is
    unknown: it runs train.max_steps; num_epochs is refused there), then the checkpoint of a resume is checked against
    the resolved run (outputs.check_resume: refused in one paragraph naming the fix, or its changes noted)."""
    rows = None if recipe.data.streaming else len(train_examples)
    if rows is not None:
        resolve_max_steps(recipe, rows, plan.world_size)
    with held_signals.checks_every_rank_makes():  # every rank gets rank 0's answer; rank 0 prints the paragraph
        outputs.check_resume(resume_from, recipe, plan, train_rows=rows, train_fingerprint=(  # rank 0 decides
            rows_fingerprint(train_examples) if rows is not None and resume_from is not None
            and distributed.info().is_main else None))


def build_optimizer(recipe: Recipe, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    if recipe.train.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(parameters, lr=recipe.train.learning_rate, weight_decay=recipe.train.weight_decay)
    return torch.optim.AdamW(parameters, lr=recipe.train.learning_rate, weight_decay=recipe.train.weight_decay)


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over the trained tokens of a batch, and their count.

    Computed inside the model's forward on the trained positions only, a chunk at a time (finetune/training/loss.py): the
    (batch x length x vocabulary) fp32 logits are never built, which is most of a QLoRA step's memory and a large
    part of its CPU time. Same value as the plain full-logits cross-entropy (tests/training/test_loss.py).
    """
    return token_loss_sum(model, batch, device)


def evaluate(model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int) -> float | None:
    """Mean held-out loss of the recipe's objective (SFT: token-weighted), identical for any world size."""
    figures = evaluate_figures(model, examples, recipe, pad_id=pad_id)
    return figures["eval_loss"] if figures is not None else None


def evaluate_figures(model: nn.Module, examples: list[Example], recipe: Recipe, *, pad_id: int,
                     objective: objectives.Objective | None = None
                     ) -> dict | None:
    """The objective's held-out figures ({"eval_loss": ..., DPO: "eval_rewards/..."}), identical for any world size."""
    if not examples:
        return None
    objective = objective or objectives.for_recipe(model, recipe)
    was_training = model.training
    model.eval()
    figures = objective.evaluate(model, examples, recipe, pad_id=pad_id)
    model.train(was_training)
    return figures


def train(model: nn.Module, recipe: Recipe, train_examples: list[Example], eval_examples: list[Example], *, pad_id: int,
          out_dir: Path, trainable_names: list[str] | None = None, resume_from: Path | None = None,
          parallel: str = "single process", tokenizer=None) -> TrainResult:
    """Run optimizer steps up to recipe.train.max_steps (from a checkpoint's step when resuming); log to metrics.jsonl,
    each training line with its epoch (step / steps per epoch of this launch).

    Checkpoints every train.save_every steps, at the last step, and when SIGTERM/SIGINT arrives (then raises Preempted).
    `trainable_names`: the model's names of the trainable parameters (given by run.py: under FSDP1 the wrapped model
    only exposes flat parameters).

    Kept whole: this is the training loop, the one place a reader sees the whole step on one screen (accumulation with
    the gradient sync, clipping, the optimizer and scheduler step, logging, eval and checkpoint cadence).
    """
    from tqdm.auto import tqdm

    info, t = distributed.info(), recipe.train
    if t.num_epochs is not None:  # run.py resolves it before any weight loads; a library caller gets it here
        resolve_max_steps(recipe, len(train_examples), info.world_size)
    names = set(trainable_names or [name for name, param in model.named_parameters() if param.requires_grad])
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = engine_optimizer(model) or build_optimizer(recipe, parameters)  # DeepSpeed: the AdamW it wraps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
    stream = batch_stream(train_examples, micro_batch_size=objectives.rows_per_micro_batch(recipe), rank=info.rank,
                          world_size=info.world_size, seed=t.seed, pad_id=pad_id, grad_accum=t.grad_accum,
                          kl_max_length=recipe.data.max_length if objectives.uses_kl(recipe) else None,
                          iterations=steps_per_rows(recipe))
    result = TrainResult()
    objective = objectives.for_recipe(model, recipe, tokenizer)  # DPO: the starting LoRA values, before a resume
    router_aux = objective.router_aux  # a MoE model's load-balancing loss (train.router_aux_loss_coef), or off
    router_aux.pad_id = pad_id  # packed rows' padding tails are no tokens of it
    first_step = 1
    if resume_from is not None:
        distributed.doing(f"the load of the checkpoint {resume_from}")  # else a lost peer is named in the wrap's
        first_step = resume(resume_from, model, optimizer, scheduler, stream, names, result, parallel=parallel,
                            max_steps=t.max_steps) + 1
        if not Path(resume_from).resolve().is_relative_to(Path(out_dir).resolve()):  # another run folder's checkpoint
            result.eval_losses = []  # its evaluations are that run's: no best eval of it here, whose checkpoint is there
    recipe_yaml = recipe_to_yaml(recipe)
    if info.is_main:  # only now: a run that failed on its inputs has changed nothing in out_dir
        outputs.begin_outputs(out_dir, recipe_yaml, resume_from)
    distributed.barrier()  # a replaced run's files are gone before any rank writes its own (completions/rank<r>.jsonl)
    # DPO with dpo.reference precomputed: the reference log-probs before step 1 (or read back on resume); bb58 #7.
    distributed.doing("the reference log-probs (dpo.reference: precomputed)" if recipe.dpo.reference == "precomputed"
                      else "the objective's work before step 1")
    objective.prepare(model, train_examples, eval_examples, recipe, pad_id=pad_id, out_dir=out_dir, resume_from=resume_from)
    batches = iter(stream)
    if line := router_aux.describe():
        distributed.print0(line)
    if note := eval_every_note(recipe, len(eval_examples)):  # train.eval_every with no eval rows: not silently
        distributed.print0(f"[finetune] note: {note}")
    tags = run_tags(strategy=parallel, world_size=info.world_size, device=str(info.device)) if info.is_main else None
    metrics = Trackers(recipe, out_dir, is_main=info.is_main, tags=tags, resumed_step=first_step - 1,
                       elapsed_before=result.elapsed_before)
    status = "FAILED"  # what the trackers record unless the run finishes or is preempted
    try:  # trackers are closed however the run ends (done, preempted, numerical fault)
        if first_step == 1:
            generation_eval(model, tokenizer, eval_examples, recipe, "before", metrics)
        interactive = sys.stderr.isatty()
        progress = tqdm(total=t.max_steps, initial=first_step - 1, disable=not (info.is_main and interactive), desc="train",
                        dynamic_ncols=True)
        print_every = max(1, t.max_steps // 10)
        verify_next_save = True  # the first checkpoint of every process is read back and compared
        model.train()
        started = time.perf_counter()
        with StopSignals() as signals:
            for step in range(first_step, t.max_steps + 1):
                step_start = time.perf_counter()
                distributed.doing(f"step {step}'s forward and backward ({parallel})")
                with around_step(step, out_dir, info.rank):  # STEP_HOOKS: none unless a diagnostic is asked for
                    micro_batches = objective.take(batches, step, t.grad_accum)
                    local_counts = objective.counts(model, micro_batches, info.device)
                    trained = objective.train_batches(micro_batches)  # GRPO: its rollouts' chunks
                    *totals, global_seen = distributed.all_reduce_sum([*local_counts, objective.seen_tokens(trained, pad_id)])
                    router_aux.begin_step(len(trained))
                    # The step's loss stays on the device: one host sync per step (the all-reduce), none per batch.
                    step_loss, step_metrics = torch.zeros((), dtype=torch.float64, device=info.device), None
                    for index, batch in enumerate(trained):
                        with gradient_sync(model, enabled=index == len(trained) - 1):
                            to_backward, batch_loss, batch_metrics = objective.loss(model, batch, totals, info.device)
                            # SFT: token-loss sum x world size / global trained tokens; + coef x aux / forwards
                            backward(model, router_aux.added_to(to_backward))
                        step_loss += batch_loss.to(step_loss.device, torch.float64)
                        if batch_metrics is not None:
                            step_metrics = batch_metrics if step_metrics is None else step_metrics + batch_metrics
                    distributed.doing(f"step {step}'s all-reduces (loss, gradient norm, stop check) and optimizer step")
                    aux_sums = router_aux.step_sums(info.device)  # [] without a load-balancing loss
                    summed = distributed.all_reduce_sum([step_loss, *aux_sums,
                                                         *([] if step_metrics is None else step_metrics)])
                    loss = objective.step_loss(summed[0], totals)  # identical on every rank
                    extra = objective.metrics(summed[1 + len(aux_sums):] if step_metrics is not None else None, totals)
                    loss, extra = router_aux.logged(loss, extra, summed[1:1 + len(aux_sums)])  # + coef x aux_loss
                    # Clip, step, zero the gradients; never step on a NaN/inf: every checkpoint and the adapter stay finite.
                    grad_norm, finite = optimizer_step(model, optimizer, parameters, t.max_grad_norm,
                                                       allowed=math.isfinite(loss))
                lr = scheduler.get_last_lr()[0]  # the rate this step trained at, as HF Trainer logs it (not the next one's)
                result.steps = step  # the steps run, skipped ones included (nan_policy: skip)
                if finite:
                    scheduler.step()
                    result.tokens = result.tokens + int(global_seen)
                    result.losses.append(loss)
                else:
                    result.skipped_steps += 1
                    handle_numerical_fault(step, loss, grad_norm, recipe, out_dir, metrics)

                elapsed = time.perf_counter() - step_start
                result.step_seconds += elapsed if finite else 0.0  # tokens/s: the trained steps' tokens over their time
                signals.timed(step, first_step, elapsed)  # a step longer than the launcher's grace after SIGTERM
                if finite and (step % t.log_every == 0 or step == t.max_steps):
                    # HF Trainer's and TRL's names: num_tokens counts every step so far (a resume goes on counting)
                    metrics.write(step=step, epoch=stream.epoch_at(step), loss=round(loss, 6), learning_rate=lr,
                                  grad_norm=round(grad_norm, 6), num_tokens=result.tokens,
                                  tokens_per_s=round(global_seen / elapsed, 1), elapsed_s=round(time.perf_counter() - started, 3),
                                  **extra)
                    for name, rows in objective.tables().items():  # GRPO: the step's completions, to the trackers
                        metrics.table(name, rows, step)
                progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{global_seen / elapsed:.0f}")
                progress.update(1)
                if not interactive and (step % print_every == 0 or step == first_step):
                    distributed.print0(f"[finetune] step {step}/{t.max_steps} loss {loss:.4f} lr {lr:.2e} tokens/s {global_seen / elapsed:.0f}")
                if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                    distributed.doing(f"the evaluation after step {step}")
                    figures = evaluate_figures(model, eval_examples, recipe, pad_id=pad_id, objective=objective)
                    if figures is not None:
                        result.eval_losses.append((step, figures["eval_loss"]))
                        metrics.write(step=step, **{k: round(v, 6) for k, v in figures.items()})
                        accuracy = figures.get("eval_rewards/accuracies")
                        distributed.print0(f"[finetune] step {step}: eval loss {figures['eval_loss']:.4f}"
                                           + (f", reward accuracy {accuracy:.1%}" if accuracy is not None else ""))

                # The signal any rank received (0: none): every rank stops after the same step, and names that signal
                stop_signal = distributed.rank_max(signals.received or 0)
                stop = stop_signal > 0
                if stop and not objective.resumable_after(step):  # GRPO: within a num_iterations cycle
                    stop = signals.postpone(objective.stop_note(step))
                if stop or step == t.max_steps or (t.save_every and step % t.save_every == 0):
                    distributed.doing(f"the checkpoint of step {step}")
                    state = trainer_state(step, scheduler, stream, result, info.world_size, parallel,
                                          elapsed_s=metrics.elapsed_offset + time.perf_counter() - started)
                    saved = checkpoint.save_checkpoint(out_dir, step, model, optimizer, names, state, recipe_yaml,
                                                       keep_last=t.keep_last, keep_best=t.keep_best,
                                                       verify=verify_next_save, tokenizer=tokenizer)
                    verify_next_save = False
                if stop:
                    progress.close()
                    raise preempted(stop_signal, step, saved)
        progress.close()
        result.seconds = time.perf_counter() - started
        result.generation = generation_eval(model, tokenizer, eval_examples, recipe, "after", metrics)
        status = "FINISHED"
        return result
    except (Preempted, KeyboardInterrupt):
        status = "KILLED"
        raise
    finally:
        metrics.close(status=status)


def _epochs(epochs: float) -> str:
    """Epochs as a figure that is not 0.00 for a run that trains (10 steps of 4,984: 0.002)."""
    return f"{epochs:.2f}" if epochs >= 0.01 else f"{epochs:.1g}"


def generation_eval(model: nn.Module, tokenizer, eval_examples: list[Example], recipe: Recipe, phase: str,
                    metrics: Trackers) -> dict | None:
    """Greedy answers to `eval.generation_rows` held-out prompts, scored (exact match...), before and after training.

    The record is logged at the step of the model it scored: "before" at the step training starts from, "after" at
    the last step trained (the newest step `metrics` has written)."""
    if tokenizer is None or not recipe.eval.generation_rows:  # no eval rows: recipe_generation_eval says so
        return None
    from finetune.parallel import generation_model
    from finetune.training import evals

    distributed.doing(f"the generation eval {phase} training")
    with generation_model(model) as generator:
        record = evals.recipe_generation_eval(generator, tokenizer, eval_examples, recipe, phase=phase,
                                              device=distributed.info().device)
    if record is not None:
        metrics.write(**{"step": metrics.last_step, **record})
        distributed.print0(f"[finetune] generation eval {phase}: {record['generation_metric']} "
                           f"{record['generation_score']:.0%} ({record['generation_correct']}/{record['generation_total']})")
    return record


def handle_numerical_fault(step: int, loss: float, grad_norm: float, recipe: Recipe, out_dir: Path, metrics: Trackers) -> None:
    """nan_policy stop: raise with the way back; skip: log the skipped step and go on."""
    if recipe.train.nan_policy == "stop":
        fault = NumericalFault(
            f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; stopped before the optimizer step, so no "
            f"NaN reaches the adapter; {step_folders.newest_kept(out_dir)} Fix: lower train.learning_rate (now "
            f"{recipe.train.learning_rate}) or "
            "set train.max_grad_norm, check the data, then continue with train.resume=auto; or set train.nan_policy: skip."
        )
        # The decision is every rank's: the loss is all-reduced, the gradient norm global (DDP's gradients are reduced,
        # FSDP and ZeRO reduce the norm), so every rank stops here alike and rank 0 says so, once (run.py main).
        fault.alike_on_every_rank = True
        raise fault
    metrics.write(step=step, skipped="non-finite loss or gradient", loss=str(loss), grad_norm=str(grad_norm))
    distributed.print0(f"[finetune] step {step}: loss {loss} / gradient norm {grad_norm} not finite, step skipped "
                       "(train.nan_policy: skip)")


def trainer_state(step: int, scheduler, stream: BatchStream, result: TrainResult, world_size: int, parallel: str, *,
                  elapsed_s: float = 0.0) -> dict:
    """Everything besides tensors that an exact resume needs (JSON). `elapsed_s`: the run's seconds so far, which a
    resume counts on from (also into another output.dir, whose metrics.jsonl has none)."""
    return {"step": step, "epoch": stream.epochs_done(step), "scheduler": scheduler.state_dict(),
            "data": stream.state_dict(), "losses": result.losses, "eval_losses": result.eval_losses,
            "tokens": result.tokens, "world_size": world_size, "strategy": parallel, "elapsed_s": round(elapsed_s, 3)}


def resume(path: Path, model: nn.Module, optimizer, scheduler, stream: BatchStream, names: set[str], result: TrainResult,
           *, parallel: str, max_steps: int) -> int:
    """Restore model, optimizer, scheduler, data position, RNG and progress from a checkpoint; return its step."""
    info = distributed.info()
    recipe_groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    state = checkpoint_load.load_checkpoint(path, model, optimizer, names)
    scheduler.load_state_dict(state["scheduler"])
    _recipe_hyperparameters(optimizer, scheduler, recipe_groups)
    # the step and the epoch logged then: epoch_at counts on from there
    stream.load_state_dict({**state["data"], "step": state["step"], "logged_epoch": state.get("epoch")})
    result.steps, result.tokens = state["step"], state["tokens"]
    result.resumed_tokens = state["tokens"]
    result.elapsed_before = state.get("elapsed_s")  # absent from checkpoints of finetune before 2026-12
    result.losses = list(state["losses"])
    result.eval_losses = [tuple(item) for item in state["eval_losses"]]
    message = f"[finetune] resumed from {path} at step {state['step']}"
    if state["world_size"] != info.world_size or state["strategy"] != parallel:
        message += (f" (saved by {state['strategy']}, now {parallel}: adapter and optimizer state resharded, data position "
                    "converted" + (", RNG of the new ranks seeded" if info.world_size > state["world_size"] else "") + ")")
    distributed.print0(message)
    if state["step"] == max_steps:  # a later one was refused before loading (outputs/resume_checks.py)
        distributed.print0(f"[finetune] the checkpoint is of step train.max_steps ({max_steps}): nothing left to train; "
                           "its adapter is written")
    return state["step"]


def _recipe_hyperparameters(optimizer, scheduler, recipe_groups: list[dict]) -> None:
    """The saved optimizer and scheduler state carry the hyperparameters they were saved with (each group's lr,
    initial_lr, weight_decay, betas; the scheduler's base_lrs): this run's recipe decides them, at the schedule's
    place. A resume that changed train.learning_rate or train.weight_decay trained on with the old ones, bitwise,
    while its note said the run would differ (found in a bug bash)."""
    for group, hyper in zip(optimizer.param_groups, recipe_groups, strict=True):
        group.update(hyper)
    scheduler.base_lrs = [hyper["initial_lr"] for hyper in recipe_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def preempted(signum: int | None, step: int, saved: Path) -> Preempted:
    name = signal.Signals(signum).name if signum else "a signal to another rank"
    stopped = Preempted(
        f"stopped by {name} after step {step}, checkpoint saved. To continue, run the same command with "
        f"train.resume=auto added (or set train.resume: auto in the recipe). Checkpoint: {saved}",
        signum or signal.SIGTERM,
    )
    stopped.alike_on_every_rank = True  # every rank stops after the same step: rank 0 says so, once
    return stopped
