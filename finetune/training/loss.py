"""Token loss without full-vocabulary fp32 logits: only trained positions, a chunk at a time, inside the forward.

`token_loss_sum(model, batch, device)` returns what `train.loss_sum` returns (sum of next-token cross-entropy over
labels != -100, and the count of those tokens), but never builds the (batch x length x vocab) logits.
`token_loss_and_correct` adds the count of those tokens whose argmax logit is the label (TRL's mean_token_accuracy
= correct / count), taken from each chunk's logits while they exist. With a 49k
vocabulary those logits, upcast to fp32 for the loss and kept for backward, are the largest tensors of a QLoRA step
(several GB at batch 4 x 512) and the softmax over them costs more time than the LoRA layers on a CPU.

How, and why it works under every wrapper:
  * The LM head's `forward` is replaced on the instance (module tree and state-dict keys unchanged). While a
    loss is requested, the head receives the final hidden states inside the model's own forward, keeps the
    positions whose next token is trained (instruction data trains answers only: often a fraction of the row),
    and computes the cross-entropy chunk by chunk. It returns the loss sum, which the model hands back as
    `.logits`. So the head's weights are used only inside the root forward, where FSDP1 and FSDP2 have them
    unsharded (calling the head outside the root forward would see shards), and the loss is a forward output,
    on which DDP and FSDP hang their backward hooks.
  * Each chunk's gradient with respect to its hidden states is computed right away (softmax - one-hot, times the
    head weight) and only that small (tokens x hidden) gradient is kept for backward; the chunk's logits are
    freed at once. Peak extra memory: one chunk of fp32 logits, whatever the batch size or length.
  * A trainable head (LoRA on lm_head, or a trained head) falls back to an ordinary autograd path over the trained
    positions, so its parameters still get their gradients.
  * No host sync per micro-batch: which positions are trained, and how many, is read from the labels as the data
    loader gives them, in host memory (`trained_positions`), and the head gathers those rows by index. A boolean mask
    applied on the device (`hidden[mask]`) or `int(count)` of a device tensor would make the host wait for the GPU
    at every micro-batch. (transformers' own mask preparation still reads one or two values per forward.)
  * A model whose forward scales or caps the head's output (Cohere's logit_scale, Granite's logits_scaling, the
    tanh softcap of Gemma and Mistral Large 4) would apply that to the loss: the head applies it to its chunks
    (head_transform, measured by one probe forward), and the loss is taken from the head, not the model's output
    (to which it stays joined with weight 0, for the wrappers' hooks). A transform it does not know: the plain path.
Outside `token_loss_sum` (evaluation scripts, generation) the head behaves exactly as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from finetune.planner.memory import CHUNK_LOGIT_ELEMENTS
from finetune.training.router_aux import RouterAux

IGNORE_INDEX = -100
# CHUNK_LOGIT_ELEMENTS (defined in finetune/planner/memory.py, beside the memory model that counts it): fp32 logits
# per chunk: 64 MB, ~340 tokens at a 49k vocabulary. The chunk's transient (12 bytes per logit, measured
# by benchmarks/memory_breakdown.py) is alive at the step's peak with every activation. 2**22 was measured too
# (docs/benchmarks.md): peak RSS -5% unpacked, -1% packed, speed within the noise; not worth the smaller matmuls.
_TARGETS = "_finetune_loss_targets"
_RESULT = "_finetune_loss_result"  # the head's loss of the forward in progress
_TRANSFORM = "_finetune_head_transform"  # head_transform of its model (None: the plain path)
_PATCHED = "_finetune_chunked_loss"


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of cross-entropy of head(hidden) against targets; gradient w.r.t. hidden computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, head_forward, chunk: int, softcap: float | None,
                correct: list | None):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = []
        for start in range(0, hidden.size(0), chunk):
            piece = hidden[start : start + chunk].detach().requires_grad_(True)
            with torch.enable_grad():
                loss = _chunk_loss(head_forward, piece, targets[start : start + chunk], softcap, correct=correct)
                (grad,) = torch.autograd.grad(loss, piece)
            grads.append(grad)
            total += loss.detach()
        ctx.save_for_backward(torch.cat(grads))
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_output).to(grad_hidden.dtype), None, None, None, None, None


class _ChunkedHeadTokenLoss(torch.autograd.Function):
    """Per-token cross-entropy of head(hidden) against targets (one value per row of hidden), same chunked scheme.

    A token's loss depends on its own hidden state only (the head is frozen here), so the gradient of the chunk's sum
    with respect to the chunk is, row by row, each token's own gradient: backward scales it by that token's grad_output.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, head_forward, chunk: int, softcap: float | None,
                entropy: list | None):
        values, grads = [], []
        for start in range(0, hidden.size(0), chunk):
            piece = hidden[start : start + chunk].detach().requires_grad_(True)
            with torch.enable_grad():
                losses = _chunk_loss(head_forward, piece, targets[start : start + chunk], softcap, reduction="none",
                                     entropy=entropy)
                (grad,) = torch.autograd.grad(losses.sum(), piece)
            grads.append(grad)
            values.append(losses.detach())
        ctx.save_for_backward(torch.cat(grads))
        return torch.cat(values)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_output[:, None]).to(grad_hidden.dtype), None, None, None, None, None


