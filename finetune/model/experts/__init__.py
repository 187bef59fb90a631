"""Mixture-of-experts layers as real QLoRA: the fused expert tensors of transformers 5 split into one Linear per expert
projection, so bitsandbytes stores every expert weight in 4 bits and PEFT puts a LoRA (with dropout) on each.

transformers 5 keeps a layer's experts as two 3-D parameters (`experts.gate_up_proj`: experts x 2*inter x hidden,
`experts.down_proj`: experts x hidden x inter) and fuses the checkpoint's per-expert tensors into them while loading
(its conversion mapping: `MergeModulelist` stacks the experts, `Concatenate` joins gate and up). bitsandbytes quantizes
`nn.Linear` modules only, so those parameters stayed bf16 (on Mixtral-8x7B ~96% of the weights), and PEFT reaches them
only through `ParamWrapper`, which has no dropout. Here each such module becomes `RoutedExperts`: per expert, one
`nn.Linear` per projection, named as the checkpoint names them (Mixtral `w1`/`w3`/`w2`, Qwen-MoE `gate_proj`/`up_proj`/
`down_proj`: read from transformers' converter for the model, not from a table of ours). Then:
  * transformers' own bnb quantizer turns them into `Linear4bit` like every other projection (NF4, double quant, the
    recipe's quant storage dtype), FSDP shards them like every other 4-bit weight, and a forward dequantizes one
    expert projection at a time (never the whole expert stack in bf16);
  * PEFT's ordinary `lora.Linear4bit` wraps each one: LoRA per expert, dropout working, and adapter keys in the
    per-expert layout that PEFT itself converts for a stock transformers 5 model (and that vLLM reads);
  * the checkpoint's per-expert tensors map one to one onto these weights, after transformers' key renames (sharded
    loading reads one expert tensor at a time, `expert_views`); a checkpoint that stores the fused 3-D tensors is read
    by slicing them per expert.
The router (`gate`) is not an `nn.Linear` in transformers 5 (Llama 4's `router` is a subclass of one, which bnb does
not convert and LoRA is kept off): it stays unquantized and, by default, frozen.
Each layout family (how transformers stores a model's fused experts) is one module in families/: `concatenated`
(Mixtral, Qwen-MoE, DeepSeek-style: (out, in)) and `llama4` (Scout, Maverick: (in, out), called with pre-scaled rows).

    routed.py     ExpertMLP, RoutedExperts: the per-expert module and its token grouping
    families/     one module per expert layout (a new architecture family is one file there, and one registry line)
    split.py      finding transformers' fused experts, splitting them (per family), 4-bit, fusing back for export
    lora.py       PEFT on the split experts: targets checked, routers trainable, adapters loaded per expert
"""

from finetune.model.experts.lora import (
    check_expert_targets,
    get_peft_model,
    load_adapter,
    per_expert_layout,
    router_names,
    trainable_routers,
)
from finetune.model.experts.routed import ExpertMLP, ExpertNames, RoutedExperts, expert_groups, has_routed_experts
from finetune.model.experts.split import fuse_experts, fused_expert_modules, quantize_split_experts, split_experts

__all__ = ["ExpertMLP", "ExpertNames", "RoutedExperts", "check_expert_targets", "expert_groups", "fuse_experts",
           "fused_expert_modules", "get_peft_model", "has_routed_experts", "load_adapter", "per_expert_layout",
           "quantize_split_experts", "router_names", "split_experts", "trainable_routers"]
