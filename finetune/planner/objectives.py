"""What an objective beyond SFT adds to a plan: a preference objective's starting-adapter copy and the forwards it
runs (a note); GRPO's generation moment (the KV cache of its sampled completions) and what it runs per step."""

from __future__ import annotations

from finetune.planner.facts import ModelFacts, gib

# Per logit of one sampling step (training/rollout.py sample_tokens; logits_to_keep=1, so one position per row):
# the logits in model.dtype and as fp32, then float64 probabilities, their sort (values and int64 order), the
# cumulative sum and the nucleus mask: ~48 bytes alive at once.
SAMPLING_BYTES_PER_LOGIT = 48


def swaps_reference(recipe) -> bool:
    """The reference pass swaps the starting adapter's values in: a copy of them is kept (planner part dpo_reference_copy)."""
    if recipe.train.objective == "kto":
        return bool(recipe.model.adapter)
    if recipe.train.objective == "grpo":  # the KL reference (beta > 0) is adapter_off, as DPO's
        return recipe.grpo.beta > 0 and bool(recipe.model.adapter)
    return (recipe.train.objective == "dpo" and bool(recipe.model.adapter) and recipe.dpo.reference == "adapter_off"
            and recipe.dpo.loss in ("sigmoid", "ipo", "hinge"))


def preference_note(recipe) -> str | None:
    """What a preference objective runs per micro-batch, as a line of the plan (None: not dpo or kto)."""
    dpo = recipe.dpo
    if recipe.train.objective not in ("dpo", "kto"):
        return None
    if recipe.train.objective == "kto":
        start = " (base + model.adapter: its values swapped in)" if recipe.model.adapter else ""
        return (f"kto: 1 sequence per row; no-grad forwards of the mismatched (KL) rows and the reference per "
                f"micro-batch{start}")
    if dpo.loss not in ("sigmoid", "ipo", "hinge"):
        return f"dpo ({dpo.loss}): 2 sequences per pair in one forward, no reference pass"
    if dpo.reference == "precomputed":
        return "dpo: 2 sequences per pair; reference log-probs precomputed before step 1 (16 bytes per pair of CPU RAM)"
    start = " (base + model.adapter: its values swapped in)" if recipe.model.adapter else ""
    return f"dpo: 2 sequences per pair; one no-grad reference forward per micro-batch{start}"


# ------------------------------------------------------------------------------------------------------- GRPO
def kv_cache_bytes(facts: ModelFacts, *, rows: int, tokens: int) -> int:
    """The KV cache of `rows` sequences of `tokens` tokens: every layer keeps a key and a value of kv_heads x head_dim
    per token, in model.dtype."""
    return rows * tokens * facts.num_layers * 2 * facts.kv_dim * facts.dtype_bytes


def kept_logps_bytes(recipe, *, rows: int) -> int:
    """The fp32 per-token log-probs a GRPO step keeps on the GPU for every micro-batch of its rollouts: the old
    policy's (num_iterations > 1) and the reference's (beta > 0), (completions, max_completion_length) each."""
    g = recipe.grpo
    copies = (g.num_iterations > 1) + (g.beta > 0)
    return copies * recipe.train.grad_accum * rows * g.max_completion_length * 4