def _chunk_loss(head_forward, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None, *,
                reduction: str = "sum", correct: list | None = None, entropy: list | None = None) -> torch.Tensor:
    """Cross-entropy of one chunk (summed, or per token), logits upcast to fp32 exactly as train.loss_sum does.

    `correct`: a list to append the chunk's count of argmax hits to (a device tensor: no host sync), read off the
    logits that exist here anyway; one argmax over the chunk, small beside the softmax and its gradient.
    `entropy`: a list to append the sum of the chunk's per-token entropies of the predicted distribution to (GRPO's
    `entropy` metric, TRL's; detached)."""
    logits = _capped(head_forward(hidden).float(), softcap)
    if correct is not None:
        correct.append((logits.detach().argmax(dim=-1) == targets).sum())
    if entropy is not None:
        logp = torch.log_softmax(logits.detach(), dim=-1)
        entropy.append(-(logp.exp() * logp).sum())
    return F.cross_entropy(logits, targets, reduction=reduction)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's own tanh cap (Gemma 2/3/4, Mistral Large 4 ...: head_transform), applied here since the model sees
    no logits."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def trained_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions whose next token is trained, as row indices into the flattened (B*T, H) hidden states in
    row-major order, and those next tokens. Computed where the labels are: on the data loader's host tensors the
    `nonzero` is host work, and its size (the token count) is known without asking the device. Labels already on a
    GPU cost one sync here."""
    targets = labels[:, 1:]
    batch_rows, columns = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    return batch_rows * labels.size(1) + columns, targets[batch_rows, columns]


def head_loss(head_forward, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, *,
              trainable_head: bool, softcap: float | None, chunk: int, per_token: bool = False,
              correct: list | None = None, entropy: list | None = None) -> torch.Tensor:
    """Loss sum of next-token prediction from final hidden states (B, T, H) at `positions` (flat rows, from
    `trained_positions`) against their `targets`; with `per_token`, the loss of every position instead, in order.
    With `correct` (SFT sums only), each chunk's count of argmax hits is appended to that list.

    The rows are gathered by index: the same rows in the same order as a boolean mask would select (bitwise the same
    loss), but the output size is the length of `positions`, known to the host, so nothing waits for the device."""
    if positions.numel() == 0:
        # Still a graph through every layer: each rank's backward must reach every unit. In fp32, as every other
        # return of this function (the loss is computed from fp32 logits): an eval batch of only filler rows (a rank's
        # short share, data/loader.py eval_batches) under a bf16 model gave a bf16 empty tensor, which
        # sequence_logps' fp32 index_add refuses, even empty (bug bash bb58 #1: DPO / KTO on 2+ processes died).
        # A trainable head (LoRA on lm_head) is reached too, through one row: DDP's reducer waits for every trainable
        # parameter's gradient, and a rank whose completions were all masked died there (bug bash bb59 #1: GRPO).
        zero = hidden.sum().float() * 0.0
        if trainable_head and torch.is_grad_enabled() and hidden.numel():
            zero = zero + head_forward(hidden.reshape(-1, hidden.size(-1))[:1]).float().sum() * 0.0
        return zero.reshape(1)[:0] + zero if per_token else zero
    selected = hidden.reshape(-1, hidden.size(-1)).index_select(0, positions)
    reduction = "none" if per_token else "sum"
    if not torch.is_grad_enabled():
        pieces = [_chunk_loss(head_forward, selected[s : s + chunk], targets[s : s + chunk], softcap, reduction=reduction,
                              correct=correct, entropy=entropy) for s in range(0, selected.size(0), chunk)]
        return torch.cat(pieces) if per_token else sum(pieces)
    if trainable_head or not selected.requires_grad:  # ordinary autograd: head parameters get grads
        return _chunk_loss(head_forward, selected, targets, softcap, reduction=reduction, correct=correct,
                           entropy=entropy)
    if per_token:
        return _ChunkedHeadTokenLoss.apply(selected, targets, head_forward, chunk, softcap, entropy)
    return _ChunkedHeadLoss.apply(selected, targets, head_forward, chunk, softcap, correct)


def causal_lm(model: nn.Module) -> nn.Module | None:
    """The transformers model inside PeftModel / DDP / FSDP wrappers whose own forward calls the LM head: the module
    with the head as a child (a `*ForCausalLM`, or a multimodal `*ForConditionalGeneration` trained on its language
    model). Before, the first module named `*ForCausalLM`: PEFT's PeftModelForCausalLM, whose config is the top-level
    one (a text_config's softcap was missed: Mistral Large 4's loss was capped, bb66)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and callable(getattr(module, "get_output_embeddings", None)):
            head = module.get_output_embeddings()
            if head is not None and any(child is head for child in module.children()):
                return module
    return None


