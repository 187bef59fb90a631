"""Where the peak memory of a training step goes, measured part by part, next to the planner's estimate of each part.

    python benchmarks/memory_breakdown.py RECIPE.yaml [key.path=value ...] [--json OUT]

One process, the recipe's model loaded as `finetune train` loads it (4-bit base, LoRA, the fused LoRA path unless
lora.fused is false), the recipe's first micro-batch. Two optimizer steps: the first creates the gradients and the
AdamW state, the second is measured:
  * runtime: resident memory of the process with torch, transformers, peft and bitsandbytes imported, before the model;
  * base, LoRA + optimizer: bytes of the tensors themselves (4-bit weights + quantization state + the dtype
    embeddings/norms; LoRA weights, their gradients and the two AdamW moments);
  * activations by kind: what autograd keeps for backward (saved-tensor hooks; each storage once, parameters not
    counted), attributed to the innermost module that saved it: norms, attention (q/k/v/out, rotary, softmax
    statistics), mlp (the intermediates), lora (the LoRA layers: their inputs and rank-r projections), loss (the LM
    head's chunked loss), other (embeddings, residual path);
  * loss: what the LM head's chunked loss keeps for backward plus the transient of its largest chunk;
  * other step transients: the rest of the step's peak of live tensor bytes (a dispatch mode counts every tensor the
    step allocates while it is alive): gradients of the activations in backward, AdamW's temporaries;
  * allocator + untracked: peak RSS minus all of the above (malloc's free lists, the tokenizer, Python objects).
The planner's column is finetune/planner/memory.py for the same batch (micro-batch x its padded length): its activation
kinds (activation_parts_per_token_layer) times tokens times layers, and its loss term.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 2**20
LAYER_KINDS = ("norms", "attention", "mlp", "lora")


def _kind(stack: list) -> str:
    """The activation kind of a tensor saved while the modules in `stack` (outermost first) run."""
    for module in reversed(stack):
        name = type(module).__name__
        if hasattr(module, "lora_A"):
            return "lora"
        if getattr(module, "_finetune_chunked_loss", False):
            return "loss"
        if "Norm" in name:
            return "norms"
        if name.endswith("Attention"):
            return "attention"
        if name.endswith("MLP"):
            return "mlp"
    return "other"


class SavedActivations:
    """Bytes autograd saves for backward while active, by kind; each storage once, parameters and buffers excluded."""

    def __init__(self, model):
        import torch

        self.torch = torch
        self.excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        for module in model.modules():  # bitsandbytes' quantization state is neither a parameter nor a buffer
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            for tensor in _quant_state_tensors(state):
                self.excluded.add(tensor.untyped_storage().data_ptr())
        self.by_kind: dict[str, int] = defaultdict(int)
        self.stack: list = []
        self.seen: set[int] = set()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded and pointer not in self.seen and tensor.device.type != "meta":
            self.seen.add(pointer)
            self.by_kind[_kind(self.stack)] += storage.nbytes()
        return tensor

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(lambda module, args: self.stack.append(module)),
                         register_module_forward_hook(lambda module, args, out: self.stack.pop() and None)]
        self._hooks = self.torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()


def _quant_state_tensors(state) -> list:
    import torch

    if state is None:
        return []
    found = [t for t in (state.absmax, getattr(state, "code", None), getattr(state, "offset", None))
             if isinstance(t, torch.Tensor)]
    return found + _quant_state_tensors(getattr(state, "state2", None))


def measure(recipe_path: str, overrides: list[str]) -> dict:
    """Run two optimizer steps of the recipe in this process; return every part in bytes, and the planner's."""
    import torch

    from finetune import data, distributed, model, planner, training
    from finetune.model import loading
    from finetune.outputs.run_folder import current_rss_bytes
    from finetune.recipe import load_recipe
    from finetune.training.tensor_bytes import LiveBytes

    recipe = load_recipe(recipe_path, [*overrides, "parallel.strategy=single"])
    tokenizer = model.load_tokenizer(recipe)
    train_examples, _, _ = data.build_examples(recipe, tokenizer)
    batch = next(iter(data.BatchStream(train_examples, micro_batch_size=recipe.train.micro_batch_size, rank=0,
                                       world_size=1, seed=recipe.train.seed, pad_id=tokenizer.pad_token_id)))
    model.import_backends()
    model.release_freed_memory()
    runtime = current_rss_bytes()
    distributed.seed_everything(recipe.train.seed)
    peft_model = loading.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                                    gradient_checkpointing=recipe.train.gradient_checkpointing).model
    model.release_freed_memory()
    load_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parameters = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = training.loop.build_optimizer(recipe, parameters)
    cpu = torch.device("cpu")

    def step(counting=None, saved=None):
        if counting is not None:
            counting.mark()
        with saved if saved is not None else contextlib.nullcontext():
            value, _ = training.loop.loss_sum(peft_model, batch, cpu)
        forward_peak = counting.peak if counting is not None else 0
        value.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: part of "LoRA + optimizer"
        return forward_peak

    peft_model.train()
    step()  # creates gradients and the AdamW moments
    rss_before_step = current_rss_bytes()
    head = peft_model.get_output_embeddings()
    counting, saved = LiveBytes(), SavedActivations(peft_model)
    loss_window = {}
    pre = head.register_forward_pre_hook(lambda module, args: counting.mark())
    post = head.register_forward_hook(lambda module, args, out: loss_window.update(peak=counting.peak_since_mark()))
    with counting:
        forward_peak = step(counting, saved)
    pre.remove()
    post.remove()

    frozen, quant = _frozen_bytes(peft_model)
    trainable = sum(p.numel() * p.element_size() for p in parameters)
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)
    kinds = dict(saved.by_kind)
    activations = sum(v for k, v in kinds.items() if k != "loss")
    loss_kept = kinds.get("loss", 0)
    loss = max(loss_kept, loss_window.get("peak", 0))
    step_peak = counting.peak  # gradients were zeroed in place, so not re-created: all of this is the step's
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured = {"runtime": runtime, "base": frozen, "quant_state": quant, "lora_grads_adamw": 2 * trainable + moments,
                **{f"activations_{k}": v for k, v in sorted(kinds.items()) if k != "loss"},
                "activations": activations, "loss": loss,
                "other_transients": max(0, step_peak - activations - loss),
                "step_peak_live": step_peak, "forward_peak_live": forward_peak}
    measured["allocator_untracked"] = peak_rss - (runtime + frozen + quant + measured["lora_grads_adamw"]
                                                  + activations + loss + measured["other_transients"])
    measured["peak_rss"] = peak_rss
    measured["load_peak_rss"] = load_peak_rss  # the high-water mark before the first step: loading's own peak
    measured["rss_before_step"] = rss_before_step

    tokens, seq_len = int(batch["input_ids"].numel()), int(batch["input_ids"].shape[1])
    facts = planner.facts_from_config(planner.model_config_for(recipe), recipe)
    # On CPU torch's dropout keeps its mask in the input's dtype (fp32 under PEFT's forward); CUDA keeps a bool mask.
    per_token = planner.activation_parts_per_token_layer(facts, recipe, seq_len=seq_len, dropout_mask_bytes=4)
    estimate = planner.estimate(facts, recipe, "single", planner.Hardware(1, 1 << 50), per_rank_full_load=False)
    planned = {"base": estimate.parts["base"], "quant_state": estimate.parts["quant_state"],
               # LoRA weights, AdamW's moments and every gradient (the estimate counts the gradients alive at the
               # step's peak moment only; this breakdown measures them as model state, after backward)
               "lora_grads_adamw": estimate.parts["lora_grads_adamw"] - estimate.gradient_bytes
               + planner.held_parameter_bytes(facts, strategy="single", world_size=1)["trainable_bytes"],
               **{f"activations_{k}": v * tokens * facts.num_layers for k, v in per_token.items()},
               "activations": sum(per_token.values()) * tokens * facts.num_layers,
               "loss": planner.loss_bytes(tokens, facts)}
    return {"recipe": str(recipe_path), "overrides": overrides, "batch": list(batch["input_ids"].shape),
            "packed": bool(recipe.data.packing), "fused": bool(recipe.lora.fused), "layers": facts.num_layers,
            "measured": measured, "planner": planned}