def generation_parts(facts: ModelFacts, recipe, key: str, training: dict[str, int], *, rows: int, step_gradients: int,
                     whole_model: int) -> dict[str, int]:
    """The parts of the peak while a GRPO micro-batch generates (training/grpo_rollouts.py), before the step's first
    backward: no activations saved and no gradient yet (`step_gradients`, counted in training's lora_grads_adamw, are
    not alive), the model state as in training, and:
      * kv_cache: `rows` (train.micro_batch_size) completions (micro_batch_size / G prompts x G) of up to data.max_length
        tokens (the prompt budget + max_completion_length), + one layer's keys and values again (the cache grows by
        concatenation, a layer at a time);
      * activations: the prefill, one layer's no-grad forward of every prompt at the budget (hidden states, q/k/v
        and output, three MLP intermediates; the SDPA mask of the prompt);
      * logits_loss: one sampling step's logits (`SAMPLING_BYTES_PER_LOGIT`);
      * fsdp_unsharded: under FSDP2 or ZeRO-3 with grpo.generation_gather once (the default) the whole model on every
        GPU for the call (`whole_model`: frozen as stored, LoRA in model.dtype); otherwise what training gathers
        (FSDP1, and per_forward, gather per forward as in training).
    The no-grad forwards that follow (old policy, reference) run a layer at a time at the training length: below the
    training backward's recomputed layer, so they add nothing to the peak but the log-probs they keep."""
    seq, a = recipe.data.max_length, facts.dtype_bytes
    prompt = seq - recipe.grpo.max_completion_length
    cache = kv_cache_bytes(facts, rows=rows, tokens=seq)
    prefill = rows * prompt * a * (4 * facts.hidden + 2 * facts.kv_dim + 3 * facts.intermediate) + rows * prompt**2
    once = gathers_whole_model(facts, recipe, key)
    return {**training, "lora_grads_adamw": training["lora_grads_adamw"] - step_gradients,
            "fsdp_unsharded": whole_model if once else training["fsdp_unsharded"],
            "kv_cache": cache + cache // facts.num_layers, "activations": prefill,
            "logits_loss": rows * facts.vocab * SAMPLING_BYTES_PER_LOGIT}


def with_generation(facts: ModelFacts, recipe, key: str, training: dict[str, int], *, rows: int, step_gradients: int,
                    moment: str) -> tuple[dict[str, int], str]:
    """(the parts of the peak, its moment) of a GRPO step: training's with the kept log-probs, or the generation
    moment's when it is larger."""
    training = {**training, "grpo_logps": kept_logps_bytes(recipe, rows=rows)}
    whole = sum(t.numel * facts.dtype_bytes if t.trainable else t.nbytes for t in facts.tensors)
    generating = generation_parts(facts, recipe, key, training, rows=rows, step_gradients=step_gradients,
                                  whole_model=whole)
    return (generating, "generation") if sum(generating.values()) > sum(training.values()) else (training, moment)


def trained_together(recipe, micro_batch: int) -> int:
    """Rows in one forward and backward of the step: the micro-batch, or GRPO's grpo.train_chunk_size of its
    completions."""
    if recipe.train.objective == "grpo" and recipe.grpo.train_chunk_size:
        return min(micro_batch, recipe.grpo.train_chunk_size)
    return micro_batch


def gathers_whole_model(facts: ModelFacts, recipe, key: str) -> bool:
    """FSDP2 or ZeRO-3 with grpo.generation_gather once: every unit (every parameter) whole for the whole generate
    call (parallel/generation.py). Shard-grad-op holds the whole model anyway; FSDP1 gathers per forward."""
    fsdp2 = key in ("fsdp", "fsdp_offload", "hsdp") and facts.fsdp_version == 2
    return (fsdp2 or key.startswith("zero3")) and recipe.grpo.generation_gather == "once"


def grpo_note(facts: ModelFacts, recipe, key: str, *, moment: str) -> str:
    """What GRPO runs per step, as a line of the plan, and whether generating is the step's peak (`moment`)."""
    g, t = recipe.grpo, recipe.train
    prompts = t.micro_batch_size // g.num_generations
    extra = [name for name, on in (("the old policy's log-probs", g.num_iterations > 1),
                                   ("the reference (adapter off)", g.beta > 0)) if on]
    forwards = f"no-grad forwards of {' and '.join(extra)}, then " if extra else ""
    reuse = f"; the completions reused for {g.num_iterations} steps" if g.num_iterations > 1 else ""
    cache = kv_cache_bytes(facts, rows=t.micro_batch_size, tokens=recipe.data.max_length)
    gather = " with the whole model gathered once per call" if gathers_whole_model(facts, recipe, key) else ""
    chunks = g.train_chunk_size and g.train_chunk_size < t.micro_batch_size
    chunked = f" ({g.train_chunk_size} at a time: grpo.train_chunk_size)" if chunks else ""
    return (f"grpo: per micro-batch, {prompts} prompt(s) x G {g.num_generations} = {t.micro_batch_size} completions of "
            f"up to {g.max_completion_length} tokens sampled with a KV cache of {gib(cache)}"
            f"{gather}, rewards scored, {forwards}the policy's forward and backward on the completions"
            f"{chunked} "
            f"({t.grad_accum} micro-batch(es) a step){reuse}; the peak: {moment}")