# The head's output is replaced, in the probe forward, by values from 1e-3 to 1e3 in size, both signs: the small ones
# give the scale (a cap is linear there), the large ones the cap (tanh saturated); bf16 holds each to ~0.4%, and a
# fitted value within 1% of a number of the model's config is that number (`_snapped`: the cap is 30, not 29.875).
_PROBE_MAGNITUDES = (-3.0, 3.0)  # log10 of the smallest and largest |value|
_FIT_TOLERANCE = 0.02


def head_transform(model: nn.Module, lm: nn.Module, device: torch.device) -> tuple[float, float | None] | None:
    """What the forward of `model` (`lm`: its causal LM, causal_lm) does to the head's output, as (scale, softcap):
    logits x scale, then the tanh cap (Cohere's `logit_scale`, Granite's 1 / `logits_scaling`, HyperCLOVAX's x
    `logits_scaling`, Falcon-H1's `lm_head_multiplier`, the softcap of Gemma, Mistral Large 4, RecurrentGemma ...);
    None (the plain path, full logits) when the model does anything else to them.

    Measured, not read: one no-grad forward of `model` (the root, wrapped as the run wraps it: every rank calls this
    at the same first loss) on two ordinary tokens, with the head's output replaced by designed values X (a forward
    hook), and the logits L it returns fitted as L = cap * tanh(scale * X / cap), or scale * X. Reading the forward's
    source (the way before, bug bash bb69) missed a scale on the head call's own line (HyperCLOVAX, Falcon-H1), a
    remote-code override, a variable not named `logits`, and took x for / from an attribute's name. The random state is
    put back, so a run trains the numbers it would without the probe."""
    from finetune.parallel.wrapping import ordinary_token_ids

    head = lm.get_output_embeddings()
    designed: list[torch.Tensor] = []

    def replace(module, args, output):
        size = output.numel()
        magnitude = torch.logspace(*_PROBE_MAGNITUDES, steps=max(size // 2, 1), dtype=torch.float64)
        values = torch.cat([magnitude, -magnitude])[:size] if size > 1 else magnitude[:1]
        designed.append(values.reshape(output.shape).to(output.dtype).to(output.device))
        return designed[-1]

    ids = torch.tensor([ordinary_token_ids(getattr(lm, "config", None), 2)], device=device)
    handle = head.register_forward_hook(replace)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            outputs = model(input_ids=ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a forward that cannot run on two tokens alone: the plain path, as before
        return None
    finally:
        handle.remove()
    logits = outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]
    if len(designed) != 1 or not isinstance(logits, torch.Tensor) or logits.shape != designed[0].shape:
        return None  # the head ran twice or not at all, or its output was sliced or reshaped
    fitted = _fitted(designed[0].double().flatten().cpu(), logits.double().flatten().cpu())
    if fitted is None:
        return None
    scale, cap = fitted
    return _snapped(scale, lm, inverse=True), None if cap is None else _snapped(cap, lm)


def _snapped(value: float, lm: nn.Module | None, *, inverse: bool = False) -> float:
    """`value`, or the number of the model's config (or its text config, or a float attribute of the model or its
    base) within 1% of it (`inverse`: of its reciprocal too, Granite's 1 / logits_scaling); 1.0 stays 1.0."""
    if value == 1.0 or lm is None:
        return value
    config = getattr(lm, "config", None)
    owners = [vars(owner) for owner in (config, getattr(config, "get_text_config", lambda: None)(), lm,
                                        getattr(lm, getattr(lm, "base_model_prefix", ""), None)) if owner is not None]
    numbers = {float(v) for owner in owners for v in owner.values()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v}
    candidates = [(n, n) for n in numbers] + ([(1.0 / n, n) for n in numbers] if inverse else [])
    near = [(abs(c - value), c) for c, _ in candidates if abs(c - value) <= 0.01 * abs(value)]
    return min(near)[1] if near else value


def _fitted(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float | None] | None:
    """(scale, cap) with y = cap * tanh(scale * x / cap) (or scale * x) within _FIT_TOLERANCE of |y|; None if none."""
    small = x.abs() < 1.0
    if not small.any() or not torch.isfinite(y).all():
        return None
    scale = float((y[small] / x[small]).median())
    if not scale > 0:
        return None
    scale = 1.0 if abs(scale - 1.0) < 1e-3 else scale  # (bf16's rounding of x 1)

    def holds(predicted: torch.Tensor) -> bool:
        return bool(((predicted - y).abs() <= _FIT_TOLERANCE * predicted.abs() + 1e-6).all())

    if holds(scale * x):
        return scale, None
    largest = int(x.abs().argmax())
    reach, top = scale * abs(float(x[largest])), abs(float(y[largest]))
    if not 0 < top < reach:
        return None
    low, high = top, top * 1e6  # cap * tanh(reach / cap) grows with cap from below `top` to `reach`: bisect
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if middle * math.tanh(reach / middle) < top else (low, middle)
    cap = high
    return (scale, cap) if holds(cap * torch.tanh(scale * x / cap)) else None


def install(model: nn.Module, device: torch.device) -> tuple[nn.Module, nn.Module] | None:
    """Patch the LM head of `model` once (idempotent); returns (causal LM, head), or None if there is no head or its
    model does to the head's output what head_transform does not measure (then the plain path: full logits)."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if lm is not None else None
    if head is None:
        return None
    if not getattr(head, _PATCHED, False):
        transform = head_transform(model, lm, device)
        setattr(head, _TRANSFORM, transform)
        if transform is None:
            return None
        scale, softcap = transform
        unscaled = head.forward  # what the model's own forward gets outside a loss request
        original = unscaled if scale == 1.0 else lambda h: unscaled(h) * scale
        vocab = int(getattr(lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config,
                            "vocab_size", 0) or 50_000)
        chunk = max(16, CHUNK_LOGIT_ELEMENTS // vocab)

        def forward(hidden_states: torch.Tensor, *args, **kwargs):
            request = head.__dict__.get(_TARGETS)
            if request is None:
                return unscaled(hidden_states, *args, **kwargs)
            positions, targets, per_token, correct, temperature, entropy = request
            head_forward, cap = original, softcap
            if temperature != 1.0:  # GRPO scores the tempered distribution it sampled from (as TRL): cap, then / T
                head_forward = lambda h: _capped(original(h).float(), softcap) / temperature
                cap = None
            # Layer split: the head lives on the last GPU (a device-to-device copy, no sync).
            positions, targets = (t.to(hidden_states.device, non_blocking=True) for t in (positions, targets))
            trainable = any(p.requires_grad for p in head.parameters())
            loss = head_loss(head_forward, hidden_states, positions, targets, trainable_head=trainable, softcap=cap,
                             chunk=chunk, per_token=per_token, correct=correct, entropy=entropy)
            head.__dict__[_RESULT] = loss  # what _forward_with_targets returns (the model may scale or cap this)
            return loss

        head.forward = forward
        setattr(head, _PATCHED, True)
    return (lm, head) if getattr(head, _TRANSFORM, None) is not None else None


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over the trained tokens of a batch, and their count (= train.loss_sum).

    `model`: a PeftModel / causal LM, plain or wrapped in DDP, FSDP1 or FSDP2. Batch keys other than `labels` are
    model inputs (input_ids plus attention_mask, or position_ids for packed rows).

    No host sync: the count is the number of trained positions, found in the host labels before they move
    (`trained_positions`), so it is a Python int for free; a batch already on a GPU costs one sync.
    """
    total, count, _ = _token_loss(model, batch, device, correct=None)
    return total, count


def token_loss_and_correct(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, *,
                           router_aux: RouterAux | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """`token_loss_sum`, plus how many of the trained tokens the model's argmax predicts (a device tensor; no sync).
    `router_aux`: the forward also gives a mixture-of-experts model's load-balancing loss to it (training/router_aux.py)."""
    correct: list[torch.Tensor] = []
    total, count, hits = _token_loss(model, batch, device, correct=correct, router_aux=router_aux)
    if hits is None:
        hits = sum(correct, torch.zeros((), dtype=torch.int64, device=total.device))
    return total, count, hits


def _token_loss(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, *, correct: list | None,
                router_aux: RouterAux | None = None) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(loss sum, trained tokens, argmax hits of the plain path or None: the head appended them to `correct`)."""
    positions, wanted = trained_positions(batch["labels"])
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    found = install(model, device)
    if found is None:  # not a transformers causal LM, or an unknown head transform: the plain way (full shapes)
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        hits = ((logits.detach().argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)).sum()
        return total, positions.numel(), hits
    where = (positions.to(device, non_blocking=True), wanted.to(device, non_blocking=True))
    total = _forward_with_targets(model, found, inputs, where, per_token=False, correct=correct, router_aux=router_aux,
                                  labels=batch["labels"])
    return total.reshape(()), positions.numel(), None


def _forward_with_targets(model: nn.Module, found: tuple[nn.Module, nn.Module], inputs: dict,
                          where: tuple[torch.Tensor, torch.Tensor], *, per_token: bool,
                          correct: list | None = None, temperature: float = 1.0, entropy: list | None = None,
                          router_aux: RouterAux | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The model's forward with the head asked for the loss at `where` (`trained_positions`, on the device): what its
    patched forward returns. With `router_aux`, the same forward returns the router load-balancing loss (of a
    mixture-of-experts model) too, which it keeps (`labels`: the batch's, for packed rows' padding tails)."""
    _, head = found
    head.__dict__[_TARGETS] = (*where, per_token, correct, temperature, entropy)
    try:
        outputs = model(**inputs, use_cache=False, **(router_aux.forward_kwargs() if router_aux is not None else {}))
        if router_aux is not None:
            router_aux.collect(outputs, inputs, labels)
        loss = head.__dict__.pop(_RESULT)
        if outputs.logits is loss:  # the model returned the head's output as it is
            return loss
        # The model scaled or capped the head's output (head_transform, applied inside the head already): the loss is
        # the head's, still joined to the model's output with weight 0, so the backward hooks DDP and FSDP hang on the
        # root's outputs fire as they do for every other model.
        return loss + outputs.logits.float().sum() * 0.0
    finally:
        head.__dict__.pop(_TARGETS, None)
        head.__dict__.pop(_RESULT, None)


def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, *,
                   router_aux: RouterAux | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the batch: the sum of log-probabilities of its trained tokens (the response of a preference
    sequence) and their count, from one forward, without full-vocabulary logits (as `token_loss_sum`). Positions and
    counts come from the host labels, so no host sync either. `router_aux`: as `token_loss_and_correct`'s."""
    labels = batch["labels"]
    positions, wanted = trained_positions(labels)
    rows = positions // labels.size(1)  # the row of every trained position, in the order the head returns their losses
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "reference_logps"}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    positions, wanted = positions.to(device, non_blocking=True), wanted.to(device, non_blocking=True)
    found = install(model, device)
    if found is None:  # not a transformers causal LM, or an unknown head transform: the plain way
        logits = model(**inputs, use_cache=False).logits
        token = F.cross_entropy(logits.reshape(-1, logits.size(-1)).index_select(0, positions).float(), wanted,
                                reduction="none")
    else:
        token = _forward_with_targets(model, found, inputs, (positions, wanted), per_token=True,
                                      router_aux=router_aux, labels=batch["labels"]).reshape(-1)
    logps = torch.zeros(labels.size(0), dtype=torch.float32, device=token.device).index_add(
        0, rows.to(token.device, non_blocking=True), -token)
    return logps, counts.to(token.device, non_blocking=True)


def token_logps(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, *,
                temperature: float = 1.0, entropy: list | None = None, router_aux: RouterAux | None = None) -> torch.Tensor:
    """The log-probability of every trained token of the batch (labels != -100), in row-major order, under the
    logits divided by `temperature` (GRPO's completions, scored as they were sampled, as TRL does), with the graph for
    backward; without full-vocabulary logits (the head computes them a chunk at a time, as `token_loss_sum`).
    `entropy`: a list the summed entropy of those positions' distributions is appended to (in pieces; detached).
    `router_aux`: as `token_loss_and_correct`'s."""
    positions, wanted = trained_positions(batch["labels"])
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()
              if k in ("input_ids", "attention_mask", "position_ids")}
    positions, wanted = positions.to(device, non_blocking=True), wanted.to(device, non_blocking=True)
    found = install(model, device)
    if found is None:  # not a transformers causal LM, or an unknown head transform: the plain way
        logits = model(**inputs, use_cache=False).logits.float() / temperature
        flat = logits.reshape(-1, logits.size(-1)).index_select(0, positions)
        if entropy is not None:
            logp = torch.log_softmax(flat.detach(), dim=-1)
            entropy.append(-(logp.exp() * logp).sum())
        return -F.cross_entropy(flat, wanted, reduction="none")
    return -_forward_with_targets(model, found, inputs, (positions, wanted), per_token=True, temperature=temperature,
                                  entropy=entropy, router_aux=router_aux).reshape(-1)