def _frozen_bytes(peft_model) -> tuple[int, int]:
    """(bytes of the frozen parameters and buffers, bytes of bitsandbytes' quantization state), each storage once."""
    seen: set[int] = set()
    frozen = quant = 0
    for tensor in [*[p for p in peft_model.parameters() if not p.requires_grad], *peft_model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            frozen += storage.nbytes()
    for module in peft_model.modules():
        for tensor in _quant_state_tensors(getattr(getattr(module, "weight", None), "quant_state", None)):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                quant += storage.nbytes()
    return frozen, quant


ROWS = [("runtime", "runtime (torch, transformers, peft, bitsandbytes imported)"),
        ("base", "base: 4-bit weights, dtype embeddings/norms"), ("quant_state", "base: quantization state"),
        ("lora_grads_adamw", "LoRA weights + gradients + AdamW moments"),
        ("activations_norms", "activations: norms (fp32 inputs)"),
        ("activations_attention", "activations: attention (q/k/v/out, rotary, softmax stats)"),
        ("activations_mlp", "activations: mlp intermediates"),
        ("activations_lora", "activations: LoRA layers (inputs, rank-r projections)"),
        ("activations_other", "activations: other (embeddings, residual path)"),
        ("activations", "activations, total"), ("loss", "loss (kept gradient + largest chunk)"),
        ("other_transients", "other step transients (backward, AdamW)"),
        ("allocator_untracked", "allocator + untracked"), ("peak_rss", "= peak RSS of the process")]


def format_breakdown(result: dict) -> str:
    measured, planned = result["measured"], result["planner"]
    lines = [(f"Memory of one training step: batch {result['batch'][0]} x {result['batch'][1]} tokens "
             f"({'packed' if result['packed'] else 'unpacked'}, {'fused' if result['fused'] else 'PEFT'} LoRA forward)"),
             "", "| part | measured (MiB) | planner (MiB) | planner / measured |", "|---|---:|---:|---:|"]
    for key, label in ROWS:
        if key not in measured:
            continue
        plan = planned.get(key)
        ratio = f"{plan / measured[key]:.2f}" if plan is not None and measured[key] > 0 else ""
        plan_text = f"{plan / MiB:.0f}" if plan is not None else ""
        lines.append(f"| {label} | {measured[key] / MiB:.0f} | {plan_text} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--json", help="also write the figures here")
    args, overrides = parser.parse_known_args()
    result = measure(args.recipe, overrides)
    print(format_breakdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
